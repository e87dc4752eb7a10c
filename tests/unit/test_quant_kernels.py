"""The quantized GEMM of the C++ CPU kernels (radixserve/csrc/quant_kernels.cpp, issue 38):
quant_linear(x, weight, qtype, K) = x @ dequantize(weight)^T with the weight kept in its GGUF
blocks and x quantized to 8 bits per block, for every supported ggml type.

Weights: gguf.quants.quantize of random floats where the gguf package can quantize the type
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), random bytes with valid fp16 scale fields for the K-quants (it
cannot); the dequantized weight is gguf.quants.dequantize of the same bytes (the ground truth of
the bit layouts). Two references:
  A. the activation quantization the kernel uses, repeated here in numpy (per block of 32, or of
     256 for the K-quants: d = amax / 127, q = rint(x * float32(127 / amax))), times the
     dequantized weight in float64: the kernel must match it to float32 accumulation error;
  B. the float product x @ W^T: the difference is the error of 8-bit activations (< 2e-2 relative).
M in {1, 3, 11, 16}: the decode path (groups of up to 8 rows of x: 8 + 3, 8 + 8); M in {17, 67}:
the blocked (prefill) path, with remainders of its 4-row groups and (at the larger K) more than
one block of rows of x. K values with a partial group of 4 blocks and more than one K chunk; N
values not multiples of the kernel's 4-row tiles."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from radixserve.layers import cpu_kernels

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
# (K, N) per block size: one K chunk of the kernel (2048 values); and several K chunks, a partial
# group of 4 blocks (281 blocks), N not a multiple of the 4-row tiles, and K so large that the
# kernel takes the 67 rows of x in more than one block (32 or 44 rows for these K)
SHAPES = {32: [(512, 48), (32 * 281, 13)], 256: [(256 * 3, 48), (256 * 35, 7)]}
MS = [1, 3, 11, 16, 17, 67]


@pytest.fixture(scope="module")
def ops():
    mod = cpu_kernels.get()
    assert mod is not None, "the C++ CPU kernels did not build (see the warning logged by cpu_kernels.build)"
    if not mod.has_quant_gemm():
        pytest.skip("quant_linear is built only with AVX512-VNNI or AVX2")
    return mod


def _fp16_field(rng, n, scale):
    """n valid fp16 values as bytes [n, 2] (positive, around `scale`)."""
    return (rng.uniform(0.5, 1.5, size=n) * scale).astype(np.float16).view(np.uint8).reshape(n, 2)


def make_weight(qtype, n, k, seed=0):
    """(GGUF bytes uint8 [n, row_bytes], dequantized float32 [n, k])."""
    rng = np.random.default_rng(seed)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in K_QUANTS:  # gguf cannot quantize these: random blocks, the fp16 fields made valid
        nb = n * k // block
        blocks = rng.integers(0, 256, size=(nb, type_size), dtype=np.uint8)
        if qtype == Q.Q6_K:
            blocks[:, 208:210] = _fp16_field(rng, nb, 2e-3)  # d (the scales are int8)
        else:
            blocks[:, 0:2] = _fp16_field(rng, nb, 2e-3)  # d
            blocks[:, 2:4] = _fp16_field(rng, nb, 1e-2)  # dmin
        data = blocks.reshape(n, k // block * type_size)
    else:
        data = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype)
    assert data.shape == (n, k // block * type_size) and data.dtype == np.uint8
    return data, gguf.quants.dequantize(data, qtype).reshape(n, k)


def quantize_activations(x, block):
    """x [M, K] float32 -> the kernel's quantized x (q * d), float64."""
    m, k = x.shape
    xb = x.reshape(m, k // block, block).astype(np.float32)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    d = amax / np.float32(127)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.rint(xb * inv)  # float32 product, round half to even (the kernel's vcvtps2dq)
    assert np.abs(q).max() <= 127
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(m, k)


def make_x(m, k, seed=1):
    x = np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)
    x[:, : k // 8] *= 4.0  # uneven magnitudes across blocks
    if m >= 3:
        x[1, 32:64] = 0.0  # an all-zero block (amax = 0)
        x[2] = 0.0  # an all-zero row
    return x


def check(ops, qtype, m, k, n, tol_a=2e-5, tol_b=2e-2):
    data, w = make_weight(qtype, n, k)
    x = make_x(m, k)
    y = ops.quant_linear(torch.from_numpy(x), torch.from_numpy(data), int(qtype), k)
    assert y.dtype == torch.float32 and tuple(y.shape) == (m, n)
    y = y.numpy().astype(np.float64)
    block = 256 if qtype in K_QUANTS else 32
    ref_a = quantize_activations(x, block) @ w.astype(np.float64).T
    scale = np.abs(ref_a).max()
    err_a = np.abs(y - ref_a).max() / scale
    assert err_a < tol_a, f"{qtype.name} M={m} K={k} N={n}: max error {err_a:.2e} of max |y| vs the quantized-x reference"
    ref_b = x.astype(np.float64) @ w.astype(np.float64).T
    err_b = np.linalg.norm(y - ref_b) / np.linalg.norm(ref_b)
    assert err_b < tol_b, f"{qtype.name} M={m} K={k} N={n}: relative error {err_b:.2e} vs the float product"
    if m >= 3:
        assert np.all(y[2] == 0.0)  # an all-zero row of x gives exact zeros


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("shape", [0, 1], ids=["one-chunk", "chunks-tails"])
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_quant_linear_matches_references(ops, qtype, shape, m):
    k, n = SHAPES[256 if qtype in K_QUANTS else 32][shape]
    check(ops, qtype, m, k, n)


@pytest.fixture
def fused_rows(ops):
    """Sets cpu_kernels.quant_decode_fused_rows for one test, restoring it after."""
    prev = ops.quant_decode_fused_rows()
    yield ops.quant_decode_fused_rows
    ops.quant_decode_fused_rows(prev)


@pytest.mark.parametrize("limit", [0, 16], ids=["scratch", "fused"])
@pytest.mark.parametrize("m", [1, 2, 4, 7])
@pytest.mark.parametrize("shape", [0, 1], ids=["one-chunk", "chunks-tails"])
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_both_decode_paths_match_references(ops, fused_rows, qtype, shape, m, limit):
    """Issue 54: the AVX2 build decodes few rows of x either fused (each block unpacked in registers
    and dotted at once; 4 rows of x a pass, so 7 = 4 + 3) or through an L1 scratch (limit 0): both
    keep the numerics above. (Other builds have one decode path; the limit is a no-op there.)"""
    fused_rows(limit)
    k, n = SHAPES[256 if qtype in K_QUANTS else 32][shape]
    check(ops, qtype, m, k, n)


def test_fused_rows_limit_round_trips(ops, fused_rows):
    built = ops.quant_gemm_isa() == "avx2"
    default = min(cpu_kernels.fused_decode_rows_from_env(), 16)  # 4 unless RADIXSERVE_FUSED_DECODE_ROWS
    assert fused_rows(3) == (default if built else 0)
    assert fused_rows() == (3 if built else 0)
    assert fused_rows(99) == (3 if built else 0)
    assert fused_rows() == (16 if built else 0)  # at most the decode path's 16 rows


def test_fused_decode_is_on_unless_turned_off():
    assert cpu_kernels.fused_decode_rows_from_env({}) == cpu_kernels.FUSED_DECODE_ROWS_DEFAULT == 4
    assert cpu_kernels.fused_decode_rows_from_env({cpu_kernels.FUSED_DECODE_ENV: "0"}) == 0
    assert cpu_kernels.fused_decode_rows_from_env({cpu_kernels.FUSED_DECODE_ENV: "2"}) == 2
    assert cpu_kernels.fused_decode_rows_from_env({cpu_kernels.FUSED_DECODE_ENV: "four"}) == 4  # a typo: the default, kernels kept


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_default_path_gives_a_row_the_same_bits_at_any_row_count(ops, fused_rows, qtype):
    """What the engine relies on (speculative verification of k+1 rows equals k+1 plain decode
    steps; --enable-deterministic-inference): a row of x gets the same bits from quant_linear
    whether it comes alone, with 3 others (decode) or with 15 others (the prefill tiles)."""
    from radixserve.layers.batch_invariant import check_rows_invariant

    fused_rows(cpu_kernels.fused_decode_rows_from_env({}))
    k = 1024
    data, _ = make_weight(qtype, 48, k)
    w = torch.from_numpy(data)
    assert check_rows_invariant(lambda x: ops.quant_linear(x, w, int(qtype), k), k, rows=(1, 2, 3, 4, 5, 8, 16))


@pytest.mark.parametrize("limit", [4, 16])
@pytest.mark.parametrize("shape", [0, 1], ids=["one-chunk", "chunks-tails"])
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_fused_decode_gives_a_row_the_same_bits_at_any_row_count(ops, fused_rows, qtype, shape, limit):
    """Issue 54: with the fused decode on (up to 4 rows of x, its default; or all 16 of the decode
    path), every row count 1..16 (fused; past the limit the scratch decode), 17 and 33 (the prefill
    tiles) gives each row the same bits as a 67-row call (the tiles, more than one block of rows of
    x at the larger K). The shapes cross K chunks (2048 values: the tiles'
    partial sums) and end in a partial chunk and group of blocks."""
    fused_rows(limit)
    k, n = SHAPES[256 if qtype in K_QUANTS else 32][shape]
    data, _ = make_weight(qtype, n, k)
    w = torch.from_numpy(data)
    x = torch.from_numpy(make_x(67, k, seed=2))
    full = ops.quant_linear(x, w, int(qtype), k)
    differ = [m for m in [*range(1, 18), 33] if not torch.equal(ops.quant_linear(x[:m], w, int(qtype), k), full[:m])]
    assert not differ, f"{qtype.name} K={k}: a row's bits at these row counts differ from the 67-row call's: {differ}"


def test_types_and_layout_sizes(ops):
    assert sorted(ops.quant_gemm_types()) == sorted(int(t) for t in TYPES)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_0], ids=["Q4_K", "Q5_0"])
