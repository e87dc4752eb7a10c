"""The Triton attention kernels, under Triton's interpreter on the CPU (compiled on a GPU with
RADIXSERVE_TEST_DEVICE=cuda: tests/unit/devices.py), against the torch-native backend: ragged
lengths, cached prefixes, GQA ratios 1/2/4, page sizes 1 and 16 with scattered pages, float32, max
abs diff <= 1e-3 (the kernels' float32 dots are "ieee", no TF32 on the GPU either); the store-KV
kernel; and a tiny model end to end."""

import os

from devices import ON_GPU, TEST_DEVICE, assert_kernels_match_the_device

# Before the kernels are defined (triton_ops imported); tests/unit/conftest.py puts it back after collection and
# turns it on again around this module's tests only (triton reads it at each launch too). Not on the GPU.
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from radixserve.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
from radixserve.layers.attention.triton_ops import store_kv_cache  # noqa: E402
from radixserve.model_executor.forward_batch import ForwardMode  # noqa: E402

from paged_kv import make_attention_batch  # noqa: E402

# The interpreter for this module's tests only (tests/unit/conftest.py; set above for the import; not on the GPU).
pytestmark = pytest.mark.usefixtures("triton_interpreter")

TOL = 1e-3


def test_kernels_run_under_the_interpreter():
    """triton.jit picks the interpreter when the kernel is defined: a module that imported
    triton_ops before TRITON_INTERPRET was set would leave GPU-only kernels here. On the GPU:
    compiled kernels, not interpreted ones."""
    from radixserve.layers.attention.triton_ops import decode_attention, extend_attention, store_kv

    assert_kernels_match_the_device(
        decode_attention._decode_stage1, decode_attention._decode_stage1_grouped, decode_attention._decode_stage2,
        extend_attention._extend_kernel, store_kv._store_kv_kernel)


def _run_both(fb, q, k, v, layer, num_kv_splits=4):
    pool = fb.token_to_kv_pool
    k0, v0 = pool.k_buffer[0].clone(), pool.v_buffer[0].clone()
    ref_be = TorchNativeAttnBackend(TEST_DEVICE)
    ref_be.init_forward_metadata(fb)
    ref = ref_be.forward(q, k, v, layer, fb)
    k_ref, v_ref = pool.k_buffer[0].clone(), pool.v_buffer[0].clone()
    pool.k_buffer[0].copy_(k0)
    pool.v_buffer[0].copy_(v0)
    tri_be = TritonAttnBackend(TEST_DEVICE, num_kv_splits=num_kv_splits)
    tri_be.init_forward_metadata(fb)
    out = tri_be.forward(q, k, v, layer, fb)
    assert torch.equal(pool.k_buffer[0], k_ref) and torch.equal(pool.v_buffer[0], v_ref)
    return out, ref


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("gqa", [1, 2, 4])
def test_extend_matches_torch_native(page_size, gqa):
    kv_heads = 2 if gqa < 4 else 1
    # ragged: no prefix, a long prefix, a one-token extend (the torch backend's decode path)
    prefix_lens = [0, 37, 5, 20]
    extend_lens = [19, 9, 1, 40]
    fb, q, k, v, layer = make_attention_batch(ForwardMode.EXTEND, prefix_lens, extend_lens, kv_heads * gqa, kv_heads, 16,
                                              page_size, seed=gqa * 10 + page_size, device=TEST_DEVICE)
    out, ref = _run_both(fb, q, k, v, layer)
    assert (out - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("gqa", [1, 2, 4])
def test_decode_matches_torch_native(page_size, gqa):
    kv_heads = 2 if gqa < 4 else 1
    seq_lens = [1, 3, 50, 17, 70]  # shorter than the split count too (empty splits)
    fb, q, k, v, layer = make_attention_batch(ForwardMode.DECODE, [s - 1 for s in seq_lens], [1] * len(seq_lens),
                                              kv_heads * gqa, kv_heads, 16, page_size, seed=gqa * 7 + page_size,
                                              device=TEST_DEVICE)
    out, ref = _run_both(fb, q, k, v, layer, num_kv_splits=4)
    assert (out - ref).abs().max().item() <= TOL


def test_odd_head_dim_and_single_split():
    """head_dim not a power of two (masked lanes), one KV split, MIXED mode through extend."""
    fb, q, k, v, layer = make_attention_batch(ForwardMode.DECODE, [4, 30], [1, 1], 4, 2, 24, 16, seed=3,
                                              device=TEST_DEVICE)
    out, ref = _run_both(fb, q, k, v, layer, num_kv_splits=1)
    assert (out - ref).abs().max().item() <= TOL
    fb, q, k, v, layer = make_attention_batch(ForwardMode.MIXED, [0, 12, 33], [21, 1, 1], 4, 2, 24, 1, seed=4,
                                              device=TEST_DEVICE)
    out, ref = _run_both(fb, q, k, v, layer)
    assert (out - ref).abs().max().item() <= TOL


def test_extend_batch_invariant_mode_ignores_where_the_prefix_ends():
    """--enable-deterministic-inference: a request's tokens get the same bits from one extend of the
    whole prompt, from an extend after a 37-token prefix (a chunk boundary or a prefix hit), from a
    one-token extend, and beside another request: every key is read from the pool in blocks on
    absolute positions (the fresh k/v are stored there before the kernel runs)."""
    from radixserve.layers.attention.triton_ops import extend_attention_fwd

    g = torch.Generator().manual_seed(5)
    heads, kv_heads, d, n = 4, 2, 16, 70
    k_buf = torch.randn(256, kv_heads, d, generator=g).to(TEST_DEVICE)
    v_buf = torch.randn(256, kv_heads, d, generator=g).to(TEST_DEVICE)
    r2t = torch.zeros(2, 128, dtype=torch.int32)
    r2t[0, :n] = torch.randperm(128, generator=g)[:n].to(torch.int32)
    r2t[1, :50] = (128 + torch.randperm(128, generator=g)[:50]).to(torch.int32)
    r2t = r2t.to(TEST_DEVICE)
    q_all = torch.randn(n, heads, d, generator=g).to(TEST_DEVICE)
    q_other = torch.randn(50, heads, d, generator=g).to(TEST_DEVICE)

    def extend(prefix: int, with_other: bool) -> torch.Tensor:
        q = torch.cat([q_other, q_all[prefix:]]) if with_other else q_all[prefix:].contiguous()
        kv = torch.zeros(q.shape[0], kv_heads, d, device=TEST_DEVICE)  # read from the pool, not here
        o = torch.empty_like(q)
        t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=TEST_DEVICE)  # noqa: E731
        rows, prefixes, lens = ([1, 0], [0, prefix], [50, n - prefix]) if with_other else ([0], [prefix], [n - prefix])
        starts = [0, 50] if with_other else [0]
        extend_attention_fwd(q, kv, kv, o, k_buf, v_buf, r2t, t(rows), t(prefixes), t(lens), t(starts), max(lens),
                             0.25, batch_invariant=True)
        return o[50:] if with_other else o

    whole = extend(0, False)
    for prefix, with_other in [(37, False), (37, True), (64, False), (69, False), (0, True)]:
        assert torch.equal(extend(prefix, with_other), whole[prefix:]), (prefix, with_other)


