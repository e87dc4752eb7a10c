"""The warm-up request (entrypoints/warmup.py, SGLang's _wait_and_warmup): a server sends itself a
short /generate once it listens, and reports healthy only after it is answered; with
--skip-server-warmup it sends none."""

from __future__ import annotations

from conftest import ServerProcess

from radixserve.bench.serving import parse_prometheus

READY = "The server is fired up and ready to roll!"


def test_the_warmup_request_runs_before_the_server_reports_ready(server):
    """The scheduler ran the warm-up's prefill before the server said it was ready (and before
    /health turned 200, which the fixture waited for)."""
    log = server.read_log()
    warmed = log.index("Warm-up request (/generate) answered in")
    assert log.index("Prefill batch.") < warmed < log.index(READY)


def test_skip_server_warmup_sends_no_request():
    srv = ServerProcess("--skip-server-warmup", "--max-total-tokens", "2000")
    try:
        with srv.client() as c:
            # healthy with nothing run: no request counted, no batch scheduled
            assert parse_prometheus(c.get("/metrics").text)["radixserve:num_requests_total"] == 0
            log = srv.read_log()
            assert "No warm-up request (--skip-server-warmup)." in log and READY in log
            assert "Warm-up request (" not in log and "Prefill batch." not in log
            r = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
            assert r.status_code == 200
            assert parse_prometheus(c.get("/metrics").text)["radixserve:num_requests_total"] == 1
    finally:
        assert srv.stop() == 0
