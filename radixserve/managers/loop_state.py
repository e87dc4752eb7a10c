"""The scheduling loop's state (issue 40): what the Scheduler schedules from, in objects of its
own, so that the helpers that change it (the pause, the memory saver, PP) are given these
instead of the Scheduler.

    LoopState   the waiting queue, the chunked request, and the current BatchSlot
    BatchSlot   a running batch and the last batch launched (PP keeps one per micro-batch and
                points the LoopState at each in turn: the Scheduler's batch selection then runs
                over that micro-batch's batches, with nothing swapped in and out)
    LoopSteps   the loop's own steps a helper may run to settle it (bound Scheduler methods)

SGLang keeps these as Scheduler fields; the Scheduler still reads them under those names
(`loop_field` properties), so its loop reads as seed 001's.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import TYPE_CHECKING, Any, Callable, List, Optional

if TYPE_CHECKING:  # kept torch-free: scheduler_process imports the pause, which imports this
    from radixserve.managers.schedule_batch import Req, ScheduleBatch
    from radixserve.protocol import AbortReq


@dataclasses.dataclass
class BatchSlot:
    """One micro-batch's batches (without PP: the loop's only slot)."""

    running_batch: "ScheduleBatch"
    last_batch: Optional["ScheduleBatch"] = None
    # PP: the requests this slot may hold while it is scheduled (its share of
    # --max-running-requests); None: the Scheduler's max_running_requests.
    request_limit: Optional[int] = None


@dataclasses.dataclass
class LoopState:
    """What the loop schedules from: the queue, the chunked request, the current slot's batches."""

    slot: BatchSlot
    waiting_queue: List["Req"] = dataclasses.field(default_factory=list)
    chunked_req: Optional["Req"] = None

    @property
    def running_batch(self) -> "ScheduleBatch":
        return self.slot.running_batch

    @running_batch.setter
    def running_batch(self, batch: "ScheduleBatch") -> None:
        self.slot.running_batch = batch

    @property
    def last_batch(self) -> Optional["ScheduleBatch"]:
        return self.slot.last_batch

    @last_batch.setter
    def last_batch(self, batch: Optional["ScheduleBatch"]) -> None:
        self.slot.last_batch = batch


def loop_field(name: str) -> property:
    """An attribute of the owner's `loop` (a LoopState), under the same name (an attrgetter: the
    loop reads these every step)."""
    return property(operator.attrgetter(f"loop.{name}"), lambda self, value: setattr(self.loop, name, value),
                    doc=f"LoopState.{name}")


@dataclasses.dataclass(frozen=True)
class LoopSteps:
    """The Scheduler's steps a helper runs to settle the loop between two batches."""

    drain_results: Callable[[], None]  # process every result in flight (overlap loop)
    stash_and_merge: Callable[[], Any]  # get_next_batch_to_run, held before it schedules
    abort: Callable[["AbortReq"], None]  # abort_request
    empty_batch: Callable[[], "ScheduleBatch"]
    requeue: Callable[["Req"], None]
