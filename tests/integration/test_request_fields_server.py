"""Issue 43 items 4, 7 and stream_interval on /v1, through real servers: token_ids_logprob
against the full-vocabulary logprobs (and at prompt positions against transformers),
return_hidden_states against transformers, input_embeds equal to the token path (on a
--disable-radix-cache server) and their 400s, custom_logit_processor refused without its flag and
working with it, --allow-auto-truncate, data_parallel_rank routing (and its 400), and the DP
methods minimum_tokens and decode_round_robin routing where they say."""

from __future__ import annotations

import random
import signal
import time

import pytest
import torch
import transformers

from conftest import ServerProcess, assert_children_gone, greedy, stream_in_background

PROMPT = [3894, 7952, 5248, 1234, 2346]


@pytest.fixture(scope="module")
def hf():
    from radixserve.tiny_model import get_tiny_model_path  # the model the servers here serve

    return transformers.AutoModelForCausalLM.from_pretrained(str(get_tiny_model_path()), dtype=torch.float32).eval()


# ---- the shared server (flags off) --------------------------------------------------------------
def test_token_ids_logprob_through_generate(http):
    body = {"input_ids": PROMPT, "sampling_params": greedy(4), "return_logprob": True}
    full = http.post("/generate", json={**body, "top_logprobs_num": 8192}).json()["meta_info"]
    r = http.post("/generate", json={**body, "token_ids_logprob": [7, 99, 8000]})
    assert r.status_code == 200, r.text
    rows = r.json()["meta_info"]["output_token_ids_logprobs"]
    assert len(rows) == 4
    for row, top in zip(rows, full["output_top_logprobs"]):
        by_id = {t: v for v, t, _ in top}
        assert [t for _, t, _ in row] == [7, 99, 8000]
        # the second request hits the first's prefix in the cache: its logits come from another
        # attention path (a cached prefix), equal to float32 rounding (~1e-6 relative)
        assert [v for v, _, _ in row] == pytest.approx([by_id[t] for t in (7, 99, 8000)], rel=2e-6, abs=1e-5)
    bad = http.post("/generate", json={**body, "token_ids_logprob": [8192]})
    assert bad.status_code == 400 and "token_ids_logprob" in bad.json()["error"]["message"]


def test_hidden_states_and_prompt_token_ids_logprob_through_generate(http, hf):
    """meta_info.hidden_states against transformers' final hidden states, input_token_ids_logprobs
    against its log_softmax (the shared server: radix cache and overlap on)."""
    body = {"input_ids": PROMPT, "sampling_params": greedy(5, ignore_eos=True), "return_hidden_states": True,
            "return_logprob": True, "logprob_start_len": 0, "token_ids_logprob": [7, 99]}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT + out["output_ids"][:-1]]), output_hidden_states=True)
    hs = out["meta_info"]["hidden_states"]
    got = torch.tensor([hs[0][0], *hs[1:]])
    assert got.shape == (5, 256)
    assert (got - ref.hidden_states[-1][0, len(PROMPT) - 1:]).abs().max().item() <= 1e-4
    rows = out["meta_info"]["input_token_ids_logprobs"]
    lp = torch.log_softmax(ref.logits[0].float(), -1)
    assert rows[0] is None and len(rows) == len(PROMPT)
    for j, row in enumerate(rows[1:], start=1):
        assert [t for _, t, _ in row] == [7, 99]
        assert max(abs(v - lp[j - 1, t].item()) for v, t, _ in row) <= 1e-4
    bad = http.post("/generate", json={**body, "return_hidden_states": "yes"})
    assert bad.status_code == 400, bad.text


def test_input_embeds_is_400_with_the_radix_cache_on(http):
    r = http.post("/generate", json={"input_embeds": [[0.0] * 256] * 3, "sampling_params": greedy(2)})
    assert r.status_code == 400 and "--disable-radix-cache" in r.json()["error"]["message"], r.text


