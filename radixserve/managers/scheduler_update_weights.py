"""The Scheduler's handlers of weight updates (SGLang's SchedulerUpdateWeightsMixin, as a component
the Scheduler composes: its dispatch_entries() join the TypeBasedDispatcher's table).

    UpdateWeightFromDiskReqInput ----------.
    UpdateWeightsFromTensorReqInput --------+--> settle --> TpModelWorker.update_weights_* --> flush_cache
    UpdateWeightsFromDistributedReqInput --'       (every TP rank, in lockstep: control messages are
    Init/DestroyWeightsUpdateGroupReqInput          broadcast by rank 0, see Scheduler.recv_requests)
    GetWeightsByNameReqInput

Before the weights change, what is in flight finishes (`settle`): the overlap loop's forward,
which reads the weights on another thread, and requests admitted before the update. The
TokenizerManager holds new requests back while an update runs (its model_update_lock), and with
abort_all_requests it aborted the old ones first. The radix cache is flushed afterwards: its KV
was computed with the old weights.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Protocol, Tuple

from radixserve.managers.overlap import ForwardThread
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache

from radixserve.protocol import (
    DestroyWeightsUpdateGroupReqInput,
    DestroyWeightsUpdateGroupReqOutput,
    GetWeightsByNameReqInput,
    GetWeightsByNameReqOutput,
    InitWeightsUpdateGroupReqInput,
    InitWeightsUpdateGroupReqOutput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromDistributedReqOutput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightsFromTensorReqOutput,
)

logger = logging.getLogger(__name__)


@dataclass
class WeightsUpdateGroupJoined:
    """Rank 0's note, sent along with its requests, that its join of a weights update group has
    ended: every TP rank handles it at the same step and they agree on the outcome together."""


# The update reaches this (the first) stage's scheduler only: the later stages would keep the old weights.
PP_REFUSAL = "Weight updates with --pp-size > 1 are not supported yet (only the first pipeline stage would be updated)."


@dataclass(frozen=True)
class SettleLoop:
    """What an update needs of the Scheduler's loop (its bound methods): run it until nothing is
    in flight, then flush."""

    has_work: Callable[[], bool]
    run_step: Callable[[], Optional[Any]]
    results_pending: Callable[[], bool]
    flush_cache: Callable[[], bool]


class WeightsWorker(Protocol):
    """The worker's weight-update methods (TpModelWorker's)."""

    def update_weights_from_disk(self, recv: UpdateWeightFromDiskReqInput) -> Tuple[bool, str]: ...

    def update_weights_from_tensor(self, recv: UpdateWeightsFromTensorReqInput) -> Tuple[bool, str]: ...

    def update_weights_from_distributed(self, recv: UpdateWeightsFromDistributedReqInput) -> Tuple[bool, str]: ...

    def join_weights_update_group(self, recv: InitWeightsUpdateGroupReqInput) -> Optional[str]: ...

    def finish_weights_update_group_join(self, recv: InitWeightsUpdateGroupReqInput, error: Optional[str]) -> Tuple[bool, str]: ...

    def destroy_weights_update_group(self, recv: DestroyWeightsUpdateGroupReqInput) -> Tuple[bool, str]: ...

    def get_weights_by_name(self, recv: GetWeightsByNameReqInput) -> Optional[List[Any]]: ...


class SchedulerUpdateWeights:
    """Weight updates between two steps of the loop (`loop`: the loop's steps it runs, SettleLoop)."""

    def __init__(self, worker: WeightsWorker, loop: SettleLoop, forward_thread: Optional[ForwardThread],
                 tree_cache: BasePrefixCache, pp_size: int = 1):
        self.worker = worker
        self.loop = loop
        self.forward_thread = forward_thread  # the overlap loop's: an update waits for its forwards
        self.tree_cache = tree_cache  # (HiCache's storage tier: emptied after an update)
        self.pp_size = pp_size
        # /init_weights_update_group's join in progress (its own thread) and its request: the
        # loop keeps serving while a trainer takes its time (at most the request's timeout)
        self._join: Optional[Tuple[Future, InitWeightsUpdateGroupReqInput]] = None

    def dispatch_entries(self) -> List[Tuple[type, Callable[[Any], Any]]]:
        return [
            (UpdateWeightFromDiskReqInput, self.update_weights_from_disk),
            (UpdateWeightsFromTensorReqInput, self.update_weights_from_tensor),
            (InitWeightsUpdateGroupReqInput, self.init_weights_update_group),
            (UpdateWeightsFromDistributedReqInput, self.update_weights_from_distributed),
            (WeightsUpdateGroupJoined, self.join_ended),
            (DestroyWeightsUpdateGroupReqInput, self.destroy_weights_update_group),
            (GetWeightsByNameReqInput, self.get_weights_by_name),
        ]

    # ---- handlers --------------------------------------------------------------------------------
    def update_weights_from_disk(self, recv: UpdateWeightFromDiskReqInput) -> UpdateWeightFromDiskReqOutput:
        if self._pp_stages():
            return UpdateWeightFromDiskReqOutput(False, PP_REFUSAL, 0, recv.query_id)
        self.settle()
        success, message = self.worker.update_weights_from_disk(recv)
        return UpdateWeightFromDiskReqOutput(success, self._after_update(success, message, True), 0, recv.query_id)

    def update_weights_from_tensor(self, recv: UpdateWeightsFromTensorReqInput) -> UpdateWeightsFromTensorReqOutput:
        if self._pp_stages():
            return UpdateWeightsFromTensorReqOutput(False, PP_REFUSAL, recv.query_id)
        self.settle()
        success, message = self.worker.update_weights_from_tensor(recv)
        return UpdateWeightsFromTensorReqOutput(success, self._after_update(success, message, recv.flush_cache), recv.query_id)

    def update_weights_from_distributed(self, recv: UpdateWeightsFromDistributedReqInput) -> UpdateWeightsFromDistributedReqOutput:
        if self._pp_stages():
            return UpdateWeightsFromDistributedReqOutput(False, PP_REFUSAL, recv.query_id)
        if self._joining(recv.group_name):
            return UpdateWeightsFromDistributedReqOutput(False, self._joining(recv.group_name), recv.query_id)
        self.settle()
        success, message = self.worker.update_weights_from_distributed(recv)
        return UpdateWeightsFromDistributedReqOutput(success, self._after_update(success, message, recv.flush_cache), recv.query_id)

    def init_weights_update_group(self, recv: InitWeightsUpdateGroupReqInput) -> Optional[InitWeightsUpdateGroupReqOutput]:
        """Start the join on a thread and answer when it ends (join_ended); generation goes on."""
        if self._join is not None:
            return InitWeightsUpdateGroupReqOutput(
                False, f"A join of the group {self._join[1].group_name!r} is in progress; wait for its answer.", recv.query_id)
        future: Future = Future()

        def join() -> None:
            try:
                future.set_result(self.worker.join_weights_update_group(recv))
            except BaseException as e:  # not expected (the join catches its own): an answer all the same
                future.set_result(f"Failed to initialize custom process group: {type(e).__name__}: {e}.")

        # a daemon: a server stopped mid-join does not wait for the trainer
        threading.Thread(target=join, name="weights-group-join", daemon=True).start()
        self._join = (future, recv)
        return None

    def _joining(self, group_name: str) -> Optional[str]:
        """Why a group cannot be used yet: its join has not been answered (every rank agreed)."""
        if self._join is not None and self._join[1].group_name == group_name:
            return f"The group {group_name!r} is still being joined; wait for /init_weights_update_group's answer."
        return None

    def join_done(self) -> bool:
        """Rank 0, every turn of the loop: whether the join has ended (then it sends the note)."""
        return self._join is not None and self._join[0].done()

    def join_ended(self, _: WeightsUpdateGroupJoined) -> InitWeightsUpdateGroupReqOutput:
        future, recv = self._join
        self._join = None
        error = future.result()  # another rank's join ends within the same timeout
        success, message = self.worker.finish_weights_update_group_join(recv, error)
        return InitWeightsUpdateGroupReqOutput(success, message, recv.query_id)

    def destroy_weights_update_group(self, recv: DestroyWeightsUpdateGroupReqInput) -> DestroyWeightsUpdateGroupReqOutput:
        if self._joining(recv.group_name):
            return DestroyWeightsUpdateGroupReqOutput(False, self._joining(recv.group_name), recv.query_id)
        success, message = self.worker.destroy_weights_update_group(recv)
        return DestroyWeightsUpdateGroupReqOutput(success, message, recv.query_id)

    def get_weights_by_name(self, recv: GetWeightsByNameReqInput) -> GetWeightsByNameReqOutput:
        return GetWeightsByNameReqOutput(self.worker.get_weights_by_name(recv), recv.query_id)

    # ---- around an update ------------------------------------------------------------------------
    def _pp_stages(self) -> bool:
        return self.pp_size > 1

    def settle(self) -> None:
        """Run the loop until nothing is in flight: no forward on the forward thread, no request
        admitted before the update still running. A step that launches nothing and leaves no
        result pending ends the wait (e.g. a paused scheduler keeps its requests as they are)."""
        loop = self.loop
        while loop.has_work():
            if loop.run_step() is None and not loop.results_pending():
                break
        if self.forward_thread is not None:
            self.forward_thread.synchronize()

    def _after_update(self, success: bool, message: str, flush_cache: bool) -> str:
        if not success:
            logger.error("Weight update refused: %s", message)
            return message
        storage = getattr(self.tree_cache, "storage", None)  # HiCache's storage tier
        if storage is not None:  # its pages hold KV of the old weights: never load them again
            storage.clear()
            storage.controller.clear()
        if flush_cache and not self.loop.flush_cache():
            return message + " The cache was not flushed: requests still hold KV of the old weights."
        return message
