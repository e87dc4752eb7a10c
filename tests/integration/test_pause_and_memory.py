"""The memory, pause and profiling routes on real servers (SGLang's routes, fields and replies):
/release_memory_occupation and /resume_memory_occupation (503 while released, outputs equal
after), /pause_generation in each mode with /continue_generation (new requests held, every
request answered), /start_profile and /stop_profile (a trace Perfetto opens), /get_load and the
/server_info fields, bad input answered 4xx; and the same control messages through a
--tp-size 2 --dp-size 2 server (rank 0 broadcasts them, the controller fans them out)."""

from __future__ import annotations

import gzip
import json
import random
import signal
import threading
import time
from pathlib import Path
from typing import Dict, List

import httpx
import pytest

from conftest import ServerProcess, assert_children_gone, greedy, server_state, stream_in_background, wait_idle

WAIT_S = 120  # upper bound on waiting for something the server does by itself
LONG = 150  # tokens: requests still running when the pause comes


@pytest.fixture(scope="module")
def srv():
    server = ServerProcess("--max-total-tokens", "3000", "--dtype", "float32", "--max-running-requests", "16")
    yield server
    assert server.stop() == 0, server.read_log()[-3000:]
    assert_children_gone(server.children)


@pytest.fixture(scope="module")
def c(srv):
    with srv.client() as client:
        yield client


def _prompt(seed: int, n: int = 30) -> List[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 8192) for _ in range(n)]


def _generate(c: httpx.Client, ids: List[int], max_new_tokens: int = 8) -> httpx.Response:
    return c.post("/generate", json={"input_ids": ids, "sampling_params": greedy(max_new_tokens, ignore_eos=True)})


def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _in_background(srv: ServerProcess, ids: List[int], max_new_tokens: int) -> Dict:
    """A non-streaming /generate on a thread; the dict gets its "response" when it ends."""
    out: Dict = {}

    def run() -> None:
        with srv.client() as client:
            out["response"] = _generate(client, ids, max_new_tokens)

    out["thread"] = threading.Thread(target=run)
    out["thread"].start()
    return out


