"""Bad and unlucky calls to the operations routes (issue 45's battery): each gets the answer it
should (a 400 whose message names what is wrong; a 403/401 for a refused key elsewhere), and
after each the server is healthy and a fixed greedy request gives exactly the text it gave
before (no refused call changed a weight, a cache or a state).

One server (the tiny model) takes every case in turn; the cases that need another server's
configuration (keys, a public bind) are in test_admin_key.py."""

from __future__ import annotations

import json
import signal
from typing import Any, List, NamedTuple

import httpx
import pytest

from conftest import ServerProcess

GREEDY = {"input_ids": [5, 6, 7, 8, 9], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
NOBODY = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "gloo"}
NORM = "model.norm.weight"


class Case(NamedTuple):
    name: str
    path: str
    body: Any  # a JSON value, or raw bytes
    status: int
    says: str  # a part of the message that names the problem
    method: str = "POST"


CASES: List[Case] = [
    # -- reading weights
    Case("weights: no body", "/get_weights_by_name", None, 400, "body is empty"),
    Case("weights: no name", "/get_weights_by_name", {}, 400, "name"),
    Case("weights: name a number", "/get_weights_by_name", {"name": 5}, 400, "name"),
    Case("weights: empty name", "/get_weights_by_name", {"name": ""}, 400, "no tensor named"),
    Case("weights: unknown tensor", "/get_weights_by_name", {"name": "model.layers.0.nope.weight"}, 400, "no tensor named"),
    Case("weights: truncate 2**70", "/get_weights_by_name", {"name": NORM, "truncate_size": 2**70}, 400, "truncate_size"),
    Case("weights: truncate 0", "/get_weights_by_name", {"name": NORM, "truncate_size": 0}, 400, "truncate_size"),
    Case("weights: truncate -1", "/get_weights_by_name", {"name": NORM, "truncate_size": -1}, 400, "truncate_size"),
    Case("weights: truncate a string", "/get_weights_by_name", {"name": NORM, "truncate_size": "10"}, 400, "truncate_size"),
    Case("weights: truncate a float", "/get_weights_by_name", {"name": NORM, "truncate_size": 1.5}, 400, "truncate_size"),
    Case("weights: not JSON", "/get_weights_by_name", b"{name: norm", 400, "JSON"),
    Case("weights: a list body", "/get_weights_by_name", [NORM], 400, "body"),
    # -- joining a trainer's group
    Case("join: world_size 10**9", "/init_weights_update_group", {**NOBODY, "world_size": 10**9}, 400, "world_size"),
    Case("join: world_size 1", "/init_weights_update_group", {**NOBODY, "world_size": 1}, 400, "world_size"),
    Case("join: port 0", "/init_weights_update_group", {**NOBODY, "master_port": 0}, 400, "master_port"),
    Case("join: port 70000", "/init_weights_update_group", {**NOBODY, "master_port": 70000}, 400, "master_port"),
    Case("join: rank_offset 0", "/init_weights_update_group", {**NOBODY, "rank_offset": 0}, 400, "rank_offset"),
    Case("join: no room for the server", "/init_weights_update_group", {**NOBODY, "rank_offset": 5}, 400, "leave no room"),
    Case("join: backend mpi", "/init_weights_update_group", {**NOBODY, "backend": "mpi"}, 400, "backend"),
    Case("join: nccl on a CPU", "/init_weights_update_group", {**NOBODY, "backend": "nccl"}, 400, "nccl needs a GPU"),
    Case("join: negative timeout", "/init_weights_update_group", {**NOBODY, "timeout": -1}, 400, "timeout"),
    Case("join: timeout 1e9", "/init_weights_update_group", {**NOBODY, "timeout": 1e9}, 400, "timeout"),
    Case("join: timeout NaN", "/init_weights_update_group", json.dumps({**NOBODY, "timeout": float("nan")}).encode(), 400, "timeout"),
    Case("join: address a number", "/init_weights_update_group", {**NOBODY, "master_address": 5}, 400, "master_address"),
    Case("join: no address", "/init_weights_update_group", {k: v for k, v in NOBODY.items() if k != "master_address"}, 400, "master_address"),
    Case("join: nobody listens", "/init_weights_update_group", {**NOBODY, "timeout": 2}, 400, "Failed to initialize custom process group"),
    # -- updates without a group, from disk, from tensors
    Case("distributed: no group", "/update_weights_from_distributed", {"names": [NORM], "dtypes": ["float32"], "shapes": [[64]]}, 400, "No weights update group"),
    Case("distributed: shapes not ints", "/update_weights_from_distributed", {"names": [NORM], "dtypes": ["float32"], "shapes": [["a"]]}, 400, "shapes"),
    Case("distributed: no names", "/update_weights_from_distributed", {"dtypes": [], "shapes": []}, 400, "names"),
    Case("destroy: no group", "/destroy_weights_update_group", {}, 400, "weight_update_group"),
    Case("destroy: group a number", "/destroy_weights_update_group", {"group_name": 5}, 400, "group_name"),
    Case("disk: no path", "/update_weights_from_disk", {}, 400, "model_path"),
    Case("disk: missing path", "/update_weights_from_disk", {"model_path": "/nonexistent/model"}, 400, "/nonexistent/model"),
    Case("disk: a file, not a model", "/update_weights_from_disk", {"model_path": "/etc/hostname"}, 400, "/etc/hostname"),
    Case("disk: load_format pickle", "/update_weights_from_disk", {"model_path": "/nonexistent", "load_format": "pickle"}, 400, "pickle"),
    Case("disk: abort flag a string", "/update_weights_from_disk", {"model_path": "/x", "abort_all_requests": "yes"}, 400, "abort_all_requests"),
    Case("tensor: values a string", "/update_weights_from_tensor", {"named_tensors": [[NORM, "abc"]]}, 400, "not a tensor of numbers"),
    Case("tensor: ragged values", "/update_weights_from_tensor", {"named_tensors": [[NORM, [[1.0], [1.0, 2.0]]]]}, 400, "not a tensor of numbers"),
    Case("tensor: unknown name", "/update_weights_from_tensor", {"named_tensors": [["model.nope.weight", [1.0]]]}, 400, "model.nope.weight"),
    Case("tensor: wrong shape", "/update_weights_from_tensor", {"named_tensors": [[NORM, [1.0, 2.0]]]}, 400, "shape"),
    Case("tensor: pickled tensors", "/update_weights_from_tensor", {"serialized_named_tensors": ["gASV"]}, 400, "serialized_named_tensors"),
    Case("tensor: load_format", "/update_weights_from_tensor", {"named_tensors": [], "load_format": "flattened_bucket"}, 400, "load_format"),
    Case("version: not a string", "/update_weight_version", {"new_version": 5}, 400, "new_version"),
    # -- memory, pause, profile
    Case("resume: nothing released", "/resume_memory_occupation", {}, 400, "release"),
    Case("release: unknown tag", "/release_memory_occupation", {"tags": ["bogus"]}, 400, "bogus"),
    Case("release: tags a string", "/release_memory_occupation", {"tags": "kv_cache"}, 400, "tags"),
    Case("pause: unknown mode", "/pause_generation", {"mode": "sideways"}, 400, "sideways"),
    Case("pause: mode a number", "/pause_generation", {"mode": 5}, 400, "mode"),
    Case("profile: stop without start", "/stop_profile", None, 400, "not in progress"),
    Case("experts: start on a model without", "/start_expert_distribution_record", None, 400, "no experts"),
    Case("experts: dump on a model without", "/dump_expert_distribution_record", None, 400, "no experts"),
    Case("profile: GPU on a CPU", "/start_profile", {"activities": ["GPU"]}, 400, "GPU"),
    Case("profile: unknown activity", "/start_profile", {"activities": ["DISK"]}, 400, "DISK"),
    Case("profile: output_dir /etc", "/start_profile", {"output_dir": "/etc", "activities": ["CPU"]}, 400, "output_dir"),
    Case("profile: output_dir escapes", "/start_profile", {"output_dir": "../../etc/x", "activities": ["CPU"]}, 400, "output_dir"),
    Case("profile: start_step 2**70", "/start_profile", {"start_step": 2**70}, 400, "start_step"),
    Case("profile: num_steps a string", "/start_profile", {"num_steps": "3"}, 400, "num_steps"),
    Case("profile: with_stack a string", "/start_profile", {"with_stack": "yes"}, 400, "with_stack"),
    # -- features this server does not run
    Case("lora: load without --enable-lora", "/load_lora_adapter", {"lora_name": "a", "lora_path": "/nonexistent"}, 400, "--enable-lora"),
    Case("lora: unload without --enable-lora", "/unload_lora_adapter", {"lora_name": "a"}, 400, "--enable-lora"),
    Case("lora: load no path", "/load_lora_adapter", {"lora_name": "a"}, 400, "lora_path"),
    Case("hicache: clear without storage", "/clear_hicache_storage_backend", None, 400, "--hicache-storage-backend"),
    Case("embeddings on a generation server", "/v1/embeddings", {"input": "hello"}, 400, "embedding"),
]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-total-tokens", "2048")
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        r = c.post("/generate", json=GREEDY)
        assert r.status_code == 200, r.text
        yield srv, c, r.json()["output_ids"]
    assert srv.stop(signal.SIGTERM) == 0, srv.read_log()[-3000:]


def _message(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message", ""))
        return str(body.get("message") or body.get("error_message") or body)
    return str(body)


def test_the_battery_is_fifty_cases_or_more():
    assert len(CASES) >= 50 and len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_bad_call_gets_its_answer_and_changes_nothing(server, case: Case):
    srv, c, want = server
    if isinstance(case.body, bytes):
        r = c.request(case.method, case.path, content=case.body, headers={"Content-Type": "application/json"})
    elif case.body is None:
        r = c.request(case.method, case.path)
    else:
        r = c.request(case.method, case.path, json=case.body)
    message = _message(r)
    assert r.status_code == case.status, f"{case.name}: {r.status_code} {r.text[:500]}"
    assert case.says.lower() in message.lower(), f"{case.name}: the message does not say {case.says!r}: {message[:500]}"
    assert c.get("/health").status_code == 200
    out = c.post("/generate", json=GREEDY)
    assert out.status_code == 200 and out.json()["output_ids"] == want, f"after {case.name}: {out.text[:300]}"
