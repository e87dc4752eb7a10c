"""HiCache end to end on the tiny model (offline Engine): shared prefixes several times larger
than the device KV pool are served from the host tier with the greedy outputs of an engine whose
pool holds everything; slots of both tiers are conserved under retraction and aborts; the
metrics count cached tokens by tier."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Tuple

import pytest

from radixserve.engine import Engine
from radixserve.managers.tokenizer_manager import TokenizerMetrics
from radixserve.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from greedy_testing import assert_same_greedy  # noqa: E402

VOCAB_LO = 3
DEVICE_POOL = 160
NUM_PREFIXES, PREFIX_LEN, WAVES = 5, 96, 2  # 480 prefix tokens: 3x the device pool


def make_waves(seed: int = 0) -> List[Tuple[List[List[int]], List[Dict]]]:
    """WAVES rounds over the same NUM_PREFIXES long prefixes, each with a fresh short suffix."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB_LO, 8192) for _ in range(PREFIX_LEN)] for _ in range(NUM_PREFIXES)]
    waves = []
    for _ in range(WAVES):
        prompts = [p + [rng.randrange(VOCAB_LO, 8192) for _ in range(16)] for p in prefixes]
        waves.append((prompts, [{"max_new_tokens": 8, "temperature": 0} for _ in prompts]))
    return waves


def run_waves(engine: Engine, waves) -> List[Dict]:
    out: List[Dict] = []
    for prompts, params in waves:
        out += engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                               top_logprobs_num=2, progress=False)
    return out


@pytest.fixture(scope="module")
def waves():
    return make_waves()


@pytest.fixture(scope="module")
def reference(waves):
    """The same waves on an engine whose pool holds every prefix."""
    engine = Engine(max_total_tokens=16384)
    out = run_waves(engine, waves)
    engine.shutdown()
    return out


def test_prefixes_larger_than_the_device_pool_come_from_the_host_tier(loop, waves, reference):
    engine = Engine(max_total_tokens=DEVICE_POOL, enable_hierarchical_cache=True, hicache_ratio=4,
                    page_size=4, test_check_memory=True, **loop)
    results = run_waves(engine, waves)
    assert_same_greedy(results, reference)
    later = results[NUM_PREFIXES:]  # the waves whose prefixes were computed before
    tiers = {t: sum(r["meta_info"]["cached_tokens_details"][t] for r in later) for t in ("device", "host", "storage")}
    assert sum(tiers.values()) == sum(r["meta_info"]["cached_tokens"] for r in later)
    prefix_tokens = len(later) * PREFIX_LEN
    assert tiers["host"] > 0.6 * prefix_tokens and tiers["host"] > tiers["device"], tiers
    assert tiers["storage"] == 0
    engine.scheduler.check_memory()  # both tiers: every slot free or in the tree, nothing locked
    engine.shutdown()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_both_tiers_are_conserved_under_retraction_and_aborts(policy, loop):
    """--test-check-memory checks device and host slots after every step (MemoryLeakError
    otherwise) while forced retractions and aborts hit requests in every state."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(VOCAB_LO, 8192) for _ in range(rng.randint(60, 160))] for _ in range(5)]
    engine = Engine(max_total_tokens=640, enable_hierarchical_cache=True, hicache_ratio=3, hicache_write_policy=policy,
                    page_size=4, chunked_prefill_size=64, test_retract_interval=3, test_check_memory=True, **loop)
    reqs = []
    for i in range(20):
        prompt = prefixes[i % 5] + [rng.randrange(VOCAB_LO, 8192) for _ in range(rng.randint(1, 40))]
        reqs += engine.submit(input_ids=prompt, sampling_params={"max_new_tokens": rng.randint(4, 24), "temperature": 0})
        if i % 4 == 3:
            engine.step()
        if i in (9, 13, 17):
            engine.abort(reqs[i - 2].rid)
    sched = engine.scheduler
    while sched.has_work():
        engine.step()
    sched.check_memory()
    stats = engine.stats()
    assert stats.num_retractions > 0
    tree = sched.tree_cache
    assert tree.host_pool.available_size() < tree.host_pool.size  # the host tier was used
    engine.shutdown()


def test_metrics_count_cached_tokens_by_tier():
    metrics = TokenizerMetrics()
    state = SimpleNamespace(first_token_time=None, last_time=None, created=0.0, finished=True, input_ids=[1] * 50,
                            completion_tokens=3, cached_tokens=40, finished_reason={"type": "length"},
                            cached_tokens_details={"device": 10, "host": 30, "storage": 0},
                            retraction_count=0, queue_time=None, sampling_params=SamplingParams())
    metrics.on_update(state, 3, now=1.0)
    value = metrics.registry.get_sample_value
    assert value("radixserve:cached_tokens_by_tier_total", {"tier": "host"}) == 30
    assert value("radixserve:cached_tokens_by_tier_total", {"tier": "device"}) == 10
    assert value("radixserve:cached_tokens_total") == 40
