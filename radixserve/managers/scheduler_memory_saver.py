"""/release_memory_occupation and /resume_memory_occupation on the scheduler side (SGLang's
release_memory_occupation / resume_memory_occupation of scheduler_update_weights_mixin.py).

A release needs a server where no request holds KV: SGLang asserts it, here the release is
refused with a clear message (HTTP 400) while requests run; pause with mode abort or retract
first, or wait. Requests that only wait (retracted by a retract pause) may stay: they hold no KV.
Releasing kv_cache flushes the radix cache first. While kv_cache or weights is released nothing
is scheduled, and a request that comes in is answered 503 (unless generation is paused: then it
is held, and answered 503 at continue if the memory is still released). cuda_graph alone leaves
generation running, eagerly (SGLang's third tag). The memory itself: model_executor/memory_saver.py.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

from radixserve.managers.encode_queue import EncodeQueue
from radixserve.managers.grammar import GrammarQueue
from radixserve.managers.loop_state import LoopState
from radixserve.managers.output_processor import SchedulerOutputProcessor
from radixserve.managers.schedule_batch import FINISH_ABORT
from radixserve.managers.schedule_policy import NewTokenRatio
from radixserve.managers.scheduler_pause import GenerationPause
from radixserve.mem_cache.kv_ledger import KVLedger
from radixserve.server_args import ServerArgs
from radixserve.model_executor.memory_saver import (
    GPU_MEMORY_ALL_TYPES, GPU_MEMORY_TYPE_KV_CACHE, GPU_MEMORY_TYPE_WEIGHTS, MemorySaverAdapter,
)
from radixserve.protocol import (
    ReleaseMemoryOccupationReqInput, ReleaseMemoryOccupationReqOutput, ResumeMemoryOccupationReqInput,
    ResumeMemoryOccupationReqOutput,
)

logger = logging.getLogger(__name__)

RELEASED_MESSAGE = ("The server's memory is released (release_memory_occupation): "
                    "call /resume_memory_occupation before sending requests.")


def parse_memory_tags(tags: Optional[List[str]], default: List[str]) -> Tuple[List[str], Optional[str]]:
    """(tags, None), or ([], why not): unknown or repeated tags are refused; None or [] is `default`."""
    if not tags:
        return list(default), None
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        return [], "tags must be a list of strings."
    unknown = [t for t in tags if t not in GPU_MEMORY_ALL_TYPES]
    if unknown:
        return [], f"Unknown memory tag(s) {unknown}: use {', '.join(GPU_MEMORY_ALL_TYPES)}."
    return list(dict.fromkeys(tags)), None


class SchedulerMemorySaver:
    """A release asks that nothing runs or waits in the loop (after the pause settled it), then
    flushes the KV cache (the ledger); while released, the waiting requests are answered 503."""

    def __init__(self, adapter: Optional[MemorySaverAdapter], server_args: ServerArgs, loop: LoopState,
                 grammar_queue: GrammarQueue, encode_queue: EncodeQueue, ledger: KVLedger, new_token_ratio: NewTokenRatio,
                 output_processor: SchedulerOutputProcessor, pause: GenerationPause,
                 waiting_on_peer: Callable[[], bool]):
        self.adapter = adapter  # the worker's (None: the simulator's worker has nothing to release)
        self.server_args = server_args
        self.loop, self.grammar_queue, self.ledger, self.new_token_ratio = loop, grammar_queue, ledger, new_token_ratio
        self.encode_queue = encode_queue  # image requests waiting for their encoder run
        self.output_processor, self.pause, self.waiting_on_peer = output_processor, pause, waiting_on_peer

    @property
    def released_tags(self) -> List[str]:
        return list(self.adapter.released) if self.adapter is not None else []

    def dispatch_entries(self) -> List[Tuple[Type, Callable[[Any], Any]]]:
        return [(ReleaseMemoryOccupationReqInput, self.release_memory_occupation),
                (ResumeMemoryOccupationReqInput, self.resume_memory_occupation)]

    def blocks_generation(self) -> bool:
        return any(t in (GPU_MEMORY_TYPE_KV_CACHE, GPU_MEMORY_TYPE_WEIGHTS) for t in self.released_tags)

    def internal_state(self) -> Dict[str, Any]:
        return {"released_memory_tags": self.released_tags}

    def hold_batches(self) -> bool:
        """While the KV pool or the weights are away: nothing runs, and what waits is answered 503."""
        if not self.blocks_generation():
            return False
        s = self.loop
        queued = s.waiting_queue + self.grammar_queue.remove(lambda r: True) + self.encode_queue.remove(lambda r: True)
        s.waiting_queue = []
        for r in queued:
            r.grammar = None
            self.output_processor.finish(r, FINISH_ABORT(RELEASED_MESSAGE, status_code=503, err_type="ServiceUnavailable"))
        return True

    # ---- handlers ---------------------------------------------------------------------------
    def release_memory_occupation(self, recv: ReleaseMemoryOccupationReqInput) -> ReleaseMemoryOccupationReqOutput:
        tags, error = parse_memory_tags(recv.tags, GPU_MEMORY_ALL_TYPES)
        error = error or self._release_problem(tags)
        if error is not None:
            return ReleaseMemoryOccupationReqOutput(False, error, recv.query_id)
        if GPU_MEMORY_TYPE_KV_CACHE in tags:
            self._flush_radix_cache()
        self.encode_queue.wait_idle()  # the encoder thread reads the weights (a removed request's encode too)
        try:
            freed = self.adapter.release(tags)
        except Exception as e:  # e.g. no room for the weights' bytes: nothing was freed
            logger.exception("Memory release failed")
            return ReleaseMemoryOccupationReqOutput(False, f"Release failed: {type(e).__name__}: {e}", recv.query_id)
        logger.info("Memory released (%s): %.1f MB freed.", ", ".join(tags), freed / 1024**2)
        return ReleaseMemoryOccupationReqOutput(True, f"Released {', '.join(tags)}: {freed / 1024**2:.1f} MB.", recv.query_id)

    def resume_memory_occupation(self, recv: ResumeMemoryOccupationReqInput) -> ResumeMemoryOccupationReqOutput:
        released = self.released_tags
        tags, error = parse_memory_tags(recv.tags, released)
        if error is None and not tags:
            error = "Nothing to resume: no memory is released (call /release_memory_occupation first)."
        if error is None and any(t not in released for t in tags):
            error = f"Cannot resume {[t for t in tags if t not in released]}: not released (released: {released or 'none'})."
        if error is not None:
            return ResumeMemoryOccupationReqOutput(False, error, recv.query_id)
        try:
            self.adapter.resume(tags)
        except Exception as e:  # e.g. out of memory: what is not back stays released (retry)
            logger.exception("Memory resume failed")
            return ResumeMemoryOccupationReqOutput(False, f"Resume failed: {type(e).__name__}: {e}", recv.query_id)
        logger.info("Memory resumed (%s).", ", ".join(tags))
        return ResumeMemoryOccupationReqOutput(True, f"Resumed {', '.join(tags)}.", recv.query_id)

    # ---- helpers ------------------------------------------------------------------------------
    def _release_problem(self, tags: List[str]) -> Optional[str]:
        s = self.loop
        if self.adapter is None:
            return "This scheduler's worker has no model memory to release."
        if self.server_args.disaggregation_mode != "null":
            return "release_memory_occupation is not supported with --disaggregation-mode (the KV transfer engine holds the pool)."
        if self.server_args.pp_size > 1:
            return "release_memory_occupation is not supported with --pp-size > 1 yet (only the first stage would release)."
        already = [t for t in tags if t in self.adapter.released]
        if already:
            return f"Already released: {already}."
        self.pause.settle()  # a request that just finished no longer counts
        running = s.running_batch.batch_size() + (s.chunked_req is not None)
        if running or self.waiting_on_peer():
            return (f"Cannot release memory while {running} request(s) are running: pause with mode abort or "
                    "retract, or wait for them to finish.")
        queued = len(s.waiting_queue) + len(self.grammar_queue) + len(self.encode_queue)
        if queued and not self.pause.engine_paused:
            return f"Cannot release memory while {queued} request(s) are waiting: pause generation first, or wait."
        return self.adapter.check_can_release(tags)

    def _flush_radix_cache(self) -> None:
        """flush_cache's resets (it refuses while requests wait; retracted ones hold no KV)."""
        self.ledger.clear()
        self.new_token_ratio.reset()
