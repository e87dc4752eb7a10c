"""`--session-timeout` on a server: a session left unused longer than the timeout is closed (its
id is refused afterwards, with nothing else happening in between), while a session in use all
along outlives the timeout."""

from __future__ import annotations

import signal
import time

import pytest

from conftest import ServerProcess, assert_children_gone

TIMEOUT = 3.0  # --session-timeout, seconds


@pytest.fixture(scope="module")
def srv():
    server = ServerProcess("--max-total-tokens", "4000", "--session-timeout", str(TIMEOUT))
    yield server
    assert server.stop(signal.SIGTERM) == 0, server.read_log()[-3000:]
    assert_children_gone(server.children)


def turn(c, sid: str, text: str):
    body = {"text": text, "session_params": {"id": sid},
            "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}
    return c.post("/generate", json=body)


def open_sessions(c) -> int:
    return c.get("/get_server_info").json()["tokenizer_manager"]["num_open_sessions"]


def test_idle_session_is_closed_after_the_timeout_and_an_active_one_is_kept(srv):
    with srv.client() as c:
        idle = c.post("/open_session", json={}).json()
        active = c.post("/open_session", json={}).json()
        opened = time.monotonic()
        for sid in (idle, active):
            r = turn(c, sid, "first turn")
            assert r.status_code == 200, r.text
        idle_last_used = time.monotonic()  # the server saw its last use before this
        assert open_sessions(c) == 2

        # Turns of `active` back to back (each gap far below the timeout) until `idle` has been
        # unused for 1.5 timeouts. No /open_session in between: the timeout must act by itself.
        turns = 0
        while time.monotonic() - idle_last_used <= 1.5 * TIMEOUT:
            r = turn(c, active, f" turn {turns}")
            assert r.status_code == 200, (turns, r.text)
            turns += 1
        assert time.monotonic() - opened > TIMEOUT  # `active` is older than the timeout: use kept it

        r = turn(c, idle, "too late")
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == f"Session {idle!r} does not exist (open it with /open_session)."
        r = c.post("/close_session", json={"session_id": idle})
        assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"], r.text

        r = turn(c, active, " still here")
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["prompt_tokens"] > 2 * turns  # it continues the whole conversation
        assert open_sessions(c) == 1
        assert c.post("/close_session", json={"session_id": active}).status_code == 200
        assert open_sessions(c) == 0
