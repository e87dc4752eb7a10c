"""The overlap loop's worst case of a slow device, forced (tests of the rows' one-step lag): each
forward waits until the scheduler has scheduled the batch after it, so everything the scheduler
does between two launches (finishing requests, handing their rows on, preparing the next batch)
happens before the forward of the batch launched first."""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from typing import Any, Deque, Dict, List, Optional, Tuple


class LateForwards:
    """Holds the forward of each launched batch until the scheduler has scheduled the next one
    (or `timeout` passed: nothing more to schedule), and counts what happened meanwhile."""

    def __init__(self, scheduler: Any, timeout: float = 0.5):
        self.timeout = timeout
        self.cond = threading.Condition()
        self.scheduled = 0  # get_next_batch_to_run calls so far
        self.waiting = 0  # forwards being held now
        # per launched batch: the call that made it, and its rows with their alloc counts then
        self.launched: Deque[Tuple[int, List[Tuple[int, int]]]] = deque()
        self.allocs: Dict[int, int] = defaultdict(int)  # row -> times handed out
        self.held = 0  # forwards released by the next batch's scheduling (not the timeout)
        self.admitted_while_held = 0  # prefills scheduled while a forward was held
        self.handed_on = 0  # forwards that found a row of their batch handed out again since scheduled
        self._schedule, self._alloc = scheduler.get_next_batch_to_run, scheduler.req_to_token_pool.alloc
        worker = scheduler.overlap_worker.worker
        self._forward = worker.forward_batch_generation
        scheduler.get_next_batch_to_run = self.get_next_batch_to_run
        scheduler.req_to_token_pool.alloc = self.alloc
        worker.forward_batch_generation = self.forward_batch_generation

    def alloc(self, need_size: int = 1) -> Optional[List[int]]:
        rows = self._alloc(need_size)
        for r in rows or []:
            self.allocs[r] += 1
        return rows

    def get_next_batch_to_run(self) -> Any:
        batch = self._schedule()
        with self.cond:
            self.scheduled += 1
            if batch is not None:
                self.admitted_while_held += batch.forward_mode.is_extend() and self.waiting > 0
                self.launched.append((self.scheduled, [(r, self.allocs[r]) for r in batch.req_pool_indices.tolist()]))
            self.cond.notify_all()
        return batch

    def forward_batch_generation(self, worker_batch: Any) -> Any:
        with self.cond:
            at, rows = self.launched.popleft()
            self.waiting += 1
            self.held += self.cond.wait_for(lambda: self.scheduled > at, timeout=self.timeout)
            self.waiting -= 1
        self.handed_on += any(self.allocs[r] != n for r, n in rows)
        return self._forward(worker_batch)
