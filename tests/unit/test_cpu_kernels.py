"""The C++ CPU kernels (radixserve/csrc/cpu_kernels.cpp) against the torch code they replace:
paged decode attention against the torch-native backend's gather + SDPA path (ragged lengths,
cached prefixes, GQA ratios, page sizes 1 and 16 with scattered pages, long sequences that take
the split-KV path, mixed batches), and fused add+RMSNorm, rotary and SiLU-and-mul against the
layers' torch paths, in float32 and bfloat16."""

import pytest
import torch

from radixserve.layers import cpu_kernels
from radixserve.layers.activation import SiluAndMul
from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.model_executor.forward_batch import ForwardMode

from paged_kv import make_attention_batch

# float32: the kernel sums in another order than SDPA; bfloat16: both round their output once.
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def ops():
    mod = cpu_kernels.get()
    assert mod is not None, "the C++ CPU kernels did not build (see the warning logged by cpu_kernels.build)"
    return mod


def _run_both(fb, q, k, v, layer):
    """(kernel output, torch-native output); both must leave the same pool contents."""
    pool = fb.token_to_kv_pool
    k0, v0 = pool.k_buffer[0].clone(), pool.v_buffer[0].clone()
    ref_be = TorchNativeAttnBackend("cpu", use_cpu_kernels=False)
    ref_be.init_forward_metadata(fb)
    assert ref_be.cpu_ops is None and fb.attn_metadata.decode_rows is None
    ref = ref_be.forward(q, k, v, layer, fb)
    k_ref, v_ref = pool.k_buffer[0].clone(), pool.v_buffer[0].clone()
    pool.k_buffer[0].copy_(k0)
    pool.v_buffer[0].copy_(v0)
    be = TorchNativeAttnBackend("cpu")
    be.init_forward_metadata(fb)
    assert fb.attn_metadata.decode_rows is not None and not fb.attn_metadata.decode_groups  # the kernel's path
    out = be.forward(q, k, v, layer, fb)
    assert torch.equal(pool.k_buffer[0], k_ref) and torch.equal(pool.v_buffer[0], v_ref)
    return out, ref


def _max_err(out, ref):
    return (out.float() - ref.float()).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2), (4, 1)])
def test_decode_attention_matches_torch_native(ops, dtype, page_size, heads, kv_heads):
    seq_lens = [1, 3, 50, 17, 70, 129, 300]  # ragged, and some longer than an online-softmax block
    fb, q, k, v, layer = make_attention_batch(
        ForwardMode.DECODE, [s - 1 for s in seq_lens], [1] * len(seq_lens), heads, kv_heads, 64, page_size,
        seed=heads * 10 + kv_heads + page_size, dtype=dtype,
    )
    out, ref = _run_both(fb, q, k, v, layer)
    assert _max_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_lens", [[700], [1000, 5], [257, 129, 3]])
def test_decode_attention_split_kv(ops, dtype, seq_lens):
    """Few requests with long sequences: the kernel splits each sequence (flash decoding),
    including splits left empty by a short request, and merges the splits."""
    fb, q, k, v, layer = make_attention_batch(
        ForwardMode.DECODE, [s - 1 for s in seq_lens], [1] * len(seq_lens), 6, 2, 32, 16, seed=len(seq_lens), dtype=dtype
    )
    out, ref = _run_both(fb, q, k, v, layer)
    assert _max_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_decode_rows_with_prefills(ops, dtype):
    """An EXTEND/MIXED batch: one-token extends go to the kernel, longer ones (with and without a
    cached prefix) stay on SDPA; head_dim not a multiple of the vector width."""
    fb, q, k, v, layer = make_attention_batch(ForwardMode.MIXED, [0, 12, 33, 0, 90], [21, 1, 1, 7, 1], 6, 3, 24, 1, seed=4, dtype=dtype)
    out, ref = _run_both(fb, q, k, v, layer)
    assert _max_err(out, ref) <= TOL[dtype]


