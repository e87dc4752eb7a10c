"""Runs after the other modules (marked after_all; conftest.py orders it): nothing leaked, the
server still healthy, the cache flushable."""

from __future__ import annotations

import pytest
from conftest import MAX_TOTAL_TOKENS, server_state, wait_idle


@pytest.mark.after_all
def test_health_and_flush_after_everything(http):
    assert http.get("/health").status_code == 200
    wait_idle(http)
    r = http.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"] is True
    st = server_state(http)
    assert st["token_usage"] == 0
    state = st["internal_states"][0]
    assert state["available_tokens"] == MAX_TOTAL_TOKENS
    assert state["evictable_tokens"] == 0 and state["protected_tokens"] == 0
    assert st["tokenizer_manager"]["num_pending_reqs"] == 0
