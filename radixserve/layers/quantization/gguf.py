"""GGUF weights kept in their quantized blocks (issue 38).

A GGUF tensor of a linear layer reaches the layer as a QuantizedWeight: its rows of blocks as
the file stores them (uint8 [rows, row_bytes]; a row of K values is K / block_size blocks of
type_size bytes). Tensor parallelism cuts rows (column-parallel layers) or whole blocks of every
row (row-parallel ones), so a rank holds its slice in the file's bytes too.

GGUFLinearMethod keeps each checkpoint tensor a layer was given as one segment of its output
rows: a fused q|k|v or gate|up layer of a Q4_K_M file holds Q4_K and Q6_K segments side by side.
apply() multiplies each with quant_matmul, on one of three CPU paths: the C++ integer kernel
(csrc/quant_kernels.cpp: activations quantized per block to 8 bits, integer dot products, as
llama.cpp does), or the blocks dequantized a tile of output rows (~4 MB) at a time to bf16 for
oneDNN or to float32 for torch's float32 GEMM. Which path a call takes is measured at start per
matrix shape and row count (layers/gemm_select.py): the integer kernel is memory-bound at decode
sizes and wins there; at prefill sizes the winner depends on the machine.

On a CUDA device (on_triton_device) the same blocks go to the Triton kernels instead
(triton_gguf.py: a fused dequantize-matmul for few rows of x, a dequantized tile and the vendor
GEMM for many), in x's own dtype; the types they take are TRITON_TYPES.

The embedding and the LM head keep their blocks too (vocab_parallel_embedding.py): the LM head
multiplies them as a linear layer does, the embedding dequantizes the rows it looks up. Memory
after load is then about the file's size.""" 

from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

import torch
import torch.nn.functional as F

from radixserve.layers import batch_invariant, cpu_kernels, gemm_select
from radixserve.layers.quantization.base import LinearMethodBase

logger = logging.getLogger(__name__)

PREFILL_TILE_BYTES = 4 << 20  # bytes of weight dequantized at once by the bf16 and float32 paths
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


