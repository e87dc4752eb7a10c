"""Linear layers written for tensor parallelism (Megatron style), as in SGLang / vLLM.

  ColumnParallelLinear   W split by output rows:  y_local = x @ W_local^T   (no communication)
  RowParallelLinear      W split by input cols:   y = all_reduce(x_local @ W_local^T)
  QKVParallelLinear      fused q|k|v columns, split by heads (kv heads replicated when tp > kv)
  MergedColumnParallelLinear  fused gate|up columns

Each parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that copies the
rank's slice of a full checkpoint tensor, so checkpoints load the same way for any tp size.
How a layer holds and applies its weight is its `quant_method` (layers/quantization/):
UnquantizedLinearMethod here, or GGUFLinearMethod for a GGUF's blocks (model_loader gives it to
the layers whose tensors stay in blocks, before loading).
With tp_size 1 every layer is a plain F.linear, except on a CPU with AVX512_BF16 or AVX2 + FMA in
bf16: there `pack_cpu_weights` repacks each weight once for the C++ GEMM (cpu_kernels.bf16_linear,
2-4x torch's at decode batch sizes) and frees the original layout, so the weights are held once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed.parallel_state import get_tp_group, tensor_model_parallel_all_reduce
from radixserve.layers import batch_invariant, cpu_kernels
from radixserve.layers.quantization import LinearMethodBase, QuantizedWeight
from radixserve.utils import progress


class WeightShapeError(ValueError):
    pass


def _copy(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise WeightShapeError(f"expected shape {tuple(param.shape)}, got {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    _copy(param, loaded)


class UnquantizedLinearMethod(LinearMethodBase):
    """The weight as a float parameter: F.linear, or the C++ bf16 GEMM on its packed copy."""

    def load_rows(self, layer: "LinearBase", param: torch.Tensor, offset: int, loaded: torch.Tensor) -> None:
        _copy(param.data.narrow(0, offset, loaded.shape[0]), loaded)

    def apply(self, layer: "LinearBase", x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return linear(x, layer.weight, layer.weight_packed, bias)


UNQUANTIZED = UnquantizedLinearMethod()  # it keeps no state of its own: one for every layer


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.in_features, self.out_features = in_features, out_features  # this rank's
        # Set by pack_cpu_weight. A plain attribute, not a buffer: nn.Module's attribute lookup of a
        # buffer is a slow path, taken by every forward.
        self.weight_packed: Optional[PackedWeight] = None
        # --enable-lora: a radixserve.lora LoRALinearDelta that adds the batch's LoRA delta; a
        # plain attribute for the same reason (None, its only cost when LoRA is off: one check).
        self.lora: Optional[Any] = None
        self.quant_method: LinearMethodBase = UNQUANTIZED

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is not None:
            return self.lora.apply(x, self.matmul(x, self.bias))
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.quant_method.apply(self, x, bias)

    def use_quant_method(self, method: LinearMethodBase) -> None:
        """Before loading: hold the weight `method`'s way (the float weight built with the layer is
        freed, never filled; [0, 0]: still a matrix to the loaders, which tell it from the bias by dim)."""
        self.quant_method = method
        self.weight = nn.Parameter(torch.empty(0, 0, dtype=self.weight.dtype, device=self.weight.device),
                                   requires_grad=False)  # its device: where the method puts the blocks

    def load_weight_rows(self, param: torch.Tensor, offset: int, loaded: Any) -> None:
        """Rows [offset, offset + rows) of the weight (or the bias) from this rank's slice of a
        checkpoint tensor; the bias stays a float parameter whatever the method."""
        if param.dim() == 1:
            _copy(param.data.narrow(0, offset, loaded.shape[0]), loaded)
        elif isinstance(loaded, QuantizedWeight) and self.quant_method is UNQUANTIZED:
            raise ValueError(f"a {type(loaded).__name__} for a layer that holds a float weight")
        else:
            self.quant_method.load_rows(self, param, offset, loaded)

    def pack_cpu_weight(self) -> bool:
        """Pack for the C++ GEMM and free the original layout (the packed one serves every
        batch size, so the weight is held once)."""
        if self.quant_method is not UNQUANTIZED:  # kept in its own format (GGUF blocks)
            return False
        self.weight_packed = pack_cpu_weight(self.weight)
        if self.weight_packed is None:
            return False
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)
        return True

    def unpack_cpu_weight(self) -> None:
        """The inverse of pack_cpu_weight: the weight back in its own layout, for a weight update
        to write into (pack_cpu_weight again afterwards)."""
        if self.weight_packed is not None and self.weight.numel() == 0:
            self.weight = nn.Parameter(unpack_cpu_weight(self.weight_packed, self.in_features), requires_grad=False)


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        tp_size = get_tp_group().size
        assert out_features % tp_size == 0, f"{out_features} not divisible by tp_size {tp_size}"
        super().__init__(in_features, out_features // tp_size, bias)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        n = self.out_features
        self.load_weight_rows(param, 0, loaded.narrow(0, self.tp_rank * n, n))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_proj | up_proj)."""

    def __init__(self, in_features: int, output_sizes: List[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int = 0) -> None:
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        self.load_weight_rows(param, offset, loaded.narrow(0, self.tp_rank * size, size))


def rank_parts(loaded: Any, part_sizes: List[int], tp_rank: int, tp_size: int) -> List[Any]:
    """This rank's rows of each part of a checkpoint tensor that stacks several outputs (sizes
    part_sizes, in order), each part split across the ranks."""
    out, start = [], 0
    for size in part_sizes:
        n = size // tp_size
        out.append(loaded.narrow(0, start + tp_rank * n, n))
        start += size
    return out


class StackedColumnParallelLinear(ColumnParallelLinear):
    """One checkpoint tensor holding several outputs one after the other (Qwen3.5's in_proj_qkv:
    q | k | v of the linear attention), each split across the ranks: a rank keeps its slice of
    every part, in the same order."""

    def __init__(self, in_features: int, part_sizes: List[int], bias: bool = False):
        self.part_sizes = part_sizes
        super().__init__(in_features, sum(part_sizes), bias)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        offset = 0
        for part in rank_parts(loaded, self.part_sizes, self.tp_rank, self.tp_size):
            self.load_weight_rows(param, offset, part)
            offset += part.shape[0]


class QKVParallelLinear(ColumnParallelLinear):
    """q | k | v projections fused; split by attention heads across ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp_size = get_tp_group().size
        assert num_heads % tp_size == 0, f"num_heads {num_heads} not divisible by tp_size {tp_size}"
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size
        if tp_size >= num_kv_heads:
            assert tp_size % num_kv_heads == 0
            self.num_kv_heads, self.kv_replicas = 1, tp_size // num_kv_heads
        else:
            assert num_kv_heads % tp_size == 0
            self.num_kv_heads, self.kv_replicas = num_kv_heads // tp_size, 1
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, out, bias)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str = "q") -> None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        self.load_weight_rows(param, offset, loaded.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce_results: bool = True):
        tp_size = get_tp_group().size
        assert in_features % tp_size == 0
        super().__init__(in_features // tp_size, out_features, bias)
        self.reduce_results = reduce_results

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # the bias is not split; rank 0's copy is added after the reduce
            _copy(param, loaded)
            return
        n = self.in_features
        self.load_weight_rows(param, 0, loaded.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        if self.lora is not None:
            # Before the all-reduce: this rank's delta, from its slice of the input (A is cut like
            # the weight), is a partial sum like y's, and the reduce adds them all up.
            y = self.lora.apply(x, y)
        if self.reduce_results and self.tp_size > 1:
            y = tensor_model_parallel_all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y


@dataclass
class PackedWeight:
    """A [N, K] bf16 weight repacked by cpu_kernels.pack_bf16_weight ([N/16][K/2][16][2], N padded)."""

    data: torch.Tensor
    out_features: int


def pack_cpu_weight(weight: torch.Tensor) -> Optional[PackedWeight]:
    """The weight packed for cpu_kernels.bf16_linear, or None where that GEMM cannot take it
    (not bf16, a CPU with neither AVX512_BF16 nor AVX2 + FMA, odd K, or the kernels are off)."""
    ops = cpu_kernels.kernels_for(weight)
    if ops is None or not ops.has_bf16_gemm() or weight.dtype != torch.bfloat16 or weight.shape[-1] % 2:
        return None
    return PackedWeight(ops.pack_bf16_weight(weight), weight.shape[0])


def unpack_cpu_weight(packed: PackedWeight, in_features: int) -> torch.Tensor:
    """The [N, K] weight a PackedWeight was made from ([N/16][K/2][16][2] -> [N, K])."""
    blocks, k2, block_n, pair = packed.data.shape
    full = packed.data.permute(0, 2, 1, 3).reshape(blocks * block_n, k2 * pair)
    return full[: packed.out_features, :in_features].contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, packed: Optional[PackedWeight], bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear, or the C++ bf16 GEMM on the packed copy of the weight when there is one."""
    if packed is not None:
        return cpu_kernels.get().bf16_linear(x, packed.data, packed.out_features, bias)
    if batch_invariant.is_enabled() and x.device.type == "cpu":  # torch's BLAS tiles by row count
        return batch_invariant.linear_rows(x, weight, bias)
    return F.linear(x, weight, bias)


def pack_cpu_weights(model: nn.Module) -> int:
    """Once after loading: every module that can (linear layers, the LM head) packs its weight
    for the C++ GEMM. Returns how many did."""
    modules = [m for m in model.modules() if hasattr(m, "pack_cpu_weight")]
    return sum(1 for m in progress(modules, desc="Packing weights for the C++ GEMM", unit="module",
                                                      enabled=get_tp_group().rank == 0) if m.pack_cpu_weight())
