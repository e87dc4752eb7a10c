import pytest


@pytest.fixture(params=["overlap", "normal"])
def loop(request):
    """Run a scheduler test under both event loops (forced either way: the default depends on the device)."""
    return {"disable_overlap_schedule": request.param != "overlap"}
