"""The LoRA delta of one linear layer: the segmented LoRA matmul and its dispatch.

For each segment of consecutive tokens that use one adapter (slot s):
    y[seg] += scaling_s * (x[seg] @ A_s^T) @ B_s^T
A fused projection (qkv_proj = q|k|v, gate_up_proj = gate|up) gets the concatenation of its
parts' deltas; a part the adapter does not target has zero A/B in its slot, so a zero delta.
LinearBase.forward calls `apply` when its `lora` attribute is set (radixserve/layers/linear.py).

Three implementations of the same delta, one call per layer for every segment and part:
  - CPU, float32 activations (the bf16 mode, float32 models): the C++ kernel
    cpu_kernels.lora_delta (radixserve/csrc/lora_kernels.cpp), on float32 or bf16 slot buffers;
  - CUDA: the Triton kernels of radixserve/lora/triton_ops.py;
  - anything else, or `set_lora_backend("torch")`: the torch loop below, the reference the
    kernels are tested against (tests/unit/test_lora_kernels.py).
Mixed ranks: the pool zero-pads every adapter to --max-lora-rank, so every path multiplies by
the padded [max_rank] matrices (padding, not a per-slot rank)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from radixserve.layers import cpu_kernels
from radixserve.lora.mem_pool import LoRAMemoryPool

LORA_BACKENDS = ("kernel", "torch")
_backend = "kernel"


def set_lora_backend(name: str) -> None:
    """"kernel" (the default): the C++ / Triton kernel where one applies; "torch": always the
    torch loop (the reference; benchmarks/cpu/lora_batch.py measures one against the other)."""
    global _backend
    if name not in LORA_BACKENDS:
        raise ValueError(f"LoRA backend {name!r}: one of {', '.join(LORA_BACKENDS)}")
    _backend = name


@dataclass
class LoRABatchInfo:
    """Per forward: token segments [start, end) that use adapter slot `slot`, with its scaling.
    Tokens of base-model requests are in no segment (no delta)."""

    segments: List[Tuple[int, int, int, float]] = field(default_factory=list)
    token_slots: Optional[torch.Tensor] = None  # [num_tokens] int64, -1 = the base model
    # the segments as tensors for the kernels, made once per forward (kernel_segments)
    _tensors: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False, compare=False)

    def kernel_segments(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """[S, 3] int64 rows (start, end, slot) and [S] float32 scalings, on `device`."""
        key = str(device)
        if key not in self._tensors:
            segs = torch.tensor([s[:3] for s in self.segments], dtype=torch.int64).reshape(-1, 3)
            scalings = torch.tensor([s[3] for s in self.segments], dtype=torch.float32)
            self._tensors[key] = (segs.to(device), scalings.to(device))
        return self._tensors[key]


class LoRABatchState:
    """The one object every LoRALinearDelta reads the current forward's LoRABatchInfo from."""

    def __init__(self) -> None:
        self.info: Optional[LoRABatchInfo] = None


class LoRALinearDelta:
    """Attached to a linear layer as its `lora` (a plain object, not an nn.Module, so the model's
    parameter names and modules stay as they are)."""

    def __init__(self, layer_id: int, parts: List[Tuple[str, int, int]], pool: LoRAMemoryPool, state: LoRABatchState):
        self.layer_id = layer_id
        self.parts = [p for p in parts if p[0] in pool.a_buffers]  # (module, out offset, out size)
        self.pool = pool
        self.state = state
        self.offsets = [offset for _, offset, _ in self.parts]

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        info = self.state.info
        if info is None or not self.parts or not info.segments:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.view(-1, y.shape[-1])
        if _backend == "kernel" and self._apply_kernel(x2, y2, info):
            return y
        self.apply_torch(x2, y2, info)
        return y

    def _buffers(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        a = [self.pool.a_buffers[module] for module, _, _ in self.parts]  # [layer, slot, rank, in]
        b = [self.pool.b_buffers[module] for module, _, _ in self.parts]  # [layer, slot, out, rank]
        return a, b

    def _apply_kernel(self, x2: torch.Tensor, y2: torch.Tensor, info: LoRABatchInfo) -> bool:
        """The delta by a kernel, in place; False where none applies (the caller takes the torch loop)."""
        a, b = self._buffers()
        if x2.is_cuda:
            from radixserve.lora import triton_ops  # imports triton: only where there is a GPU

            segs, scalings = info.kernel_segments(x2.device)
            triton_ops.lora_delta(y2, x2, [t[self.layer_id] for t in a], [t[self.layer_id] for t in b], self.offsets,
                                  segs, scalings, max(e - s for s, e, _, _ in info.segments))
            return True
        ops: Any = cpu_kernels.kernels_for(x2)
        if ops is None or not hasattr(ops, "lora_delta") or x2.dtype != torch.float32 or y2.dtype != torch.float32 \
                or a[0].dtype not in (torch.float32, torch.bfloat16):  # bf16 slots: half the bytes to read
            return False
        segs, scalings = info.kernel_segments(x2.device)
        ops.lora_delta(y2, x2, a, b, self.offsets, self.layer_id, segs, scalings)
        return True

    def apply_torch(self, x2: torch.Tensor, y2: torch.Tensor, info: LoRABatchInfo) -> None:
        """The reference: one pair of matmuls per segment and part."""
        for module, offset, size in self.parts:
            a_all = self.pool.a_buffers[module][self.layer_id]  # [slot, rank, in]
            b_all = self.pool.b_buffers[module][self.layer_id]  # [slot, out, rank]
            for start, end, slot, scaling in info.segments:
                delta = (x2[start:end] @ a_all[slot].t().to(x2.dtype)) @ b_all[slot].t().to(x2.dtype)
                y2[start:end, offset:offset + size].add_(delta.to(y2.dtype), alpha=scaling)
