"""A second server beside the first (its own ipc sockets): API key, queue full -> 503, and a
killed scheduler takes the server down with a non-zero exit, leaving nothing behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from conftest import ServerProcess, assert_children_gone, stream_in_background

KEY = "test-secret"


@pytest.fixture(scope="module")
def small():
    srv = ServerProcess("--max-total-tokens", "2000", "--max-running-requests", "1", "--max-queued-requests", "1",
                        api_key=KEY)
    yield srv
    srv.stop(signal.SIGKILL)


def test_two_servers_side_by_side(server, small, http):
    assert server.ipc_dir != small.ipc_dir
    with small.client() as c:
        assert c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}).status_code == 200
    assert http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}).status_code == 200


def test_api_key(small):
    assert httpx.get(small.url + "/health").status_code == 200  # health needs no key
    for path in ("/get_model_info", "/v1/models", "/metrics", "/get_server_info"):
        r = httpx.get(small.url + path)
        assert r.status_code == 401, path
        assert "Unauthorized" in r.json()["error"]["message"]
    r = httpx.get(small.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = httpx.post(small.url + "/generate", json={"text": "x"})
    assert r.status_code == 401
    with small.client() as c:
        assert c.get("/v1/models").status_code == 200
    import openai

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=small.url + "/v1", api_key="wrong", max_retries=0).models.list()
    models = openai.OpenAI(base_url=small.url + "/v1", api_key=KEY, max_retries=0).models.list()
    assert len(models.data) == 1


def test_queue_full_is_503(small):
    async def run() -> list:
        async with httpx.AsyncClient(base_url=small.url, headers=small.headers, timeout=120) as c:
            body = {"text": "queue", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
            return await asyncio.gather(*[c.post("/generate", json=body) for _ in range(4)])

    codes = [r.status_code for r in asyncio.run(run())]
    assert 503 in codes and 200 in codes, codes
    r = [r for r in asyncio.run(run()) if r.status_code == 503][0]
    assert r.json()["error"]["message"] == "The request queue is full."


def test_killed_scheduler_takes_server_down(small):
    with small.client() as c:
        pid = c.get("/get_server_info").json()["scheduler_pid"]
    assert pid in small.children
    # a stream in flight ends with an error event, then [DONE]
    t, events = stream_in_background(small, {"text": "doomed", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}, 60)
    deadline = time.monotonic() + 20
    while len(events) < 2:
        assert time.monotonic() < deadline and t.is_alive()
        time.sleep(0.05)
    start = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    code = small.proc.wait(timeout=20)
    t.join(10)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "died unexpectedly" in error["message"] and error["code"] == 500
    assert code != 0
    assert time.monotonic() - start < 15
    assert "scheduler process" in small.read_log() and "died unexpectedly" in small.read_log()
    assert_children_gone(small.children)
    assert not os.path.exists(small.ipc_dir)
