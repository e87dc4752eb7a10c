"""SchedulePolicy orderings on constructed queues, PrefillAdder budgets, priority preemption."""

from __future__ import annotations


from radixserve.engine import Engine
from radixserve.managers.schedule_batch import Req, ScheduleBatch
from radixserve.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy
from radixserve.mem_cache.kv_ledger import KVLedger
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.mem_cache.radix_cache import RadixCache
from radixserve.sampling_params import SamplingParams


def _cache(size: int = 4096):
    pool = ReqToTokenPool(16, 1024)
    alloc = TokenToKVPoolAllocator(size)
    return RadixCache(pool, alloc), alloc


def _put(cache: RadixCache, alloc, ids):
    cache.insert(ids, alloc.alloc(len(ids)))


def _req(rid: str, ids, priority=None, max_new=16, arrival=0.0) -> Req:
    sp = SamplingParams(max_new_tokens=max_new)
    sp.normalize()
    return Req(rid, None, ids, sp, priority=priority, arrival_time=arrival)


def test_lpm_orders_by_longest_cached_prefix():
    cache, alloc = _cache()
    _put(cache, alloc, list(range(100, 160)))  # 60 tokens cached
    _put(cache, alloc, list(range(500, 510)))  # 10 tokens cached
    queue = [
        _req("none", list(range(900, 920)), arrival=0),
        _req("short", list(range(500, 510)) + [1, 2, 3], arrival=1),
        _req("long", list(range(100, 160)) + [4, 5], arrival=2),
        _req("mid", list(range(100, 130)) + [6], arrival=3),
    ]
    SchedulePolicy("lpm", cache).calc_priority(queue)
    assert [r.rid for r in queue] == ["long", "mid", "short", "none"]


def test_lpm_in_batch_prefix_caching_defers_second_sharer():
    cache, _ = _cache()
    shared = list(range(1000, 1040))  # 40 tokens, not cached yet
    queue = [
        _req("a", shared + [1], arrival=0),
        _req("b", shared + [2], arrival=1),
        _req("c", list(range(2000, 2010)), arrival=2),
    ]
    SchedulePolicy("lpm", cache).calc_priority(queue)
    # b shares 40 tokens with a, chosen first: it waits so that it hits the cache next round.
    assert [r.rid for r in queue] == ["a", "c", "b"]


def test_dfs_weight_runs_heaviest_subtree_first():
    cache, alloc = _cache()
    a, b = list(range(100, 120)), list(range(300, 320))
    _put(cache, alloc, a)
    _put(cache, alloc, b)
    queue = [
        _req("a1", a + [1], arrival=0),
        _req("b1", b + [1], arrival=1),
        _req("a2", a + [2], arrival=2),
        _req("b2", b + [2], arrival=3),
        _req("b3", b + [3], arrival=4),
        _req("none", [7, 7, 7], arrival=5),
    ]
    SchedulePolicy("dfs-weight", cache).calc_priority(queue)
    order = [r.rid for r in queue]
    # heaviest subtree first; requests that match nothing (at the root) last
    assert set(order[:3]) == {"b1", "b2", "b3"} and set(order[3:5]) == {"a1", "a2"} and order[5] == "none"


def test_priority_scheduling_orders_by_priority_then_arrival():
    cache, _ = _cache()
    queue = [_req("p1", [1, 2], 1, arrival=0), _req("p5", [3, 4], 5, arrival=1),
             _req("p5b", [5, 6], 5, arrival=2), _req("p0", [7, 8], 0, arrival=3)]
    SchedulePolicy("fcfs", cache, enable_priority_scheduling=True).calc_priority(queue)
    assert [r.rid for r in queue] == ["p5", "p5b", "p1", "p0"]
    SchedulePolicy("fcfs", cache, True, schedule_low_priority_values_first=True).calc_priority(queue)
    assert [r.rid for r in queue] == ["p0", "p1", "p5", "p5b"]