def test_input_embeds_through_generate_equal_the_token_path(hf):
    srv = ServerProcess("--disable-radix-cache", "--max-total-tokens", "2000", "--chunked-prefill-size", "4")
    try:
        with srv.client() as c:
            embeds = hf.model.embed_tokens.weight[torch.tensor(PROMPT)].tolist()
            body = {"sampling_params": greedy(6, ignore_eos=True), "return_logprob": True}
            by_ids = c.post("/generate", json={**body, "input_ids": PROMPT}).json()
            r = c.post("/generate", json={**body, "input_embeds": embeds})
            assert r.status_code == 200, r.text
            by_embeds = r.json()
            assert by_embeds["output_ids"] == by_ids["output_ids"]
            assert by_embeds["text"] == by_ids["text"]
            assert [v for v, _, _ in by_embeds["meta_info"]["output_token_logprobs"]] == pytest.approx(
                [v for v, _, _ in by_ids["meta_info"]["output_token_logprobs"]], abs=1e-4)
            for bad, message in [({"input_embeds": [row[:100] for row in embeds]}, "hidden size is 256"),
                                 ({"input_embeds": []}, "non-empty list"),
                                 ({"input_embeds": embeds, "input_ids": PROMPT}, "exactly one of them"),
                                 ({"input_embeds": [["x"] * 256]}, "rows of 256 numbers")]:
                r = c.post("/generate", json={**bad, "sampling_params": greedy(2)})
                assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
            assert c.get("/health").status_code == 200  # still serving
    finally:
        assert srv.stop(signal.SIGTERM) == 0
    assert_children_gone(srv.children)


def test_custom_logit_processor_is_400_without_the_flag(http):
    r = http.post("/generate", json={"input_ids": PROMPT, "custom_logit_processor": "force_token",
                                     "sampling_params": greedy(2, custom_params={"token_id": 5})})
    assert r.status_code == 400 and "--enable-custom-logit-processor" in r.json()["error"]["message"]


