"""The LoRA delta of one linear layer, in torch (the first increment: no C++ / Triton kernel).

For each segment of consecutive tokens that use one adapter (slot s):
    y[seg] += scaling_s * (x[seg] @ A_s^T) @ B_s^T
A fused projection (qkv_proj = q|k|v, gate_up_proj = gate|up) gets the concatenation of its
parts' deltas; a part the adapter does not target has zero A/B in its slot, so a zero delta.
LinearBase.forward calls `apply` when its `lora` attribute is set (radixserve/layers/linear.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from radixserve.lora.mem_pool import LoRAMemoryPool


@dataclass
class LoRABatchInfo:
    """Per forward: token segments [start, end) that use adapter slot `slot`, with its scaling.
    Tokens of base-model requests are in no segment (no delta)."""

    segments: List[Tuple[int, int, int, float]] = field(default_factory=list)
    token_slots: Optional[torch.Tensor] = None  # [num_tokens] int64, -1 = the base model


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

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        info = self.state.info
        if info is None or not self.parts:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.view(-1, y.shape[-1])
        for module, offset, size in self.parts:
            a_all = self.pool.a_buffers[module][self.layer_id]  # [slot, rank, in]
            b_all = self.pool.b_buffers[module][self.layer_id]  # [slot, out, rank]
            for start, end, slot, scaling in info.segments:
                delta = (x2[start:end] @ a_all[slot].t()) @ b_all[slot].t()
                y2[start:end, offset:offset + size].add_(delta.to(y2.dtype), alpha=scaling)
        return y
