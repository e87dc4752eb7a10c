"""/tokenize and /detokenize (and their /v1/ forms) round-trip with the server's tokenizer, as
SGLang's; `radixserve.Engine` is importable from the package top level, as `sglang.Engine`."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("prefix", ["", "/v1"])
def test_tokenize_detokenize_round_trip(http, prefix):
    one = http.post(f"{prefix}/tokenize", json={"prompt": "Hello world"}).json()
    assert one["count"] == len(one["tokens"]) > 0 and one["max_model_len"] > 0
    gen = http.post("/generate", json={"text": "Hello world", "sampling_params": {"max_new_tokens": 1}}).json()
    assert one["count"] == gen["meta_info"]["prompt_tokens"]  # the same tokenizer as /generate
    assert http.post(f"{prefix}/detokenize", json={"tokens": one["tokens"]}).json()["text"] == "Hello world"
    batch = http.post(f"{prefix}/tokenize", json={"prompt": ["a b", "c"]}).json()
    assert batch["count"] == [len(t) for t in batch["tokens"]]
    texts = http.post(f"{prefix}/detokenize", json={"tokens": batch["tokens"]}).json()["text"]
    assert texts == ["a b", "c"]


def test_tokenize_refuses_junk(http):
    assert http.post("/tokenize", json={"prompt": 5}).status_code == 400
    assert http.post("/detokenize", json={"tokens": [10**9]}).status_code == 400
    assert http.post("/detokenize", json={"tokens": ["a"]}).status_code == 400


def test_engine_at_the_package_top_level():
    import radixserve
    from radixserve.engine import Engine

    assert radixserve.Engine is Engine
