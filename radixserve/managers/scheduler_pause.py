"""/pause_generation and /continue_generation on the scheduler side (SGLang's pause_generation /
continue_generation and its `_engine_paused`), built on the SchedulerInputBlocker (seed 000).

    pause(mode)  the input blocker holds new work and no batch is scheduled (get_next_batch_to_run
                 asks hold_batches()); the scheduler settles (the result of the batch in flight
                 processed, the last prefill batch merged, the chunked request's chunk in the
                 tree), then by mode:
        abort      every request in flight or waiting ends now, finish_reason {"type": "abort"}
        retract    running requests (and the chunked one) free their KV and go back to the
                   waiting queue, outputs kept; after continue they are prefilled again (the radix
                   tree still holds most of their KV unless it was flushed meanwhile)
        in_place   nothing moves: the running requests keep their KV
    continue     scheduling resumes and the held requests come in, in their order of arrival.

Every request is answered (the abort path and retraction are the scheduler's own) and every KV
slot stays accounted for: retract and abort leave the pools as check_memory() wants them idle.
A pause in a pause applies the new mode (in_place, then abort: everything ends).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Type

from radixserve.managers.loop_state import LoopState, LoopSteps
from radixserve.managers.scheduler_input_blocker import PAUSE_MODES, SchedulerInputBlocker
from radixserve.protocol import (
    AbortReq, ContinueGenerationReqInput, ContinueGenerationReqOutput, PauseGenerationReqInput, PauseGenerationReqOutput,
)

if TYPE_CHECKING:
    from radixserve.managers.output_processor import SchedulerOutputProcessor
    from radixserve.managers.schedule_batch import Req
    from radixserve.mem_cache.kv_ledger import KVLedger

logger = logging.getLogger(__name__)

ABORT_MESSAGE = "Aborted by pause_generation."


def expects_progress(has_work: bool, pause: Optional["GenerationPause"]) -> bool:
    """Whether the loop should be making forward progress: it has work and is not paused
    (the idle poll and the watchdog of scheduler_process ask this, through Scheduler.expects_progress)."""
    return has_work and not (pause is not None and pause.engine_paused)


class GenerationPause:
    """The pause state (`engine_paused`, `mode`) and the input blocker of one scheduler. A pause
    settles the loop (`steps`), then aborts or retracts what its LoopState runs: finished requests'
    KV goes to the tree through the ledger, their outputs out through the output processor."""

    def __init__(self, loop: LoopState, ledger: "KVLedger", output_processor: "SchedulerOutputProcessor", steps: LoopSteps):
        self.loop, self.ledger, self.output_processor, self.steps = loop, ledger, output_processor, steps
        self.input_blocker = SchedulerInputBlocker()
        self.engine_paused = False
        self.mode: str = ""
        self._settling = False

    def dispatch_entries(self) -> List[Tuple[Type, Callable[[Any], Any]]]:
        return [(PauseGenerationReqInput, self.pause_generation), (ContinueGenerationReqInput, self.continue_generation)]

    def hold_batches(self) -> bool:
        """get_next_batch_to_run schedules nothing while this holds (after its stash and merge)."""
        return self.engine_paused or self._settling

    def internal_state(self) -> Dict[str, Any]:
        return {"paused": self.engine_paused, "pause_mode": self.mode or None,
                "num_held_reqs": self.input_blocker.num_pending_reqs()}

    # ---- handlers ---------------------------------------------------------------------------
    def pause_generation(self, recv: PauseGenerationReqInput) -> PauseGenerationReqOutput:
        if recv.mode not in PAUSE_MODES:
            return PauseGenerationReqOutput(False, f"Unknown pause mode {recv.mode!r}: use one of {', '.join(PAUSE_MODES)}.",
                                            recv.query_id)
        self.engine_paused, self.mode = True, recv.mode
        if recv.mode == "abort":
            self.steps.abort(AbortReq(abort_all=True, abort_message=ABORT_MESSAGE))  # the queued end now
        self.settle()
        if recv.mode == "abort":
            n = self._finish_running()
        elif recv.mode == "retract":
            n = self._retract_all()
        else:
            n = self.loop.running_batch.batch_size() + (self.loop.chunked_req is not None)
        logger.info("Generation paused (%s): %d running request(s) %s.", recv.mode, n,
                    {"abort": "aborted", "retract": "retracted", "in_place": "kept in place"}[recv.mode])
        return PauseGenerationReqOutput(True, "Generation paused successfully.", recv.query_id)

    def continue_generation(self, recv: ContinueGenerationReqInput) -> ContinueGenerationReqOutput:
        was_paused, self.engine_paused, self.mode = self.engine_paused, False, ""
        message = "Generation continued successfully." if was_paused else "Generation was not paused."
        return ContinueGenerationReqOutput(True, message, recv.query_id)

    # ---- the work -----------------------------------------------------------------------------
    def settle(self) -> None:
        """Bring the scheduler between two batches without scheduling one: the results in flight
        processed, the last prefill batch merged into the running batch and the chunked request
        stashed (get_next_batch_to_run's first steps), finished requests filtered out."""
        s = self.loop
        self.steps.drain_results()
        self._settling = True
        try:
            self.steps.stash_and_merge()  # returns at hold_batches(), before it schedules anything
        finally:
            self._settling = False
        s.last_batch = None  # merged above: the next iteration must not merge it again
        s.running_batch.filter_batch()
        if s.running_batch.is_empty():
            s.running_batch.batch_is_full = False

    def _finish_running(self) -> int:
        """abort: the running requests (to_finish set by the AbortReq) end now, their KV
        handed to the tree; the aborted chunked request was released by settle()."""
        from radixserve.managers.schedule_batch import FINISH_ABORT  # here: scheduler_process imports this module torch-free

        s = self.loop
        reqs: List[Req] = [r for r in s.running_batch.reqs if not r.finished()]
        for r in reqs:
            r.finished_reason, r.to_finish = r.to_finish or FINISH_ABORT(ABORT_MESSAGE), None
            r.grammar = None
            self.ledger.cache_finished_req(r)
        s.running_batch = self.steps.empty_batch()
        self.output_processor.stream_output(reqs)
        return len(reqs)

    def _retract_all(self) -> int:
        """retract: every running request (and the chunked one) frees its KV and waits again."""
        s = self.loop
        reqs: List[Req] = [r for r in s.running_batch.reqs if not r.finished()]
        if s.chunked_req is not None:
            reqs.append(s.chunked_req)
            s.chunked_req = None
        for r in reqs:
            s.running_batch.release_req(r)
        s.running_batch = self.steps.empty_batch()
        for r in reqs:
            self.steps.requeue(r)
        return len(reqs)
