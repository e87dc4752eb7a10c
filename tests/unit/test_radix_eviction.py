"""Plain radix-cache eviction under the scheduler (no HiCache, no retraction): a KV pool too small
to keep every prompt makes the scheduler evict the least recently used prefixes to admit new
requests, and the answers do not change (greedy, against an Engine whose pool keeps everything)."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import List

import pytest

from radixserve.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from greedy_testing import assert_same_greedy  # noqa: E402

VOCAB_LO = 3  # ids 0-2 are the tiny model's special tokens
PROMPT_LEN = 150
NUM_PROMPTS = 8  # 8 x (150 + 8) tokens: more than twice the small pool
SMALL_POOL = 600
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def distinct_prompts() -> List[List[int]]:
    """Prompts that share no prefix (their first tokens differ)."""
    rng = random.Random(7)
    return [[VOCAB_LO + i] + [rng.randrange(VOCAB_LO, 8192) for _ in range(PROMPT_LEN - 1)] for i in range(NUM_PROMPTS)]


def one_by_one(engine: Engine, prompts: List[List[int]], **kw) -> List[dict]:
    return [engine.generate(input_ids=[p], sampling_params=[GREEDY], progress=False, **kw)[0] for p in prompts]


@pytest.fixture(scope="module")
def reference():
    """A pool that holds every prompt and answer: nothing is ever evicted. Each request alone, with
    its top-2 logprobs (a batched run may flip a near-tie, and only there)."""
    engine = Engine(max_total_tokens=16384)
    out = one_by_one(engine, distinct_prompts(), return_logprob=True, top_logprobs_num=2)
    assert engine.scheduler.tree_cache.total_size() >= NUM_PROMPTS * PROMPT_LEN  # all cached, none evicted
    engine.shutdown()
    return out


@pytest.mark.parametrize("batched", [False, True], ids=["one_by_one", "batched"])
def test_small_pool_evicts_and_answers_the_same(batched, reference, monkeypatch):
    prompts = distinct_prompts()
    engine = Engine(max_total_tokens=SMALL_POOL)
    tree = engine.scheduler.tree_cache
    evicted: List[int] = []
    real_evict = tree.evict

    def counting_evict(num_tokens: int) -> int:
        n = real_evict(num_tokens)
        evicted.append(n)
        return n

    monkeypatch.setattr(tree, "evict", counting_evict)
    if batched:
        got = engine.generate(input_ids=prompts, sampling_params=[GREEDY] * len(prompts), progress=False)
    else:
        got = one_by_one(engine, prompts)

    for i, a in enumerate(got):
        assert a["meta_info"]["finish_reason"] == {"type": "length", "length": GREEDY["max_new_tokens"]}, (i, a["meta_info"])
    if batched:
        assert_same_greedy(got, reference)
    else:  # the same computation as the reference's, prompt by prompt: the same tokens
        assert [a["output_ids"] for a in got] == [b["output_ids"] for b in reference]
    # The pool cannot hold them all, so the tree must have given slots back to admit the later ones.
    assert sum(evicted) >= NUM_PROMPTS * PROMPT_LEN - SMALL_POOL, evicted  # the prompts alone overflow it
    engine.wait_until_idle()
    engine.scheduler.check_memory()  # every slot free or in the tree: eviction returned them to the pool

    # Least recently used first: the first prompt is gone from the tree, the last one is still there.
    first = engine.generate(input_ids=[prompts[0]], sampling_params=[GREEDY], progress=False)[0]
    assert first["meta_info"]["cached_tokens"] == 0
    assert_same_greedy([first], [reference[0]])
    last = engine.generate(input_ids=[prompts[-1]], sampling_params=[GREEDY], progress=False)[0]
    assert last["meta_info"]["cached_tokens"] == PROMPT_LEN - 1  # all but the token whose logits it needs
    assert_same_greedy([last], [reference[-1]])  # from the cached prefix: near-ties may flip
    engine.shutdown()
