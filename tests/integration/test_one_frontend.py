"""Engine.generate and POST /generate share one request front end: the same request gives
results with the same keys, shapes and (greedy) tokens, and the same refusal message."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.engine import Engine

from conftest import MAX_TOTAL_TOKENS


def shape(x: Any) -> Any:
    """The structure of a result: dict keys, list lengths, leaf types (None kept apart)."""
    if isinstance(x, dict):
        return {k: shape(v) for k, v in x.items() if k != "e2e_latency"}
    if isinstance(x, list):
        return [shape(v) for v in x]
    return None if x is None else type(x).__name__


@pytest.fixture(scope="module")
def engine():
    # the server fixture runs the embedded tiny model with this pool; the same here
    eng = Engine(max_total_tokens=MAX_TOTAL_TOKENS)
    yield eng
    eng.shutdown()


REQUESTS = [
    dict(text="Hello there", sampling_params={"max_new_tokens": 6, "temperature": 0}),
    dict(text=["a b", "c d e"], sampling_params={"max_new_tokens": 4, "temperature": 0},
         return_logprob=True, top_logprobs_num=2, logprob_start_len=0),
    dict(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 3, "temperature": 0, "n": 2},
         return_logprob=True),
    dict(text="stop here", sampling_params={"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [0]}),
]


@pytest.mark.parametrize("body", REQUESTS)
def test_engine_and_http_results_have_one_shape(http, engine, body):
    got_http = http.post("/generate", json=body).json()
    kw = dict(body)
    got_engine = engine.generate(prompt=kw.pop("text", None), **kw, progress=False)
    assert isinstance(got_http, dict) == isinstance(got_engine, dict)
    if isinstance(got_http, list):
        prompts = len(body["text"]) if isinstance(body.get("text"), list) else 1
        assert len(got_http) == len(got_engine) == prompts * body["sampling_params"].get("n", 1)
    for a, b in ([(got_http, got_engine)] if isinstance(got_http, dict) else zip(got_http, got_engine)):
        a["meta_info"].pop("id"), b["meta_info"].pop("id")
        assert shape(a) == shape(b)
        assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"]
        assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
    assert isinstance(got_http, dict) == isinstance(got_engine, dict)


def test_engine_and_http_refuse_alike(http, engine):
    body = dict(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4, "top_p": 2.0})
    r = http.post("/generate", json=body)
    assert r.status_code == 400
    with pytest.raises(ValueError) as e:
        engine.generate(input_ids=body["input_ids"], sampling_params=body["sampling_params"])
    assert str(e.value) in r.text
