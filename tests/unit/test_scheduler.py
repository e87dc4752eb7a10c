"""The scheduler end to end, in-process on the tiny model: batching, chunking, retraction,
mixed chunk, paging and the disabled cache must not change greedy outputs; memory is
conserved; aborts leave nothing behind."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from radixserve.engine import Engine
from radixserve.managers.scheduler import Scheduler
from radixserve.protocol import TokenizedGenerateReqInput
from radixserve.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from greedy_testing import assert_same_greedy, reference_alone  # noqa: E402

VOCAB_LO = 3  # ids 0-2 are special tokens of the tiny model


def make_workload(n: int = 200, seed: int = 0):
    """Prompts made of one of 8 shared 'system prompts' plus a unique suffix."""
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB_LO, 8192) for _ in range(rng.randint(20, 120))] for _ in range(8)]
    prompts, params = [], []
    for _ in range(n):
        prefix = systems[rng.randrange(len(systems))] if rng.random() < 0.8 else []
        suffix = [rng.randrange(VOCAB_LO, 8192) for _ in range(rng.randint(1, 100))]
        prompts.append(prefix + suffix)
        params.append({"max_new_tokens": rng.randint(1, 16), "temperature": 0})
    return prompts, params


@pytest.fixture(scope="module")
def workload():
    return make_workload()


@pytest.fixture(scope="module")
def reference(workload):
    """Each request run alone (no cache, no batching)."""
    return reference_alone(*workload, disable_radix_cache=True, max_total_tokens=4096)


CONFIGS = {
    "default": dict(),
    "chunked_prefill_64": dict(chunked_prefill_size=64),
    "mixed_chunk": dict(chunked_prefill_size=64, enable_mixed_chunk=True),
    "page_size_16": dict(page_size=16, chunked_prefill_size=64),
    "radix_disabled": dict(disable_radix_cache=True),
    "lpm": dict(schedule_policy="lpm"),
    "dfs_weight": dict(schedule_policy="dfs-weight", chunked_prefill_size=128),
    "tiny_pool_retracts": dict(max_total_tokens=1200, schedule_conservativeness=0.02, chunked_prefill_size=128),
    "forced_retract": dict(test_retract_interval=3),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_outputs_equal_alone(name, loop, workload, reference):
    prompts, params = workload
    kw = dict(max_total_tokens=16384, **loop)
    kw.update(CONFIGS[name])
    engine = Engine(**kw)
    results = engine.generate(input_ids=prompts, sampling_params=params, progress=False)
    assert_same_greedy(results, reference)
    if name == "default":
        _LOOP_OUTPUTS[bool(loop)] = [r["output_ids"] for r in results]
    sched = engine.scheduler
    sched.check_memory()  # every slot back: free or in the tree, nothing locked
    stats = engine.stats()
    if name in ("tiny_pool_retracts", "forced_retract"):
        assert stats.num_retractions > 0 and stats.num_retracted_reqs > 0
    if name.startswith("chunked") or name in ("mixed_chunk", "page_size_16"):
        assert stats.num_chunked_prefills > 0
    if name == "mixed_chunk":
        assert stats.num_mixed_batches > 0
    if name == "radix_disabled":
        assert all(r["meta_info"]["cached_tokens"] == 0 for r in results)
    else:
        assert sum(r["meta_info"]["cached_tokens"] for r in results) > 0


_LOOP_OUTPUTS: Dict[bool, List[List[int]]] = {}


def test_overlap_and_normal_loops_give_identical_outputs(workload):
    """Runs after the default config ran in both loops (same module, declared later)."""
    prompts, params = workload
    for normal in (False, True):
        if normal not in _LOOP_OUTPUTS:
            engine = Engine(max_total_tokens=16384, disable_overlap_schedule=normal)
            _LOOP_OUTPUTS[normal] = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params, progress=False)]
    assert _LOOP_OUTPUTS[False] == _LOOP_OUTPUTS[True]


def test_overlap_processes_results_while_the_next_forward_runs(workload):
    """Post Schedule of batch N runs while the forward of N+1 is in flight: if the loop waited
    for the device before processing (a sync in the overlap window), the share would be ~0."""
    prompts, params = workload
    engine = Engine(max_total_tokens=16384, disable_overlap_schedule=False)  # on the CPU too
    engine.generate(input_ids=prompts, sampling_params=params, progress=False)
    st = engine.stats()
    assert st.results_processed > 10
    assert st.results_processed_while_busy / st.results_processed > 0.5, st


def test_cached_tokens_on_repeated_prefix(loop):
    engine = Engine(max_total_tokens=4096, **loop)
    prompt = list(range(100, 180))
    first = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 4, "temperature": 0})
    second = engine.generate(input_ids=prompt + [7, 8, 9], sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert first["meta_info"]["cached_tokens"] == 0
    # The whole first prompt (and the generated tokens but the last) are in the tree.
    assert second["meta_info"]["cached_tokens"] == len(prompt)
    engine.scheduler.check_memory()


def test_abort_in_every_state_leaks_nothing(loop):
    engine = Engine(max_total_tokens=4096, chunked_prefill_size=32, max_running_requests=4, **loop)
    rng = random.Random(1)
    long_prompt = [rng.randrange(VOCAB_LO, 8192) for _ in range(150)]
    reqs = engine.submit(input_ids=[long_prompt] + [[rng.randrange(VOCAB_LO, 8192) for _ in range(20)] for _ in range(7)],
                         sampling_params={"max_new_tokens": 50, "temperature": 0, "ignore_eos": True})
    engine.step()  # the long prompt is now the chunked request; others wait
    sched = engine.scheduler
    assert sched.chunked_req is not None and sched.chunked_req.rid == reqs[0].rid
    engine.abort(reqs[0].rid)  # chunked
    engine.abort(reqs[7].rid)  # waiting
    for _ in range(8):
        engine.step()
    running = [r.rid for r in sched.running_batch.reqs]
    assert running, "some requests should be decoding"
    engine.abort(running[0])  # running
    while sched.has_work():
        engine.step()
    states = {r.rid: r for r in reqs}
    aborted = {reqs[0].rid, reqs[7].rid, running[0]}
    for rid in aborted:
        assert states[rid].finished_reason["type"] == "abort"
    for r in reqs:
        if r.rid not in aborted:
            assert states[r.rid].finished_reason == {"type": "length", "length": 50}
    sched.check_memory()


def test_queue_full_aborts_with_503(loop):
    engine = Engine(max_total_tokens=4096, max_queued_requests=2, **loop)
    results = engine.generate(input_ids=[[5, 6, 7]] * 4, sampling_params={"max_new_tokens": 2}, progress=False)
    reasons = [r["meta_info"]["finish_reason"] for r in results]
    full = [r for r in reasons if r["type"] == "abort"]
    assert len(full) == 2 and all(r["status_code"] == 503 for r in full)
    assert "queue is full" in full[0]["message"]


def test_prompt_longer_than_context_is_rejected():
    engine = Engine(max_total_tokens=4096, context_length=64)
    with pytest.raises(ValueError, match=r"The input \(70 tokens\) is longer than the model's context length \(64"):
        engine.generate(input_ids=list(range(10, 80)), sampling_params={"max_new_tokens": 2})
    # The scheduler's own check, for callers that reach it directly (simulator, tests).
    sent: List = []
    sched = Scheduler(ServerArgs(max_total_tokens=4096, context_length=64), send_fn=sent.append)
    sp = SamplingParams(max_new_tokens=2)
    sp.normalize()
    sched.process_input_requests([TokenizedGenerateReqInput("long", None, list(range(10, 80)), sp)])
    assert sent[-1].rids == ["long"] and sent[-1].finished_reasons[0]["status_code"] == 400
    assert not sched.has_work()
    ok = engine.generate(input_ids=list(range(10, 40)), sampling_params={"ignore_eos": True})
    # The default max_new_tokens (128) is clipped to the room left in the context (an explicit
    # one that does not fit is refused: test_engine_refuses_max_new_tokens_beyond_the_context).
    assert ok["meta_info"]["completion_tokens"] == 64 - 30 - 1


def test_flush_cache_refused_while_running(loop):
    engine = Engine(max_total_tokens=4096, **loop)
    engine.submit(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 20})
    engine.step()
    assert engine.flush_cache() is False
    while engine.scheduler.has_work():
        engine.step()
    assert engine.scheduler.tree_cache.evictable_size() > 0
    assert engine.flush_cache() is True
    assert engine.scheduler.tree_cache.evictable_size() == 0
    engine.scheduler.check_memory()


def test_flush_cache_right_after_generate(loop):
    """generate() returns when its requests finish, before the step that filters them out of the
    running batch: flush_cache settles them and succeeds, so the next generate misses the cache."""
    engine = Engine(max_total_tokens=4096, **loop)
    prompts = [list(range(10, 60)), list(range(70, 120))]
    engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 4, "ignore_eos": True})
    assert engine.flush_cache() is True
    assert engine.scheduler.tree_cache.evictable_size() == 0
    again = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 4, "ignore_eos": True})
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in again)
    engine.scheduler.check_memory()


def test_engine_decodes_a_cached_system_prompt_once(monkeypatch):
    """End to end: requests behind a system prompt the radix cache holds decode with the shared
    prefix taken once (shared_prefix_len > 0 seen), and answer as each does alone (greedy tokens,
    and their logprobs to 1e-4)."""
    from radixserve.layers.attention import torch_native_backend as tnb

    seen = []
    real = tnb.shared_prefix_len
    monkeypatch.setattr(tnb, "shared_prefix_len", lambda *a: seen.append(real(*a)) or seen[-1])
    system = list(range(10, 110))
    prompts = [system + [200 + i, 300 + 7 * i] for i in range(4)]
    params = [{"max_new_tokens": 8, "temperature": 0, "ignore_eos": True} for _ in prompts]
    ref = reference_alone(prompts, params)
    engine = Engine(max_total_tokens=16384)
    engine.generate(input_ids=[system], sampling_params={"max_new_tokens": 1}, progress=False)  # now cached
    out = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2,
                          progress=False)
    engine.shutdown()
    assert max(seen) >= len(system)
    assert_same_greedy(out, ref)
    for got, want in zip(out, ref):
        for a, b in zip(got["meta_info"]["output_token_logprobs"], want["meta_info"]["output_token_logprobs"]):
            if a[1] != b[1]:
                break
            assert abs(a[0] - b[0]) < 1e-4


def test_stop_token_and_stop_string(loop):
    engine = Engine(max_total_tokens=4096, **loop)
    base = engine.generate("Once upon a time", {"max_new_tokens": 12, "temperature": 0})
    ids = base["output_ids"]
    stop_tok = engine.generate("Once upon a time", {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [ids[3]]})
    assert stop_tok["output_ids"] == ids[: ids.index(ids[3]) + 1]
    assert stop_tok["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[3]}
    text = base["text"]
    # Three characters from the second half, not all whitespace (a stop string of spaces alone
    # would test less): the first such window there.
    start = next((i for i in range(len(text) // 2, len(text) - 2) if text[i : i + 3].strip()), None)
    assert start is not None, f"no stop string to take from {text!r}"
    stop_str = text[start : start + 3]
    r = engine.generate("Once upon a time", {"max_new_tokens": 12, "temperature": 0, "stop": stop_str})
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_str}
    assert r["text"] == text[: text.index(stop_str)]  # cut where the stop string first appears, itself left out


def check_slot_conservation(sched) -> None:
    """Every slot is in exactly one place: free, in the tree, or private to a live request."""
    alloc, ps = sched.token_to_kv_pool_allocator, sched.page_size
    free_pages = set(alloc.free_pages.tolist())
    tree_slots = sched.tree_cache.all_values_flatten().tolist() if not sched.tree_cache.disable else []
    tree_pages = {s // ps for s in tree_slots}
    live = {id(r): r for r in sched.running_batch.reqs}
    if sched.last_batch is not None:
        live.update({id(r): r for r in sched.last_batch.reqs})
    if sched.chunked_req is not None:
        live[id(sched.chunked_req)] = sched.chunked_req
    private_pages = set()
    for r in live.values():
        if r.finished() or r.req_pool_idx is None:
            continue
        protected = 0 if sched.tree_cache.disable else len(r.prefix_indices) // ps * ps
        row = sched.req_to_token_pool.req_to_token[r.req_pool_idx, protected : r.kv_committed_len].tolist()
        pages = {s // ps for s in row}
        assert not pages & private_pages, "a slot is private to two requests"
        private_pages |= pages
    assert not free_pages & tree_pages and not free_pages & private_pages and not tree_pages & private_pages
    assert len(free_pages) + len(tree_pages) + len(private_pages) == alloc.num_pages
    tc = sched.tree_cache
    assert tc.evictable_size() + tc.protected_size() == tc.total_size()


@pytest.mark.parametrize("kw", [dict(chunked_prefill_size=48), dict(page_size=4, chunked_prefill_size=48, enable_mixed_chunk=True),
                                dict(max_total_tokens=1000, schedule_conservativeness=0.02, test_retract_interval=5),
                                dict(disable_radix_cache=True, chunked_prefill_size=48)])
def test_slot_conservation_after_every_step(kw, loop):
    prompts, params = make_workload(60, seed=3)
    args = dict(max_total_tokens=6000, **loop)
    args.update(kw)
    engine = Engine(**args)
    reqs = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        reqs += engine.submit(input_ids=p, sampling_params=sp)
        if i % 10 == 9:  # arrivals interleaved with steps
            engine.step()
            check_slot_conservation(engine.scheduler)
        if i == 30:
            engine.abort(reqs[25].rid)
    while engine.scheduler.has_work():
        engine.step()
        check_slot_conservation(engine.scheduler)
    engine.scheduler.check_memory()


def test_engine_refuses_max_new_tokens_beyond_the_context():
    engine = Engine(max_total_tokens=4096, context_length=64)
    with pytest.raises(ValueError, match="maximum context length of 64 tokens"):
        engine.generate(input_ids=[5] * 10, sampling_params={"max_new_tokens": 54}, progress=False)
    out = engine.generate(input_ids=[5] * 10, sampling_params={"max_new_tokens": 53, "temperature": 0, "ignore_eos": True},
                          progress=False)
    assert len(out["output_ids"]) == 53
    engine.shutdown()


def test_engine_with_skip_tokenizer_init_returns_ids_only():
    engine = Engine(max_total_tokens=4096, skip_tokenizer_init=True)
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
                          progress=False)
    assert len(out["output_ids"]) == 4 and out["text"] == ""
    engine.shutdown()


def test_an_exception_while_admitting_one_request_ends_only_that_request(loop, monkeypatch):
    """Isolation (issue 16): a bug reached by one request's input during admission aborts that
    request with a 500 and leaves the scheduler serving the others, leaking nothing."""
    engine = Engine(max_total_tokens=4096, **loop)
    validate = engine.scheduler._validate_request

    def failing_validate(req):
        if req.rid == "bad":
            raise RuntimeError("boom")
        return validate(req)

    monkeypatch.setattr(engine.scheduler, "_validate_request", failing_validate)
    params = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    out = engine.generate(input_ids=[[5, 6, 7], [8, 9, 10], [11, 12]], sampling_params=params, rid=["a", "bad", "b"])
    bad = out[1]["meta_info"]["finish_reason"]
    assert bad["type"] == "abort" and bad["status_code"] == 500 and "RuntimeError: boom" in bad["message"]
    assert [len(o["output_ids"]) for o in (out[0], out[2])] == [5, 5]
    assert engine.scheduler.waiting_queue == [] and len(engine.scheduler.grammar_queue) == 0
    engine.scheduler.check_memory()


def test_requests_that_did_not_fit_run_once_the_pool_frees(loop):
    """A prefill that found no room marks the batch full; when the requests holding the pool
    finish in that very prefill (max_new_tokens 1), nothing is left running to clear the mark:
    the waiting requests must still be admitted (they used to wait forever)."""
    engine = Engine(max_total_tokens=4000, **loop)
    states = engine.submit(input_ids=[[7] * 3000] * 6, sampling_params={"max_new_tokens": 1})
    for _ in range(200):
        engine.step()
        if all(s.finished for s in states):
            break
    assert all(s.finished for s in states), [s.finished for s in states]
    assert all(s.finished_reason["type"] == "length" for s in states)
    engine.wait_until_idle()
    engine.scheduler.check_memory()


@pytest.mark.parametrize("priorities_on", [True, False])
def test_retraction_picks_the_worst_priority_first(priorities_on):
    """Issue 43 item 5 (seed 001 §9.2): with priority scheduling the first victim is the request
    of the worst priority, though the default order (least output, then longest prompt) would
    pick another; without it, the default order."""
    engine = Engine(max_total_tokens=2048, enable_priority_scheduling=priorities_on, test_retract_interval=3)
    try:
        rng = random.Random(9)
        states = {}
        for rid, n, priority in (("low", 6, 0), ("high-long", 40, 10), ("high", 20, 10)):
            ids = [rng.randrange(3, 8000) for _ in range(n)]
            states[rid] = engine.submit(input_ids=ids, rid=rid, priority=priority,
                                        sampling_params={"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})[0]
        sched = engine.scheduler
        while sched.stats.num_retractions == 0:
            engine.step()
        assert [r.rid for r in sched.waiting_queue] == (["low"] if priorities_on else ["high-long"])
        engine.wait_until_idle()
        assert all(s.finished and len(s.output_ids) == 12 for s in states.values())
    finally:
        engine.shutdown()


def test_prompt_one_short_of_the_context_is_served():
    """A prompt of context_len - 1 tokens leaves room for the one token its prefill samples
    (max_new_tokens becomes 0). Its admission reserve was the max_new_tokens clip, more than a
    small pool holds, so it waited forever and held up the queue behind it."""
    engine = Engine(max_total_tokens=2048, context_length=64)
    try:
        rng = random.Random(3)
        full = engine.submit(input_ids=[rng.randrange(3, 8000) for _ in range(63)], sampling_params={"temperature": 0})[0]
        behind = engine.submit(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2, "temperature": 0})[0]
        for _ in range(20):
            engine.step()
        assert full.finished and len(full.output_ids) == 1
        assert behind.finished and len(behind.output_ids) == 2
    finally:
        engine.shutdown()


def test_chunked_prefill_size_unset_is_picked_by_device():
    """SGLang's semantics: unset picks by device (here 512 on a CPU, 2048 on a GPU), -1 (or any
    value <= 0) turns chunking off, a number is taken as given."""
    assert ServerArgs().chunked_prefill_size_on("cpu") == 512
    assert ServerArgs().chunked_prefill_size_on("cuda") == 2048
    assert ServerArgs(page_size=1024).chunked_prefill_size_on("cpu") == 1024  # never below a page
    for off in (-1, 0):
        assert ServerArgs(chunked_prefill_size=off).chunked_prefill_size_on("cpu") is None
    assert ServerArgs(chunked_prefill_size=300).chunked_prefill_size_on("cuda") == 300


def test_cpu_engine_chunks_a_long_prompt_by_default():
    """A 700-token prompt on the CPU is prefilled in two chunks (512 + 188), with the same greedy
    tokens as with chunking off."""
    rng = random.Random(3)
    prompt = [rng.randrange(VOCAB_LO, 8192) for _ in range(700)]
    params = {"max_new_tokens": 4, "temperature": 0}
    chunked = Engine(max_total_tokens=4096)
    assert chunked.scheduler.chunked_prefill_size == 512
    out = chunked.generate(input_ids=[prompt], sampling_params=[params], progress=False)
    assert chunked.stats().num_chunked_prefills == 1  # the first 512 tokens; the rest finishes it
    whole = Engine(max_total_tokens=4096, chunked_prefill_size=-1)
    assert whole.scheduler.chunked_prefill_size is None
    ref = whole.generate(input_ids=[prompt], sampling_params=[params], progress=False)
    assert whole.stats().num_chunked_prefills == 0
    assert_same_greedy(out, ref)
