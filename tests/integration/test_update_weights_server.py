"""Weight updates of a running server (float32, SGLang's routes): from disk, from JSON tensors, from
a trainer process over torch.distributed (gloo); with --tp-size 2 and --dp-size 2. After an update
the greedy outputs equal the new checkpoint's under transformers and the old cache is gone; a
refused update answers 400 and the old weights keep serving; abort_all_requests aborts the request
in flight with a clear finish reason, without it the request finishes on the old weights first."""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import ServerProcess, assert_children_gone, free_port, stream_in_background

sys.path.append(str(Path(__file__).resolve().parents[1] / "reference"))
from hf_utils import hf_logits, load_hf, make_hf_model_dir  # noqa: E402
from weight_trainer import broadcast_checkpoint  # noqa: E402

TOL = 1e-4
N_NEW = 8
PROMPTS = [[1, 5, 9, 33, 100, 7, 8], [200, 3, 17, 250, 9, 11, 12, 40, 41]]
ABORT_MESSAGE = "Aborted: the server's weights are being updated (abort_all_requests)."
SERVER_ARGS = ("--skip-tokenizer-init", "--dtype", "float32", "--device", "cpu", "--max-total-tokens", "4000")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> Dict[str, str]:
    root = tmp_path_factory.mktemp("ckpts")
    out = {
        "a": make_hf_model_dir("llama", str(root / "a"), seed=0),
        "b": make_hf_model_dir("llama", str(root / "b"), seed=1),
        "qwen3": make_hf_model_dir("qwen3", str(root / "qwen3"), seed=0),
    }
    bad = root / "bad_shape"
    shutil.copytree(out["b"], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:64].clone()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    out["bad_shape"] = str(bad)
    return out


@pytest.fixture(scope="module")
def reference(dirs) -> Dict[str, List[Tuple[List[int], List[float]]]]:
    """transformers' greedy tokens and logprobs of every prompt, per checkpoint."""
    out = {}
    for key in ("a", "b"):
        model = load_hf(dirs[key])
        out[key] = [hf_greedy(model, ids) for ids in PROMPTS]
    return out


@pytest.fixture(scope="module")
def srv(dirs):
    """The overlap loop (forced on, as on a GPU): an update must wait for the forward in flight."""
    server = ServerProcess("--model-path", dirs["a"], *SERVER_ARGS, "--enable-overlap-schedule")
    yield server
    assert server.stop(signal.SIGTERM) == 0, server.read_log()[-3000:]
    assert_children_gone(server.children)


@pytest.fixture(scope="module")
def http(srv):
    with srv.client() as c:
        yield c


def hf_greedy(model, ids: List[int], n: int = N_NEW) -> Tuple[List[int], List[float]]:
    seq, toks, lps = list(ids), [], []
    for _ in range(n):
        logprobs = torch.log_softmax(hf_logits(model, seq)[-1], dim=-1)
        toks.append(int(logprobs.argmax()))
        lps.append(float(logprobs[toks[-1]]))
        seq.append(toks[-1])
    return toks, lps


def generate(http: httpx.Client, ids: List[int], n: int = N_NEW) -> dict:
    body = {"input_ids": ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def assert_serves(http: httpx.Client, ref: List[Tuple[List[int], List[float]]]) -> None:
    for ids, (toks, lps) in zip(PROMPTS, ref):
        out = generate(http, ids)
        assert out["output_ids"] == toks
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(got, lps)) <= TOL


def wait_decoding(thread, events: List[str], n: int = 3, timeout: float = 60) -> None:
    """Until the streamed request has sent n events (it is decoding); a stream that ends or
    stalls first fails the test instead of hanging it."""
    deadline = time.monotonic() + timeout
    while len(events) < n:
        assert thread.is_alive(), f"the stream ended after {len(events)} event(s): {events[-2:]}"
        assert time.monotonic() < deadline, f"{len(events)} event(s) after {timeout} s"
        time.sleep(0.05)


def update_from_disk(http: httpx.Client, path: str, **kw) -> httpx.Response:
    return http.post("/update_weights_from_disk", json={"model_path": path, **kw})


def load_and_check(http: httpx.Client, path: str) -> None:
    r = update_from_disk(http, path)
    assert r.status_code == 200 and r.json()["success"], r.text


