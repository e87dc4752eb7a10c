"""The loop state (managers/loop_state.py, issue 40): the Scheduler's queue, batches and chunked
request live in a LoopState that the pause, the memory saver and PP are given instead of the
Scheduler. Here on stand-ins (no model): the Scheduler's names read and write the LoopState and
follow its current slot (PP's micro-batches), and a pause drives a LoopState alone."""

from __future__ import annotations

from typing import List, Optional

from radixserve.managers.loop_state import BatchSlot, LoopState, LoopSteps, loop_field
from radixserve.managers.scheduler_pause import GenerationPause
from radixserve.protocol import PauseGenerationReqInput


class FakeReq:
    def __init__(self, rid: str):
        self.rid, self.to_finish, self.finished_reason, self.grammar = rid, None, None, None

    def finished(self) -> bool:
        return self.finished_reason is not None


class FakeBatch:
    def __init__(self, reqs: Optional[List[FakeReq]] = None):
        self.reqs, self.batch_is_full, self.released = list(reqs or []), False, []

    def batch_size(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    def filter_batch(self) -> None:
        self.reqs = [r for r in self.reqs if not r.finished()]

    def release_req(self, req: FakeReq) -> None:
        self.released.append(req.rid)


class Owner:
    """What the Scheduler declares: its loop fields are the LoopState's."""

    running_batch = loop_field("running_batch")
    last_batch = loop_field("last_batch")
    waiting_queue = loop_field("waiting_queue")
    chunked_req = loop_field("chunked_req")

    def __init__(self, loop: LoopState):
        self.loop = loop


def test_loop_fields_follow_the_current_slot():
    """PP points the LoopState at a micro-batch's slot: the Scheduler's running and last batch are
    then that slot's, and what the Scheduler writes lands in that slot (no copying back)."""
    a, b = BatchSlot(FakeBatch([FakeReq("a")])), BatchSlot(FakeBatch([FakeReq("b")]))
    owner = Owner(LoopState(a))
    assert owner.running_batch.reqs[0].rid == "a" and owner.last_batch is None
    owner.loop.slot = b
    assert owner.running_batch.reqs[0].rid == "b"
    merged = FakeBatch([FakeReq("b"), FakeReq("c")])
    owner.running_batch, owner.last_batch = merged, merged
    assert b.running_batch is merged and b.last_batch is merged
    assert a.running_batch.reqs[0].rid == "a" and a.last_batch is None  # the other slot untouched
    owner.waiting_queue = [FakeReq("w")]
    owner.chunked_req = FakeReq("chunk")
    assert [r.rid for r in owner.loop.waiting_queue] == ["w"] and owner.loop.chunked_req.rid == "chunk"
    owner.loop.slot = a  # the queue and the chunked request are the loop's, not a slot's
    assert [r.rid for r in owner.waiting_queue] == ["w"] and owner.chunked_req.rid == "chunk"


def test_a_retract_pause_drives_the_loop_state_alone():
    """GenerationPause given a LoopState and the loop's steps (no Scheduler): it settles (results
    drained, then the stash-and-merge step run while it holds batches), then every running request
    and the chunked one release their KV and are requeued, and the running batch is emptied."""
    running = FakeBatch([FakeReq("r0"), FakeReq("r1")])
    loop = LoopState(BatchSlot(running, last_batch=running), chunked_req=FakeReq("chunk"))
    calls: List[str] = []
    requeued: List[str] = []
    pause: GenerationPause

    def stash_and_merge() -> None:
        calls.append(f"stash(hold={pause.hold_batches()})")

    steps = LoopSteps(drain_results=lambda: calls.append("drain"), stash_and_merge=stash_and_merge,
                      abort=lambda recv: calls.append("abort"), empty_batch=FakeBatch,
                      requeue=lambda req: requeued.append(req.rid))
    pause = GenerationPause(loop, ledger=None, output_processor=None, steps=steps)
    out = pause.pause_generation(PauseGenerationReqInput(mode="retract"))
    assert out.success and pause.engine_paused and pause.hold_batches()
    assert calls == ["drain", "stash(hold=True)"]
    assert running.released == ["r0", "r1", "chunk"] and requeued == ["r0", "r1", "chunk"]
    assert loop.chunked_req is None and loop.running_batch.is_empty() and loop.running_batch is not running
    assert loop.last_batch is None  # merged by the settle: not merged again


def test_replica_load_reads_the_loop_state():
    """What a DP replica reports (scheduler_process.replica_load) comes from its LoopState: the
    running and waiting requests, and with minimum_tokens routing the running requests' tokens
    plus the waiting prompts'."""
    from radixserve.managers.scheduler_process import replica_load

    running = [FakeReq("r0"), FakeReq("r1")]
    for r, n in zip(running, (7, 5)):
        r.seqlen = lambda n=n: n
    waiting = FakeReq("w")
    waiting.origin_input_ids = [1, 2, 3]
    loop = LoopState(BatchSlot(FakeBatch(running)), waiting_queue=[waiting])
    load = replica_load(loop, dp_rank=1, count_tokens=True)
    assert (load.dp_rank, load.num_reqs, load.num_tokens) == (1, 3, 7 + 5 + 3)
    assert replica_load(loop, dp_rank=1, count_tokens=False).num_reqs == 3