def test_release_and_resume(c):
    ids = _prompt(1)
    before = _generate(c, ids).json()
    r = c.post("/release_memory_occupation", json={})
    assert r.status_code == 200 and r.json() is None, r.text  # SGLang's reply
    assert server_state(c)["released_memory_tags"] == ["kv_cache", "weights", "cuda_graph"]
    r = _generate(c, ids)
    assert r.status_code == 503 and "resume_memory_occupation" in r.json()["error"]["message"]
    r = c.post("/release_memory_occupation", json={"tags": ["weights"]})
    assert r.status_code == 400 and "Already released" in r.json()["error"]["message"]
    assert c.post("/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]}).status_code == 200
    assert _generate(c, ids).status_code == 503  # the weights are still away
    assert c.post("/resume_memory_occupation").status_code == 200  # no body: all that is released
    after = _generate(c, ids).json()
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["cached_tokens"] == 0  # the radix cache went with the pool
    assert server_state(c)["released_memory_tags"] == []


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_holds_new_requests_and_continue_resumes_them(srv, c, mode):
    long_ids, late_ids = _prompt(2), _prompt(3)
    ref_long = _generate(c, long_ids, LONG).json()["output_ids"]
    ref_late = _generate(c, late_ids, 8).json()["output_ids"]
    body = {"input_ids": long_ids, "sampling_params": greedy(LONG, ignore_eos=True)}
    thread, events = stream_in_background(srv, body)
    _until(lambda: len(events) >= 3, "the stream to start")
    r = c.post("/pause_generation", json={"mode": mode})
    assert r.status_code == 200 and r.json() == {"message": "Generation paused successfully.", "status": "ok"}
    late = _in_background(srv, late_ids, 8)
    _until(lambda: server_state(c)["internal_states"][0]["num_held_reqs"] == 1, "the new request to be held")
    info = server_state(c)
    assert info["paused"] is True and info["internal_states"][0]["pause_mode"] == mode
    seen = len(events)
    time.sleep(0.5)
    assert len(events) == seen and "response" not in late  # nothing runs while paused
    r = c.post("/continue_generation")
    assert r.status_code == 200 and r.json() == {"message": "Generation continued successfully.", "status": "ok"}
    thread.join(WAIT_S)
    late["thread"].join(WAIT_S)
    assert events[-1] == "[DONE]"
    final = json.loads(events[-2])
    assert final["output_ids"] == ref_long and final["meta_info"]["finish_reason"]["type"] == "length"
    assert late["response"].status_code == 200 and late["response"].json()["output_ids"] == ref_late
    assert server_state(c)["paused"] is False
    wait_idle(c)


def test_pause_abort_answers_every_request(srv, c):
    running = [_in_background(srv, _prompt(10 + i), 2 * LONG) for i in range(3)]
    _until(lambda: server_state(c)["num_running_reqs"] == 3, "three running requests")
    assert c.post("/pause_generation", json={"mode": "abort"}).status_code == 200
    for job in running:  # answered at once, with the abort as the finish reason
        job["thread"].join(WAIT_S)
        out = job["response"].json()
        assert job["response"].status_code == 200 and out["meta_info"]["finish_reason"]["type"] == "abort", out
    late = _in_background(srv, _prompt(20), 4)
    _until(lambda: server_state(c)["internal_states"][0]["num_held_reqs"] == 1, "the new request to be held")
    assert c.post("/continue_generation").status_code == 200
    late["thread"].join(WAIT_S)
    assert late["response"].json()["meta_info"]["finish_reason"]["type"] == "length"
    wait_idle(c)


def test_profile_writes_a_trace(c, tmp_path):
    r = c.post("/start_profile", json={"output_dir": str(tmp_path), "num_steps": 3, "activities": ["CPU"]})
    assert r.status_code == 200 and r.text == "Start profiling.\n"
    assert _generate(c, _prompt(4), 8).status_code == 200  # 8 forwards: the profile stops after 3
    _until(lambda: list(tmp_path.glob("*-TP-0.trace.json.gz")), "the trace file")
    (trace,) = tmp_path.glob("*-TP-0.trace.json.gz")
    _until(lambda: _readable(trace), "the trace to be complete")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert any(str(e.get("name", "")).startswith("aten::") for e in events)
    r = c.post("/stop_profile")  # it stopped by itself
    assert r.status_code == 400 and "not in progress" in r.json()["error"]["message"]
    assert c.post("/start_profile", json={"output_dir": str(tmp_path / "b")}).status_code == 200
    r = c.post("/stop_profile")
    assert r.status_code == 200 and r.text == "Stop profiling. This will take some time.\n"
    assert list((tmp_path / "b").glob("*.trace.json.gz"))


def _readable(path: Path) -> bool:
    try:
        json.loads(gzip.decompress(path.read_bytes()))
        return True
    except (EOFError, OSError, ValueError):
        return False


@pytest.mark.parametrize("route, body, message", [
    ("/pause_generation", {"mode": "sleep"}, "Unknown pause mode 'sleep'"),
    ("/release_memory_occupation", {"tags": ["kv_cache", "vram"]}, "Unknown memory tag"),
    ("/release_memory_occupation", {"tags": "kv_cache"}, "tags"),
    ("/resume_memory_occupation", {}, "Nothing to resume"),
    ("/resume_memory_occupation", {"tags": ["weights"]}, "not released"),
    ("/stop_profile", None, "Profiling is not in progress. Call /start_profile first."),
    ("/start_profile", {"activities": ["TPU"]}, "Unknown profiler activities"),
    ("/start_profile", {"num_steps": -1}, "num_steps must be a positive integer"),
])
def test_bad_input_gets_a_4xx_and_changes_nothing(c, route, body, message):
    r = c.post(route, json=body) if body is not None else c.post(route)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    info = server_state(c)
    assert info["paused"] is False and info["released_memory_tags"] == []
    assert _generate(c, _prompt(5), 2).status_code == 200


def test_get_load_reports_sglangs_fields(srv, c):
    """num_tokens is the KV the requests hold (what sglang-router balances on): the pool less its
    free slots and the radix cache's evictable prefixes. Idle, it is 0 however full the cache is;
    while a request runs, its prompt and the tokens generated so far."""
    ids = _prompt(6)
    assert _generate(c, ids).status_code == 200  # its prompt stays in the radix cache
    idle = wait_idle(c)["internal_states"][0]
    assert idle["evictable_tokens"] >= len(ids)  # a cache the load must not count
    assert c.get("/get_load").json() == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    busy_ids = _prompt(7)
    job = _in_background(srv, busy_ids, 2 * LONG)
    _until(lambda: server_state(c)["num_running_reqs"] == 1, "the request to run")
    load = c.get("/get_load").json()
    job["thread"].join(WAIT_S)
    assert job["response"].status_code == 200
    assert [(x["dp_rank"], x["num_reqs"], x["num_waiting_reqs"]) for x in load] == [(0, 1, 0)], load
    assert len(busy_ids) <= load[0]["num_tokens"] <= len(busy_ids) + 2 * LONG, load
    wait_idle(c)


def test_tp2_dp2_server_runs_the_control_messages_on_every_rank(c, tmp_path):
    prompts = [_prompt(30 + i) for i in range(4)]
    ref = [_generate(c, p, LONG).json()["output_ids"] for p in prompts]
    srv = ServerProcess("--tp-size", "2", "--dp-size", "2", "--max-total-tokens", "2000", "--dtype", "float32",
                        "--max-running-requests", "8")
    try:
        with srv.client() as c2:
            jobs = [_in_background(srv, p, LONG) for p in prompts]
            _until(lambda: server_state(c2)["num_running_reqs"] > 0, "requests to run")
            assert c2.post("/pause_generation", json={"mode": "retract"}).status_code == 200
            assert c2.post("/release_memory_occupation", json={"tags": ["kv_cache", "weights"]}).status_code == 200
            info = server_state(c2)
            assert info["paused"] and all(s["released_memory_tags"] == ["kv_cache", "weights"] for s in info["internal_states"])
            assert c2.post("/resume_memory_occupation").status_code == 200
            assert c2.post("/start_profile", json={"output_dir": str(tmp_path), "activities": ["CPU"]}).status_code == 200
            assert c2.post("/continue_generation").status_code == 200
            for job in jobs:
                job["thread"].join(WAIT_S)
            assert [j["response"].json()["output_ids"] for j in jobs] == ref
            assert c2.post("/stop_profile").status_code == 200
            names = sorted(p.name.split("-TP-")[1] for p in tmp_path.glob("*.trace.json.gz"))
            assert names == ["0-DP-0.trace.json.gz", "0-DP-1.trace.json.gz", "1-DP-0.trace.json.gz", "1-DP-1.trace.json.gz"]
            assert c2.post("/resume_memory_occupation").status_code == 400  # nothing released
    finally:
        assert srv.stop(signal.SIGTERM) == 0, srv.read_log()[-3000:]
    assert_children_gone(srv.children)
