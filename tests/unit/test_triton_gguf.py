"""The GPU's GGUF kernels (radixserve/layers/quantization/triton_gguf.py, issue 38 item 5) under
Triton's interpreter on the CPU (compiled on a GPU with RADIXSERVE_TEST_DEVICE=cuda), against the
gguf package's dequantization of the same bytes (tests/unit/test_quant_kernels.py's weights: gguf's
own quantization for the legacy types, random blocks with valid scales for the K-quants, Q2_K and
Q3_K included):

- the dequantization kernel: every type, rows strided (a slice of wider rows);
- x @ W^T in float32 (exact float32 products) for every type at M = 1, 5, 8 (the fused kernel) and
  M = 40 (the prefill path: dequantized tiles, with a tile smaller than the matrix), K not a
  multiple of the kernel's K step where the type allows it, N not a multiple of its row tile,
  x with a row stride wider than K and x transposed (column-major);
- bf16 x stays bf16 out (both paths);
- 9-64 rows of fp16 x take the tensor-core kernel (every type, x transposed too): fp16 out;
- the dispatch: with on_triton_device true (what x.is_cuda decides on a GPU), GGUFLinearMethod,
  quant_matmul and QuantizedWeight.dequantize run these kernels and never the C++ ones, the LM
  head in blocks multiplies fp16 hidden states as they are, a synthetic GGUF model served with
  --quantization gguf gives transformers' logits on the dequantized weights (prefill and decode),
  and the loader keeps exactly these types in blocks on a GPU."""

import os

from devices import ON_GPU, TEST_DEVICE, assert_kernels_match_the_device

if not ON_GPU:  # before triton_gguf is imported (triton.jit picks the interpreter then)
    os.environ["TRITON_INTERPRET"] = "1"

import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402

