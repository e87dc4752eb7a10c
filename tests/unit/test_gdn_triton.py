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
from radixserve.layers.gated_delta_net import decode_kernel  # noqa: E402

from test_gated_delta_net import check_decode_step_in_place  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def test_kernel_runs_under_the_interpreter():
    assert_kernels_match_the_device(gdn_triton._gdn_decode_kernel)


@pytest.mark.parametrize("B, H, dk, dv", [(1, 2, 8, 4), (3, 4, 16, 24), (2, 2, 128, 160)])
def test_the_triton_decode_step_is_the_recurrent_step_in_place(B, H, dk, dv):
    check_decode_step_in_place(gdn_triton.gated_delta_decode, B, H, dk, dv, TEST_DEVICE)


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
