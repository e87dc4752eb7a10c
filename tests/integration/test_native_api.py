"""SGLang's native API: /generate (single, batch, input_ids, stream, stop, logprobs, n),
info routes, abort by rid, a client that disconnects mid-stream, sessions, metrics."""

from __future__ import annotations

import json
import threading
import time

import httpx

from conftest import MAX_TOTAL_TOKENS, greedy, server_state, wait_idle


def sse_events(resp: httpx.Response) -> list:
    events = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            events.append(line[len("data: "):])
    return events


def test_generate_text(http):
    r = http.post("/generate", json={"text": "The capital of France is", "sampling_params": greedy(8)})
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out["text"], str) and len(out["output_ids"]) == 8
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["completion_tokens"] == 8 and meta["prompt_tokens"] > 0
    assert {"id", "cached_tokens", "e2e_latency"} <= set(meta)


def test_generate_input_ids_and_batch(http):
    single = http.post("/generate", json={"input_ids": [5, 6, 7, 8], "sampling_params": greedy(4)}).json()
    assert single["meta_info"]["prompt_tokens"] == 4
    batch = http.post("/generate", json={"input_ids": [[5, 6, 7, 8], [9, 10, 11]], "sampling_params": greedy(4)}).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0]["output_ids"] == single["output_ids"]  # greedy: same prompt, same tokens
    texts = http.post("/generate", json={
        "text": ["Hello", "World"], "sampling_params": [greedy(3), greedy(5)], "rid": ["b-0", "b-1"],
    }).json()
    assert [len(o["output_ids"]) for o in texts] == [3, 5]
    assert [o["meta_info"]["id"] for o in texts] == ["b-0", "b-1"]


