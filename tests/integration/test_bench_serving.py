"""`radixserve bench serving` against the real server of this session (tiny model): a small run
completes, and its request / token counts agree with the server's /metrics counters."""

from __future__ import annotations

import json

import pytest

from conftest import wait_idle
from radixserve.bench.serving import parse_prometheus
from radixserve.cli import main


def _run(server, tmp_path, *extra: str) -> dict:
    out = tmp_path / "serving.jsonl"
    code = main([
        "bench", "serving", "--base-url", server.url, "--num-prompts", "12", "--max-concurrency", "4",
        "--random-input-len", "48", "--random-output-len", "8", "--random-range-ratio", "0.5",
        "--output-file", str(out), "--disable-tqdm", *extra,
    ])
    assert code == 0
    return json.loads(out.read_text().splitlines()[-1])


@pytest.mark.parametrize("backend,dataset", [("sglang", "random-ids"), ("openai", "random")])
def test_bench_serving_counts_agree_with_metrics(server, http, tmp_path, backend, dataset):
    wait_idle(http)
    before = parse_prometheus(http.get("/metrics").text)
    rec = _run(server, tmp_path, "--backend", backend, "--dataset-name", dataset, "--plot", str(tmp_path / "p.png"))
    after = parse_prometheus(http.get("/metrics").text)
    assert rec["completed"] == 12 and rec["failed"] == 0
    # The bench's own deltas of the server counters (taken after its warm-up request) ...
    assert rec["server_num_requests"] == rec["completed"]
    assert rec["server_prompt_tokens"] == rec["total_input_tokens"]
    assert rec["server_generation_tokens"] == rec["total_output_tokens"]
    # ... and ours around the whole command (one warm-up request more).
    delta = after["radixserve:num_requests_total"] - before["radixserve:num_requests_total"]
    assert delta == rec["completed"] + 1
    assert 0.0 <= rec["cache_hit_rate"] <= 1.0
    for key in ("ttft", "tpot", "itl", "e2e_latency"):
        for stat in ("mean", "median", "p90", "p99"):
            assert rec[f"{stat}_{key}_ms"] >= 0
    assert rec["mean_ttft_ms"] > 0 and rec["output_throughput"] > 0
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_bench_serving_shared_prefix_hits_the_cache(server, http, tmp_path):
    wait_idle(http)
    rec = _run(server, tmp_path, "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2",
               "--gsp-prompts-per-group", "6", "--gsp-system-prompt-len", "200", "--gsp-question-len", "16",
               "--gsp-output-len", "4", "--flush-cache", "--max-concurrency", "2")
    assert rec["completed"] == 12
    assert rec["server_num_requests"] == 12
    # After flush, each group's system prompt is computed about once, then shared.
    assert rec["cache_hit_rate"] > 0.5