# ---- one server ------------------------------------------------------------------------------------
def test_update_from_disk_serves_the_new_checkpoint(http, dirs, reference):
    load_and_check(http, dirs["a"])
    assert_serves(http, reference["a"])
    assert generate(http, PROMPTS[0])["meta_info"]["cached_tokens"] > 0

    r = update_from_disk(http, dirs["b"], weight_version="step-7")
    assert r.status_code == 200, r.text
    assert r.json() == {"success": True, "num_paused_requests": 0,
                        "message": f"Succeeded to update model weights from {dirs['b']}. Weight version updated to step-7."}
    first = generate(http, PROMPTS[0])["meta_info"]
    assert first["cached_tokens"] == 0 and first["weight_version"] == "step-7"
    assert_serves(http, reference["b"])

    assert http.get("/get_weight_version").json() == {"weight_version": "step-7"}
    info = http.get("/server_info").json()
    assert info["weight_version"] == "step-7" and info["model_path"] == dirs["b"]
    r = http.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["metadata"] == {"weight_version": "step-7"}


@pytest.mark.parametrize("bad, status, expected", [
    ("missing", 400, "no such file or directory"),
    ("qwen3", 400, "architecture Qwen3ForCausalLM, but this server runs LlamaForCausalLM"),
    ("bad_shape", 400, "tensor 'model.norm.weight' has shape (64,); the model's is (128,)"),
])
def test_refused_update_from_disk_keeps_serving(http, dirs, reference, bad, status, expected):
    load_and_check(http, dirs["a"])
    before = [generate(http, ids)["output_ids"] for ids in PROMPTS]
    r = update_from_disk(http, dirs.get(bad, dirs["a"] + "-missing"), weight_version="never")
    assert r.status_code == status and r.json()["success"] is False and expected in r.json()["message"], r.text
    assert [generate(http, ids)["output_ids"] for ids in PROMPTS] == before
    assert_serves(http, reference["a"])
    assert http.get("/get_weight_version").json()["weight_version"] != "never"


def test_malformed_update_requests_answer_400(http):
    r = http.post("/update_weights_from_disk", json={"load_format": "auto"})
    assert r.status_code == 400 and "model_path" in r.json()["error"]["message"]
    r = http.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["gASV"]})
    assert r.status_code == 400 and "not accepted over HTTP" in r.json()["error"]["message"]
    r = http.post("/update_weights_from_tensor", json={"named_tensors": [["model.norm.weight", [[1.0], [1.0, 2.0]]]]})
    assert r.status_code == 400 and "not a tensor of numbers" in r.json()["error"]["message"]
    r = http.post("/get_weights_by_name", json={"name": "model.layers.0.nope.weight"})
    assert r.status_code == 400 and "no tensor named" in r.json()["error"]["message"]
    # Issue 45: an integer beyond any tensor once killed the scheduler (an overflow in a comparison);
    # now a 400 naming the field, and the server answers as before.
    before = generate(http, PROMPTS[0])["output_ids"]
    r = http.post("/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 2**70})
    assert r.status_code == 400 and "truncate_size" in r.json()["error"]["message"], r.text
    r = http.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": 1,
                                                      "rank_offset": 1, "world_size": 10**9, "backend": "gloo"})
    assert r.status_code == 400 and "world_size" in r.json()["error"]["message"], r.text
    # A trainer address where nobody listens: the join gives up after its timeout with a 400
    # (it once waited 120 s with the scheduler's loop blocked), and no group is left behind.
    t0 = time.monotonic()
    r = http.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": 1,
                                                      "rank_offset": 1, "world_size": 2, "backend": "gloo", "timeout": 3})
    assert r.status_code == 400 and "Failed to initialize custom process group" in r.json()["message"], r.text
    assert time.monotonic() - t0 < 30
    assert generate(http, PROMPTS[0])["output_ids"] == before
    r = http.post("/destroy_weights_update_group", json={})
    assert r.status_code == 400  # nothing was joined


def test_abort_all_requests_aborts_the_request_in_flight(srv, http, dirs, reference):
    load_and_check(http, dirs["a"])
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 900, "temperature": 0, "ignore_eos": True}}
    thread, events = stream_in_background(srv, body)
    wait_decoding(thread, events)
    r = update_from_disk(http, dirs["b"], abort_all_requests=True)
    assert r.status_code == 200 and r.json()["success"], r.text
    thread.join(60)
    assert not thread.is_alive()
    last = json.loads(events[-2])
    assert events[-1] == "[DONE]"
    assert last["meta_info"]["finish_reason"] == {"type": "abort", "message": ABORT_MESSAGE}
    assert len(last["output_ids"]) < 900
    assert_serves(http, reference["b"])