def test_strided_rows_and_leading_dims(ops, qtype):
    """Weight rows read through a row stride (a slice of a wider buffer, e.g. one part of a fused
    projection), and x with leading dimensions: the same numbers as the contiguous call."""
    k, n = SHAPES[256 if qtype in K_QUANTS else 32][0]
    data, _ = make_weight(qtype, n, k)
    wide = np.zeros((n, data.shape[1] + 40), dtype=np.uint8)
    wide[:, 7 : 7 + data.shape[1]] = data
    strided = torch.from_numpy(wide)[:, 7 : 7 + data.shape[1]]
    assert not strided.is_contiguous()
    x = torch.from_numpy(make_x(6, k))
    want = ops.quant_linear(x, torch.from_numpy(data), int(qtype), k)
    got = ops.quant_linear(x.view(2, 3, k), strided, int(qtype), k)
    assert tuple(got.shape) == (2, 3, n)
    assert torch.equal(got.reshape(6, n), want)


def test_bad_arguments(ops):
    data, _ = make_weight(Q.Q4_0, 8, 64)
    w = torch.from_numpy(data)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        ops.quant_linear(x, w, int(Q.Q2_K), 64)
    with pytest.raises(RuntimeError, match="bytes, expected"):
        ops.quant_linear(x, w, int(Q.Q8_0), 64)
    with pytest.raises(RuntimeError, match="multiple of"):
        ops.quant_linear(torch.randn(2, 48), w, int(Q.Q4_0), 48)
    with pytest.raises(RuntimeError, match="float32"):
        ops.quant_linear(x.double(), w, int(Q.Q4_0), 64)
    assert tuple(ops.quant_linear(torch.zeros(0, 64), w, int(Q.Q4_0), 64).shape) == (0, 8)