def test_decode_attention_rejects_bad_shapes(ops):
    q = torch.randn(2, 5, 16)
    kv = torch.randn(10, 2, 16)  # 5 heads over 2 KV heads
    r2t = torch.zeros(3, 8, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        ops.decode_attention(torch.empty_like(q), q, kv, kv, r2t, torch.tensor([0, 1]), torch.tensor([2, 2]), 0.25)
    q4 = torch.randn(2, 4, 16)
    with pytest.raises(RuntimeError, match="q and out must share a dtype"):
        ops.decode_attention(torch.empty_like(q4).bfloat16(), q4, kv, kv, r2t, torch.tensor([0, 1]),
                             torch.tensor([2, 2]), 0.25)
    with pytest.raises(RuntimeError, match="the K and V pools"):
        ops.decode_attention(torch.empty_like(q4), q4, kv, kv.bfloat16(), r2t, torch.tensor([0, 1]),
                             torch.tensor([2, 2]), 0.25)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_float32_queries_over_a_low_precision_kv_cache(ops, kv_dtype, mode):
    """The CPU's bf16 mode: float32 q/k/v, the pool in --kv-cache-dtype. The store rounds K/V to
    the pool's dtype once; the kernel widens the pool's rows and matches the torch path to float32
    precision (the same rounded K/V, summed in another order); extend attends to its own new
    tokens as the cache holds them, so a prefix hit later sees the very same K/V."""
    seq_lens = [1, 40, 300] if mode == ForwardMode.DECODE else [7, 40, 90]
    new = [1, 1, 1] if mode == ForwardMode.DECODE else [7, 12, 90]
    fb, q, k, v, layer = make_attention_batch(mode, [s - n for s, n in zip(seq_lens, new)], new, 8, 2, 64, 1,
                                              seed=5, dtype=torch.float32, kv_dtype=kv_dtype)
    if mode == ForwardMode.DECODE:
        out, ref = _run_both(fb, q, k, v, layer)
        assert out.dtype == torch.float32 and _max_err(out, ref) <= 2e-5
    else:
        be = TorchNativeAttnBackend("cpu")
        be.init_forward_metadata(fb)
        out = be.forward(q, k, v, layer, fb)
        # the last request has no prefix: its attention must equal one over the rounded K/V
        sl = slice(sum(new[:2]), sum(new))
        kr, vr = k[sl].to(kv_dtype).float(), v[sl].to(kv_dtype).float()
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[sl].transpose(0, 1)[None], kr.transpose(0, 1)[None], vr.transpose(0, 1)[None], is_causal=True,
            scale=layer.scaling, enable_gqa=True)[0].transpose(0, 1)
        assert _max_err(out[sl], ref) <= 2e-5
    pool = fb.token_to_kv_pool
    assert torch.equal(pool.k_buffer[0][fb.out_cache_loc], k.to(kv_dtype))  # stored rounded, once


@pytest.mark.parametrize("head_dim", [32, 96, 128])
def test_bf16_pool_keeps_float32_precision(ops, head_dim):
    """Over a bf16 pool the kernel matches float32 math over the same rounded K/V to float32
    precision (one bf16 rounding of q is off by ~1e-2 here), for every head_dim the vdpbf16ps path
    takes (D / 32 chunks) and odd block tails (an odd last key pairs with itself in P.V). On a CPU
    with AVX512_BF16 that is the vdpbf16ps path (test_bf16_pool_decode_runs_on_vdpbf16ps), whose
    query and softmax weights split in two bf16 halves keep this precision."""
    seq_lens = [1, 17, 33, 129, 255]
    fb, q, k, v, layer = make_attention_batch(ForwardMode.DECODE, [s - 1 for s in seq_lens], [1] * len(seq_lens), 8, 2,
                                              head_dim, 1, seed=head_dim, dtype=torch.float32, kv_dtype=torch.bfloat16)
    q = q * 4  # sharper softmax weights: a rounded query shows
    out, ref = _run_both(fb, q, k, v, layer)
    assert _max_err(out, ref) <= 1e-4


