"""pause_generation / continue_generation on the offline Engine (the scheduler's own handlers) and
the SchedulerInputBlocker under them: in every mode new work is held (not refused) and runs after
continue; in_place and retract requests end with the outputs they would have had unpaused, abort
ones with an abort finish reason; every request is answered and every KV slot accounted for
(--test-check-memory checks the pools after every step, check_memory() at the end)."""

from __future__ import annotations

import random
from typing import Dict, List

import pytest

from radixserve.engine import Engine
from radixserve.managers.scheduler_input_blocker import SchedulerInputBlocker
from radixserve.protocol import (
    AbortReq, BatchTokenizedGenerateReqInput, BlockReqInput, BlockReqType, ContinueGenerationReqInput,
    FlushCacheReqInput, PauseGenerationReqInput, TokenizedGenerateReqInput,
)
from radixserve.sampling_params import SamplingParams

SAMPLING = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
NEAR_TIE = 1e-3


def _prompts(n: int, seed: int = 3) -> List[List[int]]:
    rng = random.Random(seed)
    long = [rng.randrange(3, 8192) for _ in range(150)]  # chunked (chunked_prefill_size 32)
    return [long] + [[rng.randrange(3, 8192) for _ in range(rng.randint(4, 40))] for _ in range(n - 1)]


def _engine(loop: Dict) -> Engine:
    return Engine(max_total_tokens=4096, chunked_prefill_size=32, max_running_requests=4, dtype="float32",
                  test_check_memory=True, **loop)


@pytest.fixture(scope="module")
def reference() -> List[List[int]]:
    """Each prompt alone, never paused. These prompts have no near-tie (top-2 logprob gap well above
    float32 batching noise, ~1e-5), so a paused run must give exactly these tokens."""
    engine = Engine(max_total_tokens=4096, dtype="float32", disable_radix_cache=True)
    out = [engine.generate(input_ids=p, sampling_params=SAMPLING, return_logprob=True, top_logprobs_num=2)
           for p in _prompts(7)]
    gaps = [top[0][0] - top[1][0] for r in out for top in r["meta_info"]["output_top_logprobs"]]
    assert min(gaps) > NEAR_TIE
    return [r["output_ids"] for r in out]


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
def test_pause_holds_new_work_and_continue_resumes_it(mode, loop, reference):
    engine = _engine(loop)
    sched = engine.scheduler
    prompts = _prompts(7)
    first = engine.submit(input_ids=prompts[:5], sampling_params=SAMPLING)
    for _ in range(6):
        engine.step()
    assert sched.chunked_req is not None or sched.running_batch.batch_size() > 0
    running_before = [s.rid for s in first if not s.finished]
    assert running_before, "some requests must be in flight when the pause comes"
    engine.pause_generation(mode)
    late = engine.submit(input_ids=prompts[5:], sampling_params=SAMPLING)
    progress = [len(s.output_ids) for s in first + late]
    for _ in range(5):
        engine.step()
    engine.wait_until_idle()  # returns: what is left waits for the continue
    assert [len(s.output_ids) for s in first + late] == progress  # nothing runs while paused
    info = engine.get_server_info()
    assert info["paused"] and info["pause_mode"] == mode and info["num_held_reqs"] == 2
    assert not any(s.finished for s in late)  # held, not refused
    alloc, tree = sched.token_to_kv_pool_allocator, sched.tree_cache
    if mode == "in_place":
        assert sched.running_batch.batch_size() + (sched.chunked_req is not None) > 0  # still holding its KV
    else:  # no request holds KV: every slot is free or in the tree, nothing locked
        assert sched.running_batch.is_empty() and sched.chunked_req is None
        assert alloc.available_size() + tree.evictable_size() == sched.max_total_num_tokens
    if mode == "abort":
        for s in first:
            if s.rid in running_before:
                assert s.finished and s.finished_reason["type"] == "abort", s.finished_reason
    engine.continue_generation()
    assert not engine.get_server_info()["paused"]
    engine.wait_until_idle()
    assert all(s.finished for s in first + late)  # every request answered
    for s, ref in zip(first + late, reference[:5] + reference[5:]):
        if mode == "abort" and s in first:
            continue
        assert s.output_ids == ref, (mode, s.rid)
    sched.check_memory()