import radixserve.layers.quantization.gguf as quant_gguf  # noqa: E402
from radixserve.layers.quantization import GGUFLinearMethod, QuantizedWeight, quant_matmul  # noqa: E402
from radixserve.layers.quantization import triton_gguf  # noqa: E402
import test_quant_kernels  # noqa: E402
from test_quant_kernels import make_x  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter")

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def make_weight(qtype, n, k, seed=0):
    """(GGUF bytes uint8 [n, row_bytes], gguf's dequantization float32 [n, k]): test_quant_kernels'
    weights; Q2_K / Q3_K (no C++ kernel, so not there) as random blocks with valid fp16 fields."""
    if qtype not in (Q.Q2_K, Q.Q3_K):
        return test_quant_kernels.make_weight(qtype, n, k, seed)
    rng = np.random.default_rng(seed)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    nb = n * k // block
    blocks = rng.integers(0, 256, size=(nb, type_size), dtype=np.uint8)
    for at, scale in ((80, 2e-3), (82, 1e-2)) if qtype == Q.Q2_K else ((108, 2e-3),):  # d, dmin / d
        blocks[:, at : at + 2] = (rng.uniform(0.5, 1.5, size=nb) * scale).astype(np.float16).view(np.uint8).reshape(nb, 2)
    data = blocks.reshape(n, k // block * type_size)
    return data, gguf.quants.dequantize(data, qtype).reshape(n, k)
# K per block size: one that the fused kernel's K step (32 or 64) and the dequant kernel's (256)
# do not divide where the type allows it (7 and 9 blocks of 32), and more than one step
K_VALUES = {32: [32 * 7, 32 * 9], 256: [256, 256 * 3]}
N = 40  # not a multiple of the row tiles (32, 16)


def on_device(a) -> torch.Tensor:
    return torch.as_tensor(a).to(TEST_DEVICE)


def test_kernels_run_under_the_interpreter():
    assert_kernels_match_the_device(triton_gguf._gguf_matmul_kernel, triton_gguf._gguf_dequant_kernel)
    assert set(triton_gguf.TRITON_TYPES) == quant_gguf.TRITON_TYPES == {int(t) for t in TYPES}


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_dequantize_matches_gguf(qtype):
    k = K_VALUES[256 if qtype in K_QUANTS else 32][-1]
    data, w = make_weight(qtype, 2 * N, k)
    wide = on_device(data).reshape(N, -1)  # two weight rows per row: every other row is a strided view
    rows = wide[:, : data.shape[1]]
    assert rows.stride(0) == 2 * data.shape[1]
    got = triton_gguf.gguf_dequantize(rows, int(qtype), k).cpu()
    assert got.dtype == torch.float32 and tuple(got.shape) == (N, k)
    want = torch.from_numpy(w[0::2])
    # the same float32 operations (exact on the CPU); a GPU may fuse a multiply-add: an ulp or so
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


def check_matmul(qtype, m, k, layout="contiguous", dtype=torch.float32, tol=1e-5, n=N):
    data, w = make_weight(qtype, n, k)
    x = torch.from_numpy(make_x(m, k))
    ref = x.double() @ torch.from_numpy(w).double().T
    xd = on_device(x).to(dtype)
    if layout == "row-stride":
        xd = torch.cat([xd, torch.ones(m, 32, dtype=dtype, device=xd.device)], dim=1)[:, :k]
    elif layout == "transposed":
        xd = xd.t().contiguous().t()
    y = triton_gguf.gguf_matmul(xd, on_device(data), int(qtype), k)
    assert y.dtype == dtype and tuple(y.shape) == (m, n)
    err = (y.double().cpu() - ref).abs().max().item() / ref.abs().max().item()
    assert err < tol, f"{qtype.name} M={m} K={k} {layout}: max error {err:.2e} of max |y|"
    if m >= 3:
        assert torch.all(y[2] == 0)  # make_x's all-zero row


@pytest.mark.parametrize("m", [1, 5, 8, 40], ids=["decode-1", "decode-5", "decode-8", "prefill-40"])
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_matmul_matches_gguf(qtype, m, monkeypatch):
    monkeypatch.setattr(triton_gguf, "DEQUANT_TILE_BYTES", 16 * 4 * 256)  # the prefill path in tiles of 16 rows
    for k in K_VALUES[256 if qtype in K_QUANTS else 32]:
        check_matmul(qtype, m, k)


@pytest.mark.parametrize("layout", ["row-stride", "transposed"])
@pytest.mark.parametrize("m", [3, 40])
def test_matmul_takes_strided_x(layout, m):
    check_matmul(Q.Q4_K, m, 512, layout)
    check_matmul(Q.Q5_0, m, 32 * 7, layout)


@pytest.mark.parametrize("m", [24, 64], ids=["mma-24", "mma-64"])
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_tensor_core_kernel_in_fp16(qtype, m, monkeypatch):
    """9-64 rows of half-precision x: the tensor-core kernel (never the dequantized tiles), the
    weight rounded to fp16, float32 sums, fp16 out."""
    monkeypatch.setattr(triton_gguf, "_dequantized_matmul", None)  # would raise if taken
    for k in K_VALUES[256 if qtype in K_QUANTS else 32]:  # N = 72: more than one tile of 64 rows
        check_matmul(qtype, m, k, dtype=torch.float16, tol=2e-3, n=72)
    check_matmul(qtype, m, K_VALUES[256 if qtype in K_QUANTS else 32][-1], "transposed", torch.float16, tol=2e-3, n=72)


def test_rows_choose_the_kernel():
    x = lambda m, dtype: torch.empty(m, 32, dtype=dtype)  # noqa: E731
    assert triton_gguf.takes_mma(x(16, torch.float16)) and not triton_gguf.takes_mma(x(16, torch.float32))
    # bf16 only on a GPU (the interpreter's bf16 tl.dot is wrong)
    assert triton_gguf.takes_mma(x(16, torch.bfloat16)) == (TEST_DEVICE == "cuda")


@pytest.mark.parametrize("m", [2, 40, 100], ids=["fused", "mma", "tiles"])
def test_matmul_in_half_precision_past_the_tensor_core_range(m):
    check_matmul(Q.Q6_K, m, 512, dtype=torch.float16, tol=2e-3)


@pytest.mark.parametrize("m", [2, 40])
def test_matmul_in_bf16(m):
    """bf16 activations, bf16 out (the fused kernel multiplies in float32; the prefill path
    dequantizes to bf16)."""
    check_matmul(Q.Q6_K, m, 512, dtype=torch.bfloat16, tol=2e-2)


# ---------------------------------------------------------------------------- the dispatch


class CountLaunches:
    """kernel[grid](...) that records `name` first."""

    def __init__(self, kernel, calls, name):
        self.kernel, self.calls, self.name = kernel, calls, name

    def __getitem__(self, grid):
        self.calls.append(self.name)
        return self.kernel[grid]


@pytest.fixture
def triton_dispatch(monkeypatch):
    """What a CUDA tensor decides on a GPU, for the CPU's tensors here; the Triton calls recorded."""
    calls = []
    matmul, dequantize = triton_gguf.gguf_matmul, triton_gguf.gguf_dequantize
    monkeypatch.setattr(quant_gguf, "on_triton_device", lambda t: True)
    monkeypatch.setattr(triton_gguf, "gguf_matmul", lambda x, *a: calls.append("matmul") or matmul(x, *a))
    for kernel, name in (("_gguf_matmul_kernel", "fused"), ("_gguf_mma_kernel", "mma")):
        monkeypatch.setattr(triton_gguf, kernel, CountLaunches(getattr(triton_gguf, kernel), calls, name))
    monkeypatch.setattr(triton_gguf, "gguf_dequantize", lambda *a, **kw: calls.append("dequantize") or dequantize(*a, **kw))
    return calls


@pytest.fixture
def no_cpu_kernels(monkeypatch):
    def no_cpu_kernels():
        raise AssertionError("the C++ kernels were asked for on the Triton path")

    monkeypatch.setattr(quant_gguf.cpu_kernels, "get", no_cpu_kernels)
    monkeypatch.setattr(quant_gguf, "kernel_types", no_cpu_kernels)


def test_linear_method_dispatches_to_triton(triton_dispatch, no_cpu_kernels):
    """A fused layer's Q4_K | Q8_0 | float segments, x with leading dims: each block segment by
    the Triton kernel, the result the dequantized matrix's."""
    k = 256
    segs = [make_weight(Q.Q4_K, 24, k, seed=2), make_weight(Q.Q8_0, 16, k, seed=3)]
    plain = torch.randn(8, k)
    layer = SimpleNamespace(in_features=k, out_features=48, weight=on_device(torch.empty(0, 0)))
    method = GGUFLinearMethod()
    method.load_rows(layer, layer.weight, 0, QuantizedWeight(int(Q.Q4_K), torch.from_numpy(segs[0][0]), k))
    method.load_rows(layer, layer.weight, 24, QuantizedWeight(int(Q.Q8_0), torch.from_numpy(segs[1][0]), k))
    method.load_rows(layer, layer.weight, 40, plain)
    assert all(s.data.device.type == TEST_DEVICE for s in method.ordered)
    bias = torch.randn(48)
    x = torch.randn(2, 3, k)
    y = method.apply(layer, on_device(x), on_device(bias)).cpu()
    w = torch.cat([torch.from_numpy(segs[0][1]), torch.from_numpy(segs[1][1]), plain])
    torch.testing.assert_close(y, x @ w.T + bias, rtol=1e-5, atol=1e-5)
    assert triton_dispatch == ["matmul", "fused", "matmul", "fused"]  # 6 rows of x: the fused kernel

    # the LM head's and the embedding's ways in: quant_matmul and QuantizedWeight.dequantize
    qw = QuantizedWeight(int(Q.Q5_1), on_device(make_weight(Q.Q5_1, 24, 64)[0]), 64)
    x2 = on_device(torch.randn(3, 64))
    torch.testing.assert_close(quant_matmul(x2, qw), x2 @ qw.dequantize().T, rtol=1e-5, atol=1e-5)
    assert triton_dispatch[4:] == ["matmul", "fused", "dequantize"]


def test_lm_head_in_blocks_multiplies_in_the_hidden_dtype(triton_dispatch, no_cpu_kernels):
    """On a GPU the LM head's blocks multiply the hidden states as they are (fp16 here: the
    tensor-core kernel), as the float LM head does, not a float32 copy of them."""
    from radixserve.layers.vocab_parallel_embedding import ParallelLMHead

    head = ParallelLMHead(72, 64)
    head.weight.data = on_device(head.weight.data)
    data, w = make_weight(Q.Q8_0, 72, 64, seed=4)
    head.weight_loader(head.weight, QuantizedWeight(int(Q.Q8_0), torch.from_numpy(data), 64))
    hidden = torch.randn(12, 64)
    logits = head.get_logits(on_device(hidden).half())
    assert logits.dtype == torch.float16 and tuple(logits.shape) == (12, 72)
    ref = hidden.half().double() @ torch.from_numpy(w).double().T
    assert (logits.double().cpu() - ref).abs().max().item() <= 2e-3 * ref.abs().max().item()
    assert triton_dispatch == ["matmul", "mma"]


def test_quant_matmul_refuses_a_type_without_a_triton_kernel(triton_dispatch, no_cpu_kernels):
    qw = QuantizedWeight(int(Q.IQ4_NL), torch.zeros(2, 18, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match="IQ4_NL blocks on a GPU: no Triton kernel"):
        quant_matmul(torch.zeros(1, 32), qw)


def test_loader_keeps_the_triton_types_on_a_gpu(monkeypatch):
    """--quantization gguf on a GPU keeps exactly the Triton kernels' types in blocks (refused in
    one line without triton); auto still dequantizes there; w8a8_int8 is served on a GPU."""
    from radixserve.model_executor import model_loader
    from radixserve.models.model_config import LoadError

    cfg = SimpleNamespace(gguf_file="m.gguf", model_path="m.gguf")
    assert model_loader.gguf_block_types("gguf", cfg, torch.bfloat16, "cuda") == quant_gguf.TRITON_TYPES
    assert model_loader.gguf_block_types("auto", cfg, torch.bfloat16, "cuda") == frozenset()
    assert model_loader.check_w8a8("w8a8_int8", SimpleNamespace(gguf_file=None), "cuda")
    monkeypatch.setattr(model_loader, "triton_available", lambda: False)
    with pytest.raises(LoadError, match="--quantization gguf on a GPU needs triton"):
        model_loader.gguf_block_types("gguf", cfg, torch.bfloat16, "cuda")
    with pytest.raises(LoadError, match="w8a8_int8 on a GPU needs triton"):
        model_loader.check_w8a8("w8a8_int8", SimpleNamespace(gguf_file=None), "cuda")


@pytest.mark.skipif(ON_GPU, reason="the GPU run serves through the real device check (a served GPU model)")
def test_synthetic_gguf_served_through_triton_matches_transformers(tmp_path, triton_dispatch):
    """End to end: every quantized linear layer, the LM head and the embedding of a synthetic GGUF
    (Q8_0 / Q4_1 / Q5_0 / Q4_0 tensors) through the interpreted Triton kernels, a prefill (the
    dequantized tiles) then a decode step (the fused kernel): transformers' logits on the
    dequantized weights."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
    from hf_utils import KVDriver, make_runner
    from test_gguf import write_synthetic

    path = tmp_path / "qwen2.gguf"
    hf = write_synthetic("qwen2", path)
    runner = make_runner(str(path), max_total_tokens=1024, max_running_requests=4, quantization="gguf")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (7, 12)]
    driver = KVDriver(runner)
    out = driver.extend([0, 1], [0, 0], prompts)  # 19 rows: dequantized tiles and the GEMM
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    assert (out.all_logits - ref).abs().max().item() <= 1e-4
    # per layer 5 block segments (q, k | o | gate | down; v and up are F16/BF16 floats), and the head
    blocks = 2 * 5 + 1
    assert triton_dispatch.count("matmul") == blocks and "fused" not in triton_dispatch
    assert triton_dispatch.count("dequantize") >= blocks + 1  # their tiles, and the embedding's rows
    triton_dispatch.clear()
    nxt = [11, 200]
    out = driver.decode([0, 1], [len(p) for p in prompts], nxt)  # 2 rows: the fused kernel
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p + [t]])).logits[0, -1] for p, t in zip(prompts, nxt)])
    assert (out.next_token_logits - ref).abs().max().item() <= 1e-4
    assert triton_dispatch.count("fused") == blocks and triton_dispatch.count("dequantize") == 1
