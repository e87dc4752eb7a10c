"""Limits, liveness and shutdown: --max-concurrent-requests, --max-sessions, --request-timeout,
--zmq-hwm, the scheduler heartbeat behind /health (--health-check-timeout), and the SIGTERM
drain (--graceful-shutdown-timeout)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import List

import httpx
import pytest

from conftest import ServerProcess, assert_children_gone, stream_in_background, wait_idle

LONG = {"max_new_tokens": 3000, "ignore_eos": True}


def wait_for(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.fixture(scope="module")
def limited():
    srv = ServerProcess("--max-total-tokens", "4000", "--max-concurrent-requests", "3", "--max-sessions", "2",
                        "--request-timeout", "3", "--health-check-timeout", "2")
    yield srv
    srv.stop(signal.SIGKILL)


def test_max_concurrent_requests_is_503(limited):
    async def run() -> List[httpx.Response]:
        async with httpx.AsyncClient(base_url=limited.url, timeout=60) as c:
            body = {"text": "busy", "sampling_params": LONG}
            return await asyncio.gather(*[c.post("/generate", json=body) for _ in range(5)])

    responses = asyncio.run(run())
    refused = [r for r in responses if r.status_code == 503]
    assert len(refused) >= 2, [r.status_code for r in responses]
    assert "--max-concurrent-requests 3" in refused[0].json()["error"]["message"]
    assert {r.status_code for r in responses} <= {200, 503, 504}  # the others ran (or hit --request-timeout)
    with limited.client() as c:
        wait_idle(c)


def test_request_timeout_aborts_with_504_and_frees_the_request(limited):
    """The scheduler is stopped (SIGSTOP), so the request cannot finish: after 3 s it is
    answered 504 and aborted; once the scheduler runs again nothing of it is left."""
    with limited.client() as c:
        pid = c.get("/get_server_info").json()["scheduler_pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            r = c.post("/generate", json={"text": "slow", "sampling_params": LONG})
            assert r.status_code == 504 and "--request-timeout" in r.json()["error"]["message"]
            assert time.monotonic() - start < 10
        finally:
            os.kill(pid, signal.SIGCONT)
        info = wait_idle(c)
        assert info["internal_states"][0]["protected_tokens"] == 0


def test_max_sessions_is_503(limited):
    with limited.client() as c:
        sids = [c.post("/open_session", json={}).json() for _ in range(2)]
        r = c.post("/open_session", json={})
        assert r.status_code == 503 and "--max-sessions 2" in r.json()["error"]["message"]
        for sid in sids:
            assert c.post("/close_session", json={"session_id": sid}).status_code == 200
        assert c.post("/open_session", json={}).status_code == 200


def test_health_follows_the_scheduler_heartbeat(limited):
    """A scheduler whose loop stops (SIGSTOP stands in for a hang) turns /health 503 within
    --health-check-timeout (2 s) plus a heartbeat, long before the watchdog; it recovers."""
    with limited.client() as c:
        pid = c.get("/get_server_info").json()["scheduler_pid"]
        assert c.get("/health").status_code == 200
        os.kill(pid, signal.SIGSTOP)
        try:
            took = wait_for(lambda: c.get("/health").status_code == 503, 10, "/health to turn 503")
            assert took < 6
            assert "has not reported" in c.get("/health").json()["error"]["message"]
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: c.get("/health").status_code == 200, 10, "/health to recover")
        r = c.post("/generate", json={"text": "after", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200


@pytest.fixture(scope="module")
def drained():
    srv = ServerProcess("--max-total-tokens", "4000", "--zmq-hwm", "1", "--graceful-shutdown-timeout", "60")
    yield srv
    if srv.proc.poll() is None:
        srv.stop(signal.SIGKILL)


def test_full_scheduler_queue_is_503_not_a_blocked_server(drained):
    """With the scheduler stopped, requests pile up in front of it: past --zmq-hwm (and the
    socket's own buffer) new requests get 503 at once; /health-free routes keep answering."""
    with drained.client() as c:
        pid = c.get("/get_server_info").json()["scheduler_pid"]
    big = {"input_ids": [7] * 3000, "sampling_params": {"max_new_tokens": 1}}

    async def run() -> List[int]:
        unlimited = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=drained.url, timeout=120, limits=unlimited) as c, \
                httpx.AsyncClient(base_url=drained.url, timeout=10) as probe:
            tasks, codes = [], []
            for _ in range(400):
                tasks.append(asyncio.ensure_future(c.post("/generate", json=big)))
                await asyncio.sleep(0.01)
                if any(t.done() and t.result().status_code == 503 for t in tasks):
                    break
            done_503 = [t for t in tasks if t.done() and t.result().status_code == 503]
            assert done_503, f"no 503 after {len(tasks)} requests although the scheduler is stopped"
            assert "overloaded" in done_503[0].result().json()["error"]["message"]
            assert (await probe.get("/get_model_info")).status_code == 200  # the event loop is free
            os.kill(pid, signal.SIGCONT)
            for t in tasks:
                codes.append((await t).status_code)
            return codes

    os.kill(pid, signal.SIGSTOP)
    try:
        codes = asyncio.run(run())
    finally:
        os.kill(pid, signal.SIGCONT)
    assert set(codes) <= {200, 503} and 200 in codes
    with drained.client() as c:
        wait_idle(c, timeout=120)


def test_non_streaming_client_that_leaves_is_aborted_within_a_second(drained):
    with drained.client() as c:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(drained.url + "/generate", json={"text": "leaving", "sampling_params": LONG}, timeout=1.5)
        left = time.monotonic()
        wait_for(lambda: c.get("/get_server_info").json()["num_running_reqs"] == 0, 10, "the abort")
        assert time.monotonic() - left < 2.5  # the disconnect check runs every 0.5 s
        assert c.get("/get_server_info").json()["tokenizer_manager"]["num_disconnect_aborts"] >= 1


def test_sigterm_drains_then_exits_0(drained):
    t, events = stream_in_background(drained, {"text": "drain me", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}})
    wait_for(lambda: len(events) >= 2, 30, "the stream to start")
    drained.proc.send_signal(signal.SIGTERM)
    with drained.client() as c:
        wait_for(lambda: c.get("/health").status_code == 503, 5, "/health to turn 503")
        r = c.post("/generate", json={"text": "late", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    t.join(120)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 200}  # finished, not cut
    assert drained.proc.wait(timeout=30) == 0
    assert_children_gone(drained.children)
