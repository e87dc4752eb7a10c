"""Issue 43 item 1: /health_generate under load. The probe is a one-token request marked as a
health check; a busy scheduler does not queue it behind its work (here 32 long requests, two
running at a time) but answers from its loop after its next batch, so the probe passes while the
long requests still run. A stopped scheduler (SIGSTOP stands in for a hang) still fails it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import List, Tuple

import httpx
import pytest

from conftest import ServerProcess, wait_idle

NUM_LONG = 32
# Long enough that the first two requests are far from done when the probe is answered; a probe
# queued behind the 30 waiting ones would wait for ~15 of these runs (or time out: 503).
LONG = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def busy_server():
    srv = ServerProcess("--max-total-tokens", "6000", "--max-running-requests", "2", "--health-check-timeout", "3")
    yield srv
    srv.stop(signal.SIGKILL)


async def _probe_under_load(srv: ServerProcess) -> Tuple[httpx.Response, int, int]:
    """Start the long requests, wait until they fill the queue, probe; returns (the probe's
    response, long requests finished when it came, requests waiting in the queue just before)."""
    unlimited = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=srv.url, timeout=300, limits=unlimited) as c:
        tasks: List[asyncio.Future] = [
            asyncio.ensure_future(c.post("/generate", json={"input_ids": [100 + i, 7, 8, 9], "sampling_params": LONG}))
            for i in range(NUM_LONG)
        ]
        try:
            deadline = time.monotonic() + 60
            while True:
                info = (await c.get("/get_server_info")).json()
                if info["num_running_reqs"] >= 1 and info["num_queue_reqs"] >= NUM_LONG // 2:
                    break
                assert time.monotonic() < deadline, info["internal_states"]
                await asyncio.sleep(0.05)
            r = await c.get("/health_generate")
            finished = sum(t.done() for t in tasks)
            return r, finished, info["num_queue_reqs"]
        finally:
            await c.post("/abort_request", json={"abort_all": True})
            await asyncio.gather(*tasks, return_exceptions=True)


def test_idle_server_probe_is_a_real_generation(busy_server):
    with busy_server.client() as c:
        wait_idle(c)
        assert c.get("/health_generate").status_code == 200
        wait_idle(c)  # the probe left nothing behind


def test_probe_is_answered_while_long_requests_run(busy_server):
    r, finished, queued = asyncio.run(_probe_under_load(busy_server))
    assert r.status_code == 200, r.text
    # answered from the loop, not after its turn in the queue: no long request had finished
    assert finished == 0 and queued >= NUM_LONG // 2
    with busy_server.client() as c:
        wait_idle(c)  # the probe was not left in the scheduler (nothing pending, nothing queued)


def test_stopped_scheduler_fails_the_probe(busy_server):
    with busy_server.client() as c:
        pid = c.get("/get_server_info").json()["scheduler_pid"]
        wait_idle(c)
        os.kill(pid, signal.SIGSTOP)
        try:
            r = c.get("/health_generate", timeout=30)
            assert r.status_code == 503, r.text
        finally:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 20
        while c.get("/health_generate").status_code != 200:
            assert time.monotonic() < deadline, "the probe did not recover after SIGCONT"
            time.sleep(0.2)
        wait_idle(c)
