"""SiLU-and-mul: the gated MLP's activation on a fused [gate | up] projection."""

import torch
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return nn.functional.silu(x[..., :d]) * x[..., d:]
