"""Issue 43 item 6: /set_internal_state on the scheduler (through the offline Engine, which drives
the same handler): max_running_requests and chunked_prefill_size change while serving and the
next batches follow them; a bad name or value changes nothing and the error names the field."""

from __future__ import annotations

import pytest

from radixserve.engine import Engine
from radixserve.managers.scheduler_internal_state import RunTimeLimits, internal_state_problem

LONG = {"max_new_tokens": 12, "ignore_eos": True, "temperature": 0}


def test_lower_max_running_requests_caps_the_next_batches(loop):
    engine = Engine(max_total_tokens=4096, **loop)
    sched = engine.scheduler
    assert engine.set_internal_state({"max_running_requests": 2}) == {
        "max_running_requests": 2, "chunked_prefill_size": sched.chunked_prefill_size}
    states = engine.submit(input_ids=[[5 + i, 6, 7] for i in range(5)], sampling_params=LONG)
    most = 0
    while engine._inbox or sched.has_work():
        engine.step()
        most = max(most, sched.running_batch.batch_size())
    assert most == 2 and all(len(s.output_ids) == 12 for s in states)
    engine.set_internal_state({"max_running_requests": 4})  # raised again: admitted again
    engine.submit(input_ids=[[9 + i, 6, 7] for i in range(5)], sampling_params=LONG)
    most = 0
    while engine._inbox or sched.has_work():
        engine.step()
        most = max(most, sched.running_batch.batch_size())
    assert most == 4
    assert engine.get_server_info()["max_running_requests"] == 4
    sched.check_memory()


def test_chunked_prefill_size_changes_the_chunks(loop):
    engine = Engine(max_total_tokens=4096, chunked_prefill_size=256, **loop)
    engine.set_internal_state({"chunked_prefill_size": 512})
    before = engine.stats()
    engine.generate(input_ids=[7] * 1000, sampling_params={"max_new_tokens": 1}, progress=False)
    after = engine.stats()
    assert after.num_prefill_batches - before.num_prefill_batches == 2  # 512 + 488, not 4 chunks of 256
    engine.scheduler.check_memory()


@pytest.mark.parametrize("args, field", [
    ({"max_running_requests": 0}, "max_running_requests"),
    ({"max_running_requests": 10**9}, "max_running_requests"),
    ({"max_running_requests": "8"}, "max_running_requests"),
    ({"max_running_requests": True}, "max_running_requests"),
    ({"chunked_prefill_size": 0}, "chunked_prefill_size"),
    ({"page_size": 4}, "page_size"),
    ({}, "server_args"),
])
def test_bad_settings_are_refused_naming_the_field(args, field):
    engine = Engine(max_total_tokens=4096)
    before = engine.set_internal_state({"max_running_requests": 3})
    with pytest.raises(ValueError, match=field):
        engine.set_internal_state(args)
    assert engine.set_internal_state({"max_running_requests": 3}) == before  # nothing changed


def test_the_overlap_loops_future_map_bounds_the_chunk_size():
    limits = RunTimeLimits(pool_rows=16, page_size=1, context_len=4096, overlap_max_chunks=2, pipeline_parallel=False)
    assert internal_state_problem({"chunked_prefill_size": 2048}, limits) is None
    problem = internal_state_problem({"chunked_prefill_size": 2047}, limits)
    assert "chunked_prefill_size must be at least 2048" in problem and "FutureMap" in problem
    normal = RunTimeLimits(pool_rows=16, page_size=16, context_len=4096, overlap_max_chunks=None, pipeline_parallel=False)
    assert internal_state_problem({"chunked_prefill_size": 16}, normal) is None
    assert "at least 16 (the page size)" in internal_state_problem({"chunked_prefill_size": 15}, normal)
    pp = RunTimeLimits(pool_rows=16, page_size=1, context_len=4096, overlap_max_chunks=None, pipeline_parallel=True)
    assert "--pp-size" in internal_state_problem({"max_running_requests": 4}, pp)


def test_chunking_turned_on_at_run_time_mixes_with_decode_as_at_start():
    """--enable-mixed-chunk is derived from chunked_prefill_size at start: a server started without
    chunking that gets a chunk size now mixes its chunks with decode, as one started with it."""
    engine = Engine(max_total_tokens=4096, chunked_prefill_size=-1, enable_mixed_chunk=True,
                    disable_overlap_schedule=True)
    assert not engine.scheduler.is_mixed_chunk
    engine.set_internal_state({"chunked_prefill_size": 256})
    assert engine.scheduler.is_mixed_chunk


def test_dp_merges_every_replicas_histogram_buckets():
    """A histogram's bucket counts (e.g. grammar_compilation_time_counts) add up across
    replicas, as its _sum and _count do, so the merged histogram is consistent."""
    from types import SimpleNamespace

    from radixserve.managers.dp_controller import DataParallelController
    from radixserve.protocol import GetInternalStateReqOutput

    replies = [GetInternalStateReqOutput({"grammar_compilation_time_counts": [1, 0, 2], "note": "a"}, "q"),
               GetInternalStateReqOutput({"grammar_compilation_time_counts": [0, 3, 1], "note": "b"}, "q")]
    ctl = SimpleNamespace(dp_size=2, budget=SimpleNamespace(num_dispatched=[1, 1]))
    merged = DataParallelController.merge(ctl, replies).internal_state
    assert merged["grammar_compilation_time_counts"] == [1, 3, 3]
    assert merged["note"] == "a"
