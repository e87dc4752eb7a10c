"""Bad input gets a clear error with the right status; the server keeps serving."""

from __future__ import annotations

import json

import pytest

from conftest import greedy


JSON_HEADERS = {"content-type": "application/json"}


def err(r, status):
    assert r.status_code == status, r.text
    return r.json()["error"]["message"]


def test_malformed_json(http):
    r = http.post("/generate", content=b'{"text": "hi", ', headers={"content-type": "application/json"})
    assert "Malformed JSON" in err(r, 400)
    r = http.post("/v1/completions", content=b"not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    assert "JSON object" in err(http.post("/generate", json=[1, 2]), 400)
    assert "empty" in err(http.post("/generate", content=b""), 400)


@pytest.mark.parametrize("params, message", [
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"temperature": -1}, "temperature must be non-negative"),
    ({"top_k": 0}, "top_k must be -1 (disable), or at least 1"),
    ({"min_p": 2}, "min_p must be in [0, 1]"),
    ({"frequency_penalty": 3}, "frequency_penalty must be in [-2, 2]"),
    ({"presence_penalty": -3}, "presence_penalty must be in [-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 2]"),
    ({"max_new_tokens": -1}, "max_new_tokens must be at least 0"),
    ({"n": 0}, "n must be at least 1"),
    ({"temperature": "hot"}, "sampling_params.temperature"),
    ({"max_new_tokens": 1.5}, "sampling_params.max_new_tokens"),
    ({"no_such_param": 1}, "unknown sampling parameter(s): no_such_param"),
    ({"logit_bias": {"99999999": 1.0}}, "out of the vocabulary"),
])
def test_bad_sampling_params(http, params, message):
    assert message in err(http.post("/generate", json={"text": "hi", "sampling_params": params}), 400)


def test_wrong_types(http):
    assert "text must be a string" in err(http.post("/generate", json={"text": 5}), 400)
    assert "input_ids must contain integers" in err(http.post("/generate", json={"input_ids": ["a"]}), 400)
    assert "Either text or input_ids" in err(http.post("/generate", json={"sampling_params": {}}), 400)
    assert "stream" in err(http.post("/generate", json={"text": "x", "stream": "maybe"}), 400)


def test_empty_and_too_long_prompts(http):
    assert "The input is empty" in err(http.post("/generate", json={"text": ""}), 400)
    assert "The input is empty" in err(http.post("/generate", json={"input_ids": []}), 400)
    too_long = {"input_ids": [5] * 4200, "sampling_params": greedy(4)}
    assert "longer than the model's context length" in err(http.post("/generate", json=too_long), 400)
    # a streaming request refused at intake still gets its status, not a 200 stream
    assert "longer than" in err(http.post("/generate", json={**too_long, "stream": True}), 400)
    assert "Input token ids must be in" in err(http.post("/generate", json={"input_ids": [10**6]}), 400)


def test_max_new_tokens_beyond_the_context_is_400(http, openai_client, model_name):
    """An explicit max_new_tokens that can't fit beside the input is refused (SGLang's message);
    one that fits exactly, or none at all (clipped to the room left), is served."""
    import openai

    context = http.get("/get_model_info").json()["context_length"]
    body = {"input_ids": [5] * 100, "sampling_params": greedy(context - 100)}
    msg = err(http.post("/generate", json=body), 400)
    assert f"maximum context length of {context} tokens" in msg and f"{context} tokens: 100 tokens from the input" in msg
    fits = {"input_ids": [5] * (context - 3), "sampling_params": greedy(2)}
    assert len(http.post("/generate", json=fits).json()["output_ids"]) == 2
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model=model_name, prompt=[5] * 100, max_tokens=context)
    assert "maximum context length" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        openai_client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=context)
    # The default max_new_tokens (128) is not the user's: it is clipped to the room left.
    default = {"input_ids": [5] * (context - 3), "sampling_params": {"temperature": 0, "ignore_eos": True}}
    assert len(http.post("/generate", json=default).json()["output_ids"]) == 2


def test_body_too_large_is_413(http):
    r = http.post("/generate", json={"text": "x" * 300_000})
    assert "larger than 200000 bytes" in err(r, 413)

    def chunked():  # no Content-Length: counted while it arrives
        yield b'{"text": "'
        for _ in range(30):
            yield b"x" * 10_000
        yield b'"}'

    r = http.post("/v1/completions", content=chunked(), headers=JSON_HEADERS)
    assert "larger than 200000 bytes" in err(r, 413) and r.json()["error"]["code"] == 413


