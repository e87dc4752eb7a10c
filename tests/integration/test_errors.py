"""Bad input gets a clear error with the right status; the server keeps serving."""

from __future__ import annotations

import json
import time

import pytest

from conftest import greedy, wait_idle


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


# ---- the hostile-input table (issue 16): every route, each case answered 4xx in time ----------
# (method, route, body, headers, status, a fragment of the error message or None). A body is
# sent as JSON (json.dumps writes NaN / Infinity literals, which the server's parser accepts,
# and escapes a lone surrogate as "\ud800", which it also accepts), or as raw bytes; "<model>"
# stands for the served model's name. After each case /health must still answer 200; the last
# test of this file sends normal requests.
MODEL = "<model>"
HUGE = 2**64
SURROGATE = "\ud800"  # a lone UTF-16 surrogate: valid JSON ("\ud800"), not valid Unicode
TEXT_PLAIN = {"content-type": "text/plain"}
FORM = {"content-type": "application/x-www-form-urlencoded"}
SESSION = "hostile-session"  # opened by the hostile_session fixture


def gen(sp=None, **body):
    return {"text": "hi", "sampling_params": {"max_new_tokens": 2, **(sp or {})}, **body}


def cmpl(**body):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **body}


def chat(content="hi", **body):
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}], **body}


def msg(**m):
    return chat(messages=[m])


def case(method, route, body, status, fragment, headers=JSON_HEADERS, id=None, marks=()):
    return pytest.param(method, route, body, headers, status, fragment, id=id, marks=marks)


