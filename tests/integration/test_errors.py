"""Bad input gets a clear error with the right status; the server keeps serving."""

from __future__ import annotations


import pytest

from conftest import greedy


def err(r, status):
    assert r.status_code == status, r.text
    return r.json()["error"]["message"]


def test_malformed_json(http):
    r = http.post("/generate", content=b'{"text": "hi", ', headers={"content-type": "application/json"})
    assert "Malformed JSON" in err(r, 400)
    r = http.post("/v1/completions", content=b"not json")
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
