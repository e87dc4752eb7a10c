import os

import pytest

# TRITON_INTERPRET as pytest was started with it. The Triton test modules set it to 1 when they
# are imported (triton.jit picks the interpreter when a kernel is defined, at import), except with
# RADIXSERVE_TEST_DEVICE=cuda (tests/unit/devices.py); it is put back once collection ends, so the
# servers and engines of every other test (integration tests included: they run after this
# collection) get compiled kernels on a GPU. Those modules turn it on again around their own tests
# (triton_interpreter: triton reads it at each launch too).
_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET")


def _restore_triton_interpret() -> None:
    if _TRITON_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _TRITON_INTERPRET


def pytest_collection_finish(session):
    _restore_triton_interpret()


@pytest.fixture(scope="module")
def triton_interpreter():
    """Triton's CPU interpreter for one test module (pytestmark = usefixtures("triton_interpreter")).
    Nothing with RADIXSERVE_TEST_DEVICE=cuda: the compiled kernels run there (tests/unit/devices.py)."""
    from devices import ON_GPU  # here, not at the top: the check that a GPU is there fails only those modules

    if ON_GPU:
        yield
        return
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    _restore_triton_interpret()


@pytest.fixture(params=["overlap", "normal"])
def loop(request):
    """Run a scheduler test under both event loops (forced either way: the default depends on the device)."""
    return {"disable_overlap_schedule": request.param != "overlap"}
