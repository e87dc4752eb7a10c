"""Issue 29, served: `radixserve serve --enable-hierarchical-cache` with a device pool smaller
than the shared prefixes serves the second round of prefixes from the host tier: each
response's meta_info.cached_tokens_details says so, and /metrics counts cached tokens by tier
in agreement with them. --test-check-memory checks both tiers after every step."""

from __future__ import annotations

import random

from conftest import ServerProcess, greedy

NUM_PREFIXES, PREFIX_LEN = 5, 96  # 480 prefix tokens, 3x the device pool


def test_host_tier_hits_are_reported_per_request_and_in_metrics():
    srv = ServerProcess("--max-total-tokens", "160", "--page-size", "4", "--enable-hierarchical-cache",
                        "--hicache-ratio", "4", "--test-check-memory")
    try:
        rng = random.Random(0)
        prefixes = [[rng.randrange(3, 8192) for _ in range(PREFIX_LEN)] for _ in range(NUM_PREFIXES)]
        details = []
        with srv.client() as c:
            for _ in range(2):
                for p in prefixes:
                    body = {"input_ids": p + [rng.randrange(3, 8192) for _ in range(16)], "sampling_params": greedy(4)}
                    meta = c.post("/generate", json=body).json()["meta_info"]
                    assert sum(meta["cached_tokens_details"].values()) == meta["cached_tokens"]
                    details.append(meta["cached_tokens_details"])
            metrics = c.get("/metrics").text
        second = details[NUM_PREFIXES:]
        assert sum(d["host"] for d in second) >= 0.8 * NUM_PREFIXES * PREFIX_LEN, second
        for tier in ("device", "host", "storage"):
            line = f'radixserve:cached_tokens_by_tier_total{{tier="{tier}"}} '
            value = next(float(x[len(line):]) for x in metrics.splitlines() if x.startswith(line))
            assert value == sum(d[tier] for d in details), tier
    finally:
        assert srv.stop() == 0, srv.read_log()[-3000:]