def test_store_kv_kernel():
    g = torch.Generator().manual_seed(0)
    k_buf = torch.zeros(64, 2, 24, device=TEST_DEVICE)
    v_buf = torch.zeros(64, 2, 24, device=TEST_DEVICE)
    loc = (torch.randperm(63, generator=g)[:10] + 1).to(TEST_DEVICE)
    # non-contiguous k/v (slices of a fused qkv row), as the model hands them over
    kv = torch.randn(10, 2, 2, 24, generator=g).to(TEST_DEVICE)
    k, v = kv[:, 0], kv[:, 1]
    store_kv_cache(k, v, k_buf, v_buf, loc)
    ref_k, ref_v = torch.zeros_like(k_buf), torch.zeros_like(v_buf)
    ref_k[loc], ref_v[loc] = k, v
    assert torch.equal(k_buf, ref_k) and torch.equal(v_buf, ref_v)
    # into a lower-precision pool: rows are cast on store (the interpreter's float32 -> bfloat16
    # cast may round differently from torch's, so within one bfloat16 step)
    kb16 = torch.zeros(64, 2, 24, dtype=torch.bfloat16, device=TEST_DEVICE)
    vb16 = torch.zeros(64, 2, 24, dtype=torch.bfloat16, device=TEST_DEVICE)
    store_kv_cache(k, v, kb16, vb16, loc)
    torch.testing.assert_close(kb16[loc].float(), k, rtol=2**-7, atol=0)
    torch.testing.assert_close(vb16[loc].float(), v, rtol=2**-7, atol=0)
    assert kb16[0].abs().sum() == 0 and vb16[0].abs().sum() == 0  # nothing else written