@pytest.mark.parametrize("shape", [0, 1], ids=["one-chunk", "chunks-tails"])
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_dequantize_bf16_is_the_gguf_dequantization_rounded(ops, qtype, shape):
    """The prefill path's tile (quant_dequantize_bf16): gguf's dequantization of the same bytes,
    rounded to bf16 (to nearest, as torch rounds), for every type, with a partial last group of 4
    blocks and N not a multiple of anything; read through a row stride as well."""
    k, n = SHAPES[256 if qtype in K_QUANTS else 32][shape]
    data, w = make_weight(qtype, n, k)
    want = torch.from_numpy(w.astype(np.float32)).bfloat16()
    got = ops.quant_dequantize_bf16(torch.from_numpy(data), int(qtype), k)
    assert got.dtype == torch.bfloat16 and tuple(got.shape) == (n, k)
    # the kernel computes scale * u + min in float32 with one rounding (an fma); gguf in numpy
    # rounds twice: the two may land one bf16 step apart where a value sits on a rounding edge
    diff = (got.float() - want.float()).abs()
    step = want.float().abs().clamp_min(1e-30) * 2.0**-7
    assert bool((diff <= step).all()), f"{qtype.name}: {int((diff > step).sum())} values off by more than a bf16 step"
    assert float((diff == 0).float().mean()) > 0.99
    wide = np.zeros((n, data.shape[1] + 24), dtype=np.uint8)
    wide[:, 5 : 5 + data.shape[1]] = data
    strided = torch.from_numpy(wide)[:, 5 : 5 + data.shape[1]]
    assert torch.equal(ops.quant_dequantize_bf16(strided, int(qtype), k), got)


