"""The C++ CPU kernels (radixserve/csrc/cpu_kernels.cpp), the hot path on the CPU: paged decode
and extend (prefill) attention, the KV store, fused add+RMSNorm, rotary embedding, SiLU-and-mul, and the bf16
GEMM of the linear layers (AVX512_BF16, or AVX2 + FMA; weights packed once by linear.pack_cpu_weights).

They are compiled once per machine with torch.utils.cpp_extension (`-O3 -march=native`,
torch's own OpenMP pool) into torch's extension cache; `scripts/install.sh` builds them, and
otherwise the first process that needs them does (~30 s on two cores). Where no
compiler is at hand, or RADIXSERVE_DISABLE_CPU_KERNELS=1 is set, `get()` returns None and every
layer takes its torch path, which stays the reference the kernels are tested against.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType
from typing import Mapping, Optional

import torch

logger = logging.getLogger(__name__)

DISABLE_ENV = "RADIXSERVE_DISABLE_CPU_KERNELS"
SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_kernels.cpp"
SOURCES = [SOURCE, SOURCE.with_name("lora_kernels.cpp")]  # the segmented LoRA matmul (issue 28)
SOURCES.append(SOURCE.with_name("quant_kernels.cpp"))  # GGUF-quantized linear layers (issue 38)
SOURCES.append(SOURCE.with_name("gdn_kernels.cpp"))  # the GatedDeltaNet decode step (issue 41)


def extension_name() -> str:
    """The build is -march=native: name it by the instruction sets it may use, so that a cache
    shared by different CPUs (a home directory on NFS) never loads one built for another."""
    cpu = getattr(torch, "cpu", None)
    bf16 = bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)())
    capability = torch.backends.cpu.get_cpu_capability().lower()
    return f"radixserve_cpu_kernels_{capability}{'_bf16' if bf16 else ''}"


def enabled_from_env(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(DISABLE_ENV, "").strip().lower() not in ("1", "true", "yes", "on")


ENABLED: bool = enabled_from_env()


STALE_LOCK_SECONDS = 900  # a build takes ~30-60 s; a lock this old was left by a killed build


def remove_stale_lock(build_dir: Path, now: Optional[float] = None) -> bool:
    """torch waits without end on a build's lock file; a process killed mid-build (a server stopped
    while it compiled) leaves one behind, and every later start would hang on it."""
    import time

    lock = build_dir / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_SECONDS:
        return False
    logger.warning("CPU kernels: removing %s, left %.0f s ago by a build that did not finish", lock, age)
    lock.unlink(missing_ok=True)
    return True


@functools.lru_cache(maxsize=1)
def build() -> Optional[ModuleType]:
    """Compile (or load the cached build of) the extension; None when that fails."""
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        remove_stale_lock(Path(_get_build_directory(extension_name(), verbose=False)))

        return load(
            name=extension_name(),
            sources=[str(p) for p in SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no headers: the torch path serves
        logger.warning("CPU kernels unavailable, using the torch path: %s", str(e).splitlines()[0] if str(e) else e)
        return None


def get() -> Optional[ModuleType]:
    """The kernels module for CPU tensors, or None (use torch)."""
    return build() if ENABLED else None


def kernels_for(x: torch.Tensor) -> Optional[ModuleType]:
    """The kernels module when `x` (a CPU tensor) should take the C++ path, else None."""
    if not ENABLED or x.device.type != "cpu":
        return None
    return build()


if __name__ == "__main__":  # python -m radixserve.layers.cpu_kernels: build now (install.sh)
    logging.basicConfig(level=logging.INFO)
    mod = build()
    print("radixserve CPU kernels:", "built" if mod is not None else "NOT available (torch fallback)")
