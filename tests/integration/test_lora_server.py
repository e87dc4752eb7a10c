"""Multi-LoRA over HTTP (issue 28): `radixserve serve --enable-lora --lora-paths name=path ...`;
/generate's `lora_path` (one, or a list for a batch), the OpenAI routes' `model: "adapter"` and
`"base:adapter"`, /v1/models listing the adapters with their base as parent, 400 naming an
unknown adapter."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import ServerProcess

sys.path.append(str(Path(__file__).resolve().parents[1] / "reference"))
from lora_utils import base_weights, write_adapter  # noqa: E402

PROMPT = "Once upon a time there"
GREEDY = {"max_new_tokens": 6, "temperature": 0.0}


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_http")
    base = base_weights()
    a4 = write_adapter(root / "a4", 4, 8.0, ["q_proj", "v_proj"], base, seed=1)
    c16 = write_adapter(root / "c16", 16, 32.0, ["q_proj", "o_proj", "up_proj", "down_proj"], base, seed=3)
    srv = ServerProcess("--enable-lora", "--lora-paths", f"a4={a4}", f"c16={c16}", "--max-loras-per-batch", "2",
                        "--dtype", "float32", "--max-total-tokens", "2048")  # radix cache on: keyed by adapter
    d8 = write_adapter(root / "d8", 8, 8.0, ["q_proj", "down_proj"], base, seed=4)  # loaded at run time
    yield srv, {"a4": str(a4), "c16": str(c16), "d8": str(d8)}
    assert srv.stop() == 0, srv.read_log()[-3000:]


def test_lora_routes(lora_server):
    srv, paths = lora_server
    with srv.client() as http:
        models = http.get("/v1/models").json()["data"]
        base_name = models[0]["id"]
        adapters = {m["id"]: m for m in models[1:]}
        assert set(adapters) >= {"a4", "c16"}
        assert all(m["parent"] == base_name and m["root"] == paths[m["id"]] for m in adapters.values())

        batch = http.post("/generate", json={"text": [PROMPT] * 3, "sampling_params": GREEDY,
                                             "lora_path": [None, "a4", "c16"]})
        assert batch.status_code == 200, batch.text
        base_ids, a4_ids, c16_ids = (o["output_ids"] for o in batch.json())
        assert len({tuple(base_ids), tuple(a4_ids), tuple(c16_ids)}) == 3  # each its own weights

        single = http.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY, "lora_path": "a4"}).json()
        assert single["output_ids"] == a4_ids
        for model, want in [("a4", a4_ids), (f"{base_name}:c16", c16_ids), (base_name, base_ids)]:
            r = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 6,
                                                   "temperature": 0})
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["text"]
            want_text = http.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY,
                                                     "lora_path": None if model == base_name else model.split(":")[-1]}).json()["text"]
            assert text == want_text, model

        bad = http.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY, "lora_path": "nope"})
        assert bad.status_code == 400 and "'nope'" in bad.json()["error"]["message"]
        bad = http.post("/v1/completions", json={"model": f"{base_name}:nope", "prompt": PROMPT, "max_tokens": 2})
        assert bad.status_code == 400 and "'nope'" in bad.json()["error"]["message"]
        assert http.post("/v1/completions", json={"model": "nope", "prompt": PROMPT}).status_code == 404
        assert http.get("/health").status_code == 200  # still serving


def test_load_and_unload_routes(lora_server):
    srv, paths = lora_server
    with srv.client() as http:
        body = {"text": PROMPT, "sampling_params": GREEDY, "lora_path": "d8"}
        assert http.post("/generate", json=body).status_code == 400
        r = http.post("/load_lora_adapter", json={"lora_name": "d8", "lora_path": paths["d8"]})
        assert r.status_code == 200 and r.json()["success"] and r.json()["loaded_adapters"]["d8"] == paths["d8"]
        assert "d8" in {m["id"] for m in http.get("/v1/models").json()["data"]}
        d8_ids = http.post("/generate", json=body).json()["output_ids"]
        base_ids = http.post("/generate", json={**body, "lora_path": None}).json()["output_ids"]
        assert d8_ids != base_ids

        bad = http.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"})
        assert bad.status_code == 400 and "/nowhere/adapter_config.json: no such file" in bad.json()["error_message"]

        r = http.post("/unload_lora_adapter", json={"lora_name": "d8"})
        assert r.status_code == 200 and "d8" not in r.json()["loaded_adapters"]
        assert http.post("/generate", json=body).status_code == 400
        assert "d8" not in {m["id"] for m in http.get("/v1/models").json()["data"]}
        assert http.post("/unload_lora_adapter", json={"lora_name": "d8"}).status_code == 400
