"""Issue 27, served: a `radixserve serve --speculative-algorithm NGRAM` server (the tiny model)
reports speculative decoding in /metrics (SGLang's names: spec_verify_calls_total,
spec_accept_length, spec_accept_rate, and an accept-length histogram) and in its decode log
line ("accept len: x.xx"), in agreement with the requests' own meta_info."""

from __future__ import annotations

import re
from typing import Dict

import pytest
from conftest import ServerProcess, greedy, wait_idle

from radixserve.bench.serving import parse_prometheus

NUM_DRAFT_TOKENS = 4


@pytest.fixture(scope="module")
def spec_server():
    # --skip-server-warmup: the counters are checked from zero (the warm-up request would verify too)
    srv = ServerProcess("--max-total-tokens", "4096", "--decode-log-interval", "2", "--skip-server-warmup",
                        "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(NUM_DRAFT_TOKENS))
    yield srv
    assert srv.stop() == 0, srv.read_log()[-3000:]


def metric_lines(text: str, prefix: str) -> Dict[str, float]:
    """Every sample whose name starts with prefix (labels kept in the key)."""
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_metrics_and_log_report_speculative_decoding(spec_server):
    with spec_server.client() as http:
        before = parse_prometheus(http.get("/metrics").text)
        assert before["radixserve:spec_verify_calls_total"] == 0
        # A prompt that repeats a phrase: its continuation repeats it too, so drafts are accepted.
        phrase = [101, 2024, 77, 3051, 9, 640]
        metas = []
        for _ in range(2):
            r = http.post("/generate", json={"input_ids": phrase * 6, "sampling_params": greedy(40)})
            assert r.status_code == 200, r.text
            metas.append(r.json()["meta_info"])
        wait_idle(http)
        text = http.get("/metrics").text
    prom = parse_prometheus(text)
    verify = sum(m["spec_verify_ct"] for m in metas)
    tokens = sum(m["completion_tokens"] for m in metas)
    assert prom["radixserve:spec_verify_calls_total"] == verify > 0
    assert prom["radixserve:spec_num_correct_drafts_total"] == sum(m["spec_num_correct_drafts"] for m in metas) > 0
    assert prom["radixserve:spec_num_proposed_drafts_total"] == sum(m["spec_num_proposed_drafts"] for m in metas)
    assert prom["radixserve:spec_accept_length"] > 1.0
    assert 0.0 < prom["radixserve:spec_accept_rate"] <= 1.0
    # The histogram: one observation per request per verify step, of the tokens it committed.
    hist = metric_lines(text, "radixserve:spec_accept_length_histogram")
    assert hist["radixserve:spec_accept_length_histogram_count"] == verify
    # ... summing to the tokens the verify steps committed (each request's first token came
    # from its prefill; both ran to max_new_tokens, so no committed token was cut by a stop).
    assert all(m["finish_reason"]["type"] == "length" for m in metas)
    assert hist["radixserve:spec_accept_length_histogram_sum"] == tokens - len(metas)
    buckets = [hist[f'radixserve:spec_accept_length_histogram_bucket{{le="{float(b)}"}}'] for b in range(1, NUM_DRAFT_TOKENS + 1)]
    assert buckets == sorted(buckets) and buckets[-1] == verify
    assert buckets[0] < verify  # some steps committed more than one token
    # The decode log line carries the accept length, as SGLang's does.
    lens = [float(x) for x in re.findall(r"Decode batch\..*accept len: (\d+\.\d\d)", spec_server.read_log())]
    assert lens and max(lens) > 1.0
