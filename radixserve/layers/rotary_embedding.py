"""Rotary position embedding (neox style, as Llama / Qwen in transformers), with the default
and llama3 frequency scalings. cos/sin are precomputed up to max_position once at start-up.
On CUDA q and k are rotated by one Triton kernel (radixserve.layers.fused), on the CPU by one
C++ kernel (radixserve.layers.cpu_kernels); the torch code is the fallback and the reference."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from radixserve.layers import cpu_kernels, fused


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope_scaling: Optional[Dict[str, Any]] = None,
        partial_rotary_factor: float = 1.0,
    ):
        super().__init__()
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        inv_freq = 1.0 / (base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float64) / self.rotary_dim))
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / float(rope_scaling["factor"])
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope scaling type {rope_type!r}")
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        # [max_position, rotary_dim]: the cos/sin of each half repeated, as rotate_half expects
        self.register_buffer("cos_cached", torch.cat([freqs.cos()] * 2, -1).float(), persistent=False)
        self.register_buffer("sin_cached", torch.cat([freqs.sin()] * 2, -1).float(), persistent=False)

    def _apply(self, fn, recurse=True):
        # model.to(bfloat16) moves the tables with the model but must not round them: the
        # angles keep float32 precision whatever the model's dtype (every path computes in fp32).
        super()._apply(fn, recurse)
        self.cos_cached, self.sin_cached = self.cos_cached.float(), self.sin_cached.float()
        return self

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """q: [T, num_heads, head_dim], k: [T, num_kv_heads, head_dim]."""
        kernels = fused.kernels_for(q)
        if kernels is not None and kernels.can_fuse_rotary(q, k, self.cos_cached, self.sin_cached):
            return kernels.apply_rotary(positions, q, k, self.cos_cached, self.sin_cached, self.rotary_dim)
        ops = cpu_kernels.kernels_for(q)
        if ops is not None:
            q_out, k_out = ops.rotary_embedding(positions, q, k, self.cos_cached, self.sin_cached, self.rotary_dim)
            return q_out, k_out
        cos = self.cos_cached[positions].unsqueeze(1)
        sin = self.sin_cached[positions].unsqueeze(1)
        return _apply(q, cos, sin, self.rotary_dim), _apply(k, cos, sin, self.rotary_dim)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = (rot.float() * cos + rotated.float() * sin).to(x.dtype)
    return out if rest.shape[-1] == 0 else torch.cat([out, rest], dim=-1)


def _llama3_inv_freq(inv_freq: torch.Tensor, cfg: Dict[str, Any]) -> torch.Tensor:
    factor = float(cfg["factor"])
    low = float(cfg.get("low_freq_factor", 1.0))
    high = float(cfg.get("high_freq_factor", 4.0))
    old_ctx = float(cfg["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)



class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): three position axes (time, height, width). Each
    frequency of the half that rotate_half pairs up (the same in both halves) turns by one axis's
    position: Qwen2.5-VL gives the axes consecutive groups of mrope_section frequencies;
    Qwen3-VL (interleaved) takes them in turn, t h w t h w ..., until an axis has its share.
    For text the three axes are equal and it is the ordinary rotary embedding, so 1-D
    positions take that path. Qwen3.5 rotates only the first partial_rotary_factor of head_dim."""

    def __init__(self, head_dim: int, max_position: int, base: float, mrope_section: List[int],
                 interleaved: bool = False, partial_rotary_factor: float = 1.0):
        super().__init__(head_dim, max_position, base, partial_rotary_factor=partial_rotary_factor)
        half = self.rotary_dim // 2
        # interleaved, transformers takes the axes in turn whatever the sum (a section past the
        # rotary dim is cut there); consecutive groups must tile it exactly
        if len(mrope_section) != 3 or (not interleaved and sum(mrope_section) != half):
            raise ValueError(f"mrope_section {mrope_section} must be 3 numbers adding up to the rotary dim / 2 = {half}")
        if interleaved:  # transformers' Qwen3VLTextRotaryEmbedding: index j%3 of axis j%3, below 3 x its share
            j = torch.arange(half)
            axis = torch.where((j % 3 > 0) & (j < 3 * torch.tensor(mrope_section)[j % 3]), j % 3, 0)
        else:
            axis = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))
        self.register_buffer("mrope_axis", torch.cat([axis, axis]), persistent=False)  # [rotary_dim]: its axis

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] (text: every axis the same) or [3, T]."""
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        index = self.mrope_axis.view(1, 1, -1).expand(1, positions.shape[1], -1)
        cos = self.cos_cached[positions].gather(0, index)[0].unsqueeze(1)  # [T, 1, rotary_dim]
        sin = self.sin_cached[positions].gather(0, index)[0].unsqueeze(1)
        return _apply(q, cos, sin, self.rotary_dim), _apply(k, cos, sin, self.rotary_dim)
