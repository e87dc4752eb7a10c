"""--quantization w8a8_int8 for a safetensors checkpoint (issue 38): the linear layers' weights
quantized to 8 bits at load, the activations to 8 bits per step, integer dot products.

SGLang's flag of that name (per-channel int8 weights, per-token dynamic int8 activations) here
runs on the GGUF path's integer kernel (csrc/quant_kernels.cpp), so a user with an HF directory
gets the quantized file's speed: each weight row is quantized to ggml's Q8_0 as it is loaded (a
float16 scale per 32 values, d = amax / 127, q = round(w / d), byte for byte what
`llama-quantize` and the gguf package write), and GGUFLinearMethod keeps and multiplies those
blocks: activations quantized per 32 values in the decode path, the dequantized-to-bf16 tile with
oneDNN at prefill sizes. The scales are finer than SGLang's (per 32 values, not per row and per
token), for 1.06 bytes a weight instead of 1. The embedding, the LM head and the MoE routers
(and a shared expert's one-output gate) stay as loaded, as in SGLang.
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.layers.quantization.gguf import GGUFLinearMethod, QuantizedWeight

Q8_0 = 8  # ggml's type id
Q8_0_BLOCK = 32


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """float [N, K] (K a multiple of 32) -> Q8_0 rows uint8 [N, K / 32 * 34]: per block a float16
    d = amax / 127, then 32 int8 round(w / d) (round half away from zero, as ggml)."""
    n, k = w.shape
    blocks = w.detach().float().reshape(n, k // Q8_0_BLOCK, Q8_0_BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    scaled = blocks * inv
    q = (torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)).to(torch.int8)
    out = torch.empty(n, k // Q8_0_BLOCK, 2 + Q8_0_BLOCK, dtype=torch.uint8)
    out[..., :2] = d.to(torch.float16).view(torch.uint8)
    out[..., 2:] = q.view(torch.uint8)
    return out.reshape(n, -1)


class W8A8Int8LinearMethod(GGUFLinearMethod):
    """GGUFLinearMethod whose float checkpoint rows are quantized to Q8_0 as they are loaded (a
    weight update from disk too)."""

    def load_rows(self, layer: Any, param: torch.Tensor, offset: int, loaded: Any) -> None:
        if isinstance(loaded, torch.Tensor):
            if loaded.dim() != 2 or loaded.shape[1] != layer.in_features:
                raise ValueError(f"expected [rows, {layer.in_features}], got {tuple(loaded.shape)}")
            loaded = QuantizedWeight(Q8_0, quantize_q8_0(loaded), layer.in_features)
        super().load_rows(layer, param, offset, loaded)


def can_quantize(in_features: int) -> bool:
    """A layer's (this rank's) input width the Q8_0 blocks can cut."""
    return in_features > 0 and in_features % Q8_0_BLOCK == 0