@pytest.mark.parametrize("shape", [0, 1], ids=["one-chunk", "chunks-tails"])
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_dequantize_f32_is_the_gguf_dequantization(ops, qtype, shape):
    """quant_dequantize_f32 (the "float32 tile + torch's sgemm" candidate, on any CPU): gguf's
    dequantization of the same bytes, for every type, through a row stride as well. The kernel
    computes scale * u + min with one rounding where it can (an fma), gguf's numpy with two: they
    may differ in the last bits of a value, relative to the block's magnitude, not more."""
    k, n = SHAPES[256 if qtype in K_QUANTS else 32][shape]
    data, w = make_weight(qtype, n, k)
    want = torch.from_numpy(w.astype(np.float32))
    got = ops.quant_dequantize_f32(torch.from_numpy(data), int(qtype), k)
    assert got.dtype == torch.float32 and tuple(got.shape) == (n, k)
    block = 256 if qtype in K_QUANTS else 32
    scale = want.abs().reshape(n, k // block, block).amax(-1, keepdim=True).expand(n, k // block, block).reshape(n, k)
    diff = (got - want).abs()
    assert bool((diff <= scale * 2.0**-21).all()), f"{qtype.name}: max diff {float((diff / scale.clamp_min(1e-30)).max()):.2e}"
    assert float((diff == 0).float().mean()) > 0.9
    wide = np.zeros((n, data.shape[1] + 24), dtype=np.uint8)
    wide[:, 5 : 5 + data.shape[1]] = data
    strided = torch.from_numpy(wide)[:, 5 : 5 + data.shape[1]]
    assert torch.equal(ops.quant_dequantize_f32(strided, int(qtype), k), got)
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        ops.quant_dequantize_f32(torch.from_numpy(data), int(Q.Q2_K), k)


def test_quant_gemm_isa_names_the_build(ops):
    assert ops.quant_gemm_isa() in ("avx512_vnni", "avx2")


def test_dequantize_bf16_bad_arguments(ops):
    data, _ = make_weight(Q.Q4_0, 8, 64)
    w = torch.from_numpy(data)
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        ops.quant_dequantize_bf16(w, int(Q.Q2_K), 64)
    with pytest.raises(RuntimeError, match="bytes, expected"):
        ops.quant_dequantize_bf16(w, int(Q.Q8_0), 64)
    with pytest.raises(RuntimeError, match="multiple of"):
        ops.quant_dequantize_bf16(w, int(Q.Q4_0), 48)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_0], ids=["Q4_K", "Q6_K", "Q5_0"])
