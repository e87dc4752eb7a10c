"""The GatedDeltaNet building blocks (layers/gated_delta_net.py) against their definitions: the
chunked delta rule equals the token-by-token recurrence (ragged batches padded, nonzero starting
states, several chunks), and the causal conv1d with its saved state equals one conv over the
whole sequence however it is split; a speculative verify's trace advances the states by the
tokens kept as an extend of them would. The reference for the C++ / Triton kernels to come."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.layers.gated_delta_net import (
    GatedDeltaNet,
    LinearAttnMetadata,
    advance_states,
    causal_conv1d,
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_step,
)


def _inputs(B: int, H: int, L: int, dk: int = 8, dv: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, H, L, dk, generator=g, dtype=torch.float64)) * dk ** -0.5
    k = l2norm(torch.randn(B, H, L, dk, generator=g, dtype=torch.float64))
    v = torch.randn(B, H, L, dv, generator=g, dtype=torch.float64)
    decay = -torch.rand(B, H, L, generator=g, dtype=torch.float64)
    beta = torch.rand(B, H, L, generator=g, dtype=torch.float64)
    state = torch.randn(B, H, dk, dv, generator=g, dtype=torch.float64)
    return q, k, v, decay, beta, state


def _recurrent(q, k, v, decay, beta, state):
    outs = []
    for t in range(q.shape[2]):
        o, state = recurrent_gated_delta_step(q[:, :, t], k[:, :, t], v[:, :, t], decay[:, :, t], beta[:, :, t], state)
        outs.append(o)
    return torch.stack(outs, dim=2), state


@pytest.mark.parametrize("L, chunk", [(1, 4), (7, 4), (16, 4), (70, 64)])
def test_the_chunked_rule_is_the_recurrence(L, chunk):
    args = _inputs(2, 3, L)
    out, state = chunk_gated_delta_rule(*args, chunk_size=chunk)
    ref_out, ref_state = _recurrent(*args)
    assert torch.allclose(out, ref_out, atol=1e-10) and torch.allclose(state, ref_state, atol=1e-10)


def test_padded_positions_leave_the_state_alone():
    """A request shorter than the batch: zeros after its end (k = v = beta = g = 0) change
    neither its outputs nor its final state."""
    q, k, v, decay, beta, state = _inputs(1, 2, 5)
    pad = lambda x: F.pad(x, (0, 0, 0, 6)) if x.dim() == 4 else F.pad(x, (0, 6))  # noqa: E731
    out, final = chunk_gated_delta_rule(pad(q), pad(k), pad(v), pad(decay), pad(beta), state, chunk_size=4)
    ref_out, ref_final = _recurrent(q, k, v, decay, beta, state)
    assert torch.allclose(out[:, :, :5], ref_out, atol=1e-10) and torch.allclose(final, ref_final, atol=1e-10)


def test_the_conv_continues_from_its_saved_state():
    """A 10-token sequence split 3 + 6 + 1 (a decode step), beside other requests, equals one
    causal conv over all 10 tokens; a request without a computed prefix ignores its slot's state."""
    torch.manual_seed(0)
    C, K = 6, 4
    weight = torch.randn(C, K)
    x = torch.randn(10, C)
    ref = F.silu(F.conv1d(x.t()[None], weight[:, None], padding=K - 1, groups=C)[0, :, :10].t())
    conv_state = torch.randn(4, K - 1, C)  # slots 0..3 hold garbage
    other = torch.randn(5, C)
    meta = LinearAttnMetadata.build(torch.tensor([2, 1]), False, [3, 5], [0, 0])
    out = causal_conv1d(torch.cat([x[:3], other]), conv_state, weight, meta)
    ref_other = F.silu(F.conv1d(other.t()[None], weight[:, None], padding=K - 1, groups=C)[0, :, :5].t())
    assert torch.allclose(out[3:], ref_other, atol=1e-6)
    meta = LinearAttnMetadata.build(torch.tensor([2]), False, [6], [3])
    out = torch.cat([out[:3], causal_conv1d(x[3:9], conv_state, weight, meta)])
    meta = LinearAttnMetadata.build(torch.tensor([2]), True, [1], [9])
    out = torch.cat([out, causal_conv1d(x[9:], conv_state, weight, meta)])
    assert torch.allclose(out, ref, atol=1e-6)
    assert torch.equal(conv_state[2], x[7:10])  # the last K - 1 inputs


