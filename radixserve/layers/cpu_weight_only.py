"""The CPU's bf16 mode: bf16 weights, float32 activations (llama.cpp's numerics for BF16 weights).

On a CPU with AVX512_BF16 or AVX2 + FMA a bf16 model keeps its matrices in bf16 (the bandwidth a
decode step is bound by) and runs everything else in float32: the residual stream, the norms,
rotary, the attention softmax and the logits. With AVX512_BF16 activations are rounded to bf16
only as the operand of each dot product inside the C++ GEMM (vdpbf16ps), whose sums come back
unrounded; on AVX2 the GEMM widens the weights and multiplies the float32 activations as they are
(no bf16 dot product there to save time with; closer to float32). Running the activations in bf16
too cost answers (issue 25: 13 of 24 greedy chat answers equal float32's on SmolLM2, where
llama.cpp's BF16 kept 19); benchmarks/NOTES.md has the per-kernel errors.

`convert_to_weight_only(model)` does it once after loading; where the C++ GEMM is not at hand
(no AVX512_BF16 or AVX2, no compiler, RADIXSERVE_DISABLE_CPU_KERNELS=1) the model stays as it is, all in
bf16 on torch's ops.
"""

from __future__ import annotations

import logging
import torch
from torch import nn

from radixserve.layers import cpu_kernels
from radixserve.layers.linear import pack_cpu_weights
from radixserve.layers.vocab_parallel_embedding import VocabParallelEmbedding

logger = logging.getLogger(__name__)

# --kv-cache-dtype names (SGLang's, with the short forms it also takes)
KV_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
                   "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}
# The KV cache of the bf16 mode under --kv-cache-dtype auto, by measurement on SmolLM2
# (benchmarks/NOTES.md, issue 25): fp16 keys and values (llama.cpp's default too). Half the bytes
# of float32 at the same agreement; bf16's 8-bit mantissa cost a larger mean logprob error.
WEIGHT_ONLY_KV_DTYPE = torch.float16
# Logits per row the LM head recomputes from float32 hidden states (refine_top_logits) where the
# GEMM rounds them to bf16 (AVX512_BF16; on AVX2 it multiplies them in float32 already)
LM_HEAD_REFINE_TOP_K = 64


def weight_only_available(dtype: torch.dtype, device: str) -> bool:
    """Whether a model of this dtype on this device runs as bf16 weights + float32 activations."""
    if device != "cpu" or dtype != torch.bfloat16:
        return False
    ops = cpu_kernels.get()
    return ops is not None and bool(ops.has_bf16_gemm())


def convert_to_weight_only(model: nn.Module) -> None:
    """Pack every linear layer and the LM head for the C++ GEMM (bf16, as loaded), then move the
    rest to float32: norm weights and biases become float32 parameters, the embedding keeps its
    bf16 table and hands out float32 rows, so every activation downstream is float32. A matrix the
    GEMM cannot take (odd K) is kept in float32 instead. Call only where weight_only_available."""
    packed = pack_cpu_weights(model)
    embeddings = [m for m in model.modules() if isinstance(m, VocabParallelEmbedding)]
    tables = {id(m.weight) for m in embeddings}
    for m in embeddings:
        m.output_dtype = torch.float32
    kept = 0
    for p in model.parameters():
        if id(p) in tables or not p.is_floating_point() or p.dtype == torch.float32:
            continue
        kept += p.dim() == 2 and p.numel() > 0
        p.data = p.data.float()
    for m in embeddings:
        if getattr(m.weight, "gguf_blocks", None) is not None:  # multiplied in a GGUF file's blocks
            continue
        if getattr(m, "weight_packed", True) is None:  # an LM head the GEMM could not take: float32
            m.weight = nn.Parameter(m.weight.detach().float(), requires_grad=False)
            kept += 1
        elif hasattr(m, "refine_top_k") and cpu_kernels.get().has_avx512_bf16():
            m.refine_top_k = LM_HEAD_REFINE_TOP_K
    logger.info("CPU bf16 mode: %d weight matrices in bf16 for the C++ GEMM%s, activations in float32",
                packed, f" ({kept} more kept in float32)" if kept else "")


def resolve_kv_cache_dtype(flag: str, activation_dtype: torch.dtype, weight_only: bool) -> torch.dtype:
    """--kv-cache-dtype: auto is the activations' dtype, except in the CPU's bf16 mode, where the
    cache is WEIGHT_ONLY_KV_DTYPE."""
    if flag == "auto":
        return WEIGHT_ONLY_KV_DTYPE if weight_only else activation_dtype
    return KV_CACHE_DTYPES[flag]

