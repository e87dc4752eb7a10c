"""ReqToTokenPool keeps two copies on a GPU: the device's (the attention kernels read it) and the
host's (the scheduler reads it without a device sync). Here, on the CPU, the two are made two
tensors, as on a GPU: every write the scheduler makes must reach both (a write to one copy alone
leaves them different), and what the engine answers must not change."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from radixserve.engine import Engine
from radixserve.mem_cache import memory_pool
from radixserve.mem_cache.memory_pool import ReqToTokenPool

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from greedy_testing import assert_same_greedy, reference_alone, run_in_two_waves, with_repeats  # noqa: E402


@pytest.fixture
def two_copies(monkeypatch):
    """Every ReqToTokenPool made from now on has a host copy of its own, as on a GPU."""
    pools = []
    init = ReqToTokenPool.__init__

    def split(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.req_to_token_cpu = self.req_to_token.clone()
        pools.append(self)

    monkeypatch.setattr(memory_pool.ReqToTokenPool, "__init__", split)
    return pools


def test_write_and_write_spans_reach_both_copies(two_copies):
    pool = ReqToTokenPool(4, 16)
    pool.write((torch.tensor([1, 2]), torch.tensor([3, 5])), torch.tensor([7, 9]))
    pool.write((2, slice(6, 9)), torch.tensor([4, 5, 6], dtype=torch.int64))
    pool.write_spans([0, 3], [2, 0], [3, 2], torch.arange(10, 15))
    assert torch.equal(pool.req_to_token, pool.req_to_token_cpu)
    assert pool.req_to_token_cpu[1, 3] == 7 and pool.req_to_token_cpu[2, 5] == 9
    assert pool.req_to_token_cpu[2, 6:9].tolist() == [4, 5, 6]
    assert pool.req_to_token_cpu[0, 2:5].tolist() == [10, 11, 12] and pool.req_to_token_cpu[3, :2].tolist() == [13, 14]
    assert pool.req_to_token.dtype == torch.int32


def _workload(n: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]  # a common prefix: radix hits
    prompts = [shared[: rng.randrange(8, 40)] + [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 30))]
               for _ in range(n)]
    params = [{"max_new_tokens": rng.randrange(4, 20), "temperature": 0, "ignore_eos": True} for _ in range(n)]
    return with_repeats(prompts, params)


@pytest.mark.parametrize("extra", [
    {},  # page size 1, overlap loop (the default)
    {"page_size": 4, "disable_overlap_schedule": True, "chunked_prefill_size": 16},
    {"speculative_algorithm": "NGRAM", "page_size": 4},  # drafts written ahead into the rows
], ids=["default", "paged_chunked_normal", "ngram_paged"])
def test_both_copies_stay_equal_and_answers_do_not_change(two_copies, extra):
    prompts, params = _workload(12, 2000)
    kw = dict(dtype="float32", device="cpu", skip_tokenizer_init=True, max_total_tokens=1024, **extra)
    engine = Engine(**kw)
    results = run_in_two_waves(engine, prompts, params, num_base=12)
    pool = engine.scheduler.req_to_token_pool
    assert pool.req_to_token_cpu is not pool.req_to_token
    assert torch.equal(pool.req_to_token, pool.req_to_token_cpu), "a write reached one copy of req_to_token only"
    engine.shutdown()
    assert_same_greedy(results, reference_alone(prompts, params, **kw))
