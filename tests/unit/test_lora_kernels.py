"""The segmented LoRA matmul kernels (issue 28) against the torch loop of radixserve/lora/layers.py:
the C++ kernel (cpu_kernels.lora_delta, radixserve/csrc/lora_kernels.cpp) and the Triton kernels
(radixserve/lora/triton_ops.py, under Triton's interpreter on the CPU; compiled on a GPU with
RADIXSERVE_TEST_DEVICE=cuda, tests/unit/devices.py, where the C++ kernel's tests stay on the CPU),
on one batch that mixes everything a batch can: adapters of ranks 4, 8 and 16 (and 24: more than
one 16-wide rank chunk) zero-padded in one pool, a slot whose segments are not adjacent, one-token
(decode) segments next to a long (prefill) one, base-model tokens between them (which must come
back bit for bit), a fused projection of three parts (q|k|v) with output widths that are not
multiples of 16."""

import os

from devices import ON_GPU, TEST_DEVICE, assert_kernels_match_the_device

# Before triton_ops is imported (its kernels are defined at import), as in test_triton_kernels.py. Not on the GPU.
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

from typing import List, Tuple  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from radixserve.layers import cpu_kernels  # noqa: E402
from radixserve.lora import layers as lora_layers  # noqa: E402
from radixserve.lora.layers import LoRABatchInfo, LoRABatchState, LoRALinearDelta  # noqa: E402
from radixserve.lora.mem_pool import LoRAMemoryPool  # noqa: E402

# The interpreter for this module's tests only (tests/unit/conftest.py; set above for the import; not on the GPU).
pytestmark = pytest.mark.usefixtures("triton_interpreter")

TOL = 1e-4  # float32: the kernels sum in another order than torch's matmuls
K = 72  # input width (not a multiple of 16 or of the Triton K block)
PARTS = [("q_proj", 0, 40), ("k_proj", 40, 24), ("v_proj", 64, 24)]  # (module, offset, size): y is [T, 88]
SLOT_RANKS = [4, 16, 8]  # the adapters' own ranks, zero-padded to the pool's
# (start, end, slot, scaling): tokens 0-1 base, a 1-token segment, base, a 19-token prefill of slot
# 2, slot 0 again (not adjacent to its first segment), base, two more 1-token segments.
SEGMENTS = [(2, 3, 0, 2.0), (4, 23, 2, 0.5), (23, 25, 0, 2.0), (26, 27, 1, 1.25), (27, 28, 2, 0.5)]
NUM_TOKENS = 29
BASE_TOKENS = [0, 1, 3, 25, 28]
LAYER = 1


def _pool(max_rank: int) -> LoRAMemoryPool:
    """A 2-layer pool with random A/B; each slot keeps only its adapter's rank (the rest zero, as
    LoRAMemoryPool._load pads a smaller adapter)."""
    dims = {m: (K, size) for m, _, size in PARTS}
    pool = LoRAMemoryPool(len(SLOT_RANKS), max_rank, dims, num_layers=2, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(max_rank)
    for module, _, _ in PARTS:
        a, b = pool.a_buffers[module], pool.b_buffers[module]
        a.copy_(torch.randn(a.shape, generator=gen) / K**0.5)
        b.copy_(torch.randn(b.shape, generator=gen))
        for slot, r in enumerate(SLOT_RANKS):
            a[:, slot, min(r, max_rank):] = 0
            b[:, slot, :, min(r, max_rank):] = 0
    return pool


def _delta(pool: LoRAMemoryPool) -> Tuple[LoRALinearDelta, LoRABatchInfo]:
    state = LoRABatchState()
    state.info = LoRABatchInfo(segments=list(SEGMENTS))
    return LoRALinearDelta(LAYER, PARTS, pool, state), state.info


def _inputs(device: str = "cpu") -> Tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)  # drawn on the CPU: the same values on every device
    x = torch.randn(NUM_TOKENS, K, generator=gen)
    y = torch.randn(NUM_TOKENS, PARTS[-1][1] + PARTS[-1][2], generator=gen)
    return x.to(device), y.to(device)


