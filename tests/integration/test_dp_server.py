"""`--dp-size 2`: a DataParallelController routes requests to two replicas. Outputs equal the
dp=1 server's, both replicas serve (from /get_server_info), and killing a TP rank of a
`--tp-size 2` server takes the whole server down."""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import REPO, ServerProcess, assert_children_gone, free_port


def _prompts(n: int):
    rng = random.Random(5)
    shared = [rng.randrange(3, 8192) for _ in range(40)]
    return [shared + [rng.randrange(3, 8192) for _ in range(rng.randint(1, 30))] for _ in range(n)]


@pytest.mark.parametrize("method", ["round_robin", "shortest_queue"])
def test_dp2_serves_64_concurrent_requests_like_dp1(http, method):
    prompts = _prompts(64)
    body = lambda ids: {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    srv = ServerProcess("--dp-size", "2", "--load-balance-method", method, "--max-total-tokens", "3000")
    try:
        assert "dp controller" in srv.read_log() or len(srv.children) >= 4
        with srv.client() as c, ThreadPoolExecutor(16) as pool:
            got = list(pool.map(lambda ids: c.post("/generate", json=body(ids)).json(), prompts))
            info = c.get("/get_server_info").json()
            dash = c.get("/dashboard/state").json()
        # the live view: one panel's data per replica, each from that replica's own scheduler
        assert dash["dp_size"] == 2 and len(dash["replicas"]) == 2
        for replica, state in zip(dash["replicas"], info["internal_states"]):
            d = replica["dashboard"]
            assert d["kv"]["total"] == state["max_total_num_tokens"] and d["tree"]["cached_tokens"] > 0
            assert {b["kind"] for b in d["recent_batches"]} >= {"prefill", "decode"}
            assert replica["prompt_tokens"] == state["prompt_tokens"]
        ref = [http.post("/generate", json=body(ids)).json() for ids in prompts]
        assert [g["output_ids"] for g in got] == [r["output_ids"] for r in ref]
        states = info["internal_states"]  # one per replica: both served
        assert len(states) == 2 and all(s["prompt_tokens"] > 0 for s in states), info
        with srv.client() as c:
            assert c.post("/flush_cache").status_code == 200
            # issue 43: a run-time setting reaches every replica; the health probe crosses the controller
            r = c.post("/set_internal_state", json={"server_args": {"max_running_requests": 6}})
            assert r.status_code == 200, r.text
            assert [s["max_running_requests"] for s in c.get("/get_server_info").json()["internal_states"]] == [6, 6]
            assert c.get("/health_generate").status_code == 200
    finally:
        assert srv.stop(signal.SIGTERM) == 0
    assert_children_gone(srv.children)


def test_killing_a_tp_rank_takes_the_server_down():
    srv = ServerProcess("--tp-size", "2", "--max-total-tokens", "2000")
    try:
        children = srv.children
        target = srv.tp_rank_pid(1)  # a rank other than the one that talks to the server
        with srv.client() as c:
            assert target != c.get("/get_server_info").json()["scheduler_pid"]
        os.kill(target, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while srv.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        log = srv.read_log()
        assert srv.proc.returncode == 1, log
        assert f"The scheduler_tp1 process (pid {target}) died unexpectedly (killed by signal 9)" in log, log
    finally:
        srv.stop(signal.SIGKILL)
    assert_children_gone(children)



def test_tp_across_two_nodes(http):
    """--nnodes 2: node 1 runs TP rank 1 only; node 0 serves. Both "nodes" run on this machine."""
    import subprocess
    import sys

    addr = f"127.0.0.1:{free_port()}"
    common = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr, "--max-total-tokens", "2000"]
    follower = subprocess.Popen(
        [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(free_port()), "--node-rank", "1", *common],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    srv = None
    try:
        srv = ServerProcess("--node-rank", "0", *common)
        body = {"text": "Across two nodes", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        with srv.client() as c:
            got = c.post("/generate", json=body).json()
        assert got["output_ids"] == http.post("/generate", json=body).json()["output_ids"]
    finally:
        if srv is not None:
            srv.stop(signal.SIGTERM)
        follower.send_signal(signal.SIGTERM)
        assert follower.wait(30) in (0, 1, -signal.SIGTERM)  # it stops, whichever went first
