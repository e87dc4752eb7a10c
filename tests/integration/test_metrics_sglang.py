"""Issue 43 item 3: /metrics serves SGLang's metric names, labels and histogram buckets, so SGLang's
Grafana dashboard and alert rules work unchanged; the older radixserve: names stay beside them.
The names and buckets below are copied by hand from SGLang's exporter
(python/sglang/srt/metrics/collector.py), not imported from our code, so a renamed metric or a
changed bucket fails here."""

from __future__ import annotations

import uuid
from typing import Dict, List, Tuple

from prometheus_client.parser import text_string_to_metric_families

from conftest import greedy

# (SGLang's name, its type): the dashboard's panels (e2e latency, TTFT, ITL, running and queued
# requests, throughput, cache hit rate) and the rest of the collector's request-level families.
SGLANG_METRICS: List[Tuple[str, str]] = [
    ("sglang:e2e_request_latency_seconds", "histogram"),
    ("sglang:time_to_first_token_seconds", "histogram"),
    ("sglang:inter_token_latency_seconds", "histogram"),
    ("sglang:queue_time_seconds", "histogram"),
    ("sglang:num_retractions", "histogram"),
    ("sglang:num_running_reqs", "gauge"),
    ("sglang:num_queue_reqs", "gauge"),
    ("sglang:num_grammar_queue_reqs", "gauge"),
    ("sglang:gen_throughput", "gauge"),
    ("sglang:cache_hit_rate", "gauge"),
    ("sglang:token_usage", "gauge"),
    ("sglang:num_used_tokens", "gauge"),
    ("sglang:max_total_num_tokens", "gauge"),
    ("sglang:new_token_ratio", "gauge"),
    ("sglang:prompt_tokens", "counter"),
    ("sglang:generation_tokens", "counter"),
    ("sglang:cached_tokens", "counter"),
    ("sglang:num_requests", "counter"),
    ("sglang:num_aborted_requests", "counter"),
    ("sglang:num_so_requests", "counter"),
    ("sglang:num_retracted_requests", "counter"),
    ("sglang:num_grammar", "counter"),  # sglang:num_grammar_total (a counter family drops _total)
    ("sglang:num_grammar_cache_hit", "counter"),
    ("sglang:num_grammar_aborted", "counter"),
    ("sglang:num_grammar_timeout", "counter"),
    ("sglang:grammar_compilation_time_seconds", "histogram"),
]

SGLANG_BUCKETS: Dict[str, List[float]] = {
    "sglang:time_to_first_token_seconds": [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400],
    "sglang:inter_token_latency_seconds": [0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
                                           0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0],
    "sglang:e2e_request_latency_seconds": [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400,
                                           600, 1200, 1800, 2400],
    "sglang:queue_time_seconds": [0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200,
                                  300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000],
    "sglang:num_retractions": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 15, 20, 25, 30, 40, 50, 75, 100],
    "sglang:grammar_compilation_time_seconds": [0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 90,
                                                120, 240],
}


def _families(text: str) -> Dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families: Dict[str, object], name: str, sample: str) -> float:
    return next(s.value for s in families[name].samples if s.name == sample)


def test_sglang_metric_names_labels_and_buckets(http):
    model_name = http.get("/get_model_info").json()["served_model_name"]
    before = _families(http.get("/metrics").text)
    r = http.post("/generate", json={"text": "metrics for sglang", "sampling_params": greedy(6)})
    assert r.status_code == 200, r.text
    after = _families(http.get("/metrics").text)
    for name, kind in SGLANG_METRICS:
        assert name in after, name
        family = after[name]
        assert family.type == kind, (name, family.type)
        assert family.samples and all(s.labels.get("model_name") == model_name for s in family.samples), name
    for name, buckets in SGLANG_BUCKETS.items():
        les = [float(s.labels["le"]) for s in after[name].samples if s.name == name + "_bucket"]
        assert les == [float(b) for b in buckets] + [float("inf")], name
    # one request more, under both names (the radixserve: ones are kept for old scrapes)
    for new, old in (("sglang:num_requests", "radixserve:num_requests"),
                     ("sglang:generation_tokens", "radixserve:generation_tokens")):
        delta = _value(after, new, new + "_total") - _value(before, new, new + "_total")
        assert delta == (1 if new.endswith("num_requests") else 6)
        assert _value(after, old, old + "_total") - _value(before, old, old + "_total") == delta
    # its queue time was observed, and it is the meta_info queue_time SGLang reports too
    queued = _value(after, "sglang:queue_time_seconds", "sglang:queue_time_seconds_count")
    assert queued - _value(before, "sglang:queue_time_seconds", "sglang:queue_time_seconds_count") == 1
    assert r.json()["meta_info"]["queue_time"] >= 0
    assert _value(after, "sglang:max_total_num_tokens", "sglang:max_total_num_tokens") == \
        http.get("/get_server_info").json()["max_total_num_tokens"]


def test_grammar_metrics_count_a_structured_output_request(http):
    """A regex never seen before: compiled once (not a cache hit), counted as a grammar request and
    as a structured-output request; the same one again is a cache hit."""
    regex = f"{uuid.uuid4().hex[:8]}(yes|no)"
    names = ("sglang:num_grammar", "sglang:num_grammar_cache_hit", "sglang:num_so_requests")

    def counts() -> List[float]:
        fam = _families(http.get("/metrics").text)
        return [_value(fam, n, n + "_total") for n in names] + [
            _value(fam, "sglang:grammar_compilation_time_seconds", "sglang:grammar_compilation_time_seconds_count")]

    before = counts()
    body = {"text": "Answer:", "sampling_params": greedy(16, regex=regex)}
    assert http.post("/generate", json=body).status_code == 200
    first = counts()
    assert [a - b for a, b in zip(first, before)] == [1, 0, 1, 1]
    assert http.post("/generate", json=body).status_code == 200
    assert [a - b for a, b in zip(counts(), first)] == [1, 1, 1, 0]
