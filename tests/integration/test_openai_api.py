"""The OpenAI-compatible API through the official openai client."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk


def test_models(openai_client, model_name):
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [model_name]
    assert openai_client.models.retrieve(model_name).id == model_name


def test_completion(openai_client, model_name, http):
    c = openai_client.completions.create(model=model_name, prompt="The sky is", max_tokens=8, temperature=0)
    assert c.object == "text_completion" and len(c.choices) == 1
    assert c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == 8 and c.usage.prompt_tokens > 0
    native = http.post("/generate", json={"text": "The sky is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    assert c.choices[0].text == native["text"]
    again = openai_client.completions.create(model=model_name, prompt="The sky is", max_tokens=8, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_completion_stream_with_usage(openai_client, model_name):
    full = openai_client.completions.create(model=model_name, prompt="Stream me", max_tokens=10, temperature=0)
    chunks = list(openai_client.completions.create(
        model=model_name, prompt="Stream me", max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_completion_n_stop_logprobs_echo(openai_client, model_name):
    c = openai_client.completions.create(model=model_name, prompt="Many", max_tokens=5, n=3, temperature=0.8, seed=1)
    assert sorted(ch.index for ch in c.choices) == [0, 1, 2]
    assert c.usage.completion_tokens == 15
    # n samples with one seed: each sample draws its own randomness (they differ), and the set
    # is reproducible; choice 0 is what n = 1 with that seed gives
    texts = [ch.text for ch in sorted(c.choices, key=lambda ch: ch.index)]
    assert len(set(texts)) > 1, texts
    again = openai_client.completions.create(model=model_name, prompt="Many", max_tokens=5, n=3, temperature=0.8, seed=1)
    assert [ch.text for ch in sorted(again.choices, key=lambda ch: ch.index)] == texts
    one = openai_client.completions.create(model=model_name, prompt="Many", max_tokens=5, temperature=0.8, seed=1)
    assert one.choices[0].text == texts[0]
    base = openai_client.completions.create(model=model_name, prompt="Stop here", max_tokens=16, temperature=0).choices[0].text
    stop = base[len(base) // 2 : len(base) // 2 + 2]
    s = openai_client.completions.create(model=model_name, prompt="Stop here", max_tokens=16, temperature=0, stop=[stop])
    assert s.choices[0].finish_reason == "stop" and s.choices[0].text == base[: base.find(stop)]
    lp = openai_client.completions.create(model=model_name, prompt="Logprobs", max_tokens=4, temperature=0, logprobs=2)
    l = lp.choices[0].logprobs
    assert len(l.tokens) == 4 and len(l.token_logprobs) == 4 and all(len(t) <= 2 for t in l.top_logprobs)
    assert "".join(l.tokens) == lp.choices[0].text
    e = openai_client.completions.create(model=model_name, prompt="Echo", max_tokens=2, temperature=0, echo=True)
    assert e.choices[0].text.startswith("Echo")
    batch = openai_client.completions.create(model=model_name, prompt=["A", "B"], max_tokens=2, temperature=0)
    assert len(batch.choices) == 2


def test_chat(openai_client, model_name):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]
    c = openai_client.chat.completions.create(model=model_name, messages=msgs, max_completion_tokens=8, temperature=0)
    assert c.object == "chat.completion" and c.choices[0].message.role == "assistant"
    assert c.choices[0].finish_reason in ("length", "stop")
    chunks = list(openai_client.chat.completions.create(
        model=model_name, messages=msgs, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == c.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == c.usage.completion_tokens


def test_chat_options(openai_client, model_name):
    """Every option is accepted together and the response has its shape (what each one does:
    test_sampling_fields_reach_the_sampler)."""
    msgs = [{"role": "user", "content": "Options"}]
    c = openai_client.chat.completions.create(
        model=model_name, messages=msgs, max_tokens=4, n=2, temperature=0.7, top_p=0.9, seed=3,
        presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"5": 1.0}, user="tester",
        logprobs=True, top_logprobs=2,
        extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True},
    )
    assert len(c.choices) == 2
    for ch in c.choices:
        assert len(ch.logprobs.content) == 4 and all(len(t.top_logprobs) == 2 for t in ch.logprobs.content)
    assert c.usage.completion_tokens == 8
    ok = openai_client.chat.completions.create(
        model=model_name, messages=msgs, max_tokens=2, extra_body={"regex": "[a-z]+", "json_schema": None},
    )
    assert ok.choices[0].message.content is not None


def chat_tokens(client, model: str, max_tokens: int = 24, **kw) -> list:
    """The sampled tokens (as text) of each choice of a chat completion on a fixed prompt."""
    c = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Options"}],
                                       max_tokens=max_tokens, logprobs=True, **kw)
    return [[t.token for t in ch.logprobs.content] for ch in c.choices]


def repeats(tokens: list) -> int:
    return len(tokens) - len(set(tokens))


def test_sampling_fields_reach_the_sampler(openai_client, model_name, http):
    """Each sampling field of the OpenAI request changes the output the way it should (the
    embedded model's tokens are random-ish, which is all these need)."""
    greedy = chat_tokens(openai_client, model_name, temperature=0)[0]
    assert len(greedy) == 24

    # logit_bias +100 on token 5 forces it: every token of every sample, at temperature 1
    biased = chat_tokens(openai_client, model_name, max_tokens=8, temperature=1.0, n=2, logit_bias={"5": 100},
                         extra_body={"ignore_eos": True})
    native = http.post("/generate", json={"text": "x", "sampling_params": {
        "max_new_tokens": 1, "logit_bias": {"5": 100.0}, "ignore_eos": True}}).json()
    assert native["output_ids"] == [5]
    assert biased == [[native["text"]] * 8] * 2

    # seed: the same seed gives the same text at temperature 1, another seed another text
    a = chat_tokens(openai_client, model_name, max_tokens=16, temperature=1.0, seed=11)[0]
    assert chat_tokens(openai_client, model_name, max_tokens=16, temperature=1.0, seed=11)[0] == a
    assert chat_tokens(openai_client, model_name, max_tokens=16, temperature=1.0, seed=12)[0] != a
    assert a != greedy[:16]

    # top_k = 1 is greedy, whatever the temperature
    assert chat_tokens(openai_client, model_name, temperature=1.0, seed=5, extra_body={"top_k": 1})[0] == greedy

    # penalties on the greedy output, which repeats tokens: positive ones repeat fewer, a
    # negative frequency penalty more
    assert repeats(greedy) >= 3, greedy
    for field in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"extra_body": {"repetition_penalty": 2.0}}):
        penalized = chat_tokens(openai_client, model_name, temperature=0, **field)[0]
        assert repeats(penalized) < repeats(greedy), (field, penalized, greedy)
    encouraged = chat_tokens(openai_client, model_name, temperature=0, frequency_penalty=-2.0)[0]
    assert repeats(encouraged) > repeats(greedy), encouraged