def test_lof_orders_by_longest_output():
    cache, _ = _cache()
    queue = [_req("s", [1], max_new=4), _req("l", [2], max_new=64), _req("m", [3], max_new=16)]
    SchedulePolicy("lof", cache).calc_priority(queue)
    assert [r.rid for r in queue] == ["l", "m", "s"]


def test_prefill_adder_budgets_and_chunking():
    cache, alloc = _cache(size=1000)
    empty = ScheduleBatch(reqs=[], tree_cache=cache)
    # input budget: the second request no longer fits max_prefill_tokens
    adder = PrefillAdder(1, KVLedger(cache.req_to_token_pool, alloc, cache), empty, 0.7, rem_input_tokens=100, rem_chunk_tokens=None)
    r1, r2 = _req("1", list(range(10, 70))), _req("2", list(range(200, 260)))
    for r in (r1, r2):
        r.init_next_round_input(cache)
    assert adder.add_one_req(r1) == AddReqResult.CONTINUE
    assert adder.add_one_req(r2) == AddReqResult.OTHER
    assert adder.can_run_list == [r1]
    # chunk budget: the request is truncated into a chunk
    adder = PrefillAdder(1, KVLedger(cache.req_to_token_pool, alloc, cache), empty, 0.7, rem_input_tokens=10000, rem_chunk_tokens=40)
    r3 = _req("3", list(range(10, 110)))
    r3.init_next_round_input(cache)
    adder.add_one_req(r3)
    assert adder.new_chunked_req is r3 and r3.extend_input_len == 40 and len(r3.fill_ids) == 40
    # total budget: input + reserved output must fit free + evictable tokens (200 slots held elsewhere)
    held = alloc.alloc(200)
    adder = PrefillAdder(1, KVLedger(cache.req_to_token_pool, alloc, cache), empty, 0.7, rem_input_tokens=10000, rem_chunk_tokens=None)
    r4 = _req("4", list(range(10, 900)), max_new=200)
    r4.init_next_round_input(cache)
    assert adder.add_one_req(r4) == AddReqResult.NO_TOKEN
    # ... but the reserve is capped at what the whole pool has beside the request: prompt +
    # max_new_tokens beyond the pool is admitted into an empty pool, not kept waiting forever
    alloc.free(held)
    adder = PrefillAdder(1, KVLedger(cache.req_to_token_pool, alloc, cache), empty, 0.7, rem_input_tokens=10000, rem_chunk_tokens=None)
    assert adder.add_one_req(r4) == AddReqResult.CONTINUE


def test_running_requests_reserve_decode_space():
    cache, alloc = _cache(size=1000)
    running = ScheduleBatch(reqs=[_req(str(i), [1, 2, 3], max_new=100) for i in range(5)], tree_cache=cache)
    adder = PrefillAdder(1, KVLedger(cache.req_to_token_pool, alloc, cache), running, new_token_ratio=0.5, rem_input_tokens=10000, rem_chunk_tokens=None)
    assert adder.rem_total_tokens == 1000 - 5 * 100 * 0.5


def test_priority_preemption_runs_urgent_request_first(loop):
    engine = Engine(max_total_tokens=4096, enable_priority_scheduling=True, max_running_requests=2,
                    priority_scheduling_preemption_threshold=5, **loop)
    low = engine.submit(input_ids=[[10 + i] * 20 for i in range(2)],
                        sampling_params={"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}, priority=0)
    for _ in range(3):
        engine.step()
    sched = engine.scheduler
    assert len(sched.running_batch.reqs) == 2
    high = engine.submit(input_ids=[[99] * 20], sampling_params={"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}, priority=100)[0]
    engine.step()
    assert sched.stats.num_preempted_reqs == 1
    steps = 0
    while not high.finished:
        engine.step()
        steps += 1
    assert not any(r.finished for r in low)
    while sched.has_work():
        engine.step()
    # The preempted request restarted and still produced its greedy continuation.
    alone = Engine(max_total_tokens=4096)
    for r in low:
        ref = alone.generate(input_ids=r.input_ids, sampling_params={"max_new_tokens": 40, "temperature": 0, "ignore_eos": True})
        assert r.output_ids == ref["output_ids"]
    sched.check_memory()
