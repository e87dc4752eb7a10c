"""RMSNorm, with the residual add fused into the same call (saves a pass over the hidden states).
On CUDA this is one Triton kernel (radixserve.layers.fused), on the CPU one C++ kernel
(radixserve.layers.cpu_kernels); the torch code is the fallback and the reference."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import nn

from radixserve.layers import cpu_kernels, fused


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        kernels = fused.kernels_for(x)
        if kernels is not None and kernels.can_fuse_rmsnorm(x, self.weight, residual):
            out, residual = kernels.fused_add_rmsnorm(x, self.weight, self.variance_epsilon, residual)
            return out if residual is None else (out, residual)
        ops = cpu_kernels.kernels_for(x)
        if ops is not None:
            outs = ops.fused_add_rmsnorm(x, residual, self.weight, self.variance_epsilon)
            return outs[0] if residual is None else (outs[0], outs[1])
        if residual is not None:
            x = x + residual
            residual = x
        out = torch.nn.functional.rms_norm(
            x.float(), (x.shape[-1],), self.weight.float(), self.variance_epsilon
        ).to(x.dtype)
        return out if residual is None else (out, residual)


class GemmaRMSNorm(nn.Module):
    """Zero-centered RMSNorm: the scale is 1 + weight (Gemma's; Qwen3-Next's and Qwen3.5's
    Qwen3NextRMSNorm), computed in float32, with the residual add fused as RMSNorm does."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.variance_epsilon = eps

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        if residual is not None:
            x = x + residual
            residual = x
        out = torch.nn.functional.rms_norm(
            x.float(), (x.shape[-1],), 1.0 + self.weight.float(), self.variance_epsilon
        ).to(x.dtype)
        return out if residual is None else (out, residual)
