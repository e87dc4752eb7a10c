"""SiLU-and-mul: the gated MLP's activation on a fused [gate | up] projection (one C++ kernel
on the CPU, radixserve.layers.cpu_kernels; the torch code is the fallback and the reference)."""

import torch
from torch import nn

from radixserve.layers import cpu_kernels


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = cpu_kernels.kernels_for(x)
        if ops is not None:
            return ops.silu_and_mul(x)
        d = x.shape[-1] // 2
        return nn.functional.silu(x[..., :d]) * x[..., d:]


class GeluAndMul(nn.Module):
    """GeGLU's activation on a fused [gate | up] projection: gelu(gate) * up (Gemma's; approximate
    "tanh" is transformers' gelu_pytorch_tanh)."""

    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return nn.functional.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]
