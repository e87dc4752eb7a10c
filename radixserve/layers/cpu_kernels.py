"""The C++ CPU kernels (radixserve/csrc/cpu_kernels.cpp), the hot path on the CPU: paged decode
and extend (prefill) attention, the KV store, fused add+RMSNorm, rotary embedding, SiLU-and-mul, and the bf16
GEMM of the linear layers (AVX512_BF16, or AVX2 + FMA; weights packed once by linear.pack_cpu_weights).

They are compiled once per machine with torch.utils.cpp_extension (`-O3 -march=native`,
torch's OpenMP for torch's ops; the kernels' own worker pool, csrc/parallel.h) into torch's extension cache, in a directory named by the ISA and a hash
of the sources, flags and toolchain (`extension_name()`), so that installs with other sources
never rebuild each other's; `scripts/install.sh` builds them, and otherwise the first process that
needs them does (~30-120 s on two cores). One process builds at a time (`build_lock`), and a lock
left by a killed build is cleared at the next start. Where no compiler is at hand, or
RADIXSERVE_DISABLE_CPU_KERNELS=1 is set, `get()` returns None and every layer takes its torch path, which stays the reference the kernels are tested against.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import re
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Iterator, Mapping, Optional, Sequence

import torch

from radixserve import omp_wait

logger = logging.getLogger(__name__)

DISABLE_ENV = "RADIXSERVE_DISABLE_CPU_KERNELS"
SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_kernels.cpp"
SOURCES = [SOURCE, SOURCE.with_name("lora_kernels.cpp")]  # the segmented LoRA matmul (issue 28)
SOURCES.append(SOURCE.with_name("quant_kernels.cpp"))  # GGUF-quantized linear layers (issue 38)
SOURCES.append(SOURCE.with_name("gdn_kernels.cpp"))  # the GatedDeltaNet decode step (issue 41)


CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"]
LDFLAGS = ["-fopenmp"]
KEY_HEX = 12  # 48 bits: collisions between a machine's few source revisions are out of reach

_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def isa_tag() -> str:
    """The build is -march=native: name it by the instruction sets it may use, so that a cache
    shared by different CPUs (a home directory on NFS) never loads one built for another."""
    cpu = getattr(torch, "cpu", None)
    bf16 = bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)())
    capability = torch.backends.cpu.get_cpu_capability().lower()
    return f"{capability}{'_bf16' if bf16 else ''}"


def build_inputs(sources: Sequence[Path] = SOURCES) -> list[Path]:
    """The sources and every header they include ("..." form) from their own directory tree,
    transitively: the files whose bytes the build depends on. System and torch headers are
    covered by the toolchain part of the key instead."""
    root = sources[0].parent
    seen: dict[Path, None] = {}
    todo = [Path(s).resolve() for s in sources]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen[path] = None
        for name in _INCLUDE.findall(path.read_text(errors="replace")):
            header = (path.parent / name).resolve()
            if header.is_file() and header.is_relative_to(root):
                todo.append(header)
    return sorted(seen)


def toolchain_fingerprint() -> list[str]:
    """What, besides the sources and flags, goes into the commands torch writes to build.ninja:
    the compiler, torch's (and Python's) include and library paths, the module suffix. Two
    installs that differ here would make ninja rebuild each other's objects in a shared
    directory, so they get directories of their own."""
    from torch.utils.cpp_extension import include_paths, library_paths

    return [
        torch.__version__,
        os.environ.get("CXX", "c++"),
        sysconfig.get_config_var("EXT_SUFFIX") or "",
        sysconfig.get_path("include", scheme="posix_prefix") or "",
        *include_paths("cpu"),
        *library_paths("cpu"),
    ]


def build_key(
    files: Sequence[Path],
    cflags: Sequence[str],
    ldflags: Sequence[str],
    toolchain: Sequence[str],
    isa: str,
) -> str:
    """A short hash of everything the compiled module depends on. Files enter by their path
    relative to their common directory and their bytes, not their absolute path, so a clone
    or a second checkout of the same commit finds the same build."""
    root = Path(os.path.commonpath([str(f.parent) for f in files]))
    h = hashlib.sha256()
    for f in sorted(files):
        data = f.read_bytes()
        h.update(f"file {f.relative_to(root)} {len(data)}\n".encode())
        h.update(data)
    for label, items in (("cflags", cflags), ("ldflags", ldflags), ("toolchain", toolchain)):
        h.update(f"{label} {len(items)}\n".encode())
        for item in items:
            h.update(f"{item}\0".encode())
    h.update(f"isa {isa}\n".encode())
    return h.hexdigest()[:KEY_HEX]


def extension_name(sources: Sequence[Path] = SOURCES) -> str:
    """e.g. radixserve_cpu_kernels_avx2_3f0c9a1b2d4e: a build directory per (ISA, sources,
    flags, toolchain), so that installs with different sources never share one (and rebuild
    each other's kernels at every start), while those with the same share one build."""
    isa = isa_tag()
    key = build_key(build_inputs(sources), CFLAGS, LDFLAGS, toolchain_fingerprint(), isa)
    return f"radixserve_cpu_kernels_{isa}_{key}"


def enabled_from_env(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(DISABLE_ENV, "").strip().lower() not in ("1", "true", "yes", "on")


ENABLED: bool = enabled_from_env()


# --- One builder at a time, and a killed builder's lock cleared at once ---------------------
#
# torch's FileBaton creates an empty `lock` file in the build directory, builds, deletes it; a
# process that finds it waits (polling) for it to go. It records no owner, so a build killed
# midway leaves a `lock` that no one will ever delete. We wrap every load() in an exclusive
# flock on a side file, BUILD_LOCK, held for the whole load():
#   * while a process holds the flock, no other radixserve process is inside load() for this
#     directory (every one takes the flock first), so a torch `lock` found then was left by a
#     process that died: removing it is safe. The directory's name is ours alone (it carries the
#     key), so no other program builds there.
#   * the kernel drops a flock when its holder dies (however it dies: SIGKILL, OOM), so a dead
#     builder never blocks anyone; a live one (compiling now) keeps it, and the next process
#     waits on the flock, then finds the build done and only loads it (ninja: nothing to do).
#   * BUILD_LOCK itself is never deleted: deleting a lock file others may have open would let two
#     processes lock two different inodes at once.
# flock on NFS is emulated with fcntl locks by Linux (>= 2.6.12), which the server tracks too.
# One case stays: a builder killed alone (kill -9 of its pid, not its process group) may leave
# its compiler running for a while; the next builder then compiles beside it. Both write the
# same objects from the same sources; at worst a link reads a half-written object, that build
# fails (the torch path serves) and the next start builds again.

BUILD_LOCK = "radixserve.build.lock"


@contextlib.contextmanager
def build_lock(build_dir: Path, wait: bool = True) -> Iterator[bool]:
    """Hold BUILD_LOCK in `build_dir`; yields whether it is held (always, when `wait`)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / BUILD_LOCK, "a") as f:  # open() fds are not inherited by the compiler
        held = _try_flock(f)
        if not held and wait:
            logger.info("CPU kernels: waiting for another process's build in %s", build_dir)
            fcntl.flock(f, fcntl.LOCK_EX)
            held = True
        yield held  # closing the file releases the lock


def _try_flock(f) -> bool:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _remove_orphaned_torch_lock(build_dir: Path) -> bool:
    """With BUILD_LOCK held: a torch `lock` here is a dead builder's (see above)."""
    lock = build_dir / "lock"
    if not lock.exists():
        return False
    logger.warning("CPU kernels: removing %s, left by a build that did not finish", lock)
    lock.unlink(missing_ok=True)
    return True


def remove_stale_lock(build_dir: Path) -> bool:
    """Remove torch's `lock` in `build_dir` if its builder is dead; leave it when a live
    process holds BUILD_LOCK. True when a lock was removed."""
    with build_lock(build_dir, wait=False) as held:
        return held and _remove_orphaned_torch_lock(build_dir)


def stage_sources(build_dir: Path, files: Sequence[Path]) -> dict[Path, Path]:
    """Copy the build's inputs to `build_dir`/src (once; bytes never change under one key) and
    return {file: its staged copy}. torch writes absolute source paths into build.ninja, so two
    checkouts of the same sources building from their own paths would make ninja recompile at
    every switch; from the staged copies every install runs the same commands."""
    root = Path(os.path.commonpath([str(f.parent) for f in files]))
    staged = {}
    for f in files:
        dst = build_dir / "src" / f.relative_to(root)
        data = f.read_bytes()
        if not dst.is_file() or dst.read_bytes() != data:  # rewriting would bump mtime: ninja rebuilds
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_name(dst.name + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, dst)
        staged[f] = dst
    return staged


FUSED_DECODE_ENV = "RADIXSERVE_FUSED_DECODE_ROWS"
FUSED_DECODE_ROWS_DEFAULT = 4  # measured: at 8 rows the fused and scratch decodes are even (benchmarks/NOTES.md)
FUSED_DECODE_ROWS_MAX = 16  # quant_kernels.cpp's kFusedRowsMax: the most rows a fused call takes
I16_TILES_MIN_ROWS = 13  # quant_kernels.cpp's AVX2 kDecodeRows + 1: fewer rows of an i16 call run int8's decode


def fused_decode_rows_from_env(environ: Mapping[str, str] = os.environ) -> int:
    """The AVX2 GGUF kernel's fused decode (issue 54: blocks unpacked in registers, 1.2-1.5x the
    scratch path at 1-2 rows) serves calls of up to this many rows of x: FUSED_DECODE_ROWS_DEFAULT
    unless RADIXSERVE_FUSED_DECODE_ROWS says otherwise (0 turns it off). It sums in the prefill
    tiles' float order, so a row gets the same bits whichever path its row count takes (speculative
    verification equals plain decoding; --enable-deterministic-inference)."""
    value = environ.get(FUSED_DECODE_ENV, "").strip()
    if not value:
        return FUSED_DECODE_ROWS_DEFAULT
    try:
        return max(0, int(value))
    except ValueError:  # never a reason to lose the kernels (build() falls back to torch on errors)
        logger.warning("%s=%r is not a row count: the default, %d", FUSED_DECODE_ENV, value, FUSED_DECODE_ROWS_DEFAULT)
        return FUSED_DECODE_ROWS_DEFAULT


@functools.lru_cache(maxsize=1)
def build() -> Optional[ModuleType]:
    """Compile (or load the cached build of) the extension; None when that fails."""
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        name = extension_name()
        build_dir = Path(_get_build_directory(name, verbose=False))
        with build_lock(build_dir):  # held for the whole load(): see the comment above BUILD_LOCK
            _remove_orphaned_torch_lock(build_dir)
            staged = stage_sources(build_dir, build_inputs(SOURCES))
            mod = load(
                name=name,
                sources=[str(staged[s]) for s in SOURCES],
                extra_cflags=CFLAGS,
                extra_ldflags=LDFLAGS,
                build_directory=str(build_dir),
                verbose=False,
            )
        mod.quant_decode_fused_rows(fused_decode_rows_from_env())
        if leave_the_pool(omp_wait.LIBGOMP_WAIT_SHORT, os.environ) and mod.parallel_division() == "pool":
            logger.info("The CPU kernels divide their work on OpenMP's threads, not their worker pool: torch was "
                        "imported before radixserve, so libgomp spins ~ms after each region (GOMP_SPINCOUNT is "
                        "read once, at load) on the core the pool would need. Import radixserve first or set "
                        "GOMP_SPINCOUNT=%s for the pool, which holds up when another process shares the CPU.",
                        omp_wait.OMP_SPINCOUNT)
            mod.set_parallel_division("omp")
        return mod
    except Exception as e:  # no compiler, no headers: the torch path serves
        logger.warning("CPU kernels unavailable, using the torch path: %s", str(e).splitlines()[0] if str(e) else e)
        return None


def leave_the_pool(libgomp_wait_short: bool, env: Mapping[str, str]) -> bool:
    """Whether the kernels should divide their work on OpenMP's threads instead of their worker
    pool (csrc/parallel.h, which reads the division's variables itself): libgomp keeps its long
    default spin, so one of its threads already spins on the core the pool's worker needs, and
    the user named no division."""
    return not libgomp_wait_short and "RADIXSERVE_PARALLEL_DIVISION" not in env


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
    if mod is None:
        print("radixserve CPU kernels: NOT available (torch fallback)")
    else:
        print(f"radixserve CPU kernels: built {mod.__name__} in {Path(mod.__file__).parent}")