def test_requests_in_flight_finish_on_the_old_weights_first(srv, http, dirs, reference):
    load_and_check(http, dirs["a"])
    n = 150
    old = generate(http, PROMPTS[1], n)["output_ids"]  # the request alone, on the old weights
    http.post("/flush_cache")
    body = {"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    thread, events = stream_in_background(srv, body)
    wait_decoding(thread, events)
    r = update_from_disk(http, dirs["b"], weight_version="after")
    assert r.status_code == 200 and r.json()["success"], r.text
    thread.join(60)
    assert not thread.is_alive()
    last = json.loads(events[-2])
    # Every token came from the old weights: the update waited for the request to end.
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": n}
    assert last["output_ids"] == old and last["meta_info"]["weight_version"] != "after"
    assert_serves(http, reference["b"])


def test_update_from_json_tensors_and_get_weights_by_name(http, dirs, reference):
    load_and_check(http, dirs["a"])
    hf_a = load_hf(dirs["a"])
    rows = http.post("/get_weights_by_name", json={"name": "model.layers.0.self_attn.v_proj.weight", "truncate_size": 3})
    assert rows.status_code == 200
    assert torch.equal(torch.tensor(rows.json()), hf_a.model.layers[0].self_attn.v_proj.weight[:3].detach())

    norm = [0.5 + i / 128 for i in range(128)]
    r = http.post("/update_weights_from_tensor", json={"named_tensors": [["model.norm.weight", norm]], "weight_version": "t1"})
    assert r.status_code == 200 and r.json()["success"], r.text
    got = http.request("GET", "/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 200}).json()
    assert torch.allclose(torch.tensor(got), torch.tensor(norm))
    assert generate(http, PROMPTS[0])["meta_info"]["weight_version"] == "t1"

    r = http.post("/update_weights_from_tensor", json={"named_tensors": [["model.norm.weight", norm[:5]]]})
    assert r.status_code == 400 and "has shape (5,); the model's is (128,)" in r.json()["message"]
    load_and_check(http, dirs["a"])
    assert_serves(http, reference["a"])


def test_update_weight_version(http):
    r = http.post("/update_weight_version", json={"new_version": "v-42"})
    assert r.status_code == 200 and r.json() == {"success": True, "message": "Weight version updated to v-42", "new_version": "v-42"}
    assert http.get("/get_weight_version").json() == {"weight_version": "v-42"}
    assert generate(http, PROMPTS[0])["meta_info"]["weight_version"] == "v-42"


# ---- a trainer over torch.distributed; TP 2 and DP 2 ---------------------------------------------------
def distributed_update(http: httpx.Client, model_dir: str, server_ranks: int) -> None:
    """What an RL framework does: start its trainer (rank 0), let the server join, broadcast."""
    port = free_port()
    trainer = mp.get_context("spawn").Process(target=broadcast_checkpoint, args=(port, 1 + server_ranks, model_dir))
    trainer.start()
    try:
        r = http.post("/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 1 + server_ranks, "backend": "gloo"})
        assert r.status_code == 200 and r.json() == {"success": True, "message": "Succeeded to initialize custom process group."}
        tensors = load_file(str(Path(model_dir) / "model.safetensors"))
        r = http.post("/update_weights_from_distributed", json={
            "names": list(tensors), "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()], "weight_version": "rl"})
        assert r.status_code == 200 and r.json()["success"], r.text
        trainer.join(60)
        assert trainer.exitcode == 0
        r = http.post("/destroy_weights_update_group", json={})
        assert r.status_code == 200 and r.json()["success"]
    finally:
        trainer.join(5)
        if trainer.is_alive():
            trainer.kill()


def test_update_from_a_trainer_over_torch_distributed(http, dirs, reference):
    load_and_check(http, dirs["a"])
    distributed_update(http, dirs["b"], server_ranks=1)
    assert_serves(http, reference["b"])
    assert generate(http, PROMPTS[0])["meta_info"]["weight_version"] == "rl"


def test_tp2_server_updates_from_disk_and_from_a_trainer(dirs, reference):
    srv = ServerProcess("--model-path", dirs["a"], *SERVER_ARGS, "--tp-size", "2")
    try:
        with srv.client() as http:
            assert_serves(http, reference["a"])
            r = update_from_disk(http, dirs["bad_shape"])
            assert r.status_code == 400 and "has shape (64,)" in r.json()["message"]
            assert_serves(http, reference["a"])
            load_and_check(http, dirs["b"])
            assert_serves(http, reference["b"])
            distributed_update(http, dirs["a"], server_ranks=2)  # ranks 1 and 2 of the group
            assert_serves(http, reference["a"])
            rows = http.post("/get_weights_by_name", json={"name": "model.layers.1.self_attn.o_proj.weight", "truncate_size": 2})
            hf_a = load_hf(dirs["a"])
            assert torch.equal(torch.tensor(rows.json()), hf_a.model.layers[1].self_attn.o_proj.weight[:2].detach())
    finally:
        assert srv.stop(signal.SIGTERM) == 0, srv.read_log()[-3000:]
    assert_children_gone(srv.children)


def test_dp2_server_updates_every_replica(dirs, reference):
    srv = ServerProcess("--model-path", dirs["a"], *SERVER_ARGS, "--dp-size", "2")
    try:
        with srv.client() as http:
            load_and_check(http, dirs["b"])
            for _ in range(2):  # round robin: both replicas answer
                assert_serves(http, reference["b"])
            rows = http.post("/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 4}).json()
            hf_b = load_hf(dirs["b"])
            assert len(rows) == 2 and all(torch.equal(torch.tensor(r), hf_b.model.norm.weight[:4].detach()) for r in rows)
            r = http.post("/init_weights_update_group", json={
                "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 3})
            assert r.status_code == 400 and "needs --dp-size 1" in r.json()["error"]["message"]
    finally:
        assert srv.stop(signal.SIGTERM) == 0, srv.read_log()[-3000:]
    assert_children_gone(srv.children)


def test_the_server_serves_while_a_join_waits_for_its_trainer(http, dirs, reference):
    """Issue 45: the join runs on a thread of its own, so while /init_weights_update_group waits
    for a trainer the scheduler's loop goes on: generation answers, /health answers every probe.
    A join to an address where nobody listens ends in a 400 after its timeout and leaves nothing
    behind; a second join right after, whose trainer comes late but within the timeout,
    succeeds and its update lands."""
    import threading

    load_and_check(http, dirs["a"])
    want_a = generate(http, PROMPTS[0])["output_ids"]
    probes: List[int] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=str(http.base_url), timeout=5) as c:
            while not stop.is_set():
                probes.append(c.get("/health").status_code)
                time.sleep(0.5)

    def join_in_background(port: int, timeout: float) -> Tuple[threading.Thread, list]:
        out: list = []
        body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "backend": "gloo", "timeout": timeout}
        t = threading.Thread(target=lambda: out.append(http.post("/init_weights_update_group", json=body, timeout=120)))
        t.start()
        return t, out

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        joining, result = join_in_background(1, timeout=6)  # nobody listens there
        time.sleep(1)
        assert generate(http, PROMPTS[0])["output_ids"] == want_a  # answered during the join
        r = http.post("/update_weights_from_distributed", json={"names": [], "dtypes": [], "shapes": []})
        assert r.status_code == 400 and "still being joined" in r.json()["message"], r.text
        assert joining.is_alive()
        joining.join(60)
        r = result[0]
        assert r.status_code == 400 and "Failed to initialize custom process group" in r.json()["message"], r.text
        assert http.post("/destroy_weights_update_group", json={}).status_code == 400  # no group left

        port = free_port()
        trainer = mp.get_context("spawn").Process(target=broadcast_checkpoint, args=(port, 2, dirs["b"], 20.0))  # 20 s late, as issue 45 asks
        trainer.start()
        try:
            t0 = time.monotonic()
            joining, result = join_in_background(port, timeout=40)
            time.sleep(2)
            assert generate(http, PROMPTS[0])["output_ids"] == want_a
            joining.join(60)
            assert result[0].status_code == 200 and result[0].json()["success"], result[0].text
            assert time.monotonic() - t0 >= 19  # it did wait for the late trainer
            tensors = load_file(str(Path(dirs["b"]) / "model.safetensors"))
            r = http.post("/update_weights_from_distributed", json={
                "names": list(tensors), "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
                "shapes": [list(t.shape) for t in tensors.values()]})
            assert r.status_code == 200 and r.json()["success"], r.text
            trainer.join(60)
            assert trainer.exitcode == 0
            assert http.post("/destroy_weights_update_group", json={}).status_code == 200
        finally:
            trainer.join(5)
            if trainer.is_alive():
                trainer.kill()
    finally:
        stop.set()
        prober.join(10)
    assert len(probes) >= 10 and all(code == 200 for code in probes), probes
    assert_serves(http, reference["b"])