def test_generate_stream_matches_non_stream(http):
    body = {"text": "Once upon a time", "sampling_params": greedy(12)}
    plain = http.post("/generate", json=body).json()
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    outs = [json.loads(e) for e in events[:-1]]
    assert len(outs) >= 2
    texts = [o["text"] for o in outs]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))  # cumulative
    # a chunk never ends inside a multi-byte character (random weights can still make invalid bytes)
    assert all(not t.endswith("\ufffd") for t in texts[:-1])
    assert outs[-1]["text"] == plain["text"] and outs[-1]["output_ids"] == plain["output_ids"]
    assert outs[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert all(o["meta_info"]["finish_reason"] is None for o in outs[:-1])


def test_stop_string_trimmed(http):
    base = http.post("/generate", json={"text": "Hello there", "sampling_params": greedy(16)}).json()
    text = base["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip() and "\ufffd" not in stop
    out = http.post("/generate", json={"text": "Hello there", "sampling_params": greedy(16, stop=stop)}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.find(stop)]
    kept = http.post("/generate", json={"text": "Hello there", "sampling_params": greedy(16, stop=stop, no_stop_trim=True)}).json()
    # kept: up to the end of the token that completed the stop string, which may run past it
    assert kept["text"].startswith(text[: text.find(stop) + len(stop)]) and text.startswith(kept["text"]), (kept, text)
    assert kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # streaming never shows a part of the stop string
    with http.stream("POST", "/generate", json={"text": "Hello there", "stream": True, "sampling_params": greedy(16, stop=stop)}) as r:
        outs = [json.loads(e) for e in sse_events(r)[:-1]]
    assert outs[-1]["text"] == out["text"]
    assert all(out["text"].startswith(o["text"]) for o in outs)


def test_stop_token_ids(http):
    base = http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": greedy(8)}).json()
    tok = base["output_ids"][3]
    out = http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": greedy(8, stop_token_ids=[tok])}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}
    assert out["output_ids"][-1] == tok and len(out["output_ids"]) == base["output_ids"].index(tok) + 1


def test_special_tokens(http):
    body = {"input_ids": [5, 6, 7], "sampling_params": greedy(3, logit_bias={"1": 100.0}, ignore_eos=True)}
    out = http.post("/generate", json=body).json()
    assert out["output_ids"] == [1, 1, 1] and out["text"] == ""  # <|im_start|> skipped by default
    body["sampling_params"]["skip_special_tokens"] = False
    assert http.post("/generate", json=body).json()["text"] == "<|im_start|>" * 3
    body["stream"] = True
    with http.stream("POST", "/generate", json=body) as r:
        outs = [json.loads(e) for e in sse_events(r)[:-1]]
    assert outs[-1]["text"] == "<|im_start|>" * 3


def test_logprobs(http):
    out = http.post("/generate", json={
        "text": "Logprobs please", "sampling_params": greedy(5), "return_logprob": True,
        "top_logprobs_num": 3, "return_text_in_logprobs": True,
    }).json()
    meta = out["meta_info"]
    toks = meta["output_token_logprobs"]
    assert len(toks) == 5 and [t[1] for t in toks] == out["output_ids"]
    assert all(t[0] <= 0 and isinstance(t[2], str) for t in toks)
    tops = meta["output_top_logprobs"]
    assert len(tops) == 5 and all(len(row) == 3 for row in tops)
    for tok, row in zip(toks, tops):  # greedy: the chosen token is the top one
        assert row[0][1] == tok[1] and abs(row[0][0] - tok[0]) < 1e-4


def test_parallel_sampling_n3(http):
    out = http.post("/generate", json={
        "text": "Sample three", "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "n": 3}, "rid": "par",
    }).json()
    assert isinstance(out, list) and len(out) == 3
    assert sorted(o["meta_info"]["id"] for o in out) == ["par-0", "par-1", "par-2"]
    assert all(len(o["output_ids"]) == 6 for o in out)
    # at temperature 1 the samples draw their own randomness: not all the same
    assert len({tuple(o["output_ids"]) for o in out}) > 1, [o["output_ids"] for o in out]
    # with a sampling_seed too (each sample gets its own seed, derived from it): they differ,
    # the set is reproducible, and sample 0 is what n = 1 with that seed gives
    seeded = {"text": "Sample three", "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "n": 3, "sampling_seed": 7}}
    first = [o["output_ids"] for o in http.post("/generate", json=seeded).json()]
    assert len({tuple(ids) for ids in first}) > 1, first
    assert [o["output_ids"] for o in http.post("/generate", json=seeded).json()] == first
    single = {**seeded, "sampling_params": {**seeded["sampling_params"], "n": 1}}
    assert http.post("/generate", json=single).json()["output_ids"] == first[0]
    # at temperature 0 they are all the greedy output
    greedy3 = http.post("/generate", json={"text": "Sample three", "sampling_params": greedy(6, n=3)}).json()
    assert greedy3[0]["output_ids"] == greedy3[1]["output_ids"] == greedy3[2]["output_ids"]
    assert greedy3[0]["output_ids"] == http.post("/generate", json={"text": "Sample three", "sampling_params": greedy(6)}).json()["output_ids"]
    with http.stream("POST", "/generate", json={"text": "x", "stream": True, "sampling_params": greedy(3, n=2)}) as r:
        outs = [json.loads(e) for e in sse_events(r)[:-1]]
    assert {o["index"] for o in outs} == {0, 1}


def test_info_routes(http, server):
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True and info["context_length"] == 4096
    st = server_state(http)
    assert st["max_total_num_tokens"] == MAX_TOTAL_TOKENS
    for key in ("num_running_reqs", "num_queue_reqs", "token_usage", "cache_hit_rate", "gen_throughput", "port"):
        assert key in st
    assert "api_key" not in st


def _long_request(http, body, result):
    result["response"] = http.post("/generate", json=body, timeout=120)


def test_abort_by_rid(http):
    result = {}
    body = {"text": "Abort me", "rid": "to-abort", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    t = threading.Thread(target=_long_request, args=(http, body, result))
    t.start()
    deadline = time.monotonic() + 20
    while server_state(http)["num_running_reqs"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert http.post("/abort_request", json={"rid": "to-abort"}).status_code == 200
    t.join(30)
    assert not t.is_alive()
    out = result["response"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) < 3000
    wait_idle(http)


def test_client_disconnect_aborts_request(server, http):
    body = {"text": "Disconnect", "stream": True, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/generate", json=body) as r:
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                if got >= 3:
                    break
            assert server_state(http)["num_running_reqs"] == 1
        # the connection is closed here, long before 3000 tokens
    start = time.monotonic()
    info = wait_idle(http, timeout=15)
    assert time.monotonic() - start < 15
    assert info["num_running_reqs"] == 0


def test_sessions_keep_prefix_cached(http):
    sid = http.post("/open_session", json={"capacity_of_str_len": 1000}).json()
    assert isinstance(sid, str)
    first = http.post("/generate", json={
        "input_ids": list(range(100, 140)), "sampling_params": greedy(5), "session_params": {"id": sid}, "rid": "s-1",
    }).json()
    second = http.post("/generate", json={
        "input_ids": [7, 8, 9], "sampling_params": greedy(5), "session_params": {"id": sid, "rid": "s-1"},
    }).json()
    # the second turn continues the first: its prompt is turn 1's prompt + output + new tokens
    assert second["meta_info"]["prompt_tokens"] == 40 + 5 + 3
    assert second["meta_info"]["cached_tokens"] >= 40
    assert http.post("/close_session", json={"session_id": sid}).status_code == 200
    r = http.post("/generate", json={"input_ids": [1], "session_params": {"id": sid}})
    assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]
    assert first["meta_info"]["finish_reason"]["type"] == "length"


def test_metrics(http):
    http.post("/generate", json={"text": "metrics", "sampling_params": greedy(4)})
    text = http.get("/metrics").text
    for name in ("num_running_reqs", "num_queue_reqs", "token_usage", "cache_hit_rate", "gen_throughput",
                 "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket"):
        assert f"radixserve:{name}" in text, name


def test_scheduler_log_lines(server):
    log = server.read_log()
    assert "Prefill batch. #new-seq:" in log and "#cached-token:" in log and "#queue-req:" in log
    assert "Decode batch. #running-req:" in log and "gen throughput (token/s)" in log
    assert "max_total_num_tokens=6000" in log


def test_input_logprobs_over_http(http):
    ids = list(range(200, 230))
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 10,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    meta = http.post("/generate", json=body).json()["meta_info"]
    lp = meta["input_token_logprobs"]
    # SGLang's convention: the first entry from logprob_start_len is None, whatever the start
    assert [t for _, t, _ in lp] == ids[10:] and lp[0][0] is None and all(v <= 0 for v, _, _ in lp[1:])
    assert len(meta["output_token_logprobs"]) == 3
