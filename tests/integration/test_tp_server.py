"""`--tp-size 2`: two scheduler ranks (gloo on CPU) behind one server; rank 0 owns the sockets.
Greedy outputs equal the tp=1 server's."""

from __future__ import annotations

import signal

from conftest import ServerProcess, assert_children_gone


def test_tp2_server_matches_tp1(http):
    srv = ServerProcess("--tp-size", "2", "--max-total-tokens", "2000")
    try:
        assert len(srv.children) >= 3  # two scheduler ranks and the detokenizer
        body = {"text": "Tensor parallel serving", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        with srv.client() as c:
            got = c.post("/generate", json=body).json()
            with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
                assert r.status_code == 200 and list(r.iter_lines())[-2] == "data: [DONE]"
        ref = http.post("/generate", json=body).json()
        assert got["output_ids"] == ref["output_ids"]
        assert "scheduler TP1" in srv.read_log()
    finally:
        assert srv.stop(signal.SIGTERM) == 0
    assert_children_gone(srv.children)