def test_data_parallel_rank_beyond_dp_size_is_400(http):
    r = http.post("/generate", json={"input_ids": PROMPT, "data_parallel_rank": 1, "sampling_params": greedy(2)})
    assert r.status_code == 400 and "data_parallel_rank" in r.json()["error"]["message"]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_stream_interval_on_the_v1_routes(openai_client, model_name, route):
    def chunks(**extra):
        kw = dict(model=model_name, max_tokens=12, temperature=0, stream=True,
                  extra_body={"ignore_eos": True, **extra})
        if route == "chat":
            stream = openai_client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **kw)
            return [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
        stream = openai_client.completions.create(prompt=PROMPT, **kw)
        return [c.choices[0].text for c in stream if c.choices and c.choices[0].text]

    every, fourth = chunks(), chunks(stream_interval=4)
    assert "".join(every) == "".join(fourth)
    assert len(every) > 4  # about a token per chunk (fewer where a split character is held back)
    assert len(fourth) <= 4  # after tokens 1, 5, 9 and 12


# ---- --dp-size 2 servers -------------------------------------------------------------------------
def _prompt_tokens(c) -> list:
    return [s["prompt_tokens"] for s in c.get("/get_server_info").json()["internal_states"]]


def _ids(rng: random.Random, n: int) -> list:
    return [rng.randrange(3, 8192) for _ in range(n)]


def test_dp_minimum_tokens_rank_routing_processors_and_truncation():
    srv = ServerProcess("--dp-size", "2", "--load-balance-method", "minimum_tokens", "--max-total-tokens", "4000",
                        "--enable-custom-logit-processor", "--allow-auto-truncate", "--context-length", "2048")
    rng = random.Random(43)
    try:
        with srv.client() as c:
            # data_parallel_rank: every request to replica 1, whatever the method would pick
            before = _prompt_tokens(c)
            for _ in range(3):
                r = c.post("/generate", json={"input_ids": _ids(rng, 7), "data_parallel_rank": 1, "sampling_params": greedy(2)})
                assert r.status_code == 200, r.text
            after = _prompt_tokens(c)
            assert (after[0] - before[0], after[1] - before[1]) == (0, 21)
            r = c.post("/generate", json={"input_ids": PROMPT, "data_parallel_rank": 2})
            assert r.status_code == 400 and "[0, 2)" in r.json()["error"]["message"]

            # minimum_tokens: a long request runs on one replica; short ones all go to the other
            long_body = {"input_ids": _ids(rng, 1500), "rid": "long-one", "sampling_params": greedy(500, ignore_eos=True)}
            thread, events = stream_in_background(srv, long_body)
            deadline = time.monotonic() + 60
            while len(events) < 2 and time.monotonic() < deadline:  # it runs (its first token came)
                time.sleep(0.05)
            before = _prompt_tokens(c)
            busy = 0 if before[0] >= 1500 else 1
            for _ in range(4):
                assert c.post("/generate", json={"input_ids": _ids(rng, 10), "sampling_params": greedy(2)}).status_code == 200
            after = _prompt_tokens(c)
            still_running = events[-1] != "[DONE]"
            c.post("/abort_request", json={"rid": "long-one"})
            thread.join(60)
            assert still_running, "the long request ended before the short ones were routed"
            assert after[busy] == before[busy] and after[1 - busy] - before[1 - busy] == 40, (before, after, busy)

            # custom_logit_processor with the flag
            r = c.post("/generate", json={"input_ids": PROMPT, "custom_logit_processor": "force_token",
                                          "sampling_params": greedy(5, custom_params={"token_id": 77})})
            assert r.status_code == 200 and r.json()["output_ids"] == [77] * 5, r.text
            r = c.post("/generate", json={"input_ids": PROMPT, "custom_logit_processor": "no_such"})
            assert r.status_code == 400 and "registered processor" in r.json()["error"]["message"]

            # --allow-auto-truncate: a prompt beyond the context is cut, not refused
            r = c.post("/generate", json={"input_ids": _ids(rng, 3000), "sampling_params": greedy(3)})
            assert r.status_code == 200, r.text
            assert r.json()["meta_info"]["prompt_tokens"] == 2048 - 2
    finally:
        assert srv.stop(signal.SIGTERM) == 0
    assert_children_gone(srv.children)


def test_dp_decode_round_robin_follows_the_bootstrap_room():
    srv = ServerProcess("--dp-size", "2", "--load-balance-method", "decode_round_robin", "--max-total-tokens", "2000")
    rng = random.Random(7)
    try:
        with srv.client() as c:
            before = _prompt_tokens(c)
            for room in (1, 3, 5):  # odd rooms: replica 1 (this server is no PD server: they run as usual)
                body = {"input_ids": _ids(rng, 9), "bootstrap_host": "127.0.0.1", "bootstrap_room": room,
                        "sampling_params": greedy(2)}
                r = c.post("/generate", json=body)
                assert r.status_code == 200, r.text
            mid = _prompt_tokens(c)
            assert (mid[0] - before[0], mid[1] - before[1]) == (0, 27)
            for _ in range(4):  # without a room: in turn
                assert c.post("/generate", json={"input_ids": _ids(rng, 5), "sampling_params": greedy(2)}).status_code == 200
            after = _prompt_tokens(c)
            assert (after[0] - mid[0], after[1] - mid[1]) == (10, 10)
    finally:
        assert srv.stop(signal.SIGTERM) == 0
    assert_children_gone(srv.children)


def test_structural_tag_in_response_format(http, model_name):
    """SGLang's response_format {"type": "structural_tag"}: xgrammar's format (a tag around a
    JSON value) and the OpenAI-style structures + triggers; a bad one is a 400."""
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<tool>", "end": "</tool>", "content": {
        "type": "json_schema", "json_schema": {"type": "integer", "minimum": 0, "maximum": 999}}}}
    body = {"model": model_name, "messages": [{"role": "user", "content": "Call a tool."}], "max_tokens": 40, "temperature": 0}
    r = http.post("/v1/chat/completions", json={**body, "response_format": tag})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    assert content.startswith("<tool>") and content.endswith("</tool>"), content
    assert 0 <= int(content[len("<tool>"):-len("</tool>")].strip()) <= 999
    triggered = {"type": "structural_tag", "triggers": ["<f="],
                 "structures": [{"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}]}
    assert http.post("/v1/chat/completions", json={**body, "max_tokens": 4, "response_format": triggered}).status_code == 200
    bad = http.post("/v1/chat/completions", json={**body, "response_format": {"type": "structural_tag", "structures": []}})
    assert bad.status_code == 400 and "structural_tag" in bad.json()["error"]["message"], bad.text
