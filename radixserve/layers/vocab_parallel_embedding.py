"""Vocabulary-parallel embedding and LM head: rank r holds rows [r*V/tp, (r+1)*V/tp)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed.parallel_state import (
    get_tp_group,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from radixserve.layers import cpu_kernels
from radixserve.layers.linear import PackedWeight, _copy, linear, pack_cpu_weight
from radixserve.layers.quantization import QuantizedWeight, quant_matmul
from radixserve.layers.quantization import gguf as quant_gguf


def gguf_blocks(weight: torch.Tensor) -> Optional[QuantizedWeight]:
    """This rank's rows of the table in a GGUF file's blocks, when it was loaded so. Kept on the
    Parameter itself: a tied LM head holds the very same Parameter as the embedding."""
    return getattr(weight, "gguf_blocks", None)


def embed_with_input_embeds(embed_tokens: nn.Module, input_ids: torch.Tensor, forward_batch) -> torch.Tensor:
    """embed_tokens(input_ids), with the rows a request gave as input_embeds (SGLang's field)
    taken from it instead: their ids are only placeholders."""
    hidden = embed_tokens(input_ids)
    rows = getattr(forward_batch, "input_embeds_rows", None)
    if rows is None:
        return hidden
    return hidden.index_copy(0, rows, forward_batch.input_embeds.to(hidden.dtype))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.num_embeddings = num_embeddings
        self.shard_size = -(-num_embeddings // self.tp_size)  # padded so every rank is equal
        self.vocab_start = self.tp_rank * self.shard_size
        self.embedding_dim = embedding_dim
        # Uninitialised (untouched memory: a GGUF table kept in blocks never makes it resident)
        # except the padding rows past the vocabulary, which the LM head turns into logits too.
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.data[max(0, num_embeddings - self.vocab_start):].zero_()
        # The hidden states' dtype when it differs from the table's (the CPU's bf16 mode: a bf16
        # table, float32 activations; layers/cpu_weight_only.py). None: the table's.
        self.output_dtype: Optional[torch.dtype] = None

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        dim = self.embedding_dim
        if tuple(loaded.shape[1:]) != (dim,) or loaded.shape[0] != self.num_embeddings:
            raise ValueError(f"expected shape ({self.num_embeddings}, {dim}), got {tuple(loaded.shape)}")
        n = min(self.shard_size, self.num_embeddings - self.vocab_start)
        if isinstance(loaded, QuantizedWeight):  # kept in its blocks; the float table is freed
            rows = loaded.narrow(0, self.vocab_start, n)
            param.gguf_blocks = QuantizedWeight(rows.qtype, rows.data.to(param.device, copy=True), dim)
            param.data = torch.empty(0, dim, dtype=param.dtype, device=param.device)
            return
        if param.numel() == 0:  # held in blocks until now (a weight update from another format)
            param.data = torch.zeros(self.shard_size, dim, dtype=param.dtype, device=param.device)
            param.gguf_blocks = None
        _copy(param.data[:n], loaded[self.vocab_start : self.vocab_start + n])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        mask = (local < 0) | (local >= self.shard_size)
        out = self._lookup(local.masked_fill(mask, 0))
        out.masked_fill_(mask.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        blocks = gguf_blocks(self.weight)
        if blocks is not None:  # dequantize just the rows looked up
            flat = ids.reshape(-1)
            rows = QuantizedWeight(blocks.qtype, blocks.data.index_select(0, flat), blocks.cols).dequantize()
            out = rows.reshape(*ids.shape, blocks.cols).to(self.output_dtype or self.weight.dtype)
            return out
        out = F.embedding(ids, self.weight)
        return out if self.output_dtype is None else out.to(self.output_dtype)


class ParallelLMHead(VocabParallelEmbedding):
    """Computes logits of its vocab shard; `get_logits` gathers them over ranks.
    On a CPU with AVX512_BF16 or AVX2 `pack_cpu_weight` adds a copy of the weight packed for the C++
    GEMM (cpu_kernels.bf16_linear); the original stays, as the input embedding is often tied to it."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.weight_packed: Optional[PackedWeight] = None  # a plain attribute, as in LinearBase
        # The CPU's bf16 mode (layers/cpu_weight_only.py): this many of each row's largest logits are
        # recomputed from the float32 hidden states. 0: none.
        self.refine_top_k = 0

    def pack_cpu_weight(self) -> bool:
        if gguf_blocks(self.weight) is not None:  # multiplied in its blocks
            return False
        self.weight_packed = pack_cpu_weight(self.weight)  # the original stays (the embedding)
        return self.weight_packed is not None

    def get_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        blocks = gguf_blocks(self.weight)
        if blocks is not None:
            x = hidden.reshape(-1, hidden.shape[-1])
            if not quant_gguf.on_triton_device(x):  # the C++ kernels take float32 rows; a GPU multiplies in the
                x = x.float().contiguous()  # hidden states' dtype, as its float LM head does
            logits = quant_matmul(x, blocks)
            logits = F.pad(logits, (0, self.shard_size - logits.shape[-1]))  # the last rank's padding rows
            if self.tp_size > 1:
                logits = tensor_model_parallel_all_gather(logits, dim=-1)
            return logits[..., : self.num_embeddings]
        logits = linear(hidden, self.weight, self.weight_packed)
        if self.refine_top_k and logits.dtype == torch.float32:
            # The GEMM rounded the hidden states to bf16; the largest logits, what greedy choice,
            # sampling and logprobs read, come again from the float32 ones (per row: batch-invariant).
            cpu_kernels.get().refine_top_logits(logits, hidden.reshape(-1, hidden.shape[-1]), self.weight, self.refine_top_k)
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings]

