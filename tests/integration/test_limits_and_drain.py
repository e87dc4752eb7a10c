"""Limits, liveness and shutdown: --max-concurrent-requests, --max-sessions, --request-timeout,
--zmq-hwm, the scheduler heartbeat behind /health (--health-check-timeout), and the SIGTERM
drain (--graceful-shutdown-timeout)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from typing import List

import httpx
import pytest

from conftest import ServerProcess, assert_children_gone, stream_in_background, wait_idle
from radixserve.managers.scheduler_process import HEARTBEAT_INTERVAL_S

LONG = {"max_new_tokens": 3000, "ignore_eos": True}
# A request that runs far longer than any drain below (it never finishes within a test).
ENDLESS = {"max_new_tokens": 3900, "ignore_eos": True}


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
            r = c.post("/generate", json={"text": "slow", "sampling_params": LONG}, timeout=60)
            # answered while the scheduler is still stopped (SIGCONT comes after): the front end
            # enforced the timeout, and not before it ran out
            assert r.status_code == 504 and "--request-timeout" in r.json()["error"]["message"]
            assert time.monotonic() - start >= 3
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
    """A scheduler whose loop stops (SIGSTOP stands in for a hang) turns /health 503 once
    --health-check-timeout (2 s) has passed since its last heartbeat, long before the watchdog;
    it recovers. Not before: the last heartbeat came at most HEARTBEAT_INTERVAL_S before the stop
    (a lower bound a slow machine cannot break); the deadline is far below the default 20 s, so
    a server ignoring the flag fails."""
    with limited.client() as c:
        pid = c.get("/get_server_info").json()["scheduler_pid"]
        assert c.get("/health").status_code == 200
        os.kill(pid, signal.SIGSTOP)
        try:
            took = wait_for(lambda: c.get("/health").status_code == 503, 12, "/health to turn 503")
            assert took >= 2 - HEARTBEAT_INTERVAL_S
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
    """The request is aborted because its client left (counted as such), not finished; and soon:
    the scheduler runs fewer steps between the client leaving and the abort than during the 3 s
    the client waited (the disconnect check runs every 0.5 s). Steps, not seconds, so a slow
    machine slows both sides alike."""
    with drained.client() as c:
        def state() -> dict:
            return c.get("/get_server_info").json()

        before = state()
        aborts, steps_before = before["tokenizer_manager"]["num_disconnect_aborts"], before["internal_states"][0]["forward_ct"]
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(drained.url + "/generate", json={"text": "leaving", "sampling_params": LONG}, timeout=3)
        steps_left = state()["internal_states"][0]["forward_ct"]
        wait_for(lambda: state()["num_running_reqs"] == 0, 60, "the abort")
        after = state()
        assert after["tokenizer_manager"]["num_disconnect_aborts"] == aborts + 1
        assert after["internal_states"][0]["forward_ct"] - steps_left < steps_left - steps_before, (steps_before, steps_left, after)


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


def stream_until_closed(srv: ServerProcess, body: dict) -> "tuple":
    """stream_in_background, but a connection the server cuts is recorded in `errors` (not
    raised on the thread)."""
    events: List[str] = []
    errors: List[BaseException] = []

    def run() -> None:
        try:
            with httpx.Client(base_url=srv.url, timeout=120) as c:
                with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
        except httpx.HTTPError as e:
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, events, errors


def finished_events(events: List[str]) -> List[dict]:
    out = []
    for e in events:
        if e != "[DONE]":
            obj = json.loads(e)
            if (obj.get("meta_info") or {}).get("finish_reason") is not None:
                out.append(obj)
    return out


def test_drain_past_its_timeout_ends_the_requests_with_503_then_exits_0():
    """SIGTERM with --graceful-shutdown-timeout 1 and two requests far from done: the drain
    runs out, both requests end with a 503 that names the flag (a streamed error event and
    [DONE], a non-streamed 503 response), not a cut connection; then the server exits 0."""
    srv = ServerProcess("--max-total-tokens", "8000", "--graceful-shutdown-timeout", "1")
    try:
        t, events, errors = stream_until_closed(srv, {"text": "drain me", "sampling_params": ENDLESS})
        plain: list = []

        def post() -> None:
            try:
                plain.append(httpx.post(srv.url + "/generate", json={"text": "me too", "sampling_params": ENDLESS}, timeout=120))
            except httpx.HTTPError as e:
                plain.append(e)

        t2 = threading.Thread(target=post)
        t2.start()
        with srv.client() as c:
            wait_for(lambda: len(events) >= 2 and c.get("/get_server_info").json()["num_running_reqs"] == 2,
                     60, "both requests to run")
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(timeout=120)  # a deadline only: the drain lasts 1 s
        t.join(30)
        t2.join(30)
        log = srv.read_log()
        assert code == 0, log[-3000:]
        # in this order: the drain starts, runs out, the server stops
        start = log.index("SIGTERM: draining 2 request(s) in flight (up to 1s).")
        out = log.index("Graceful shutdown timeout: 2 request(s) still running are cut off.", start)
        assert log.index("Shut down (exit code 0).", out)
        assert "Traceback" not in log, log[-3000:]

        assert not errors, errors  # the stream was ended by the server, not cut
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and "--graceful-shutdown-timeout" in error["message"], error
        assert not finished_events(events)  # it was cut, it did not finish
        [r] = plain
        assert isinstance(r, httpx.Response), r
        assert r.status_code == 503 and "--graceful-shutdown-timeout" in r.json()["error"]["message"], r.text
    finally:
        if srv.proc.poll() is None:
            srv.stop(signal.SIGKILL)
    assert_children_gone(srv.children)


def test_second_sigterm_while_draining_stops_at_once():
    """A drain of up to 600 s with a request far from done: a second SIGTERM stops the server
    (exit 0) while the request still runs and before the drain ran out."""
    srv = ServerProcess("--max-total-tokens", "4000", "--graceful-shutdown-timeout", "600")
    try:
        t, events, errors = stream_until_closed(srv, {"text": "drain me", "sampling_params": ENDLESS})
        wait_for(lambda: len(events) >= 2, 60, "the stream to start")
        srv.proc.send_signal(signal.SIGTERM)
        with srv.client() as c:
            wait_for(lambda: c.get("/health").status_code == 503, 30, "the drain to start")
        assert "SIGTERM: draining 1 request(s) in flight (up to 600s)." in srv.read_log()
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(timeout=120)  # a deadline only, far below the 600 s drain
        t.join(30)
        log = srv.read_log()
        assert code == 0, log[-3000:]
        assert "Graceful shutdown timeout" not in log  # the drain did not run out: the signal stopped it
        assert "Shut down (exit code 0)." in log
        assert events and not finished_events(events)  # the request was still running
    finally:
        if srv.proc.poll() is None:
            srv.stop(signal.SIGKILL)
    assert_children_gone(srv.children)
