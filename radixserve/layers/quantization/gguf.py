"""GGUF weights kept in their quantized blocks (issue 38).

A GGUF tensor of a linear layer reaches the layer as a QuantizedWeight: its rows of blocks as
the file stores them (uint8 [rows, row_bytes]; a row of K values is K / block_size blocks of
type_size bytes). Tensor parallelism cuts rows (column-parallel layers) or whole blocks of every
row (row-parallel ones), so a rank holds its slice in the file's bytes too.

GGUFLinearMethod keeps each checkpoint tensor a layer was given as one segment of its output
rows: a fused q|k|v or gate|up layer of a Q4_K_M file holds Q4_K and Q6_K segments side by side.
apply() multiplies each with the C++ kernel (csrc/quant_kernels.cpp: activations quantized per
block to 8 bits, integer dot products, as llama.cpp does) where it takes the type; otherwise it
dequantizes a tile of rows at a time (never the whole matrix) and uses F.linear.
At prefill sizes (PREFILL_MIN_ROWS rows of x or more) the integer kernel is compute-bound and
torch's oneDNN bf16 GEMM is faster: there the C++ kernel dequantizes a tile of output rows to
bf16 (~4 MB) at a time and oneDNN multiplies it with x rounded to bf16 (benchmarks/NOTES.md,
issue 38 prefill: 1.3-1.5x at 256-512 rows; the accuracy against float32 is measured there).

On a CUDA device (on_triton_device) the same blocks go to the Triton kernels instead
(triton_gguf.py: a fused dequantize-matmul for few rows of x, a dequantized tile and the vendor
GEMM for many), in x's own dtype; the types they take are TRITON_TYPES.

The embedding and the LM head keep their blocks too (vocab_parallel_embedding.py): the LM head
multiplies them as a linear layer does, the embedding dequantizes the rows it looks up. Memory
after load is then about the file's size.""" 

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

import torch
import torch.nn.functional as F

from radixserve.layers import cpu_kernels
from radixserve.layers.quantization.base import LinearMethodBase

FALLBACK_TILE_ROWS = 256  # rows dequantized at once by the torch fallback
# Rows of x from which the dequantize-to-bf16 + oneDNN path beats the integer kernel (measured on
# Qwen2.5-1.5B's shapes: level at 64 rows, 1.3x at 128-256; benchmarks/cpu/quant_gemm.py)
PREFILL_MIN_ROWS = 128
PREFILL_TILE_BYTES = 4 << 20  # bf16 bytes of weight dequantized at once on that path
# The ggml types triton_gguf.py multiplies (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K):
# here, so a loader can ask without importing triton
TRITON_TYPES = frozenset({2, 3, 6, 7, 8, 10, 11, 12, 13, 14})


def on_triton_device(t: torch.Tensor) -> bool:
    """Whether blocks / activations on t's device take the Triton kernels (a GPU) rather than the
    C++ ones. One function, so a CPU test can send interpreted Triton kernels through the layer."""
    return t.is_cuda


@functools.lru_cache(maxsize=1)
def triton_kernels() -> Any:
    """triton_gguf, imported on first use (never on a CPU serving path: it imports triton)."""
    from radixserve.layers.quantization import triton_gguf

    return triton_gguf