GEN, CMPL, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"
HOSTILE = [
    # -- /generate: sampling parameters (the ones test_bad_sampling_params / test_hostile_sampling_params_are_refused lack)
    case("POST", GEN, gen({"top_k": True}), 400, "sampling_params.top_k: Input should be a number, not a boolean", id="gen-top_k-bool"),
    case("POST", GEN, gen({"max_new_tokens": True}), 400, "sampling_params.max_new_tokens", id="gen-max_new_tokens-bool"),
    case("POST", GEN, gen({"n": True}), 400, "sampling_params.n", id="gen-n-bool"),
    case("POST", GEN, gen({"temperature": False}), 400, "sampling_params.temperature", id="gen-temperature-bool"),
    case("POST", GEN, gen({"ignore_eos": "yes"}), 400, "sampling_params.ignore_eos: Input should be true or false", id="gen-ignore_eos-string"),
    case("POST", GEN, gen({"max_new_tokens": [1]}), 400, "sampling_params.max_new_tokens", id="gen-max_new_tokens-list"),
    case("POST", GEN, gen({"temperature": {"a": 1}}), 400, "sampling_params.temperature", id="gen-temperature-object"),
    case("POST", GEN, gen({"n": HUGE}), 400, "n must be at most 128", id="gen-n-2**64"),
    case("POST", GEN, gen({"n": -1}), 400, "n must be at least 1", id="gen-n-negative"),
    case("POST", GEN, gen({"top_k": -HUGE}), 400, "top_k must be -1 (disable), or at least 1", id="gen-top_k--2**64"),
    case("POST", GEN, gen({"min_new_tokens": -5}), 400, "min_new_tokens must be at least 0", id="gen-min_new_tokens-negative"),
    case("POST", GEN, gen({"sampling_seed": HUGE}), 400, "sampling_seed must be in [0, 2**63)", id="gen-seed-2**64"),
    case("POST", GEN, gen({"sampling_seed": 1.5}), 400, "sampling_params.sampling_seed", id="gen-seed-float"),
    case("POST", GEN, gen({"stop": 5}), 400, "sampling_params.stop", id="gen-stop-number"),
    case("POST", GEN, gen({"stop": [["nested"]]}), 400, "sampling_params.stop", id="gen-stop-nested-list"),
    case("POST", GEN, gen({"stop": SURROGATE}), 400, "stop is not valid Unicode", id="gen-stop-lone-surrogate"),
    case("POST", GEN, gen({"stop_token_ids": [HUGE]}), 400, "stop_token_ids entry 18446744073709551616 is out of the vocabulary", id="gen-stop_token_ids-2**64"),
    case("POST", GEN, gen({"stop_token_ids": [True]}), 400, "stop_token_ids: Input should be a list of token ids", id="gen-stop_token_ids-bool"),
    case("POST", GEN, gen({"stop_token_ids": "abc"}), 400, "sampling_params.stop_token_ids", id="gen-stop_token_ids-string"),
    case("POST", GEN, gen({"stop_regex": "[a-"}), 400, "not a valid regular expression", id="gen-stop_regex-bracket"),
    case("POST", GEN, gen({"stop_regex": "x" * 5000}), 400, "stop_regex takes patterns of at most 1024 characters", id="gen-stop_regex-huge"),
    case("POST", GEN, gen({"stop": ["x" * 2000]}), 400, "stop takes strings of at most 1024 bytes", id="gen-stop-huge"),
    case("POST", GEN, gen({"stop_regex": ["a"] * 65}), 400, "stop_regex takes at most 64 entries", id="gen-stop_regex-too-many"),
    case("POST", GEN, gen({"stop_regex": 5}), 400, "sampling_params.stop_regex", id="gen-stop_regex-number"),
    case("POST", GEN, gen({"logit_bias": {"abc": 1}}), 400, "logit_bias keys must be token ids", id="gen-logit_bias-key-not-a-number"),
    case("POST", GEN, gen({"logit_bias": {"-1": 1}}), 400, "out of the vocabulary", id="gen-logit_bias-negative-id"),
    case("POST", GEN, gen({"logit_bias": {"5": 1e308}}), 400, "logit_bias values must be in [-100, 100]", id="gen-logit_bias-1e308"),
    case("POST", GEN, gen({"logit_bias": {"5": float("-inf")}}), 400, "logit_bias values must be finite", id="gen-logit_bias--Infinity"),
    case("POST", GEN, gen({"logit_bias": {"5": "x"}}), 400, "sampling_params.logit_bias.5", id="gen-logit_bias-value-string"),
    case("POST", GEN, gen({"logit_bias": {"5": True}}), 400, "sampling_params.logit_bias", id="gen-logit_bias-value-bool"),
    case("POST", GEN, gen({"logit_bias": [1, 2]}), 400, "sampling_params.logit_bias", id="gen-logit_bias-list"),
    case("POST", GEN, gen({"regex": "("}), 400, "Invalid regex", id="gen-regex-invalid"),
    case("POST", GEN, gen({"json_schema": "{not json"}), 400, "Invalid json_schema", id="gen-json_schema-not-json"),
    case("POST", GEN, gen({"json_schema": '{"type": "nonsense"}'}), 400, "Invalid json_schema", id="gen-json_schema-bad-type"),
    case("POST", GEN, gen({"ebnf": "junk ::= ::="}), 400, "Invalid ebnf", id="gen-ebnf-invalid"),
    case("POST", GEN, gen({"regex": "a", "json_schema": "{}"}), 400, "Only one of regex, json_schema, ebnf or structural_tag", id="gen-two-grammars"),
    case("POST", GEN, b'{"text": "hi", "sampling_params": {"min_p": NaN}}', 400, "min_p must be a finite number", id="gen-NaN-literal"),
    case("POST", GEN, b'{"text": "hi", "sampling_params": {"frequency_penalty": -Infinity}}', 400, "frequency_penalty must be a finite number", id="gen--Infinity-literal"),
    case("POST", GEN, b'{"text": "hi", "sampling_params": {"max_new_tokens": 1e999}}', 400, "sampling_params.max_new_tokens", id="gen-1e999"),
    case("POST", GEN, b'{"text": "hi", "sampling_params": {"max_new_tokens": ' + b"9" * 5000 + b"}}", 400, "Malformed JSON", id="gen-5000-digit-integer"),
    case("POST", GEN, {"text": "hi", "sampling_params": "greedy"}, 400, "sampling_params must be an object", id="gen-sampling_params-string"),
    case("POST", GEN, {"text": "hi", "sampling_params": [{}, {}]}, 400, "sampling_params has 2 entries for 1 prompts", id="gen-sampling_params-list-length"),
    # -- /generate: the other fields
    case("POST", GEN, {"text": SURROGATE}, 400, "text is not valid Unicode", id="gen-text-lone-surrogate"),
    case("POST", GEN, {"text": ["ok", "\udfff"]}, 400, "text[1] is not valid Unicode", id="gen-batch-text-lone-surrogate"),
    case("POST", GEN, {"text": {"a": 1}}, 400, "text must be a string or a list of strings", id="gen-text-object"),
    case("POST", GEN, {"text": "x" * 150_000}, 400, "longer than the model's context length", id="gen-text-huge"),
    case("POST", GEN, {"input_ids": [True]}, 400, "input_ids must contain integers", id="gen-input_ids-bool"),
    case("POST", GEN, {"input_ids": [1.5]}, 400, "input_ids must contain integers", id="gen-input_ids-float"),
    case("POST", GEN, {"input_ids": [[1], "a"]}, 400, "input_ids must contain integers", id="gen-input_ids-mixed"),
    case("POST", GEN, {"input_ids": [[1], []]}, 400, "The input is empty", id="gen-input_ids-empty-row"),
    case("POST", GEN, {"input_ids": [HUGE]}, 400, "Input token ids must be in [0, ", id="gen-input_ids-2**64"),
    case("POST", GEN, {"input_ids": 5}, 400, "input_ids must be a list", id="gen-input_ids-number"),
    case("POST", GEN, gen(rid=5), 400, "rid", id="gen-rid-number"),
    case("POST", GEN, gen(rid={"a": 1}), 400, "rid", id="gen-rid-object"),
    case("POST", GEN, gen(rid=["a"]), 400, "rid must be a string", id="gen-rid-list-for-one-prompt"),
    case("POST", GEN, gen(rid=SURROGATE), 400, "rid is not valid Unicode", id="gen-rid-lone-surrogate"),
    case("POST", GEN, {"text": ["a", "b"], "rid": ["x"]}, 400, "rid has 1 entries for 2 prompts", id="gen-batch-rid-length"),
    case("POST", GEN, gen(return_logprob=[True]), 400, "return_logprob must be true or false", id="gen-return_logprob-list-for-one-prompt"),
    case("POST", GEN, gen(return_logprob="x"), 400, "return_logprob", id="gen-return_logprob-string"),
    case("POST", GEN, gen(logprob_start_len=HUGE, return_logprob=True), 400, "logprob_start_len", id="gen-logprob_start_len-2**64"),
    case("POST", GEN, gen(logprob_start_len=-5, return_logprob=True), 400, "logprob_start_len", id="gen-logprob_start_len-negative"),
    case("POST", GEN, gen(top_logprobs_num=HUGE, return_logprob=True), 400, "top_logprobs_num", id="gen-top_logprobs_num-2**64"),
    case("POST", GEN, gen(top_logprobs_num=10**6, return_logprob=True), 400, "top_logprobs_num must be an integer in [0, ", id="gen-top_logprobs_num-over-vocab"),
    case("POST", GEN, gen(top_logprobs_num=-1), 400, "top_logprobs_num", id="gen-top_logprobs_num-negative"),
    case("POST", GEN, gen(stream=1), 400, "stream: Input should be a valid boolean", id="gen-stream-number"),
    case("POST", GEN, gen(priority=HUGE), 400, "priority", id="gen-priority-2**64"),
    case("POST", GEN, gen(session_params={"id": "no-such-session"}), 400, "does not exist", id="gen-session-nonexistent"),
    case("POST", GEN, gen(session_params="x"), 400, "session_params", id="gen-session_params-string"),
    case("POST", GEN, gen(session_params={"id": SESSION, "rid": "no-such-rid"}), 400, "is not a finished request of session", id="gen-session-unknown-rid"),
    case("POST", GEN, gen({"n": 2}, session_params={"id": SESSION}), 400, "n > 1 cannot continue a session", id="gen-session-n2"),
    case("POST", GEN, {"text": ["a", "b"], "session_params": {"id": SESSION}}, 400, "session_params takes a single prompt", id="gen-session-batch"),
    # -- /generate: the body itself
    case("POST", GEN, b'{"text": "\xff\xfe"}', 400, "Malformed JSON", id="gen-invalid-utf8"),
    case("POST", GEN, b'"just a string"', 400, "must be a JSON object", id="gen-body-string"),
    case("POST", GEN, b"42", 400, "must be a JSON object", id="gen-body-number"),
    case("POST", GEN, b"null", 400, "must be a JSON object", id="gen-body-null"),
    case("POST", GEN, b'{"text": ' + b'{"a":' * 20_000 + b"1" + b"}" * 20_000 + b"}", 400, "nested too deeply", id="gen-deep-objects"),
    case("POST", GEN, b'{"text": "hi"}', 415, "application/json", {"content-type": "multipart/form-data; boundary=x"}, id="gen-multipart"),
    case("PUT", GEN, gen(), 405, None, id="gen-PUT"),
    case("GET", GEN, None, 405, None, id="gen-GET"),
    # -- /v1/completions
    case("POST", CMPL, cmpl(top_k=True), 400, "top_k", id="cmpl-top_k-bool"),
    case("POST", CMPL, cmpl(temperature=True), 400, "temperature", id="cmpl-temperature-bool"),
    case("POST", CMPL, cmpl(max_tokens=HUGE), 400, "max_new_tokens must be at most", id="cmpl-max_tokens-2**64"),
    case("POST", CMPL, cmpl(max_tokens=-1), 400, "max_new_tokens must be at least 0", id="cmpl-max_tokens-negative"),
    case("POST", CMPL, cmpl(min_tokens=HUGE), 400, "min_new_tokens must be at most", id="cmpl-min_tokens-2**64"),
    case("POST", CMPL, cmpl(n=HUGE), 400, "n must be at most", id="cmpl-n-2**64"),
    case("POST", CMPL, cmpl(seed=HUGE), 400, "sampling_seed must be in [0, 2**63)", id="cmpl-seed-2**64"),
    case("POST", CMPL, cmpl(seed=-1), 400, "sampling_seed must be in [0, 2**63)", id="cmpl-seed-negative"),
    case("POST", CMPL, cmpl(logprobs=21), 400, "logprobs", id="cmpl-logprobs-21"),
    case("POST", CMPL, cmpl(logprobs=HUGE), 400, "logprobs", id="cmpl-logprobs-2**64"),
    case("POST", CMPL, cmpl(logit_bias={"abc": 1}), 400, "logit_bias keys must be token ids", id="cmpl-logit_bias-key"),
    case("POST", CMPL, b'{"model": "<model>", "prompt": "hi", "logit_bias": {"5": Infinity}}', 400, "logit_bias values must be finite", id="cmpl-logit_bias-Infinity-literal"),
    case("POST", CMPL, cmpl(logit_bias={"5": -101}), 400, "logit_bias values must be in [-100, 100]", id="cmpl-logit_bias-over-100"),
    case("POST", CMPL, cmpl(logit_bias="x"), 400, "logit_bias", id="cmpl-logit_bias-string"),
    case("POST", CMPL, cmpl(presence_penalty=float("inf")), 400, "presence_penalty must be a finite number", id="cmpl-presence_penalty-Infinity"),
    case("POST", CMPL, cmpl(stream_options="x"), 400, "stream_options", id="cmpl-stream_options-string"),
    case("POST", CMPL, cmpl(stream=True, stream_options={"include_usage": "maybe"}), 400, "stream_options.include_usage", id="cmpl-stream_options-junk"),
    case("POST", CMPL, cmpl(stop=[5]), 400, "stop", id="cmpl-stop-number"),
    case("POST", CMPL, cmpl(stop=["x"] * 65), 400, "stop takes at most 64 entries", id="cmpl-stop-too-many"),
    case("POST", CMPL, cmpl(prompt=[True]), 400, "prompt", id="cmpl-prompt-bool"),
    case("POST", CMPL, cmpl(prompt={"a": 1}), 400, "prompt", id="cmpl-prompt-object"),
    case("POST", CMPL, cmpl(prompt=None), 400, "prompt", id="cmpl-prompt-null"),
    case("POST", CMPL, cmpl(prompt=[[1], "a"]), 400, "prompt", id="cmpl-prompt-mixed"),
    case("POST", CMPL, cmpl(prompt=[[1], []]), 400, "The input is empty", id="cmpl-prompt-empty-row"),
    case("POST", CMPL, cmpl(prompt=[-1], echo=True), 400, "token ids must be in [0, ", id="cmpl-echo-negative-id"),
    case("POST", CMPL, cmpl(prompt=[2**40], echo=True), 400, "token ids must be in [0, ", id="cmpl-echo-id-2**40"),
    case("POST", CMPL, cmpl(prompt=SURROGATE), 400, "prompt is not valid Unicode", id="cmpl-prompt-lone-surrogate"),
    case("POST", CMPL, cmpl(stop=SURROGATE), 400, "stop is not valid Unicode", id="cmpl-stop-lone-surrogate"),
    case("POST", CMPL, cmpl(model=5), 400, "model", id="cmpl-model-number"),
    case("POST", CMPL, cmpl(echo="x"), 400, "echo", id="cmpl-echo-string"),
    case("POST", CMPL, cmpl(regex="("), 400, "Invalid regex", id="cmpl-regex-invalid"),
    case("POST", CMPL, cmpl(json_schema="{bad"), 400, "Invalid json_schema", id="cmpl-json_schema-invalid"),
    case("POST", CMPL, cmpl(priority=HUGE), 400, "priority", id="cmpl-priority-2**64"),
    case("POST", CMPL, b"", 400, "The request body is empty", id="cmpl-empty-body"),
    case("POST", CMPL, b"[1, 2]", 400, "must be a JSON object", id="cmpl-body-list"),
    case("POST", CMPL, cmpl(), 415, "application/json", TEXT_PLAIN, id="cmpl-text-plain"),
    # -- /v1/chat/completions
    case("POST", CHAT, chat(messages="hi"), 400, "messages", id="chat-messages-string"),
    case("POST", CHAT, chat(messages={"role": "user"}), 400, "messages", id="chat-messages-object"),
    case("POST", CHAT, chat(messages=[5]), 400, "messages.0", id="chat-message-number"),
    case("POST", CHAT, msg(content="hi"), 400, "messages.0.role: Field required", id="chat-message-no-role"),
    case("POST", CHAT, msg(role=5, content="hi"), 400, "messages.0.role", id="chat-role-number"),
    case("POST", CHAT, msg(role="user"), 400, "a user message needs content", id="chat-user-without-content"),
    case("POST", CHAT, chat(content=5), 400, "messages.0.content", id="chat-content-number"),
    case("POST", CHAT, chat(content={"a": 1}), 400, "messages.0.content", id="chat-content-object"),
    case("POST", CHAT, chat(content=[5]), 400, "messages.0.content", id="chat-content-part-number"),
    case("POST", CHAT, chat(content=[{"type": "image_url", "image_url": {"url": "http://x"}}]), 400, "takes text only", id="chat-content-image"),
    case("POST", CHAT, chat(content=[{"type": "image_url", "image_url": {"uri": "x"}}]), 400, "without a string `image_url.url`", id="chat-content-image-no-url"),
    case("POST", CHAT, chat(content=[{"type": "video_url", "video_url": {"url": "x"}}]), 400, "video and audio input are not supported", id="chat-content-video"),
    case("POST", CHAT, chat(content=[{"type": "file", "file": {}}]), 400, "only text and image_url parts", id="chat-content-file"),
    case("POST", CHAT, chat(content=[{"type": "refusal"}]), 400, "only text and image_url parts", id="chat-content-unknown-part"),
    case("POST", GEN, {"text": "hi", "image_data": ["data:image/png;base64,AAAA"]}, 400, "takes text only", id="gen-image-data-text-model"),
    case("POST", GEN, {"text": "hi", "image_data": 5}, 400, "image_data", id="gen-image-data-number"),
    case("POST", CHAT, chat(content=[{"type": "text"}]), 400, "without a string `text`", id="chat-content-text-part-no-text"),
    case("POST", CHAT, chat(content=[{"type": "text", "text": 5}]), 400, "without a string `text`", id="chat-content-text-part-number"),
    case("POST", CHAT, chat(content=SURROGATE), 400, "messages[0].content is not valid Unicode", id="chat-content-lone-surrogate"),
    case("POST", CHAT, chat(content="x" * 150_000), 400, "longer than the model's context length", id="chat-content-huge"),
    case("POST", CHAT, msg(role="function", content="x", name={"a": 1}), 400, "messages.0.name", id="chat-name-object"),
    case("POST", CHAT, msg(role="assistant", content="x", tool_calls="junk"), 400, "messages.0.tool_calls", id="chat-tool_calls-string"),
    case("POST", CHAT, msg(role="assistant", tool_calls=[{"id": 1, "function": {"name": 5}}]), 400, "messages.0.tool_calls.0", id="chat-tool_calls-junk"),
    case("POST", CHAT, chat(tools="junk"), 400, "tools", id="chat-tools-string"),
    case("POST", CHAT, chat(tools=[{"type": "function", "function": {"name": 5}}]), 400, "tools.0.function.name", id="chat-tools-name-number"),
    case("POST", CHAT, chat(tools=[{"type": "retrieval"}]), 400, "tools.0", id="chat-tools-unknown-type"),
    case("POST", CHAT, chat(tool_choice={"x": 1}), 400, "tool_choice", id="chat-tool_choice-junk"),
    case("POST", CHAT, chat(response_format="json"), 400, "response_format", id="chat-response_format-string"),
    case("POST", CHAT, chat(response_format={"type": "xml"}), 400, "response_format.type", id="chat-response_format-xml"),
    case("POST", CHAT, chat(response_format={"type": "json_schema", "json_schema": "x"}), 400, "response_format.json_schema", id="chat-response_format-json_schema-string"),
    case("POST", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}), 400, "Invalid json_schema", id="chat-json_schema-bad-type"),
    case("POST", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "("}}}), 400, "Invalid json_schema", id="chat-json_schema-bad-regex"),
    case("POST", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nowhere"}}}), 400, "Invalid json_schema", id="chat-json_schema-dangling-ref"),
    case("POST", CHAT, chat(regex="[z-a]"), 400, "Invalid regex", id="chat-regex-bad-range"),
    case("POST", CHAT, chat(ebnf="root ::= ("), 400, "Invalid ebnf", id="chat-ebnf-invalid"),
    case("POST", CHAT, chat(logprobs="x"), 400, "logprobs", id="chat-logprobs-string"),
    case("POST", CHAT, chat(top_logprobs=5), 400, "top_logprobs needs logprobs", id="chat-top_logprobs-without-logprobs"),
    case("POST", CHAT, chat(logprobs=True, top_logprobs=HUGE), 400, "top_logprobs", id="chat-top_logprobs-2**64"),
    case("POST", CHAT, chat(max_completion_tokens=HUGE), 400, "max_new_tokens must be at most", id="chat-max_completion_tokens-2**64"),
    case("POST", CHAT, chat(max_completion_tokens=-1), 400, "max_new_tokens must be at least 0", id="chat-max_completion_tokens-negative"),
    case("POST", CHAT, chat(n=HUGE), 400, "n must be at most", id="chat-n-2**64"),
    case("POST", CHAT, chat(seed=HUGE), 400, "sampling_seed", id="chat-seed-2**64"),
    case("POST", CHAT, chat(stream_options=5), 400, "stream_options", id="chat-stream_options-number"),
    case("POST", CHAT, chat(logit_bias={"x": 1}), 400, "logit_bias keys must be token ids", id="chat-logit_bias-key"),
    case("POST", CHAT, chat(top_k=True), 400, "top_k", id="chat-top_k-bool"),
    case("POST", CHAT, b'{"model": "<model>", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "temperature must be a finite number", id="chat-NaN-literal"),
    case("POST", CHAT, b'{"model": "<model>", "messages": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", 400, "nested too deeply", id="chat-deep-lists"),
    case("POST", CHAT, b'{"model": "\xc3\x28"}', 400, "Malformed JSON", id="chat-invalid-utf8"),
    case("POST", CHAT, chat(content="x" * 250_000), 413, "larger than 200000 bytes", id="chat-body-over-limit"),
    case("POST", CHAT, b"model=x&messages=y", 415, "application/json", FORM, id="chat-form-encoded"),
    # -- /abort_request
    case("POST", "/abort_request", {"rid": 5}, 400, "rid", id="abort-rid-number"),
    case("POST", "/abort_request", {"rid": ["a"]}, 400, "rid", id="abort-rid-list"),
    case("POST", "/abort_request", {"rid": None}, 400, "rid", id="abort-rid-null"),
    case("POST", "/abort_request", {"abort_all": "yes"}, 400, "abort_all", id="abort-abort_all-string"),
    case("POST", "/abort_request", {"abort_all": 1}, 400, "abort_all", id="abort-abort_all-number"),
    case("POST", "/abort_request", {"rid": SURROGATE}, 400, "rid is not valid Unicode", id="abort-rid-lone-surrogate"),
    case("POST", "/abort_request", b"[1]", 400, "must be a JSON object", id="abort-body-list"),
    case("POST", "/abort_request", b"[" * 30_000 + b"]" * 30_000, 400, "nested too deeply", id="abort-deep-lists"),
    # -- /flush_cache
    case("POST", "/flush_cache", b"flush", 415, "application/json", TEXT_PLAIN, id="flush-text-plain"),
    case("DELETE", "/flush_cache", None, 405, None, id="flush-DELETE"),
    # -- /open_session, /close_session
    case("POST", "/open_session", {"session_id": SESSION}, 400, "is already open", id="open-duplicate-session"),
    case("POST", "/open_session", {"capacity_of_str_len": "x"}, 400, "capacity_of_str_len", id="open-capacity-string"),
    case("POST", "/open_session", {"session_id": 5}, 400, "session_id", id="open-session_id-number"),
    case("POST", "/open_session", {"session_id": ["a"]}, 400, "session_id", id="open-session_id-list"),
    case("POST", "/open_session", b'"x"', 400, "must be a JSON object", id="open-body-string"),
    case("POST", "/open_session", b"", 400, "The request body is empty", id="open-empty-body"),
    case("POST", "/open_session", b"{}", 415, "application/json", FORM, id="open-form-encoded"),
    case("POST", "/open_session", {"session_id": SURROGATE}, 400, "not valid Unicode", id="open-session_id-lone-surrogate"),
    case("POST", "/close_session", {"session_id": "no-such-session"}, 400, "does not exist", id="close-nonexistent"),
    case("POST", "/close_session", {}, 400, "does not exist", id="close-no-id"),
    case("POST", "/close_session", {"session_id": 5}, 400, "session_id", id="close-session_id-number"),
    case("POST", "/close_session", {"session_id": None}, 400, "session_id", id="close-session_id-null"),
    case("POST", "/close_session", b"5", 400, "must be a JSON object", id="close-body-number"),
    case("POST", "/close_session", b'{"session_id": "x"}', 415, "application/json", TEXT_PLAIN, id="close-text-plain"),
    # -- the GET routes
    case("POST", "/get_server_info", {}, 405, None, id="server_info-POST"),
    case("POST", "/health", {}, 405, None, id="health-POST"),
    case("PUT", "/health_generate", {}, 405, None, id="health_generate-PUT"),
    case("POST", "/metrics", {}, 405, None, id="metrics-POST"),
    case("GET", "/v1/models/no-such-model", None, 404, "does not exist", id="model-unknown"),
    case("GET", "/v1/models/..%2F..%2Fetc%2Fpasswd", None, 404, "does not exist", id="model-path-traversal"),
    case("GET", "/v1/models/%00", None, 404, "does not exist", id="model-nul"),
    case("GET", "/v1/models/" + "x" * 5000, None, 404, "does not exist", id="model-huge-id"),
    case("DELETE", "/v1/models/x", None, 405, None, id="model-DELETE"),
]


@pytest.fixture(scope="module")
def hostile_session(http):
    """A session that exists, for the cases that need one (duplicate open, bad continuations)."""
    r = http.post("/open_session", json={"session_id": SESSION})
    assert r.status_code == 200 or "already open" in r.text, r.text
    yield SESSION
    http.post("/close_session", json={"session_id": SESSION})


def _with_model(body, model_name):
    if isinstance(body, bytes):
        return body.replace(MODEL.encode(), model_name.encode())
    if isinstance(body, dict) and body.get("model") == MODEL:
        body = {**body, "model": model_name}
    return json.dumps(body).encode()


@pytest.mark.parametrize("method, route, body, headers, status, fragment", HOSTILE)
def test_hostile_input_is_refused(http, model_name, hostile_session, method, route, body, headers, status, fragment):
    content = None if body is None else _with_model(body, model_name)
    r = http.request(method, route, content=content, headers=headers, timeout=30)  # in time, or ReadTimeout
    assert r.status_code == status, r.text
    if fragment is not None:
        assert fragment in r.json()["error"]["message"], r.text
    assert http.get("/health", timeout=10).status_code == 200


def test_server_healthy_after_hostile_input(http, openai_client, model_name):
    """After every case above: healthy, serving, and no request state left behind."""
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    r = http.post("/generate", json={"text": "still alive", "sampling_params": greedy(3)})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 3
    c = openai_client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2, temperature=0)
    assert c.usage.completion_tokens == 2
    info = wait_idle(http)
    assert info["tokenizer_manager"]["num_pending_reqs"] == 0


def test_catastrophic_stop_regex_ends_its_request_not_the_scheduler(http):
    """(a|a)+\\1z against an output of a's backtracks exponentially (even in the `regex` module,
    which takes (a+)+b in stride): the stop check runs under a time limit, so the request ends
    with a 400 that names the pattern, in seconds, and the server keeps serving. logit_bias
    forces the tiny model's "aaaa" token (id 4815)."""
    pattern = "(a|a)+\\1z"
    body = {"text": "hi", "sampling_params": {"stop_regex": pattern, "logit_bias": {"4815": 100},
                                              "max_new_tokens": 64, "temperature": 0}}
    start = time.monotonic()
    r = http.post("/generate", json=body, timeout=60)
    assert "took over" in err(r, 400) and "(a|a)+" in r.json()["error"]["message"]
    assert time.monotonic() - start < 20
    ok = http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200 and http.get("/health").status_code == 200
