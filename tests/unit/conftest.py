import pytest


@pytest.fixture(params=["overlap", "normal"])
def loop(request):
    """Run a scheduler test under both event loops (overlap is the default)."""
    return {} if request.param == "overlap" else {"disable_overlap_schedule": True}