def test_the_dequantized_bf16_path_is_the_bf16_product(ops, qtype, monkeypatch):
    """quant_matmul on the onednn_bf16 path (layers/gemm_select.py; forced here): the weight
    dequantized to bf16 a tile of output rows at a time and multiplied by torch's bf16 GEMM with x
    rounded to bf16, so the result is that product (float32 sums, rounded to bf16 once): close to
    the float product, closer than the 8-bit activations of the integer kernel, and the same for
    any tile size. The int8 path is the integer kernel itself."""
    from radixserve.layers import gemm_select
    from radixserve.layers.quantization import gguf as quant_gguf
    from radixserve.layers.quantization import QuantizedWeight, quant_matmul

    monkeypatch.setattr(gemm_select, "_plan", gemm_select.GemmPlan(forced="onednn_bf16"))
    k, n = SHAPES[256 if qtype in K_QUANTS else 32][0]
    data, w = make_weight(qtype, n, k)
    m = 133
    x = make_x(m, k)
    qw = QuantizedWeight(int(qtype), torch.from_numpy(data), k)
    y = quant_matmul(torch.from_numpy(x), qw)
    assert y.dtype == torch.float32 and tuple(y.shape) == (m, n)
    xb = torch.from_numpy(x).bfloat16().double()
    wb = torch.from_numpy(w).bfloat16().double()
    want = xb @ wb.T
    err = ((y.double() - want).abs() / want.abs().clamp_min(want.abs().max() * 1e-3)).max()
    assert err < 2 ** -7, f"{float(err):.2e} from the bf16 product"
    exact = torch.from_numpy(x.astype(np.float64) @ w.astype(np.float64).T)
    integer = ops.quant_linear(torch.from_numpy(x), torch.from_numpy(data), int(qtype), k).double()
    assert (y.double() - exact).norm() < (integer - exact).norm()
    monkeypatch.setattr(quant_gguf, "PREFILL_TILE_BYTES", 2 * k * 16)  # 16 rows a tile: 3 tiles
    assert torch.equal(quant_matmul(torch.from_numpy(x), qw), y)
    monkeypatch.setattr(gemm_select, "_plan", gemm_select.GemmPlan(forced="int8"))
    assert torch.equal(quant_matmul(torch.from_numpy(x), qw), ops.quant_linear(torch.from_numpy(x), torch.from_numpy(data), int(qtype), k))


@pytest.mark.parametrize("path", ["int8", "f32"])
@pytest.mark.parametrize("m", [1, 17, 67])
def test_a_fused_layers_segments_write_their_own_columns(ops, monkeypatch, m, path):
    """A layer of several GGUF tensors (q / k / v of one qkv_proj in different types, as a Q4_K_M
    file has them) writes each segment's product straight into its columns of the layer's output
    (quant_linear's / quant_matmul's out), with the same bits as the segment alone, and touches no
    other column; a wrong out is refused with a message."""
    from radixserve.layers import gemm_select
    from radixserve.layers.quantization import QuantizedWeight, quant_matmul

    monkeypatch.setattr(gemm_select, "_plan", gemm_select.GemmPlan(forced=path))
    k = 512
    parts = [(Q.Q4_K, 24), (Q.Q6_K, 16), (Q.Q8_0, 8)]
    x = torch.from_numpy(make_x(m, k))
    y = torch.full((m, sum(n for _, n in parts) + 3), float("nan"))
    off = 0
    for i, (qtype, n) in enumerate(parts):
        data, _ = make_weight(qtype, n, k, seed=i)
        qw = QuantizedWeight(int(qtype), torch.from_numpy(data), k)
        view = y[:, off : off + n]
        assert quant_matmul(x, qw, view).data_ptr() == view.data_ptr()
        assert torch.equal(view, quant_matmul(x, qw))
        off += n
    assert torch.isnan(y[:, off:]).all()  # past the last segment: untouched
    # the layer itself: its output is the segments' products side by side, in offset order
    from types import SimpleNamespace

    from radixserve.layers.quantization.gguf import GGUFLinearMethod

    layer = SimpleNamespace(weight=torch.empty(0), in_features=k, out_features=off)
    method, want, off = GGUFLinearMethod(), [], 0
    for i, (qtype, n) in enumerate(parts):
        qw = QuantizedWeight(int(qtype), torch.from_numpy(make_weight(qtype, n, k, seed=i)[0]), k)
        method.load_rows(layer, layer.weight, off, qw)
        want.append(quant_matmul(x, qw))
        off += n
    assert torch.equal(method.apply(layer, x), torch.cat(want, dim=1))
    with pytest.raises(RuntimeError, match="out must be float32"):
        ops.quant_linear(x, torch.from_numpy(make_weight(Q.Q4_K, 8, k)[0]), int(Q.Q4_K), k, torch.empty(m, 9))
