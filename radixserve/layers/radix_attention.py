"""RadixAttention: the attention op of a layer. It knows its shapes; the batch's attention
backend (on the ForwardBatch) knows where the KV lives and how to compute."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class RadixAttention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int,
                 sliding_window_size: Optional[int] = None):
        super().__init__()
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.sliding_window_size = sliding_window_size  # its query attends to this many keys up to itself; None: all

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch) -> torch.Tensor:
        """q: [T, num_heads * head_dim], k/v: [T, num_kv_heads * head_dim] -> [T, num_heads * head_dim]."""
        q = q.reshape(-1, self.tp_q_head_num, self.head_dim)
        k = k.reshape(-1, self.tp_k_head_num, self.head_dim)
        v = v.reshape(-1, self.tp_k_head_num, self.head_dim)
        out = forward_batch.attn_backend.forward(q, k, v, self, forward_batch)
        return out.reshape(-1, self.tp_q_head_num * self.head_dim)