@functools.lru_cache(maxsize=64)
def block_geometry(qtype: int) -> Tuple[int, int]:
    """(values per block, bytes per block) of a ggml type (cached: a QuantizedWeight is checked
    with it, and the enum lookup costs microseconds)."""
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
    """Output rows [offset, offset + rows) of a layer: in blocks (qtype) or plain float (qtype None).
    blocks: the same data as a QuantizedWeight, made once at load (not per call on the hot path)."""

    offset: int
    rows: int
    qtype: Optional[int]
    data: torch.Tensor
    blocks: Optional[QuantizedWeight] = None


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
            data = data.to(device)
            seg = Segment(offset, loaded.shape[0], loaded.qtype, data, QuantizedWeight(loaded.qtype, data, loaded.cols))
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
        # Called ~100 times a decode step: no work here that a load could have done (issue 54)
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if not on_triton_device(x2) and (x2.dtype != torch.float32 or not x2.is_contiguous()):
            x2 = x2.float().contiguous()  # the C++ kernels take contiguous float32 rows
        if len(self.ordered) == 1:
            y = self._matmul(self.ordered[0], x2)
        else:  # each segment writes its own columns (no concatenation of the parts)
            y = x2.new_empty(x2.shape[0], layer.out_features)  # x2's dtype: float32 on the CPU, the model's on a GPU
            for s in self.ordered:
                self._matmul(s, x2, y.narrow(1, s.offset, s.rows))
        if bias is not None:
            y.add_(bias)  # y is this call's own output
        if x.dim() != 2:
            y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if y.dtype == x.dtype else y.to(x.dtype)

    @staticmethod
    def _matmul(seg: Segment, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if seg.blocks is None:
            mm = batch_invariant.linear_rows if batch_invariant.is_enabled() else F.linear
            y = mm(x, seg.data if seg.data.dtype == x.dtype else seg.data.to(x.dtype))
            return y if out is None else out.copy_(y)
        return quant_matmul(x, seg.blocks, out)


def quant_matmul(x: torch.Tensor, w: QuantizedWeight, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 x [M, K] @ w^T on the path the start-up measurement chose for w's shape and M rows
    (layers/gemm_select.py: the integer kernel, or a tile at a time dequantized to bf16 or float32
    for torch's GEMM; the float32 matrix never exists whole). On a GPU: the Triton kernels, in
    x's dtype. out: a [M, N] view (some columns of a fused layer's output) to write into."""
    if on_triton_device(x):
        if w.qtype not in TRITON_TYPES:  # the loader keeps only these in blocks on a GPU
            raise ValueError(f"{type_name(w.qtype)} blocks on a GPU: no Triton kernel for them")
        y = triton_kernels().gguf_matmul(x, w.data, w.qtype, w.cols)
        return y if out is None else out.copy_(y)
    available = cpu_paths(w.qtype)
    path = gemm_select.current_plan().path(gemm_shape(w), x.shape[0], available)
    return CPU_PATHS[path](x, w, out)


def gemm_shape(w: QuantizedWeight) -> gemm_select.GemmShape:
    return _gemm_shape(w.qtype, w.cols, w.data.shape[0])


@functools.lru_cache(maxsize=4096)
def _gemm_shape(qtype: int, k: int, n: int) -> gemm_select.GemmShape:  # per call on the hot path: no enum lookups
    return gemm_select.GemmShape(type_name(qtype), k, n)


def cpu_paths(qtype: int) -> Tuple[str, ...]:
    """The paths that can multiply blocks of this type here, the default (unmeasured) one first."""
    if qtype in kernel_types():
        avx2 = fused_decode_built()
        return (("int8", "f32", "onednn_bf16") + (("int8_fused",) if avx2 else ())
                + (("int8_i16",) if avx2 and qtype in I16_TYPES else ()))
    return ("f32",)


I16_TYPES = frozenset({12})  # Q4_K: the int16-sum tiles (quant_kernels.cpp) take it


@functools.lru_cache(maxsize=1)
def fused_decode_built() -> bool:
    """Whether the integer kernel has its fused decode (the AVX2 build), i.e. int8_fused differs."""
    ops = cpu_kernels.get()
    return ops is not None and hasattr(ops, "quant_gemm_isa") and ops.quant_gemm_isa() == "avx2"


def int8_matmul(x: torch.Tensor, w: QuantizedWeight, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The C++ integer kernel: x quantized to 8 bits per block, integer dot products."""
    return cpu_kernels.get().quant_linear(x, w.data, w.qtype, w.cols, out)


def int8_fused_matmul(x: torch.Tensor, w: QuantizedWeight, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The integer kernel with its fused decode for up to FUSED_DECODE_ROWS_MAX rows of x (beyond:
    int8's tiles). The same bits as int8_matmul, at another speed."""
    return cpu_kernels.get().quant_linear(x, w.data, w.qtype, w.cols, out, cpu_kernels.FUSED_DECODE_ROWS_MAX)


def int8_i16_matmul(x: torch.Tensor, w: QuantizedWeight, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The integer kernel with its int16-sum tiles (Q4_K, AVX2) for I16_TILES_MIN_ROWS rows of x and
    more: a super-block's 8 vectors summed in int16, then one multiply by their scales, not one per
    vector. The same integers as int8's in other float lanes: other rounding, the same accuracy.
    Fewer rows: int8's decode, int8's bits."""
    return cpu_kernels.get().quant_linear(x, w.data, w.qtype, w.cols, out, -1, True)


def dequantized_bf16_matmul(x: torch.Tensor, w: QuantizedWeight, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x rounded to bf16 once, the weight dequantized to bf16 a tile of output rows at a time (the
    C++ kernel's unpacking) and multiplied by oneDNN; float32 out."""
    ops = cpu_kernels.get()
    xb = x.to(torch.bfloat16)
    return _tiled(x, w, 2, lambda rows: F.linear(xb, ops.quant_dequantize_bf16(rows.data, w.qtype, w.cols)), out)


def dequantized_f32_matmul(x: torch.Tensor, w: QuantizedWeight, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The weight dequantized to float32 a tile of output rows at a time (the C++ kernel's
    unpacking where it takes the type, else the gguf package's), torch's float32 GEMM."""
    ops = cpu_kernels.get()
    fast = ops is not None and hasattr(ops, "quant_dequantize_f32") and w.qtype in kernel_types()

    def tile(rows: QuantizedWeight) -> torch.Tensor:
        weight = ops.quant_dequantize_f32(rows.data, w.qtype, w.cols) if fast else rows.dequantize()
        return F.linear(x, weight)

    return _tiled(x, w, 4, tile, out)


def _tiled(x: torch.Tensor, w: QuantizedWeight, elem_bytes: int, matmul_rows,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """matmul_rows(a QuantizedWeight of some output rows) for tiles of ~PREFILL_TILE_BYTES of
    dequantized weight, into one float32 [M, N] (out where given)."""
    n = w.shape[0]
    tile = max(16, PREFILL_TILE_BYTES // (elem_bytes * w.cols) // 16 * 16)
    if tile >= n:
        y = matmul_rows(w)
        return y.float() if out is None else out.copy_(y)
    if out is None:
        out = x.new_empty(x.shape[0], n, dtype=torch.float32)
    for r in range(0, n, tile):
        rows = min(tile, n - r)
        out[:, r : r + rows] = matmul_rows(w.narrow(0, r, rows))
    return out


CPU_PATHS: Dict[str, Callable[[torch.Tensor, QuantizedWeight, Optional[torch.Tensor]], torch.Tensor]] = {
    "int8": int8_matmul, "int8_fused": int8_fused_matmul, "int8_i16": int8_i16_matmul,
    "onednn_bf16": dequantized_bf16_matmul, "f32": dequantized_f32_matmul}


def quantized_weights(model: torch.nn.Module) -> List[QuantizedWeight]:
    """Every matrix of the model kept in GGUF blocks: linear layers' segments, the LM head /
    embedding, the experts."""
    found: List[QuantizedWeight] = []
    for m in model.modules():
        method = getattr(m, "quant_method", None)
        if isinstance(method, GGUFLinearMethod):
            found += [QuantizedWeight(s.qtype, s.data, m.in_features) for s in method.ordered if s.qtype is not None]
        blocks = getattr(getattr(m, "weight", None), "gguf_blocks", None)
        if isinstance(blocks, QuantizedWeight):
            found.append(blocks)
        for expert in getattr(m, "expert_blocks", None) or ():
            found += [w for w in expert.values() if isinstance(w, QuantizedWeight)]
    return found


def gemm_candidates(weights: List[QuantizedWeight], seed: int = 0):
    """For gemm_select.select_paths: the calls of each path on (up to TIMED_MAX_ROWS rows of) the
    model's own matrices of a shape, with random x of the bucket's rows. Each call takes the next
    matrix of the shape (every layer has one), so a timing reads its blocks from memory as a
    forward does, not from the cache the previous call filled: at decode sizes the two regimes
    rank the paths differently (benchmarks/NOTES.md, issue 54 session 12)."""
    by_shape: Dict[gemm_select.GemmShape, List[QuantizedWeight]] = {}
    for w in weights:
        by_shape.setdefault(gemm_shape(w), []).append(w.narrow(0, 0, min(w.shape[0], gemm_select.TIMED_MAX_ROWS)))
    turn = itertools.count()

    def candidates(shape: gemm_select.GemmShape, rows: int) -> Dict[str, Callable[[], object]]:
        ws = by_shape[shape]
        x = torch.randn(rows, ws[0].cols, generator=torch.Generator().manual_seed(seed))

        def call(path: str) -> Callable[[], object]:
            return lambda: CPU_PATHS[path](x, ws[next(turn) % len(ws)])

        return {p: call(p) for p in cpu_paths(ws[0].qtype) if not _same_as_int8(p, rows)}

    return list(by_shape), candidates


def _same_as_int8(path: str, rows: int) -> bool:
    """int8_fused or int8_i16 at a row count where it runs int8's own code (not timed twice)."""
    if path == "int8_i16":
        return rows < cpu_kernels.I16_TILES_MIN_ROWS
    if path != "int8_fused":
        return False
    return rows > cpu_kernels.FUSED_DECODE_ROWS_MAX or rows <= cpu_kernels.get().quant_decode_fused_rows()


def select_cpu_gemm_paths(model: torch.nn.Module, forced: str = "auto") -> Optional[gemm_select.Selection]:
    """At start, after loading: time the paths of every matrix shape the model keeps in blocks (or
    read the cached times), install the plan quant_matmul follows, and log what it chose and why.
    None where there is nothing to choose (no blocks, or on a GPU)."""
    weights = [w for w in quantized_weights(model) if not on_triton_device(w.data)]
    if not weights:
        return None
    if forced != "auto" and not any(forced in cpu_paths(w.qtype) for w in weights):
        raise ValueError(f"--cpu-gemm-path {forced}: no matrix of this model can take it here "
                         f"(paths here: {sorted({p for w in weights for p in cpu_paths(w.qtype)})})")
    if batch_invariant.is_enabled():
        return _batch_invariant_paths(weights, forced)
    shapes, candidates = gemm_candidates(weights)
    ops = cpu_kernels.get()
    build = cpu_kernels.extension_name() + (f"/{ops.quant_gemm_isa()}" if ops is not None and hasattr(ops, "quant_gemm_isa") else "")
    with torch.inference_mode():
        selection = gemm_select.select_paths(shapes, candidates, build, forced, cache=gemm_select.cache_path())
    # Added to the process's plan, not replacing it: a STANDALONE draft model loads beside the target
    # (a shape both have gets the same measured choice).
    gemm_select.set_plan(gemm_select.GemmPlan({**gemm_select.current_plan().choices, **selection.plan.choices},
                                              selection.plan.forced))
    how = f"measured in {selection.measured_s:.1f} s" if selection.measured_s else "timings from the cache"
    forced_note = f"; --cpu-gemm-path {forced} forces it where it applies" if forced != "auto" else ""
    logger.info("CPU GEMM paths for %d GGUF matrix shapes (%s, %d threads; %s%s):", len(shapes),
                gemm_select.cpu_model(), torch.get_num_threads(), how, forced_note)
    for line in gemm_select.summarize(selection):
        logger.info("  %s", line)
    return selection


def _batch_invariant_paths(weights: List[QuantizedWeight], forced: str) -> None:
    """--enable-deterministic-inference: one path per matrix whatever the row count (the integer
    kernel where the type has it, else float32; or --cpu-gemm-path), each checked at start to give
    a row the same bits at every row count; a path that does not is refused with one line."""
    plan = gemm_select.GemmPlan(forced=forced if forced != "auto" else "int8")
    gemm_select.set_plan(plan)
    seen = set()
    with torch.inference_mode():
        for w in weights:
            shape = gemm_shape(w)
            if shape in seen:
                continue
            seen.add(shape)
            path = plan.path(shape, 1, cpu_paths(w.qtype))
            if not batch_invariant.check_rows_invariant(lambda x: CPU_PATHS[path](x, w), w.cols):
                raise ValueError(f"--enable-deterministic-inference: the {path} GEMM path of {shape.key()} GGUF blocks "
                                 f"gives a row different bits at different row counts; load the model unquantized "
                                 f"(--quantization none) or pick another --cpu-gemm-path")
    logger.info("CPU GEMM paths for %d GGUF matrix shapes: one per shape whatever the row count "
                "(--enable-deterministic-inference; checked batch-invariant)", len(seen))