def test_auth_not_required_without_api_key(http):
    assert http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 200


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_openai_error_shape(http, route):
    r = http.post(route, json={"model": "x"})
    body = r.json()
    assert r.status_code in (400, 404) and set(body["error"]) == {"message", "type", "param", "code"}


# ---- the raw JSON, validated by the openai package's types (its client does not validate) -------
def sse_json(http, route: str, body: dict) -> list:
    with http.stream("POST", route, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completion_json_matches_openai_types(http, model_name):
    # Without echo: with it (and logprobs), the prompt's first token_logprobs / top_logprobs
    # entries are null, as OpenAI's legacy API, vLLM and SGLang send them, which openai-python's
    # types do not allow (its client does not validate responses; test_eval_clients.py covers echo).
    body = {"model": model_name, "prompt": ["Types", "More"], "max_tokens": 4, "temperature": 0, "logprobs": 2}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    c = Completion.model_validate(r.json())
    assert len(c.choices) == 2 and c.choices[0].logprobs.tokens and c.usage.completion_tokens == 8
    chunks = sse_json(http, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    # the client parses every chunk as a Completion, whose type wants a finish_reason that
    # OpenAI's own streams leave null until a choice's last chunk: validate the chunks with one
    final = [Completion.model_validate(ch) for ch in chunks if not ch["choices"] or ch["choices"][0]["finish_reason"]]
    assert [ch.choices[0].finish_reason for ch in final[:-1]] == ["length", "length"]
    assert final[-1].choices == [] and final[-1].usage.completion_tokens == 8


def test_chat_completion_json_matches_openai_types(http, model_name):
    body = {"model": model_name, "messages": [{"role": "user", "content": "Types"}], "max_tokens": 4,
            "temperature": 0, "n": 2, "logprobs": True, "top_logprobs": 2}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    c = ChatCompletion.model_validate(r.json())
    assert [ch.index for ch in c.choices] == [0, 1] and len(c.choices[0].logprobs.content) == 4
    chunks = [ChatCompletionChunk.model_validate(ch) for ch in sse_json(http, "/v1/chat/completions", {
        **body, "stream_options": {"include_usage": True}})]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {ch.choices[0].finish_reason for ch in chunks if ch.choices} == {None, "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_model_is_optional_and_unsupported_fields_are_refused(http, model_name):
    """As SGLang and vLLM: `model` may be left out (the served model answers); `suffix` and
    `best_of` > 1 are answered 400 rather than silently ignored."""
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["model"] == model_name
    cmpl = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert cmpl.status_code == 200 and cmpl.json()["model"] == model_name
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "suffix": "end"})
    assert r.status_code == 400 and "suffix is not supported" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "best_of": 2})
    assert r.status_code == 400 and "best_of is not supported" in r.json()["error"]["message"]
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "best_of": 1}).status_code == 200


def test_stop_regex_and_ebnf_reach_the_sampler_from_the_openai_routes(http):
    """SGLang's extras on the OpenAI routes: an EBNF grammar constrains the text, and a stop
    regex that the grammar's output must match ends the completion there."""
    body = {"prompt": "x", "max_tokens": 12, "temperature": 0, "ebnf": 'root ::= "ab" root | "ab"'}
    text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert text and set(text) <= {"a", "b"} and text.startswith("ab"), text
    stopped = http.post("/v1/completions", json={**body, "stop_regex": "b"}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["text"] in ("a", "ab"), stopped
