"""PD disaggregation (seed 001 §8) on one machine: prefill servers and decode servers behind
SGLang's own router (`sglang-router`, PyPI), with both KV transfer backends.

- Through the router, greedy outputs equal a unified server's, for concurrent requests with
  shared prefixes, streaming and not, on /generate, /v1/completions and /v1/chat/completions.
- Every PD server runs with --test-check-memory (each KV page free, cached or held by a live
  request, after every scheduler step; a violation ends the server, and its exit code is
  checked at the end), and every slot is free once the cache is flushed.
- Aborts in each queue, a transfer that never comes (timeout), and a prefill server killed
  mid-run end their requests with an error and free their slots; the servers keep serving.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import httpx
import pytest

from conftest import REPO, ServerProcess, free_port, greedy, stream_in_background
from radixserve.cli import main

MAX_TOTAL_TOKENS = 4000
COMMON = ("--max-total-tokens", str(MAX_TOTAL_TOKENS), "--log-level", "warning")
PREFIX = "Disaggregated serving moves the KV cache from one server to another. " * 3
PROMPTS = [PREFIX + f"Question {i}: what happens to request number {i}?" for i in range(10)] + [
    "A short one.", PREFIX * 4 + "A long one, prefilled in chunks on the prefill server.",
]


def require(module: str, hint: str) -> None:
    try:
        __import__(module)
    except ImportError as e:
        pytest.fail(f"PD tests need {module}: {hint} ({e})", pytrace=False)


class RouterProcess:
    """`python -m sglang_router.launch_router --pd-disaggregation ...` (or regular mode)."""

    def __init__(self, args: List[str]):
        require("sglang_router", "pip install sglang-router==0.3.2 setproctitle aiohttp (scripts/install.sh --test does)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers: Dict[str, str] = {}
        cmd = [sys.executable, "-m", "sglang_router.launch_router", *args, "--host", "127.0.0.1",
               "--port", str(self.port), "--prometheus-port", str(free_port()), "--log-level", "warn"]
        self.log = open(f"/tmp/radixserve-test-router-{self.port}.log", "w+")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, body: dict, timeout: float = 90) -> None:
        """Until a request goes through (the router registers its workers in the background)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.read_log()
            try:
                if httpx.post(self.url + "/generate", json=body, timeout=10).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"router not ready:\n{self.read_log()}")

    def read_log(self) -> str:
        self.log.flush()
        return open(self.log.name).read()[-4000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@dataclass
class PDCluster:
    backend: str
    prefills: List[Tuple[ServerProcess, int]] = field(default_factory=list)  # (server, bootstrap port)
    decodes: List[ServerProcess] = field(default_factory=list)
    router: Optional[RouterProcess] = None

    def servers(self) -> List[ServerProcess]:
        return [p for p, _ in self.prefills] + self.decodes


def start_cluster(backend: str, n_prefill: int, decode_args: List[Tuple[str, ...]], router: bool = True) -> PDCluster:
    if backend == "mooncake":
        require("mooncake.engine", "pip install mooncake-transfer-engine-non-cuda, and on Debian "
                "apt-get install libibverbs1 librdmacm1 libnuma1 (scripts/install.sh --test does)")
    c = PDCluster(backend)
    common = (*COMMON, "--disaggregation-transfer-backend", backend, "--test-check-memory")
    for _ in range(n_prefill):
        port = free_port()
        c.prefills.append((ServerProcess(*common, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                                         str(port), "--chunked-prefill-size", "64", wait=False), port))
    for extra in decode_args:
        c.decodes.append(ServerProcess(*common, "--disaggregation-mode", "decode", *extra, wait=False))
    for srv in c.servers():
        srv.wait_healthy()
    if router:
        args = ["--pd-disaggregation"]
        for srv, port in c.prefills:
            args += ["--prefill", srv.url, str(port)]
        for srv in c.decodes:
            args += ["--decode", srv.url]
        c.router = RouterProcess(args)
        c.router.wait_ready({"text": "warm up", "sampling_params": greedy(2)})
    return c


def stop_cluster(c: PDCluster) -> None:
    if c.router is not None:
        c.router.stop()
    codes = {srv.url: srv.stop() for srv in c.servers()}
    # 0: a clean SIGTERM exit; a failed --test-check-memory would have ended a scheduler before
    assert all(code == 0 for code in codes.values()), (codes, [s.read_log()[-3000:] for s in c.servers()])


@pytest.fixture(scope="module")
def unified():
    srv = ServerProcess(*COMMON)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def pd_fake():
    # Two prefill and two decode servers. The second decode server retracts a request every 3
    # decode steps (a transferred request is then re-run locally) and gives up on a transfer
    # after 8 s.
    c = start_cluster("fake", 2, [(), ("--test-retract-interval", "3", "--disaggregation-timeout", "8")])
    yield c
    stop_cluster(c)


@pytest.fixture(scope="module")
def pd_mooncake():
    c = start_cluster("mooncake", 1, [("--page-size", "4",)])  # pages differ from the prefill side's
    yield c
    stop_cluster(c)


@pytest.fixture(params=["fake", "mooncake"])
def pd(request) -> PDCluster:
    return request.getfixturevalue(f"pd_{request.param}")


def generate(url: str, text, max_new_tokens: int = 16, **kw) -> httpx.Response:
    body = {"text": text, "sampling_params": greedy(max_new_tokens, ignore_eos=True), **kw}
    return httpx.post(url + "/generate", json=body, timeout=120)


def concurrently(fn, items) -> list:
    with ThreadPoolExecutor(len(items)) as ex:
        return list(ex.map(fn, items))


def streamed(srv_url: str, body: dict) -> List[dict]:
    events = []
    with httpx.stream("POST", srv_url + "/generate", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


# ---- outputs ------------------------------------------------------------------------------------
def test_generate_through_the_router_equals_the_unified_server(pd, unified):
    ref = concurrently(lambda p: generate(unified.url, p).json()["output_ids"], PROMPTS)
    for attempt in range(2):  # the second time, the prefill servers' radix caches hold the prefixes
        got = concurrently(lambda p: generate(pd.router.url, p), PROMPTS)
        assert all(r.status_code == 200 for r in got), [r.text for r in got if r.status_code != 200]
        assert [r.json()["output_ids"] for r in got] == ref
    assert any(r.json()["meta_info"]["cached_tokens"] > 0 for r in got)  # reported from the prefill side
    if pd.backend == "fake":  # transferred requests were retracted, then re-run by the decode server itself
        assert pd_state(pd.decodes[1])["num_retracted_reqs"] > 0


def test_streaming_through_the_router_equals_the_unified_server(pd, unified):
    prompts = PROMPTS[:4]
    ref = [generate(unified.url, p).json()["output_ids"] for p in prompts]
    outs = concurrently(lambda p: streamed(pd.router.url, {"text": p, "sampling_params": greedy(16, ignore_eos=True)}), prompts)
    for events, want in zip(outs, ref):
        assert len(events) > 1 and events[-1]["output_ids"] == want
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def close_logprobs(got: list, want: list) -> bool:
    return [t for _, t, _ in got] == [t for _, t, _ in want] and all(
        (a is None and b is None) or abs(a - b) < 1e-4 for (a, _, _), (b, _, _) in zip(got, want))


def test_batch_and_logprobs_through_the_router(pd, unified):
    ids = [[5, 6, 7, 8, 9], [5, 6, 7, 10, 11, 12]]
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "sampling_params": greedy(6)}
    want = httpx.post(unified.url + "/generate", json=body, timeout=60).json()
    got = httpx.post(pd.router.url + "/generate", json=body, timeout=60).json()
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    for g, w in zip(got, want):
        assert close_logprobs(g["meta_info"]["output_token_logprobs"], w["meta_info"]["output_token_logprobs"])
    # One prompt: the router puts the prefill server's input logprobs in front of the decode
    # server's (empty) list (sglang-router 0.3.2 does not merge them for a batch).
    body["input_ids"] = ids[1]
    want = httpx.post(unified.url + "/generate", json=body, timeout=60).json()["meta_info"]
    got = httpx.post(pd.router.url + "/generate", json=body, timeout=60).json()["meta_info"]
    for key in ("output_token_logprobs", "input_token_logprobs"):
        assert close_logprobs(got[key], want[key]), key


def test_openai_routes_through_the_router(pd, unified):
    model = httpx.get(pd.router.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    assert model == httpx.get(unified.url + "/v1/models").json()["data"][0]["id"]  # not "unknown"
    chat = {"model": model, "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 12, "temperature": 0}
    comp = {"model": model, "prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0}
    for route, body, text_of in (("/v1/chat/completions", chat, lambda c: c["message"]["content"]),
                                 ("/v1/completions", comp, lambda c: c["text"])):
        want = httpx.post(unified.url + route, json=body, timeout=60).json()
        got = httpx.post(pd.router.url + route, json=body, timeout=60).json()
        assert text_of(got["choices"][0]) == text_of(want["choices"][0]) and got["model"] == model
        pieces = []
        with httpx.stream("POST", pd.router.url + route, json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    pieces.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
        assert "".join(pieces) == text_of(want["choices"][0])


def test_bench_serving_through_the_router(pd, tmp_path):
    out = tmp_path / "pd.jsonl"
    assert main(["bench", "serving", "--base-url", pd.router.url, "--num-prompts", "8", "--max-concurrency", "4",
                 "--dataset-name", "random-ids", "--random-input-len", "40", "--random-output-len", "8",
                 "--output-file", str(out), "--disable-tqdm"]) == 0
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec["completed"] == 8 and rec["failed"] == 0


# ---- aborts and failures ----------------------------------------------------------------------------
def pd_state(srv: ServerProcess) -> dict:
    return httpx.get(srv.url + "/get_server_info", timeout=30).json()["internal_states"][0]


def wait_for(cond, timeout: float = 30, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def generated_tokens(servers: List[ServerProcess]) -> float:
    """Output tokens of the requests the servers finished (aborted ones are not counted)."""
    total = 0.0
    for srv in servers:
        for line in httpx.get(srv.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("radixserve:generation_tokens_total"):
                total += float(line.split()[-1])
    return total


def assert_all_slots_free(srv: ServerProcess) -> None:
    """Idle, then after a flush every KV slot is free again."""
    wait_for(lambda: (lambda s: s["num_running_reqs"] + s["num_waiting_reqs"] + s["num_disagg_queue_reqs"] == 0)(pd_state(srv)),
             what=f"{srv.url} idle")
    assert httpx.post(srv.url + "/flush_cache", timeout=30).status_code == 200
    st = pd_state(srv)
    assert st["available_tokens"] == st["max_total_num_tokens"] == MAX_TOTAL_TOKENS, st


def orphan_request(srv: ServerProcess, prefill_bootstrap_port: int, rid: str, max_new_tokens: int = 8) -> Tuple[threading.Thread, list]:
    """A PD request sent to one server only: its peer never hears of the room, so it waits."""
    box: list = []
    body = {"text": PROMPTS[0], "rid": rid, "sampling_params": greedy(max_new_tokens), "bootstrap_host": "127.0.0.1",
            "bootstrap_port": prefill_bootstrap_port, "bootstrap_room": random.getrandbits(63)}
    t = threading.Thread(target=lambda: box.append(httpx.post(srv.url + "/generate", json=body, timeout=120)))
    t.start()
    return t, box


def test_abort_in_the_decode_transfer_queue_and_the_prefill_bootstrap_queue(pd):
    (prefill, bport), decode = pd.prefills[0], pd.decodes[0]
    t_d, box_d = orphan_request(decode, bport, "pd-abort-decode")  # preallocated, waits for KV
    t_p, box_p = orphan_request(prefill, bport, "pd-abort-prefill")  # waits for a decode server
    wait_for(lambda: pd_state(decode)["num_disagg_queue_reqs"] == 1 and pd_state(prefill)["num_disagg_queue_reqs"] == 1,
             what="both requests queued")
    assert pd_state(decode)["available_tokens"] < MAX_TOTAL_TOKENS  # its slots are reserved
    for srv, rid in ((decode, "pd-abort-decode"), (prefill, "pd-abort-prefill")):
        assert httpx.post(srv.url + "/abort_request", json={"rid": rid}, timeout=10).status_code == 200
    for t, box in ((t_d, box_d), (t_p, box_p)):
        t.join(30)
        assert box and box[0].json()["meta_info"]["finish_reason"]["type"] == "abort", box
    for srv in (prefill, decode):
        assert_all_slots_free(srv)
    assert generate(pd.router.url, PROMPTS[3]).status_code == 200  # still serving


def test_abort_while_decoding_and_client_disconnect(pd):
    decode = pd.decodes[0]
    body = {"text": PROMPTS[4], "rid": "pd-abort-running", "sampling_params": greedy(1000, ignore_eos=True)}
    t, events = stream_in_background(pd.router, body)
    wait_for(lambda: len(events) >= 3, what="tokens")
    for srv in pd.decodes:
        httpx.post(srv.url + "/abort_request", json={"rid": "pd-abort-running"}, timeout=10)
    t.join(30)
    assert json.loads(events[-2])["meta_info"]["finish_reason"]["type"] == "abort"
    # A client that goes away mid-stream: the decode server ends its request long before its
    # 1000 tokens (the router closes its own connection; the decode server notices).
    generated_before = generated_tokens(pd.decodes)
    with httpx.stream("POST", pd.router.url + "/generate", timeout=60,
                      json={**body, "rid": "pd-disconnect", "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
    for srv in pd.servers():
        assert_all_slots_free(srv)
    assert generated_tokens(pd.decodes) - generated_before < 1000
    assert decode.proc.poll() is None


def test_a_transfer_that_never_comes_times_out(pd_fake):
    (_, bport), decode = pd_fake.prefills[0], pd_fake.decodes[1]  # --disaggregation-timeout 8
    t0 = time.monotonic()
    t, box = orphan_request(decode, bport, "pd-timeout")
    t.join(60)
    r = box[0]
    assert r.status_code == 504 and "did not arrive" in r.json()["error"]["message"], r.text
    assert 8 <= time.monotonic() - t0 < 30
    assert_all_slots_free(decode)


def test_every_slot_is_free_at_the_end(pd):
    for r in concurrently(lambda p: generate(pd.router.url, p, 8), PROMPTS):
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 8, r.text
    for srv in pd.servers():
        assert_all_slots_free(srv)


def test_a_killed_prefill_server_fails_its_requests_on_the_decode_side():
    c = start_cluster("fake", 1, [()], router=False)
    try:
        (prefill, bport), decode = c.prefills[0], c.decodes[0]
        waiting = [orphan_request(decode, bport, f"pd-dead-{i}") for i in range(3)]
        wait_for(lambda: pd_state(decode)["num_disagg_queue_reqs"] == 3, what="requests waiting for KV")
        prefill.proc.send_signal(signal.SIGKILL)
        for t, box in waiting:
            t.join(60)
            r = box[0]
            assert r.status_code == 500 and "stopped answering" in r.json()["error"]["message"], r.text
        assert_all_slots_free(decode)
        assert generate(decode.url, "served locally").status_code == 200  # the decode server lives on
    finally:
        c.prefills = [(p, b) for p, b in c.prefills if p.proc.poll() is None]
        stop_cluster(c)


def test_regular_router_names_the_model(unified):
    router = RouterProcess(["--worker-urls", unified.url, "--policy", "cache_aware"])
    try:
        router.wait_ready({"text": "warm up", "sampling_params": greedy(2)})
        names = [m["id"] for m in httpx.get(router.url + "/v1/models", timeout=10).json()["data"]]
        assert names == [httpx.get(unified.url + "/v1/models").json()["data"][0]["id"]]
    finally:
        router.stop()