@pytest.mark.parametrize("head_dim", [32, 96, 128])
def test_bf16_pool_decode_runs_on_vdpbf16ps(ops, head_dim):
    """On a CPU with AVX512_BF16, decode over a bf16 pool runs on vdpbf16ps, which takes the float32
    query as two bf16 halves, hi = bf16(q) and lo = bf16(q - hi): the kernel's output is attention
    with q replaced by hi + lo. The float32 path (the pool's rows widened) would attend with q
    itself; a query whose bits below hi + lo carry a score of 1 .. 4 (q.k's large terms cancel
    chunk by chunk, exactly in either path) tells the two apart."""
    if not ops.has_avx512_bf16():
        pytest.skip("kernels built without AVX512_BF16 (the CPU lacks it): a bf16 pool takes the float32 path")
    g = torch.Generator().manual_seed(head_dim)
    H, D, n = 2, head_dim, 3
    sign = torch.tensor([1.0 if (d // 16) % 2 == 0 else -1.0 for d in range(D)])
    k = 0.1 * torch.randn(n, 1, D, generator=g)
    k[0, 0] = sign * 2.0**16
    # 1 + 2^-9 is hi + lo exactly; the 2^-20 (on chunks of sign +1) lies below both halves
    q = torch.full((1, H, D), 1 + 2.0**-9)
    q[0, 0] += (sign > 0) * 2.0**-20
    q[0, 1] -= (sign > 0) * 2.0**-20
    kb, vb = k.bfloat16(), torch.randn(n, 1, D, generator=g).bfloat16()
    r2t = torch.arange(n, dtype=torch.int32).view(1, n)
    out = torch.empty_like(q)
    ops.decode_attention(out, q, kb, vb, r2t, torch.tensor([0]), torch.tensor([n]), 1.0, 0)

    def attention(query):  # float64, scale 1, over the pool's bf16 rows
        p = torch.softmax(query.double() @ kb[:, 0].double().T, -1)
        return p @ vb[:, 0].double()

    hi = q.bfloat16().float()
    as_halves, as_float32 = attention(hi.double() + (q - hi).bfloat16().double()), attention(q)
    assert (as_halves - as_float32).abs().max().item() > 0.1  # the two paths' results are far apart
    err = (out.double() - as_halves).abs().max().item()
    assert err <= 1e-4, f"off attention over q's bf16 halves by {err:.3g}: not the vdpbf16ps path"


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shared", [64, 200, 300])
def test_decode_over_a_shared_prefix(ops, kv_dtype, page_size, shared):
    """A DECODE batch whose requests begin with the same slots (a system prompt in the radix
    cache): the backend finds the shared length and the kernel attends to those keys once for
    all requests (tiles), the rest per request, and merges: equal to the torch path. Lengths are
    ragged, one request has a single key of its own, one takes split-KV; 300 is a chunk plus a
    partial one."""
    seq_lens = [shared + 1, shared + 40, shared + 300, shared + 17]
    fb, q, k, v, layer = make_attention_batch(ForwardMode.DECODE, [s - 1 for s in seq_lens], [1] * len(seq_lens), 9, 3,
                                              64, page_size, seed=shared + page_size, dtype=torch.float32,
                                              kv_dtype=kv_dtype)
    r2t = fb.req_to_token_pool.req_to_token
    rows = fb.req_pool_indices
    r2t[rows[1:], :shared] = r2t[rows[0], :shared]  # the others now share request 0's first slots
    be = TorchNativeAttnBackend("cpu")
    be.init_forward_metadata(fb)
    assert fb.attn_metadata.decode_rows.shared_prefix_len == shared
    out, ref = _run_both(fb, q, k, v, layer)
    assert _max_err(out, ref) <= 2e-5


def test_shared_prefix_is_read_once_from_the_first_request(ops):
    """The kernel takes the shared keys from request 0's row for every request (read once, not
    per request): told rows share slots they do not, request 1 gets request 0's prefix."""
    seq_lens, P = [100, 100], 80
    fb, q, k, v, layer = make_attention_batch(ForwardMode.DECODE, [s - 1 for s in seq_lens], [1, 1], 4, 2, 64, 1,
                                              seed=3, dtype=torch.float32)
    pool, r2t, rows = fb.token_to_kv_pool, fb.req_to_token_pool.req_to_token, fb.req_pool_indices
    pool.set_kv_buffer(0, fb.out_cache_loc, k, v)
    args = (pool.k_buffer[0], pool.v_buffer[0], r2t, rows.long().contiguous(), torch.tensor(seq_lens), layer.scaling)
    own, told = torch.empty_like(q), torch.empty_like(q)
    ops.decode_attention(own, q, *args, 0)
    ops.decode_attention(told, q, *args, P)
    r2t[rows[1], :P] = r2t[rows[0], :P]  # now they really share those slots
    want = torch.empty_like(q)
    ops.decode_attention(want, q, *args, 0)
    assert _max_err(told, want) <= 2e-5 and _max_err(told[1], own[1]) > 1e-3


def test_shared_prefix_len_finds_the_common_slots():
    from radixserve.layers.attention.torch_native_backend import SHARED_PREFIX_MIN, shared_prefix_len

    r2t = torch.arange(4 * 300, dtype=torch.int32).view(4, 300).clone()
    rows = torch.tensor([2, 0, 3])
    assert shared_prefix_len(r2t, rows, [250, 250, 250]) == 0  # nothing shared
    r2t[[0, 3], :100] = r2t[2, :100]
    assert shared_prefix_len(r2t, rows, [250, 250, 250]) == 100
    assert shared_prefix_len(r2t, rows, [250, 80, 250]) == 79  # each keeps its last key
    assert shared_prefix_len(r2t, rows, [250, 60, 250]) == 0  # below SHARED_PREFIX_MIN
    assert shared_prefix_len(r2t, rows[:1], [250]) == 0  # one request shares nothing
    assert SHARED_PREFIX_MIN <= 64


def _extend_both(fb, q, k, v, layer):
    """(extend kernel output, torch-native SDPA output) of one EXTEND/MIXED forward; both store the
    new tokens' K/V the same way."""
    pool = fb.token_to_kv_pool
    ref_be = TorchNativeAttnBackend("cpu", use_cpu_kernels=False)
    ref_be.init_forward_metadata(fb)
    ref = ref_be.forward(q, k, v, layer, fb)
    be = TorchNativeAttnBackend("cpu")
    be.init_forward_metadata(fb)
    assert fb.attn_metadata.extend_rows is not None and not fb.attn_metadata.extend_seqs  # the kernel's path
    out = be.forward(q, k, v, layer, fb)
    assert torch.equal(pool.k_buffer[0][fb.out_cache_loc], k.to(pool.dtype))
    return out, ref


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32), (torch.float32, torch.float16),
                                            (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (32, 4, 4), (80, 8, 2), (128, 8, 1)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_attention_matches_sdpa(ops, dtype, kv_dtype, head_dim, heads, kv_heads, page_size):
    """The C++ extend kernel against SDPA on the same (pool-rounded) K/V: no prefix and cached
    prefixes, extends shorter and longer than a 16-token block with ragged tails, one-token
    extends (decode rows) in the same MIXED batch, scattered pages, every pool dtype the CPU runs."""
    prefix, new = [0, 5, 0, 40, 130, 3], [37, 16, 1, 9, 70, 1]
    fb, q, k, v, layer = make_attention_batch(ForwardMode.MIXED, prefix, new, heads, kv_heads, head_dim, page_size,
                                              seed=head_dim + page_size, dtype=dtype, kv_dtype=kv_dtype)
    out, ref = _extend_both(fb, q, k, v, layer)
    assert _max_err(out, ref) <= TOL[dtype]


def test_extend_attention_refuses_bad_shapes(ops):
    q = torch.randn(4, 2, 24)
    kv = torch.randn(8, 2, 24)
    r2t = torch.zeros(2, 8, dtype=torch.int32)
    one = torch.tensor([0])
    with pytest.raises(RuntimeError, match="head_dim a multiple of 16"):
        ops.extend_attention(torch.empty_like(q), q, kv, kv, r2t, one, one, torch.tensor([4]), one, 0.2)
    q, kv = torch.randn(4, 2, 32), torch.randn(8, 2, 32)
    with pytest.raises(RuntimeError, match="contiguous int64"):
        ops.extend_attention(torch.empty_like(q), q, kv, kv, r2t, one, one, torch.tensor([4], dtype=torch.int32), one, 0.2)


def _torch_path(monkeypatch, fn):
    monkeypatch.setattr(cpu_kernels, "ENABLED", False)
    try:
        return fn()
    finally:
        monkeypatch.setattr(cpu_kernels, "ENABLED", True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_torch(ops, monkeypatch, dtype):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, eps=1e-5).to(dtype)
    norm.weight.data.copy_(torch.rand(96, generator=g) + 0.5)
    x = (torch.randn(7, 96, generator=g) * 3).to(dtype)
    res = torch.randn(7, 96, generator=g).to(dtype)
    out, new_res = norm(x, res)
    ref_out, ref_res = _torch_path(monkeypatch, lambda: norm(x, res))
    assert torch.equal(new_res, ref_res)  # the residual sum rounds to the dtype the same way
    assert _max_err(out, ref_out) <= TOL[dtype]
    # no residual, and a [T, heads, head_dim] view (the Qwen3 q/k norm) that is not contiguous
    qk = torch.randn(5, 12, 16, generator=g).to(dtype)[:, 2:8]
    norm16 = RMSNorm(16).to(dtype)
    assert _max_err(norm16(qk), _torch_path(monkeypatch, lambda: norm16(qk))) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rotary_matches_torch(ops, monkeypatch, dtype, partial):
    g = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(32, 512, 10000.0, partial_rotary_factor=partial).to(dtype)
    assert rope.cos_cached.dtype == torch.float32  # model.to(bf16) keeps the angle tables in fp32
    qkv = torch.randn(6, (4 + 2 + 2) * 32, generator=g).to(dtype)
    q = qkv[:, : 4 * 32].reshape(6, 4, 32)  # strided views, as LlamaAttention passes them
    k = qkv[:, 4 * 32 : 6 * 32].reshape(6, 2, 32)
    positions = torch.tensor([0, 1, 7, 100, 511, 3])
    q_out, k_out = rope(positions, q, k)
    q_ref, k_ref = _torch_path(monkeypatch, lambda: rope(positions, q, k))
    assert _max_err(q_out, q_ref) <= TOL[dtype] and _max_err(k_out, k_ref) <= TOL[dtype]
    with pytest.raises(RuntimeError, match="outside the table"):
        rope(torch.tensor([0, 1, 2, 3, 4, 512]), q, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_torch(ops, monkeypatch, dtype):
    x = (torch.randn(9, 2 * 40, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    act = SiluAndMul()
    out, ref = act(x).float(), _torch_path(monkeypatch, lambda: act(x)).float()
    # relative: bf16 outputs reach ~16, where one rounding step is 0.06 (torch rounds twice)
    assert ((out - ref).abs() / (ref.abs() + 1)).max().item() <= TOL[dtype]


def test_disable_switch(monkeypatch):
    assert cpu_kernels.enabled_from_env({"RADIXSERVE_DISABLE_CPU_KERNELS": "1"}) is False
    assert cpu_kernels.enabled_from_env({}) is True
    monkeypatch.setattr(cpu_kernels, "ENABLED", False)
    assert cpu_kernels.get() is None and cpu_kernels.kernels_for(torch.zeros(1)) is None
    assert TorchNativeAttnBackend("cpu").cpu_ops is None


# ---- the bf16 GEMM for linear layers (AVX512_BF16, or AVX2 + FMA) ------------------------------
def _needs_bf16_gemm(ops):
    if not ops.has_bf16_gemm():
        pytest.skip("this CPU has neither AVX512_BF16 nor AVX2 + FMA: linear layers stay on torch")


@pytest.mark.parametrize("m", [1, 3, 8, 13, 64, 65, 200])
@pytest.mark.parametrize("n,k,bias", [(96, 64, False), (50, 34, True), (576, 1536, False), (3000, 576, True)])
def test_bf16_linear_matches_f_linear(ops, m, n, k, bias):
    """Ragged shapes: rows past a register tile and a decode block, outputs past a 16-wide block,
    and (3000 x 576) several of the prefill path's weight panels with a ragged last one."""
    _needs_bf16_gemm(ops)
    g = torch.Generator().manual_seed(m * 1000 + n)
    w = (torch.randn(n, k, generator=g) * k**-0.5).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    y = ops.bf16_linear(x, ops.pack_bf16_weight(w), n, b)
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    # fp32 accumulation, one rounding to bf16 (2^-8 relative)
    assert ((y.float() - ref).abs() / (ref.abs() + 1)).max().item() <= 2**-7


@pytest.mark.parametrize("m", [1, 5, 16, 70])
def test_bf16_linear_takes_float32_activations(ops, m):
    """Float32 x (the CPU's bf16 mode): on AVX512_BF16 rounded to bf16 only as the dot products'
    operand, as llama.cpp does for BF16 weights; on AVX2 used as it is (float32 products). Either
    way the fp32 sums come back unrounded, in float32, and within float32 precision of that math."""
    _needs_bf16_gemm(ops)
    g = torch.Generator().manual_seed(m)
    n, k = 200, 576
    w = (torch.randn(n, k, generator=g) * k**-0.5).bfloat16()
    x = torch.randn(m, k, generator=g) * 3
    b = torch.randn(n, generator=g)
    y = ops.bf16_linear(x, ops.pack_bf16_weight(w), n, b)
    rounded = x.bfloat16().double() @ w.double().T + b.double()
    exact = x.double() @ w.double().T + b.double()
    ref, other = (rounded, exact) if ops.has_avx512_bf16() else (exact, rounded)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert (y.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()  # fp32 sums, not bf16
    assert (y.double() - other).abs().max().item() > 1e-4 * ref.abs().max().item()  # not the other operand
    assert not torch.equal(y, y.bfloat16().float())  # the output was not rounded to bf16


@pytest.mark.parametrize("m,vocab,k", [(1, 1000, 64), (7, 49153, 64), (3, 40, 64)])
def test_refine_top_logits(ops, m, vocab, k):
    """The LM head's k largest logits per row come again from float32 hidden states; the rest are
    left as they were. Ties rank the lower token id first. (On AVX2 the GEMM's logits are float32
    math already: the refined ones change only by summation order.)"""
    _needs_bf16_gemm(ops)
    g = torch.Generator().manual_seed(vocab)
    hidden_size = 96
    w = (torch.randn(vocab, hidden_size, generator=g) * 0.1).bfloat16()
    h = torch.randn(m, hidden_size, generator=g)
    logits = ops.bf16_linear(h, ops.pack_bf16_weight(w), vocab)
    logits[0, :8] = logits[0].max() + 1  # a tie at the top
    before = logits.clone()
    ops.refine_top_logits(logits, h, w, k)
    exact = h.double() @ w.double().T
    kk = min(k, vocab)
    # the rows' top k of the input logits: by value, then by lower index (a stable sort)
    order = torch.sort(-before, dim=-1, stable=True).indices[:, :kk]
    refined = torch.zeros_like(before, dtype=torch.bool).scatter_(1, order, True)
    assert torch.equal(logits[~refined], before[~refined])
    assert (logits.double()[refined] - exact[refined]).abs().max().item() <= 1e-5
    if ops.has_avx512_bf16():
        assert (before.double()[refined] - exact[refined]).abs().max().item() > 1e-4  # bf16 operands were off


def test_model_weights_are_packed_once(ops):
    """On a CPU with AVX512_BF16 or AVX2 a bf16 ModelRunner packs every linear layer for the C++ GEMM and
    frees its original layout (the weights are held once); the LM head gets a packed copy beside
    the tied embedding. Its logits match the same weights on the torch path (unpacked)."""
    _needs_bf16_gemm(ops)
    from radixserve.layers.linear import LinearBase
    from radixserve.model_executor.forward_batch import ForwardBatch, ModelWorkerBatch
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.models.model_config import ModelConfig
    from radixserve.server_args import ServerArgs
    from radixserve.tiny_model import get_tiny_model_path

    path = str(get_tiny_model_path())
    args = ServerArgs(model_path=path, dtype="bfloat16", device="cpu", max_total_tokens=512, max_running_requests=4)

    def logits(runner):
        n = 20
        locs = runner.token_to_kv_pool_allocator.alloc(n)
        runner.req_to_token_pool.req_to_token[0, :n] = locs.to(torch.int32)
        batch = ModelWorkerBatch(
            forward_mode=ForwardMode.EXTEND, input_ids=torch.arange(5, 5 + n), req_pool_indices=torch.tensor([0]),
            seq_lens=torch.tensor([n]), out_cache_loc=locs, seq_lens_cpu=[n], extend_seq_lens=[n],
            extend_prefix_lens=[0], capture_all_logits=True,
        )
        return runner.forward(ForwardBatch.init_new(batch, runner)).all_logits.float()

    packed = ModelRunner(ModelConfig.from_pretrained(path), args)
    linears = [m for m in packed.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight_packed is not None and m.weight.numel() == 0 for m in linears)
    assert packed.model.lm_head.weight_packed is not None and packed.model.lm_head.weight.numel() > 0
    # bf16 weights, float32 everything else (the CPU's bf16 mode), the KV cache in float16
    assert packed.weight_only and packed.activation_dtype == torch.float32 and packed.dtype == torch.bfloat16
    assert packed.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert packed.model.model.embed_tokens.output_dtype == torch.float32
    others = [p for p in packed.model.parameters() if p.numel() and p is not packed.model.model.embed_tokens.weight]
    assert others and all(p.dtype == torch.float32 for p in others)
    assert packed.token_to_kv_pool.k_buffer[0].dtype == torch.float16
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_kernels, "ENABLED", False)
        plain = ModelRunner(ModelConfig.from_pretrained(path), args)
        assert all(m.weight_packed is None for m in plain.model.modules() if isinstance(m, LinearBase))
        assert not plain.weight_only and plain.token_to_kv_pool.k_buffer[0].dtype == torch.bfloat16
        # the reference: float32 on the torch path, with the same (bf16-rounded) weights
        exact = ModelRunner(ModelConfig.from_pretrained(path), args.replace(dtype="float32"))
        with torch.no_grad():
            for p in exact.model.parameters():
                if p.dim() == 2:
                    p.copy_(p.bfloat16().float())
        ref = logits(exact)
        all_bf16 = logits(plain)
    out = logits(packed)
    assert (out - ref).abs().max().item() <= 0.02 * ref.abs().max().item()  # bf16 operands in the GEMMs, fp16 K/V
    mean_err, mean_err_all_bf16 = (out - ref).abs().mean().item(), (all_bf16 - ref).abs().mean().item()
    assert mean_err < 0.75 * mean_err_all_bf16  # closer than the torch path's bf16 activations
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n,grain", [(1, 1), (7, 1), (64, 1), (1000, 1), (1000, 16), (37, 8), (5, 100)])
def test_parallel_for_dynamic_visits_every_item_once(ops, threads, n, grain):
    """parallel_for_dynamic (csrc/parallel.h) hands out chunks from an atomic counter: every item
    is run by exactly one thread, whatever the thread count (3 on a 2-core machine too) or chunking."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        counts = ops.parallel_for_visits(n, grain)
    finally:
        torch.set_num_threads(before)
    assert counts.tolist() == [1] * n


@pytest.mark.parametrize("threads", [1, 3])
def test_decode_attention_does_not_depend_on_the_thread_count(ops, threads):
    """Each work item of the decode kernel is computed alone, so the dynamic division gives the
    same bits with 1, 2 or 3 threads (the split count depends on threads only through nsplit:
    a batch of 16 is enough items that nsplit stays 1)."""
    seq_lens = [5, 40, 130, 300] * 4
    fb, q, k, v, layer = make_attention_batch(ForwardMode.DECODE, [s - 1 for s in seq_lens], [1] * len(seq_lens),
                                              8, 2, 64, 1, seed=3, dtype=torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        ref, _ = _run_both(fb, q, k, v, layer)
        torch.set_num_threads(threads)
        out, _ = _run_both(fb, q, k, v, layer)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out, ref)
