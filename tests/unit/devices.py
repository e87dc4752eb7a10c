"""Where the Triton-kernel tests run, from RADIXSERVE_TEST_DEVICE:

- cpu (the default): the kernels under Triton's CPU interpreter (TRITON_INTERPRET=1), on cpu tensors;
- cuda: the compiled kernels on a GPU, on cuda tensors (TRITON_INTERPRET is never set).

Imported by those modules before the kernels are defined (triton.jit picks the interpreter then).
Tests of CPU-only paths (the C++ kernels, the gate that keeps cpu tensors on torch) stay on the CPU
either way. Not named test_*: pytest would collect it."""

import os

TEST_DEVICE = os.environ.get("RADIXSERVE_TEST_DEVICE", "").strip().lower() or "cpu"
if TEST_DEVICE not in ("cpu", "cuda"):
    raise RuntimeError(f"RADIXSERVE_TEST_DEVICE must be cpu or cuda, got {TEST_DEVICE!r}")
ON_GPU = TEST_DEVICE == "cuda"

if ON_GPU:  # torch only here: the cpu mode imports nothing before the modules set TRITON_INTERPRET, as before
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("RADIXSERVE_TEST_DEVICE=cuda but torch.cuda.is_available() is False")
    if os.environ.get("TRITON_INTERPRET", "").strip() not in ("", "0"):
        raise RuntimeError("RADIXSERVE_TEST_DEVICE=cuda tests the compiled kernels: unset TRITON_INTERPRET")


def assert_kernels_match_the_device(*kernels) -> None:
    """Interpreted on the CPU (a module that imported the kernels before TRITON_INTERPRET was set
    would have left GPU-only kernels), compiled on the GPU (a TRITON_INTERPRET that leaked in would
    have the interpreter run them on the GPU run)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for fn in kernels:
        if ON_GPU:
            assert isinstance(fn, JITFunction) and not isinstance(fn, InterpretedFunction), fn
        else:
            assert isinstance(fn, InterpretedFunction), fn
