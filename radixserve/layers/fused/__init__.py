"""Fused Triton kernels for the GPU path of RMSNorm(+residual) and rotary embedding.

This package's __init__ is only the gate: it never imports triton itself, so serving on the
CPU (or on a machine without triton) never touches it. The kernels live in `kernels.py`,
imported on the first CUDA tensor that asks for them.

Set RADIXSERVE_DISABLE_FUSED_KERNELS=1 (or flip `ENABLED` at runtime, before any CUDA graph
capture) to force the torch path on CUDA, e.g. to measure what the kernels buy.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Mapping, Optional

import torch

DISABLE_ENV = "RADIXSERVE_DISABLE_FUSED_KERNELS"


def enabled_from_env(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(DISABLE_ENV, "").strip().lower() not in ("1", "true", "yes", "on")


ENABLED: bool = enabled_from_env()


def _is_fused_device(x: torch.Tensor) -> bool:
    # The CPU keeps the torch path exactly as it is (float32 CPU serving and CI rely on it).
    return x.is_cuda


@functools.lru_cache(maxsize=1)
def _import_kernels() -> Optional[ModuleType]:
    try:
        from radixserve.layers.fused import kernels
    except ImportError:  # no triton: the torch path serves
        return None
    return kernels


def kernels_for(x: torch.Tensor) -> Optional[ModuleType]:
    """The kernels module when `x` should take the fused path, else None (use torch)."""
    if not ENABLED or not _is_fused_device(x):
        return None
    return _import_kernels()