def test_model_runner_triton_backend_matches_torch_native():
    """The tiny model end to end: a ragged prefill, an extend after a cached prefix, then 2
    decode steps, through ModelRunner with each backend; logits within 1e-3. (KVDriver takes
    single slots, so page_size 1 here; the kernel tests above cover page_size 16.) On the GPU the
    Triton runner replays its decode steps from CUDA graphs, as it serves."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
    from hf_utils import KVDriver

    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.models.model_config import ModelConfig
    from radixserve.server_args import ServerArgs
    from radixserve.tiny_model import get_tiny_model_path

    path = get_tiny_model_path()
    g = torch.Generator().manual_seed(0)
    vocab = ModelConfig.from_pretrained(path).vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (9, 21, 3)]
    more = torch.randint(0, vocab, (5,), generator=g).tolist()
    steps = [torch.randint(0, vocab, (3,), generator=g).tolist() for _ in range(2)]
    results = {}
    for backend in ("torch_native", "triton"):
        args = ServerArgs(model_path=path, dtype="float32", device=TEST_DEVICE, max_total_tokens=512,
                          max_running_requests=4, attention_backend=backend)
        runner = ModelRunner(ModelConfig.from_pretrained(path), args)
        assert type(runner.attn_backend).__name__ == ("TritonAttnBackend" if backend == "triton" else "TorchNativeAttnBackend")
        drv = KVDriver(runner, scatter_seed=2)
        out = [drv.extend([0, 1, 2], [0, 0, 0], prompts).all_logits]
        # row 1 continues after its 21 cached tokens (a prefix hit)
        out.append(drv.extend([1], [21], [more]).all_logits)
        lens = [9, 26, 3]
        for toks in steps:
            # a clone: a CUDA graph's output is a view that its next replay overwrites
            out.append(drv.decode([0, 1, 2], lens, toks).next_token_logits.clone())
            lens = [n + 1 for n in lens]
        results[backend] = out
    for a, b in zip(results["torch_native"], results["triton"]):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() <= TOL


# bfloat16 only on the GPU: the interpreter's bfloat16 tl.dot is wrong (test_half_precision_path)
HALF_DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16]


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_half_precision_path(mode, dtype):
    """float16 pool and activations (the GPU's low-precision path: p cast to v's dtype before the
    second dot). bfloat16 is for the GPU session (RADIXSERVE_TEST_DEVICE=cuda adds it): the
    interpreter's bfloat16 tl.dot is wrong (triton 3.9: off by ~1e10 on a plain 16x16 product),
    so it cannot be checked on the CPU."""
    pre, ext = ([0, 37, 5], [19, 9, 1]) if mode == ForwardMode.EXTEND else ([0, 40, 7], [1, 1, 1])
    fb, q, k, v, layer = make_attention_batch(mode, pre, ext, 4, 2, 16, 16, seed=5, device=TEST_DEVICE)
    pool = fb.token_to_kv_pool
    pool.dtype = dtype
    pool.k_buffer[0] = pool.k_buffer[0].to(dtype)
    pool.v_buffer[0] = pool.v_buffer[0].to(dtype)
    out, ref = _run_both(fb, q.to(dtype), k.to(dtype), v.to(dtype), layer)
    assert out.dtype == dtype
    if dtype == torch.float16:
        assert (out.float() - ref.float()).abs().max().item() <= 1e-2
    else:
        # The outputs are averages of N(0, 1) values (|x| up to ~3); bfloat16 keeps 8 significant
        # bits (2^-8 ~ 4e-3 relative per rounding: p, the scores, the output), so 2e-2 relative.
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_sliding_window_matches_torch_native(mode):
    """A windowed layer (W = 8): the extend kernel's window mask over prefix and new tokens, and
    decode through the table of each request's last W slots, against the torch-native backend's
    windowed path (itself tested against transformers in tests/reference/test_sliding_window.py).
    Requests shorter than, as long as, and longer than the window; prefixes inside and beyond it."""
    window = 8
    pre, ext = ([0, 5, 13, 30], [20, 3, 9, 1]) if mode == ForwardMode.EXTEND else ([3, 7, 8, 40], [1, 1, 1, 1])
    fb, q, k, v, layer = make_attention_batch(mode, pre, ext, 4, 2, 16, 1, seed=11, device=TEST_DEVICE,
                                              sliding_window=window)
    pool = fb.token_to_kv_pool
    k0, v0 = pool.k_buffer[0].clone(), pool.v_buffer[0].clone()
    ref_be = TorchNativeAttnBackend(TEST_DEVICE, use_cpu_kernels=False, sliding_window=window)
    ref_be.init_forward_metadata(fb)
    assert fb.attn_metadata.windowed is not None
    ref = ref_be.forward(q, k, v, layer, fb)
    pool.k_buffer[0].copy_(k0)
    pool.v_buffer[0].copy_(v0)
    tri_be = TritonAttnBackend(TEST_DEVICE, num_kv_splits=4, sliding_window=window)
    assert tri_be.cuda_graph_unsupported_reason is not None  # the window's table is per batch
    tri_be.init_forward_metadata(fb)
    out = tri_be.forward(q, k, v, layer, fb)
    assert (out - ref).abs().max().item() <= TOL
    # and the window matters here: the same layer without it answers otherwise
    pool.k_buffer[0].copy_(k0)
    pool.v_buffer[0].copy_(v0)
    layer.sliding_window_size = None
    tri_be.init_forward_metadata(fb)
    assert (tri_be.forward(q, k, v, layer, fb) - ref).abs().max().item() > 1e-2
