"""The C++ MoE kernel (cpu_kernels.fused_moe_bf16, issue 41) against FusedMoE's torch loop over the
experts on the same packed bf16 weights (the loop calls the bf16 GEMM per expert): 64 experts,
top-8, decode (1 token), a decode batch (16) and a prefill (300 tokens, the popular experts'
tokens spanning several 64-row chunks), renormalized routing weights and not, with experts that get no token."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers import cpu_kernels
from radixserve.layers.moe import FusedMoE, TopKRouter

E, TOP_K, HIDDEN, INTER = 64, 8, 128, 96


@pytest.fixture(scope="module")
def ops():
    mod = cpu_kernels.get()
    assert mod is not None, "the C++ CPU kernels did not build (see the warning logged by cpu_kernels.build)"
    if not mod.has_bf16_gemm():
        pytest.skip("this CPU has neither AVX512_BF16 nor AVX2 + FMA: the experts stay on the torch loop")
    return mod


@pytest.fixture(scope="module")
def moe(ops) -> FusedMoE:
    layer = FusedMoE(E, HIDDEN, INTER)
    g = torch.Generator().manual_seed(0)
    layer.w13_weight.data = (torch.randn(E, 2 * INTER, HIDDEN, generator=g) * HIDDEN**-0.5).bfloat16()
    layer.w2_weight.data = (torch.randn(E, HIDDEN, INTER, generator=g) * INTER**-0.5).bfloat16()
    assert layer.pack_cpu_weight()
    return layer


def _route(m: int, renormalize: bool, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    router = TopKRouter(HIDDEN, E, TOP_K, renormalize)
    router.weight.data = torch.randn(E, HIDDEN, generator=g) * HIDDEN**-0.5
    # a few popular experts, as real routers have: in a prefill they get more tokens than one of
    # the kernel's 64-row chunks holds
    popular = torch.randn(HIDDEN, generator=g)
    router.weight.data[:3] += popular * HIDDEN**-0.5
    x = torch.randn(m, HIDDEN, generator=g) + 0.5 * popular
    weights, ids = router.route(x)
    return x, weights, ids


def _close(y: torch.Tensor, ref: torch.Tensor) -> bool:
    # as the bf16 GEMM's tests: relative to |ref| + 1, within 2^-7 (both sides round the SiLU
    # output to bf16 as the down projection's operand, and may round one element differently)
    return ((y - ref).abs() / (ref.abs() + 1)).max().item() <= 2**-7


@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "plain_topk"])
@pytest.mark.parametrize("m", [1, 16, 300])
def test_kernel_matches_the_torch_loop(ops, moe, m, renormalize):
    x, weights, ids = _route(m, renormalize, seed=m)
    counts = torch.bincount(ids.flatten(), minlength=E)
    assert all(len(set(row)) == TOP_K for row in ids.tolist())  # top-k never repeats an expert
    if m <= 16:
        assert (counts == 0).any()  # experts with no token: the kernel must skip them
    else:
        assert counts.max() > 2 * 64  # an expert's tokens span several of the kernel's row chunks
    y = ops.fused_moe_bf16(x, moe.w13_packed, moe.w2_packed, weights, ids, INTER)
    ref = moe.forward_loop(x, weights, ids)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert _close(y, ref), (y - ref).abs().max().item()
    assert (y - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()


def test_kernel_is_the_math_in_float64(ops, moe):
    """Not merely equal to the loop: sum_k w_k * down(silu(gate) * up) on the bf16-rounded
    operands, in float64, to bf16-operand precision."""
    x, weights, ids = _route(5, True, seed=7)
    y = ops.fused_moe_bf16(x, moe.w13_packed, moe.w2_packed, weights, ids, INTER)
    ref = torch.zeros(5, HIDDEN, dtype=torch.float64)
    for t in range(5):
        for j in range(TOP_K):
            e = ids[t, j].item()
            w13 = moe.w13_packed[e].permute(0, 2, 1, 3).reshape(-1, HIDDEN)[: 2 * INTER].double()
            w2 = moe.w2_packed[e].permute(0, 2, 1, 3).reshape(-1, INTER)[:HIDDEN].double()
            gate, up = (x[t].bfloat16().double() @ w13.T).chunk(2)
            act = (torch.nn.functional.silu(gate) * up).bfloat16().double()
            ref[t] += weights[t, j].double() * (act @ w2.T)
    assert (y.double() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()


def test_layer_forward_takes_the_kernel_and_falls_back(ops, moe, monkeypatch):
    """FusedMoE.forward runs the kernel when it can (packed experts, float32 activations), and
    the loop once the kernels are off."""
    x, weights, ids = _route(16, True, seed=3)
    calls = []
    real = ops.fused_moe_bf16

    class Spy:
        def __getattr__(self, name):
            return getattr(ops, name)

        def fused_moe_bf16(self, *a):
            calls.append(1)
            return real(*a)

    monkeypatch.setattr(cpu_kernels, "kernels_for", lambda t: Spy())
    y = moe.forward(x, weights, ids)
    assert calls == [1] and _close(y, moe.forward_loop(x, weights, ids))
    monkeypatch.setattr(cpu_kernels, "kernels_for", lambda t: None)
    assert torch.equal(moe.forward(x, weights, ids), moe.forward_loop(x, weights, ids)) and calls == [1]


def test_bad_expert_ids_are_refused(ops, moe):
    x, weights, ids = _route(2, True, seed=1)
    ids[1, 3] = E
    with pytest.raises(RuntimeError, match="outside"):
        ops.fused_moe_bf16(x, moe.w13_packed, moe.w2_packed, weights, ids, INTER)


@pytest.mark.parametrize("m", [1, 16, 300])
def test_pairs_of_another_ranks_experts_are_skipped(ops, moe, m):
    """--ep-size marks the pairs routed to another rank's experts -1: the kernel and the loop
    both leave them out, which is the same as giving them weight 0 (and is cheaper)."""
    x, weights, ids = _route(m, True, seed=40 + m)
    other = ids % 2 == 1  # as if the odd experts lived on another rank
    assert other.any() and (~other).any()
    skipped = torch.where(other, -1, ids)
    zeroed = torch.where(other, torch.zeros_like(weights), weights)
    y = ops.fused_moe_bf16(x, moe.w13_packed, moe.w2_packed, weights, skipped, INTER)
    ref = ops.fused_moe_bf16(x, moe.w13_packed, moe.w2_packed, zeroed, ids, INTER)
    assert _close(y, ref), (y - ref).abs().max().item()
    assert _close(moe.forward_loop(x, weights, skipped), ref)
    full = ops.fused_moe_bf16(x, moe.w13_packed, moe.w2_packed, weights, ids, INTER)
    assert not _close(y, full)  # the skipped pairs did count before
    none = torch.full_like(ids, -1)
    assert torch.equal(ops.fused_moe_bf16(x, moe.w13_packed, moe.w2_packed, weights, none, INTER), torch.zeros_like(x))
