"""The GatedDeltaNet decode step's Triton kernel (radixserve/layers/gdn_triton.py), under Triton's
interpreter on the CPU (compiled on a GPU with RADIXSERVE_TEST_DEVICE=cuda: tests/unit/devices.py),
against the torch recurrence (recurrent_gated_delta_step) and the C++ kernel's contract: the
outputs, the states written back in place at the requests' scattered slots (a fresh request
starting from zeros over a slot holding garbage), every other slot untouched; head dims that are
not powers of two and a dv split over several programs; the layer's dispatch on CUDA."""

import os

from devices import ON_GPU, TEST_DEVICE, assert_kernels_match_the_device

# Before the kernel is defined (gdn_triton imported); tests/unit/conftest.py puts it back after collection and
# turns it on again around this module's tests only. Not on the GPU.
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from radixserve.layers import gdn_triton  # noqa: E402
from radixserve.layers.gated_delta_net import decode_kernel, l2norm, recurrent_gated_delta_step  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def test_kernel_runs_under_the_interpreter():
    assert_kernels_match_the_device(gdn_triton._gdn_decode_kernel)


@pytest.mark.parametrize("B, H, dk, dv", [(1, 2, 8, 4), (3, 4, 16, 24), (2, 2, 128, 160)])
def test_the_triton_decode_step_is_the_recurrent_step_in_place(B, H, dk, dv):
    g = torch.Generator().manual_seed(B * 10 + dk)
    q = (l2norm(torch.randn(B, H, dk, generator=g)) * dk ** -0.5).to(TEST_DEVICE)
    k = l2norm(torch.randn(B, H, dk, generator=g)).to(TEST_DEVICE)
    v = torch.randn(B, H, dv, generator=g).to(TEST_DEVICE)
    decay, beta = -torch.rand(B, H, generator=g).to(TEST_DEVICE), torch.rand(B, H, generator=g).to(TEST_DEVICE)
    pool = torch.randn(2 * B + 2, H, dk, dv, generator=g).to(TEST_DEVICE)
    slots = torch.randperm(2 * B + 2, generator=g)[:B].to(TEST_DEVICE)
    has_initial = torch.tensor([b % 2 == 0 for b in range(B)], device=TEST_DEVICE)
    before = pool.clone()
    ref_state = before[slots] * has_initial[:, None, None, None]
    ref_out, ref_state = recurrent_gated_delta_step(q, k, v, decay, beta, ref_state)
    out = gdn_triton.gated_delta_decode(q, k, v, decay, beta, pool, slots, has_initial)
    assert torch.allclose(out, ref_out, rtol=1e-5, atol=1e-5), (out - ref_out).abs().max()
    assert torch.allclose(pool[slots], ref_state, rtol=1e-5, atol=1e-5)
    others = torch.ones(pool.shape[0], dtype=torch.bool, device=TEST_DEVICE)
    others[slots] = False
    assert torch.equal(pool[others], before[others])


def test_the_layer_takes_the_triton_step_on_cuda_tensors_only():
    """decode_kernel: Triton's for a CUDA tensor (unless the fused kernels are turned off), the C++
    kernel (or None) on the CPU."""
    from radixserve.layers import fused

    class FakeCuda:
        is_cuda = True

    assert decode_kernel(FakeCuda()) is gdn_triton.gated_delta_decode
    fused.ENABLED = False
    try:
        assert decode_kernel(FakeCuda()) is None
    finally:
        fused.ENABLED = True
    cpu = decode_kernel(torch.zeros(1))
    assert cpu is None or cpu.__name__ == "gated_delta_decode" and cpu is not gdn_triton.gated_delta_decode