def block_geometry(qtype: int) -> Tuple[int, int]:
    """(values per block, bytes per block) of a ggml type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]


def type_name(qtype: int) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(qtype).name


@dataclass
class QuantizedWeight:
    """A [rows, cols] matrix in a GGUF file's blocks. data: uint8 [rows, cols / block * type_size]."""

    qtype: int
    data: torch.Tensor
    cols: int

    def __post_init__(self):
        block, size = block_geometry(self.qtype)
        assert self.data.dtype == torch.uint8 and self.data.dim() == 2, (self.data.dtype, self.data.shape)
        assert self.cols % block == 0 and self.data.shape[1] == self.cols // block * size, (self.cols, self.data.shape)

    @property
    def shape(self) -> Tuple[int, int]:
        return (self.data.shape[0], self.cols)

    def narrow(self, dim: int, start: int, length: int) -> "QuantizedWeight":
        """Rows (dim 0), or columns (dim 1) in whole blocks: what a tensor-parallel rank keeps."""
        if dim == 0:
            return QuantizedWeight(self.qtype, self.data.narrow(0, start, length), self.cols)
        block, size = block_geometry(self.qtype)
        if start % block or length % block:
            raise ValueError(f"{type_name(self.qtype)} blocks are {block} values wide: columns {start}..{start + length} "
                             f"cut through one (choose a --tp-size that splits {self.cols} at whole blocks)")
        return QuantizedWeight(self.qtype, self.data.narrow(1, start // block * size, length // block * size), length)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], by the gguf package's own dequantization."""
        if on_triton_device(self.data):
            return triton_kernels().gguf_dequantize(self.data, self.qtype, self.cols)
        import gguf

        # numpy reads a copy: .numpy() on the held blocks would pin their memory (release/resume
        # could no longer free it in place)
        return torch.from_numpy(gguf.quants.dequantize(self.data.clone().numpy(), self.qtype))


@functools.lru_cache(maxsize=1)
def kernel_types() -> FrozenSet[int]:
    """The ggml types the C++ kernel multiplies (empty without it: no compiler, no AVX512-VNNI)."""
    ops = cpu_kernels.get()
    if ops is None or not hasattr(ops, "has_quant_gemm") or not ops.has_quant_gemm():
        return frozenset()
    return frozenset(int(t) for t in ops.quant_gemm_types())


@dataclass
class Segment:
    """Output rows [offset, offset + rows) of a layer: in blocks (qtype) or plain float (qtype None)."""

    offset: int
    rows: int
    qtype: Optional[int]
    data: torch.Tensor


class GGUFLinearMethod(LinearMethodBase):
    def __init__(self):
        self.segments: Dict[int, Segment] = {}  # by offset; a weight update replaces one
        self.ordered: List[Segment] = []

    def load_rows(self, layer: Any, param: torch.Tensor, offset: int, loaded: Any) -> None:
        device = layer.weight.device  # the blocks live where the layer was built (a GPU's memory there)
        if isinstance(loaded, QuantizedWeight):
            if loaded.cols != layer.in_features:
                raise ValueError(f"expected {layer.in_features} columns, got {loaded.cols}")
            data = loaded.data.contiguous()
            if data.untyped_storage().nbytes() != data.nbytes:  # a rank's slice: not the whole tensor's memory
                data = data.clone()
            seg = Segment(offset, loaded.shape[0], loaded.qtype, data.to(device))
        else:  # a plain tensor (an F16/F32 one of the file, or a weight update from safetensors)
            if loaded.dim() != 2 or loaded.shape[1] != layer.in_features:
                raise ValueError(f"expected [rows, {layer.in_features}], got {tuple(loaded.shape)}")
            # float32 for the CPU kernels' float32 activations; the model's dtype on a GPU
            dtype = layer.weight.dtype if on_triton_device(layer.weight) else torch.float32
            seg = Segment(offset, loaded.shape[0], None, loaded.detach().to(device, dtype, copy=True).contiguous())
        if offset + seg.rows > layer.out_features:
            raise ValueError(f"rows {offset}..{offset + seg.rows} beyond the layer's {layer.out_features}")
        self.segments[offset] = seg
        self.ordered = sorted(self.segments.values(), key=lambda s: s.offset)

    def apply(self, layer: Any, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if not on_triton_device(x2):  # the C++ kernels take float32 rows
            x2 = x2.float().contiguous()
        parts = [self._matmul(s, x2) for s in self.ordered]
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)

    @staticmethod
    def _matmul(seg: Segment, x: torch.Tensor) -> torch.Tensor:
        if seg.qtype is None:
            return F.linear(x, seg.data if seg.data.dtype == x.dtype else seg.data.to(x.dtype))
        return quant_matmul(x, QuantizedWeight(seg.qtype, seg.data, x.shape[1]))


def quant_matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """float32 x [M, K] @ w^T: the C++ kernel where it takes w's type, else the torch fallback,
    a tile of rows at a time, so the float32 matrix never exists whole. On a GPU: the Triton
    kernels, in x's dtype."""
    if on_triton_device(x):
        if w.qtype not in TRITON_TYPES:  # the loader keeps only these in blocks on a GPU
            raise ValueError(f"{type_name(w.qtype)} blocks on a GPU: no Triton kernel for them")
        return triton_kernels().gguf_matmul(x, w.data, w.qtype, w.cols)
    if w.qtype in kernel_types():
        ops = cpu_kernels.get()
        if x.shape[0] >= PREFILL_MIN_ROWS and ops.has_bf16_gemm():  # oneDNN's bf16 needs AVX512_BF16 to be fast
            return dequantized_bf16_matmul(ops, x, w)
        return ops.quant_linear(x, w.data, w.qtype, w.cols)
    out = x.new_empty(x.shape[0], w.shape[0])
    for r in range(0, w.shape[0], FALLBACK_TILE_ROWS):
        tile = w.narrow(0, r, min(FALLBACK_TILE_ROWS, w.shape[0] - r)).dequantize()
        out[:, r : r + tile.shape[0]] = F.linear(x, tile)
    return out


def dequantized_bf16_matmul(ops: Any, x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """The prefill path: x rounded to bf16 once, the weight dequantized to bf16 a tile of output
    rows at a time (the C++ kernel's unpacking) and multiplied by oneDNN; float32 out."""
    xb = x.to(torch.bfloat16)
    n = w.shape[0]
    tile = max(16, PREFILL_TILE_BYTES // (2 * w.cols) // 16 * 16)
    if tile >= n:
        return F.linear(xb, ops.quant_dequantize_bf16(w.data, w.qtype, w.cols)).float()
    out = x.new_empty(x.shape[0], n)
    for r in range(0, n, tile):
        rows = min(tile, n - r)
        out[:, r : r + rows] = F.linear(xb, ops.quant_dequantize_bf16(w.data[r : r + rows], w.qtype, w.cols))
    return out