def test_unknown_route_and_model(http, openai_client):
    import openai

    assert http.get("/no/such/route").status_code == 404
    with pytest.raises(openai.NotFoundError) as e:
        openai_client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert "does not exist" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("no-such-model")
    r = http.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    body = r.json()
    assert r.status_code == 404 and body["error"]["code"] == 404 and body["error"]["type"] == "NotFoundError"


def test_openai_bad_input(openai_client, model_name, http):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model=model_name, prompt="hi", max_tokens=2, top_p=1.5)
    assert "top_p must be in (0, 1]" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model=model_name, messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model=model_name, prompt="", max_tokens=2)
    assert "The input is empty" in str(e.value)
    r = http.post("/v1/completions", json={"model": model_name, "prompt": "hi", "max_tokens": "many"})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        openai_client.completions.create(model=model_name, prompt=[5] * 4200, max_tokens=2, stream=True)


def test_abort_request_needs_a_target(http):
    assert err(http.post("/abort_request", json={}), 400)


def test_server_still_serves(http):
    r = http.post("/generate", json={"text": "still alive", "sampling_params": greedy(3)})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 3


# ---- hostile input (issue 16): each was a crash or a hang of the whole server ------------------
@pytest.mark.parametrize("params, message", [
    ({"stop_regex": "("}, "not a valid regular expression"),
    ({"stop_regex": ["ok", "[unclosed"]}, "not a valid regular expression"),
    ({"top_k": 2**63}, "top_k must be -1 (disable), or in [1,"),
    ({"min_new_tokens": 2**63, "max_new_tokens": None}, "min_new_tokens must be at most"),
    ({"max_new_tokens": 2**63}, "max_new_tokens must be at most"),
    ({"n": 1000000}, "n must be at most 128"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"top_p": float("inf")}, "top_p must be a finite number"),
    ({"logit_bias": {"5": float("inf")}}, "logit_bias values must be finite"),
    ({"sampling_seed": -1}, "sampling_seed must be in [0, 2**63)"),
    ({"stop": ["x"] * 65}, "stop takes at most 64 entries"),
])
def test_hostile_sampling_params_are_refused(http, params, message):
    # json.dumps writes NaN / Infinity literals, which Python's parser (the server's) accepts
    body = json.dumps({"text": "hi", "sampling_params": params}).encode()
    assert message in err(http.post("/generate", content=body, headers=JSON_HEADERS), 400)
    assert http.get("/health").status_code == 200


def test_hostile_openai_requests_are_refused(http, model_name):
    base = {"model": model_name, "prompt": "hi", "max_tokens": 4}
    assert "top_k" in err(http.post("/v1/completions", json={**base, "top_k": 2**63}), 400)
    assert "n must be at most" in err(http.post("/v1/completions", json={**base, "n": 1000000}), 400)
    nan = json.dumps({**base, "temperature": float("nan")}).encode()
    assert "finite" in err(http.post("/v1/completions", content=nan, headers=JSON_HEADERS), 400)
    chat = {"model": model_name, "max_tokens": 4, "messages": [{"role": "wizard", "content": "hi"}]}
    assert "role" in err(http.post("/v1/chat/completions", json=chat), 400)


def test_duplicate_rids_in_one_batch_are_refused(http):
    body = {"text": ["a", "b"], "rid": ["same", "same"], "sampling_params": greedy(2)}
    assert "appears twice in this batch" in err(http.post("/generate", json=body), 400)
    # and the rid is free again: the refused batch left no state behind
    ok = http.post("/generate", json={"text": "a", "rid": "same", "sampling_params": greedy(2)})
    assert ok.status_code == 200, ok.text


def test_deeply_nested_json_is_refused(http):
    body = b"{\"text\": " + b"[" * 50000 + b"]" * 50000 + b"}"  # under the test server's body limit
    r = http.post("/generate", content=body, headers={"content-type": "application/json"})
    assert "nested too deeply" in err(r, 400)


def test_only_json_bodies_are_accepted(http):
    """A form or text/plain POST (what a page on another origin can send without a CORS
    preflight) is refused with 415 before anything runs: abort_all is not obeyed."""
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"content-type": ctype} if ctype else {}
        r = http.post("/abort_request", content=b'{"abort_all": true}', headers=headers)
        assert r.status_code == 415, r.text
        r = http.post("/generate", content=b'{"text": "hi"}', headers=headers)
        assert "application/json" in err(r, 415)
    assert http.post("/generate", json={"text": "hi", "sampling_params": greedy(2)}).status_code == 200
