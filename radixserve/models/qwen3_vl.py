"""Qwen3-VL (transformers' Qwen3VLForConditionalGeneration): Qwen2.5-VL's serving path
(models/qwen2_5_vl.py: the image embedding cache, M-RoPE positions, chunked prefill) with

  - a Qwen3 language model (q/k RMSNorm, no q/k/v bias) and interleaved M-RoPE;
  - a vision encoder without windows (every block attends over one image frame), LayerNorm,
    a GELU MLP, a learned position table (num_position_embeddings = side x side) resampled
    bilinearly to each image's patch grid and added to the patch embedding;
  - DeepStack: the outputs of blocks deepstack_visual_indexes, merged by their own mergers, are
    added to the image tokens' hidden states after the first len(deepstack_visual_indexes)
    decoder layers. The encoder returns them beside the main output, [tokens, hidden * (1 + k)],
    so the embedding cache keeps them together."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.models.model_config import LoadError
from radixserve.models.qwen2_5_vl import (
    Qwen2_5_VLForConditionalGeneration,
    VisionAttention,
    rotary_positions,
    vision_inv_freq,
)


@dataclass
class Qwen3VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: Tuple[int, ...]
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, d: dict) -> "Qwen3VisionConfig":
        kw = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        kw["deepstack_visual_indexes"] = tuple(d.get("deepstack_visual_indexes", ()))
        kw["rope_theta"] = float((d.get("rope_parameters") or {}).get("rope_theta", cls.rope_theta))
        if kw.get("hidden_act", cls.hidden_act) not in ("gelu_pytorch_tanh", "gelu"):
            raise LoadError(f"vision_config: unsupported hidden_act {kw['hidden_act']!r} (gelu_pytorch_tanh, gelu)")
        return cls(**kw)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class Qwen3VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, dim, bias=True)
        self.approximate = "tanh" if act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class Qwen3VisionBlock(nn.Module):
    def __init__(self, cfg: Qwen3VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.mlp = Qwen3VisionMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor, cu_seqlens: List[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class Qwen3VisionPatchMerger(nn.Module):
    """merge_unit patches -> one token. postshuffle (the DeepStack mergers): the LayerNorm is over
    the concatenated patches instead of each patch."""

    def __init__(self, cfg: Qwen3VisionConfig, postshuffle: bool):
        super().__init__()
        self.hidden = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.hidden if postshuffle else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.hidden, self.hidden)
        self.linear_fc2 = nn.Linear(self.hidden, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.hidden) if self.postshuffle else x).view(-1, self.hidden)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionPatchEmbed(nn.Module):
    """transformers' Conv3d whose kernel is its stride (with a bias): a matmul per flattened patch."""

    def __init__(self, cfg: Qwen3VisionConfig):
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size,
                                                    cfg.patch_size, cfg.patch_size))
        self.proj.bias = nn.Parameter(torch.empty(cfg.hidden_size))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return torch.addmm(self.proj.bias, pixels.to(w.dtype), w.view(w.shape[0], -1).t())


class Qwen3_VisionTransformer(nn.Module):
    def __init__(self, cfg: Qwen3VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = Qwen3VisionPatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.side = int(cfg.num_position_embeddings ** 0.5)
        self.blocks = nn.ModuleList(Qwen3VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = Qwen3VisionPatchMerger(cfg, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3VisionPatchMerger(cfg, postshuffle=True) for _ in cfg.deepstack_visual_indexes)

    def forward(self, pixels: torch.Tensor, grids: Sequence[Tuple[int, int, int]]) -> torch.Tensor:
        """-> [sum of patches / merge_unit, out_hidden_size * (1 + DeepStack levels)]."""
        x = self.patch_embed(pixels)
        x = x + self._position_embeddings(grids).to(x.dtype)
        rows_cols = rotary_positions(grids, self.cfg.spatial_merge_size).to(x.device)
        freqs = rows_cols[..., None] * vision_inv_freq(self.cfg, x.device)
        emb = torch.cat([freqs.flatten(1)] * 2, dim=-1)
        cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)
        cu = [0]
        for t, h, w in grids:  # every block attends over one frame of one image
            for _ in range(t):
                cu.append(cu[-1] + h * w)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cu, cos, sin)
            if i in self.cfg.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.cfg.deepstack_visual_indexes.index(i)](x))
        return torch.cat([self.merger(x), *deepstack], dim=1)

    def _position_embeddings(self, grids: Sequence[Tuple[int, int, int]]) -> torch.Tensor:
        """The learned side x side table resampled (bilinear, corners aligned) to each image's
        h x w grid, in the encoder's patch order (merge x merge blocks together)."""
        m = self.cfg.spatial_merge_size
        table = self.pos_embed.weight.view(self.side, self.side, -1).permute(2, 0, 1).unsqueeze(0).float()
        out = []
        for t, h, w in grids:
            grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0].permute(1, 2, 0)
            blocks = grid.reshape(h // m, m, w // m, m, -1).permute(0, 2, 1, 3, 4).reshape(h * w, -1)
            out.append(blocks.repeat(t, 1))
        return torch.cat(out)


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    qkv_bias, qk_norm = False, True
    mrope_interleaved, default_mrope_section = True, (24, 20, 20)

    def make_visual(self, vision_config: dict) -> nn.Module:
        return Qwen3_VisionTransformer(Qwen3VisionConfig.from_dict(vision_config))