def test_retracted_requests_wait_with_their_outputs_and_finish_after_continue(loop, reference):
    """A retract pause sends the running requests back to the waiting queue (their outputs kept);
    while they wait the cache is not flushed (SGLang's rule: a flush needs an idle server)."""
    engine = _engine(loop)
    states = engine.submit(input_ids=_prompts(4), sampling_params=SAMPLING)
    for _ in range(8):
        engine.step()
    engine.pause_generation("retract")
    assert engine.flush_cache() is False
    assert sum(r.retraction_count for r in engine.scheduler.waiting_queue) > 0
    engine.continue_generation()
    engine.wait_until_idle()
    assert [s.output_ids for s in states] == reference[:4]
    assert engine.flush_cache() is True
    engine.scheduler.check_memory()


def test_a_pause_in_a_pause_applies_the_new_mode(loop):
    engine = _engine(loop)
    states = engine.submit(input_ids=_prompts(4), sampling_params=SAMPLING)
    for _ in range(6):
        engine.step()
    engine.pause_generation("in_place")
    engine.pause_generation("abort")
    assert all(s.finished and s.finished_reason["type"] == "abort" for s in states)
    engine.continue_generation()
    engine.scheduler.check_memory()


def test_bad_input_and_the_engine_refusing_to_wait_while_paused():
    engine = Engine(max_total_tokens=2048, max_running_requests=8, context_length=512)
    with pytest.raises(ValueError, match="Unknown pause mode 'sleep'"):
        engine.pause_generation("sleep")
    assert not engine.get_server_info()["paused"]
    engine.continue_generation()  # not paused: nothing to do (SGLang's continue is idempotent too)
    engine.pause_generation("in_place")
    with pytest.raises(ValueError, match="Generation is paused"):
        engine.generate(input_ids=[5, 6, 7], sampling_params=SAMPLING)
    engine.continue_generation()
    assert engine.generate(input_ids=[5, 6, 7], sampling_params=SAMPLING)["meta_info"]["finish_reason"]["type"] == "length"


def _req(rid: str) -> TokenizedGenerateReqInput:
    sp = SamplingParams(max_new_tokens=2)
    sp.normalize()
    return TokenizedGenerateReqInput(rid, None, [5, 6, 7], sp)


def test_input_blocker_holds_work_in_order_and_lets_control_pass():
    blocker = SchedulerInputBlocker()
    a, b, c = _req("a"), _req("b"), _req("c")
    pause, cont, flush = PauseGenerationReqInput("in_place"), ContinueGenerationReqInput(), FlushCacheReqInput()
    # A request after the pause in the same read is held; control messages pass.
    assert blocker.handle([a, pause, b, flush]) == [a, pause, flush]
    batch = BatchTokenizedGenerateReqInput([c])
    assert blocker.handle([batch]) == [] and blocker.num_pending_reqs() == 2
    # An abort of a held request lets it in first, so the scheduler's abort path answers it.
    abort_c = AbortReq(rid="c")
    assert blocker.handle([abort_c]) == [batch, abort_c]
    assert blocker.handle([cont]) == [cont, b]  # continue, then the held ones in order
    assert blocker.handle([_req("d")])[0].rid == "d"
    # SGLang's BlockReqInput works the same way; an unknown pause mode does not block.
    assert blocker.handle([BlockReqInput(BlockReqType.BLOCK), a]) == [] and blocker.blocked
    assert blocker.handle([BlockReqInput(BlockReqType.UNBLOCK)]) == [a]
    bad = PauseGenerationReqInput("sleep")
    assert blocker.handle([bad, b]) == [bad, b] and not blocker.blocked


def test_aborting_a_held_request_answers_it(loop):
    engine = _engine(loop)
    engine.pause_generation("in_place")
    held = engine.submit(input_ids=[[5, 6, 7], [8, 9, 10]], sampling_params=SAMPLING)
    engine.step()
    engine.abort(held[0].rid)
    engine.step()
    assert held[0].finished and held[0].finished_reason["type"] == "abort"
    assert not held[1].finished
    engine.continue_generation()
    engine.wait_until_idle()
    assert held[1].finished_reason["type"] == "length"
    engine.scheduler.check_memory()