def _reference(pool: LoRAMemoryPool, device: str = "cpu") -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, y before, y after the torch loop), on `device` (the pool's)."""
    x, y = _inputs(device)
    lora, info = _delta(pool)
    want = y.clone()
    lora.apply_torch(x, want, info)
    return x, y, want


def _check(got: torch.Tensor, y0: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> None:
    assert not torch.equal(want, y0), "the reference added no delta: the test data is wrong"
    for t in BASE_TOKENS:
        assert torch.equal(got[t], y0[t]), f"base-model token {t} was changed"
    err = (got - want).abs().max().item()
    assert err <= tol * max(1.0, want.abs().max().item()), f"max abs diff {err}"


@pytest.fixture(scope="module")
def ops():
    mod = cpu_kernels.get()
    assert mod is not None, "the C++ CPU kernels did not build (see the warning logged by cpu_kernels.build)"
    return mod


@pytest.mark.parametrize("slot_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_rank", [8, 16, 24])
def test_cpu_kernel_matches_torch(ops, max_rank, slot_dtype):
    """Every slot and part in one lora_delta call equals the torch loop; rank 8 cuts slot 1's
    rank-16 adapter to 8 columns in both, 24 takes two rank chunks. bf16 slots (float32
    activations): the kernel widens the same bf16 values the reference multiplies in float32."""
    pool = _pool(max_rank)
    if slot_dtype == torch.bfloat16:
        for buffers in (pool.a_buffers, pool.b_buffers):
            for m in buffers:
                buffers[m] = buffers[m].bfloat16().float()
    x, y0, want = _reference(pool)
    lora, info = _delta(pool)
    got = y0.clone()
    segs, scalings = info.kernel_segments(x.device)
    ops.lora_delta(got, x, [pool.a_buffers[m].to(slot_dtype) for m, _, _ in PARTS],
                   [pool.b_buffers[m].to(slot_dtype) for m, _, _ in PARTS], lora.offsets, LAYER, segs, scalings)
    _check(got, y0, want)


def test_apply_takes_the_cpu_kernel(ops, monkeypatch):
    """LoRALinearDelta.apply on float32 CPU tensors goes to the C++ kernel (not the torch loop),
    in place on a strided view of y, and gives the reference's result."""
    pool = _pool(16)
    x, y0, want = _reference(pool)
    lora, _ = _delta(pool)

    def no_torch(*args):
        raise AssertionError("the torch loop ran")

    monkeypatch.setattr(lora, "apply_torch", no_torch)
    lora_layers.set_lora_backend("kernel")
    wide = torch.cat([y0, torch.zeros(NUM_TOKENS, 5)], dim=1)  # y as a view with a row stride of its own
    got = wide[:, : y0.shape[1]]
    assert lora.apply(x, got) is got
    _check(got, y0, want)
    assert torch.equal(wide[:, y0.shape[1]:], torch.zeros(NUM_TOKENS, 5)), "wrote outside y"


def test_torch_backend_and_other_dtypes_keep_the_torch_loop(ops):
    """set_lora_backend("torch"), and bf16 activations (the kernel is float32 only), take the
    torch loop; an unknown backend name is refused."""
    pool = _pool(16)
    x, y0, want = _reference(pool)
    lora, info = _delta(pool)
    try:
        lora_layers.set_lora_backend("torch")
        calls: List[int] = []
        orig = lora.apply_torch
        lora.apply_torch = lambda *a: (calls.append(1), orig(*a))
        got = y0.clone()
        lora.apply(x, got)
        assert calls == [1]
        assert torch.equal(got, want)
        lora_layers.set_lora_backend("kernel")
        assert not lora._apply_kernel(x.bfloat16(), y0.bfloat16(), info)
        with pytest.raises(ValueError, match="LoRA backend 'gpu'"):
            lora_layers.set_lora_backend("gpu")
    finally:
        lora_layers.set_lora_backend("kernel")


def test_triton_kernels_run_under_the_interpreter():
    """Interpreted on the CPU; on the GPU compiled, not interpreted."""
    from radixserve.lora import triton_ops

    assert_kernels_match_the_device(triton_ops._shrink_kernel, triton_ops._expand_kernel)


# bf16 only on the GPU: the interpreter has no bf16 dot
TRITON_CASES = [(8, torch.float32), (24, torch.float32), (16, torch.float16)]
TRITON_CASES += [(16, torch.bfloat16)] if ON_GPU else []
# fp16/bf16: a few roundings (to 11 / 8 significant bits) of the delta and the sum, relative to the largest value
TRITON_HALF_TOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("max_rank,dtype", TRITON_CASES)
def test_triton_kernel_matches_torch(max_rank, dtype):
    """float32 exact (ieee dots, on the GPU too: no TF32), and fp16 activations and slots as on a
    GPU (the interpreter has no bf16 dot; bf16 on the GPU only): within fp16 (bf16) rounding of
    the torch loop in fp16 (bf16)."""
    from radixserve.lora import triton_ops

    pool = _pool(max_rank)
    for buffers in (pool.a_buffers, pool.b_buffers):
        for m in buffers:
            buffers[m] = buffers[m].to(TEST_DEVICE, dtype)
    x, y0, want = (t.to(dtype) for t in _reference(pool, TEST_DEVICE))
    lora, info = _delta(pool)
    if dtype != torch.float32:
        want = y0.clone()
        lora.apply_torch(x, want, info)
    got = y0.clone()
    segs, scalings = info.kernel_segments(x.device)
    triton_ops.lora_delta(got, x, [pool.a_buffers[m][LAYER] for m, _, _ in PARTS],
                          [pool.b_buffers[m][LAYER] for m, _, _ in PARTS], lora.offsets, segs, scalings,
                          max(e - s for s, e, _, _ in SEGMENTS))
    _check(got, y0, want, tol=TOL if dtype == torch.float32 else TRITON_HALF_TOL[dtype])
