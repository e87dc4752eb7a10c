"""The /dashboard page's data (issue 59): the scheduler's snapshot (scheduler_dashboard.py) on a
real scheduler driven by the offline Engine, and the main process's request timeline
(dashboard_history.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import List, Optional

from radixserve.engine import Engine
from radixserve.managers.dashboard_history import RequestTimeline
from radixserve.managers.scheduler_dashboard import (
    PREFIX_HEAD_TOKENS, PREFIX_TAIL_TOKENS, DashboardSources, SchedulerDashboard, batch_record, summarize_tree,
)
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.mem_cache.radix_cache import RadixCache
from radixserve.model_executor.forward_batch import ForwardMode


def _dashboard(engine: Engine, tree_interval_s: float = 0.0) -> SchedulerDashboard:
    s = engine.scheduler
    return SchedulerDashboard(DashboardSources(s.ledger, s.tree_cache, s.stats, s.loop, s.max_total_num_tokens),
                              tree_interval_s)


def test_snapshot_after_requests_sharing_a_prefix():
    engine = Engine(max_total_tokens=4096)
    try:
        prefix = [(7 * i) % 500 + 3 for i in range(100)]
        prompts = [prefix + [600 + j, 700 + j, 800 + j] for j in range(4)]
        engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 4, "temperature": 0}, progress=False)
        engine.wait_until_idle()  # the last batch retired (the overlap loop filters it one step late)
        snap = _dashboard(engine).snapshot()
        kv = snap.kv
        # every slot has exactly one owner; nothing runs now, so the tree's slots are all evictable
        assert kv.private + kv.protected + kv.evictable + kv.free == kv.total == engine.scheduler.max_total_num_tokens
        assert kv.private == kv.protected == 0
        assert kv.evictable == engine.scheduler.tree_cache.evictable_size() > len(prefix)
        assert snap.queues == {"waiting": 0, "running": 0, "chunked": 0}
        tree = snap.tree
        assert tree.cached_tokens == engine.scheduler.tree_cache.total_size()
        assert tree.num_leaves == 4
        top = tree.shared_prefixes[0]
        # the four prompts share exactly `prefix` (their next tokens differ)
        assert top.num_tokens == len(prefix) and top.num_sequences == 4 and not top.in_use
        assert top.head_ids == prefix[:PREFIX_HEAD_TOKENS]
        assert top.tail_ids == prefix[-PREFIX_TAIL_TOKENS:]  # its end, which tells alike prefixes apart
        assert snap.to_dict()["tree"]["shared_prefixes"][0]["num_tokens"] == len(prefix)
        # the walk is reused for a while (it runs on the scheduler's thread), then taken again
        slow = _dashboard(engine, tree_interval_s=3600)
        first = slow.snapshot().tree
        engine.generate(input_ids=[[900 + i for i in range(20)]], sampling_params={"max_new_tokens": 2}, progress=False)
        engine.wait_until_idle()
        assert slow.snapshot().tree is first and _dashboard(engine).snapshot().tree.num_leaves == 5
    finally:
        engine.shutdown()


def test_evictions_are_counted_by_the_ledger():
    engine = Engine(max_total_tokens=600)
    try:
        dash = _dashboard(engine)
        assert dash.snapshot().evicted_tokens == 0
        for j in range(6):  # distinct prompts: each one's cached KV must go for the next ones
            engine.generate(input_ids=[[j * 50 + i + 1 for i in range(150)]],
                            sampling_params={"max_new_tokens": 2, "temperature": 0}, progress=False)
        assert dash.snapshot().evicted_tokens > 0
        assert engine.scheduler.ledger.num_evicted_tokens == dash.snapshot().evicted_tokens
    finally:
        engine.shutdown()


def _tree(seqs: List[List[int]]) -> RadixCache:
    alloc = TokenToKVPoolAllocator(1024)
    cache = RadixCache(ReqToTokenPool(4, 256), alloc)
    for s in seqs:
        cache.insert(s, alloc.alloc(len(s)))
    return cache


def test_summarize_tree_ranks_the_longest_shared_prefixes():
    cache = _tree([[1, 2, 3, 4, 5], [1, 2, 3, 4, 9], [1, 2, 3, 7], [8, 8], [8, 9], [10]])
    tree = summarize_tree(cache.root_node)
    assert [(p.num_tokens, p.num_sequences, p.head_ids) for p in tree.shared_prefixes] == [(4, 2, [1, 2, 3, 4]), (1, 2, [8])]
    # [1 2 3] is shared by three sequences but [1 2 3 4] below it is longer: only the deepest branch counts
    assert [p.tail_ids for p in tree.shared_prefixes] == [[], []]  # the head holds all of them
    assert tree.num_nodes == 9 and tree.num_leaves == 6 and tree.max_depth == 5
    assert tree.cached_tokens == cache.total_size()
    assert not tree.truncated
    assert summarize_tree(cache.root_node, max_nodes=3).truncated


def test_batch_records_name_the_kind():
    def batch(mode, reqs, extend_lens=None, decoding=None):
        return SimpleNamespace(forward_mode=mode, reqs=reqs, extend_lens=extend_lens, decoding_reqs=decoding)

    now = time.time()
    assert batch_record(batch(ForwardMode.EXTEND, [1, 2], [10, 5]), 0.01, now).kind == "prefill"
    assert batch_record(batch(ForwardMode.EXTEND, [1, 2], [10, 5]), 0.01, now).num_tokens == 15
    d = batch_record(batch(ForwardMode.DECODE, [1, 2, 3]), 0.002, now)
    assert (d.kind, d.num_reqs, d.num_tokens) == ("decode", 3, 3) and abs(d.step_ms - 2.0) < 1e-9
    m = batch_record(batch(ForwardMode.MIXED, [1, 2, 3], [7], [2, 3]), 0.01, now)
    assert (m.kind, m.num_tokens) == ("mixed", 9)
    assert batch_record(None, 0.01, now) is None
    assert batch_record(batch(ForwardMode.DECODE, []), 0.01, now) is None


@dataclass
class _State:  # the ReqState fields the timeline reads
    input_ids: List[int]
    created: float
    stream: bool = True
    cached_tokens: int = 0
    finished: bool = False
    first_token_time: Optional[float] = None
    last_time: Optional[float] = None
    output_ids: List[int] = field(default_factory=list)


def test_timeline_buckets_ttft_itl_and_hits():
    tl = RequestTimeline()
    st = _State(input_ids=list(range(40)), created=100.0, cached_tokens=30)
    tl.on_update(st, 1, 100.5)  # the first token, 0.5 s after the request came
    st.first_token_time = st.last_time = 100.5  # (what TokenizerMetrics.on_update then sets)
    tl.on_update(st, 2, 100.7)  # two more tokens 0.2 s later: 0.1 s each
    st.last_time, st.finished = 100.7, True
    tl.on_update(st, 0, 100.8)
    buckets = tl.since(60)
    total = {k: sum(b[k] for b in buckets) for k in buckets[0] if k != "t"}
    assert total["gen_tokens"] == 3 and total["first_tokens"] == 1 and total["finished"] == 1
    assert total["prompt_tokens"] == 40 and total["cached_tokens"] == 30
    assert total["ttft_n"] == 1 and abs(total["ttft_sum"] - 0.5) < 1e-9
    assert total["itl_n"] == 2 and abs(total["itl_sum"] / total["itl_n"] - 0.1) < 1e-9
    assert tl.since(-1) == []  # nothing from the future


def test_timeline_takes_no_latency_from_unstreamed_requests():
    # a request that does not stream gets its whole output once, at the end: no TTFT, no ITL
    tl = RequestTimeline()
    st = _State(input_ids=list(range(10)), created=100.0, stream=False, finished=True)
    tl.on_update(st, 8, 103.0)
    (b,) = tl.since(60)
    assert (b["gen_tokens"], b["first_tokens"], b["prompt_tokens"], b["finished"]) == (8, 1, 10, 1)
    assert b["ttft_n"] == 0 and b["ttft_sum"] == 0 and b["itl_n"] == 0
