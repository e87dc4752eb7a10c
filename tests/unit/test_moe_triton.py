"""The GPU's fused MoE (radixserve/layers/moe_triton.py, issue 41 item 1) under Triton's interpreter
on the CPU (compiled on a GPU with RADIXSERVE_TEST_DEVICE=cuda: tests/unit/devices.py), against
FusedMoE's torch loop (forward_loop, the reference of every MoE path):

- moe_align: every routed (token, k) pair exactly once, each block one expert's, -1 pairs out;
- float32 experts (exact products): 8 experts top-2 and 64 experts top-8, batch 1 / 5 / 16 / 70,
  an intermediate size not a multiple of the kernel's tiles, renormalized and raw weights;
- pairs of another --ep-size rank's experts (-1) add nothing;
- fp16 activations and experts come out fp16 (the tensor-core path; the interpreter's bf16 dot
  works on raw bits, so bf16 is left to the GPU run);
- FusedMoE takes this kernel for CUDA tensors only, and not when fused kernels are off."""

import os

from devices import ON_GPU, TEST_DEVICE, assert_kernels_match_the_device

if not ON_GPU:  # before moe_triton is imported (triton.jit picks the interpreter then)
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from radixserve.layers import moe_triton  # noqa: E402
from radixserve.layers.moe import FusedMoE, gpu_fused_moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def _layer(experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0) -> FusedMoE:
    g = torch.Generator().manual_seed(seed)
    layer = FusedMoE(experts, hidden, inter)
    layer.w13_weight.data = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    layer.w2_weight.data = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    return layer


def _route(tokens: int, experts: int, top_k: int, renormalize: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(tokens, experts, generator=g), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.to(torch.int32)


def test_kernel_runs_under_the_interpreter():
    assert_kernels_match_the_device(moe_triton._grouped_gemm_kernel)


@pytest.mark.parametrize("block_m", [16, 64])
def test_align_sorts_every_pair_once_by_expert(block_m):
    ids = torch.tensor([[3, 0], [3, -1], [1, 3], [-1, -1], [0, 3]], dtype=torch.int32)
    sorted_ids, block_expert = moe_align(ids, 4, block_m)
    P = ids.numel()
    assert sorted_ids.numel() % block_m == 0 and block_expert.numel() == sorted_ids.numel() // block_m
    real = sorted_ids[sorted_ids < P].tolist()
    flat = ids.flatten().tolist()
    assert sorted(real) == [p for p in range(P) if flat[p] >= 0]  # each routed pair once, no -1 pair
    for b, e in enumerate(block_expert.tolist()):
        block = [p for p in sorted_ids[b * block_m:(b + 1) * block_m].tolist() if p < P]
        if e < 0:
            assert not block
        else:
            assert all(flat[p] == e for p in block)
    assert sorted(e for e in block_expert.tolist() if e >= 0) == [0, 1, 3]  # expert 2 is hit by nothing


def moe_align(ids, experts, block_m):
    return moe_triton.moe_align(ids.to(TEST_DEVICE), experts, block_m)


@pytest.mark.parametrize("experts, top_k, hidden, inter", [(8, 2, 64, 48), (64, 8, 32, 40)])
@pytest.mark.parametrize("tokens", [1, 5, 16, 70])
def test_fused_moe_equals_the_torch_loop_in_float32(experts, top_k, hidden, inter, tokens):
    layer = _layer(experts, hidden, inter, torch.float32)
    weights, ids = _route(tokens, experts, top_k, renormalize=tokens % 2 == 0, seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(7))
    ref = layer.forward_loop(x, weights, ids)
    dev = lambda t: t.to(TEST_DEVICE)  # noqa: E731
    out = moe_triton.fused_moe(dev(x), dev(layer.w13_weight.data), dev(layer.w2_weight.data), dev(weights), dev(ids))
    assert out.dtype == torch.float32 and out.shape == x.shape
    tol = 2e-3 if ON_GPU else 1e-5  # the GPU's float32 tl.dot runs in tf32
    torch.testing.assert_close(out.cpu(), ref, rtol=tol, atol=tol)


def test_another_ranks_experts_add_nothing():
    layer = _layer(8, 32, 16, torch.float32, seed=1)
    weights, ids = _route(6, 8, 2, renormalize=True, seed=3)
    ids[0, 1] = ids[2, 0] = ids[4, 0] = ids[4, 1] = -1  # token 4 has none here: its output is 0
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(2))
    dev = lambda t: t.to(TEST_DEVICE)  # noqa: E731
    out = moe_triton.fused_moe(dev(x), dev(layer.w13_weight.data), dev(layer.w2_weight.data), dev(weights), dev(ids)).cpu()
    tol = 2e-3 if ON_GPU else 1e-5
    torch.testing.assert_close(out, layer.forward_loop(x, weights, ids), rtol=tol, atol=tol)
    assert torch.count_nonzero(out[4]) == 0


def test_fp16_in_fp16_out():
    layer = _layer(8, 64, 32, torch.float16, seed=4)
    weights, ids = _route(20, 8, 2, renormalize=True, seed=5)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(6)).to(torch.float16)
    dev = lambda t: t.to(TEST_DEVICE)  # noqa: E731
    out = moe_triton.fused_moe(dev(x), dev(layer.w13_weight.data), dev(layer.w2_weight.data), dev(weights), dev(ids))
    assert out.dtype == torch.float16
    ref = _layer(8, 64, 32, torch.float32, seed=4)  # the same weights in float32
    ref.w13_weight.data, ref.w2_weight.data = layer.w13_weight.data.float(), layer.w2_weight.data.float()
    torch.testing.assert_close(out.cpu().float(), ref.forward_loop(x.float(), weights, ids), rtol=2e-2, atol=2e-2)


def test_the_layer_takes_the_triton_kernel_on_cuda_tensors_only():
    from radixserve.layers import fused

    class FakeCuda:
        is_cuda = True

    assert gpu_fused_moe(FakeCuda()) is moe_triton.fused_moe
    fused.ENABLED = False
    try:
        assert gpu_fused_moe(FakeCuda()) is None
    finally:
        fused.ENABLED = True
    assert gpu_fused_moe(torch.zeros(1)) is None