def check_decode_step_in_place(step, B: int, H: int, dk: int, dv: int, device: str = "cpu") -> None:
    """A fused decode step (the C++ or the Triton kernel: step(q, k, v, g, beta, pool, slots,
    has_initial) -> o) against recurrent_gated_delta_step: the outputs, the states written back at
    the requests' slots (scattered, a fresh request starting from zeros over a slot holding
    garbage), and every other slot untouched."""
    g = torch.Generator().manual_seed(B * 100 + dk)
    q = (l2norm(torch.randn(B, H, dk, generator=g)) * dk ** -0.5).to(device)
    k = l2norm(torch.randn(B, H, dk, generator=g)).to(device)
    v = torch.randn(B, H, dv, generator=g).to(device)
    decay, beta = -torch.rand(B, H, generator=g).to(device), torch.rand(B, H, generator=g).to(device)
    pool = torch.randn(2 * B + 3, H, dk, dv, generator=g).to(device)
    slots = torch.randperm(2 * B + 3, generator=g)[:B].to(device)
    has_initial = torch.tensor([b % 3 != 1 for b in range(B)], device=device)
    before = pool.clone()
    ref_state = before[slots] * has_initial[:, None, None, None]
    ref_out, ref_state = recurrent_gated_delta_step(q, k, v, decay, beta, ref_state)
    out = step(q, k, v, decay, beta, pool, slots, has_initial)
    assert torch.allclose(out, ref_out, rtol=1e-5, atol=1e-5), (out - ref_out).abs().max()
    assert torch.allclose(pool[slots], ref_state, rtol=1e-5, atol=1e-5)
    others = torch.ones(pool.shape[0], dtype=torch.bool, device=device)
    others[slots] = False
    assert torch.equal(pool[others], before[others])


@pytest.mark.parametrize("B, H, dk, dv", [(1, 2, 8, 4), (5, 4, 128, 128), (3, 3, 64, 96)])
def test_the_cpu_decode_kernel_is_the_recurrent_step_in_place(B, H, dk, dv):
    from radixserve.layers import cpu_kernels

    ops = cpu_kernels.get()
    assert ops is not None, "the C++ CPU kernels did not build"
    check_decode_step_in_place(ops.gated_delta_decode, B, H, dk, dv)


def test_the_cpu_decode_kernel_refuses_bad_arguments():
    from radixserve.layers import cpu_kernels

    ops = cpu_kernels.get()
    q = torch.zeros(2, 2, 8)
    pool = torch.zeros(4, 2, 8, 4)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.gated_delta_decode(q, q, torch.zeros(2, 2, 4), torch.zeros(2, 2), torch.zeros(2, 2), pool,
                               torch.tensor([0, 4]), torch.tensor([True, True]))
    with pytest.raises(RuntimeError, match="float32"):
        ops.gated_delta_decode(q.double(), q, torch.zeros(2, 2, 4), torch.zeros(2, 2), torch.zeros(2, 2), pool,
                               torch.tensor([0, 1]), torch.tensor([True, True]))


def test_a_verify_leaves_the_states_and_its_trace_advances_them_by_the_kept_tokens():
    """A layer's verify forward (3 requests, 4 tokens each) writes no state; advance_states by
    each request's first 1, 2 or 4 tokens gives the states (conv and temporal) that an extend of
    just those tokens writes, and the verify's outputs are that extend's at every position."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden_size=32, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=4, conv_kernel=4,
                          layer_id=0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5 if p.dim() >= 2 else 0.3 * torch.randn_like(p))
    slots, width, keep = torch.tensor([1, 2, 3]), 4, torch.tensor([1, 2, 4])
    conv0, temporal0 = torch.randn(4, 3, layer.conv_dim), torch.randn(4, 4, 8, 4)
    x = torch.randn(3 * width, 32)
    conv, temporal = conv0.clone(), temporal0.clone()
    traces: dict = {}
    meta = LinearAttnMetadata.build(slots, False, [width] * 3, [5] * 3, verify_traces=traces)
    out = layer.forward(x, meta, conv, temporal)
    assert torch.equal(conv, conv0) and torch.equal(temporal, temporal0)  # read, not written
    advance_states(traces[0], conv, temporal, keep)
    ref_conv, ref_temporal = conv0.clone(), temporal0.clone()
    kept = torch.cat([x[i * width : i * width + n] for i, n in enumerate(keep.tolist())])
    ref_out = layer.forward(kept, LinearAttnMetadata.build(slots, False, keep.tolist(), [5] * 3), ref_conv, ref_temporal)
    assert torch.allclose(conv, ref_conv, atol=1e-5) and torch.allclose(temporal, ref_temporal, atol=1e-5)
    verify_kept = torch.cat([out[i * width : i * width + n] for i, n in enumerate(keep.tolist())])
    assert torch.allclose(verify_kept, ref_out, atol=1e-5)
