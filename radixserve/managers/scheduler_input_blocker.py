"""SchedulerInputBlocker (seed 000): between a block and an unblock, new work requests are held
back at the scheduler's door and let in, in their order of arrival, when it opens again.

    recv_requests -> [SchedulerInputBlocker.handle] -> process_input_requests -> dispatcher
                          |  UNBLOCKED: everything passes
                          |  BLOCKED:   work (generate, embedding) is held; control passes

What blocks and unblocks it: SGLang's BlockReqInput(BLOCK / UNBLOCK), and /pause_generation and
/continue_generation, at their place in the stream of messages (so a request sent after a pause
is held even when both arrive in one read). Control messages (abort, flush, state, continue,
memory release, profiling) always pass, or a paused server could never be continued. An abort
of a held request first lets that request in (then the abort ends it through the scheduler's
usual path, which answers it), so every request is answered.

SGLang's blocker also waits at a global barrier before unblocking (its ranks read their own
sockets with DP attention). Here every TP rank runs this on the same broadcast stream (rank 0
reads, Scheduler.recv_requests broadcasts), so the ranks switch state at the same message, and
each DP replica has its own blocker: no barrier is needed.
"""

from __future__ import annotations

import logging
from enum import Enum, auto
from typing import Any, List

from radixserve.protocol import AbortReq, BlockReqInput, BlockReqType, ContinueGenerationReqInput, PauseGenerationReqInput

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


def is_work_request(obj: Any) -> bool:
    """A request that asks for a forward (tokenized generate / embedding, one or a batch)."""
    batch = getattr(obj, "batch", None)
    if isinstance(batch, list):
        return all(is_work_request(r) for r in batch)
    return hasattr(obj, "input_ids") and hasattr(obj, "rid")


def request_rids(obj: Any) -> List[str]:
    batch = getattr(obj, "batch", None)
    return [r.rid for r in batch] if isinstance(batch, list) else [obj.rid]


class _State(Enum):
    UNBLOCKED = auto()
    BLOCKED = auto()


class SchedulerInputBlocker:
    def __init__(self) -> None:
        self._state = _State.UNBLOCKED
        self._pending_reqs: List[Any] = []

    @property
    def blocked(self) -> bool:
        return self._state == _State.BLOCKED

    def num_pending_reqs(self) -> int:
        return sum(len(request_rids(r)) for r in self._pending_reqs)

    def handle(self, recv_reqs: List[Any]) -> List[Any]:
        """The messages to dispatch now, in order; held ones come out at the unblock."""
        output_reqs: List[Any] = []
        for recv_req in recv_reqs:
            output_reqs += self._handle_recv_req(recv_req)
        return output_reqs

    def _handle_recv_req(self, recv_req: Any) -> List[Any]:
        if isinstance(recv_req, BlockReqInput):
            if recv_req.type == BlockReqType.BLOCK:
                self._execute_block_req()
                return []
            return self._execute_unblock_req()
        if isinstance(recv_req, PauseGenerationReqInput):
            if recv_req.mode in PAUSE_MODES:  # an unknown mode is refused by the handler: no block
                self._execute_block_req()
            return [recv_req]
        if isinstance(recv_req, ContinueGenerationReqInput):
            return [recv_req] + self._execute_unblock_req()
        if self._state == _State.BLOCKED:
            if is_work_request(recv_req):
                self._pending_reqs.append(recv_req)
                return []
            if isinstance(recv_req, AbortReq):
                return self._release_aborted(recv_req) + [recv_req]
        return [recv_req]

    def _execute_block_req(self) -> None:
        if self._state != _State.BLOCKED:
            logger.info("Input blocked: new requests are held until generation continues.")
        self._state = _State.BLOCKED

    def _execute_unblock_req(self) -> List[Any]:
        if self._state == _State.BLOCKED:
            logger.info("Input unblocked: %d held request(s) let in.", self.num_pending_reqs())
        self._state = _State.UNBLOCKED
        output_reqs, self._pending_reqs = self._pending_reqs, []
        return output_reqs

    def _release_aborted(self, abort: AbortReq) -> List[Any]:
        """The held requests this abort names (a batch: if any of its requests is named)."""
        hit = [r for r in self._pending_reqs if abort.abort_all or abort.rid in request_rids(r)]
        self._pending_reqs = [r for r in self._pending_reqs if not any(r is h for h in hit)]
        return hit
