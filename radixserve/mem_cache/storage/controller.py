"""HiCacheStorageController: the storage tier's two threads beside the scheduler (SGLang's
HiCacheController prefetch and backup threads), so a step never waits on storage.

    scheduler thread                      backup thread               prefetch thread + its io thread
    backup(keys, pages) --queue-->        backend.set(batch)
    prefetch(keys) -> op --queue------------------------------------> n = backend.exists(keys)
                                                                      (a hit: --queue--> io thread)
    op.pages_ready(), op.done                                          op.pages += backend.get(batch)
    can_take(op)  (the policy: may the request go on?)                 ... in order, to the first miss
    op.take() -> the pages arrived                                     (stops once taken or cancelled)

--hicache-storage-prefetch-policy, as SGLang's:
    best_effort    the request takes what has arrived when it is scheduled
    wait_complete  the request waits until the prefetch ends (every hit page read, or a miss/failure;
                   at most prefetch_timeout_max, 30 s, so a stuck store cannot hang it)
    timeout        it waits until the prefetch ends or base + per_ki_token * tokens/1024 seconds
                   (at most max) have passed since the prefetch began

A backend that raises degrades to misses (reads) or dropped writes, with a log line; the
threads never die of it. Writes wait in a bounded queue: when storage falls behind, new writes
are dropped (counted), not buffered without end.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from radixserve.mem_cache.storage.base import HiCacheStorage

logger = logging.getLogger(__name__)

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
CLEAR_WAIT_S = 30.0  # clear() waits this long at most for the write in flight


@dataclass(frozen=True)
class PrefetchTimeout:
    """The timeout policy's bound (SGLang's PrefetchTimeoutConfig; extra_config keys
    prefetch_timeout_base, prefetch_timeout_per_ki_token, prefetch_timeout_max)."""

    base: float = 2.0  # seconds, whatever the length
    per_ki_token: float = 0.1  # seconds per 1024 tokens fetched
    max: float = 30.0

    def seconds(self, num_tokens: int) -> float:
        return min(self.max, self.base + self.per_ki_token * num_tokens / 1024)


@dataclass
class StorageCounters:
    lookups: int = 0  # prefetches that asked the backend which pages it has
    pages_read: int = 0  # pages that arrived from storage
    pages_written: int = 0  # pages stored (or already there)
    pages_failed: int = 0  # reads of a page said to exist that failed, and writes that failed
    pages_dropped: int = 0  # writes dropped unsent: the queue was full, or cleared


class PrefetchOperation:
    """Pages of `keys` arriving in order. The prefetch thread appends to `pages`; the scheduler
    reads pages_ready() / done and at the end take()s them."""

    def __init__(self, keys: Sequence[str]):
        self.keys = list(keys)
        self.pages: List[torch.Tensor] = []
        self.hit_pages: Optional[int] = None  # leading keys storage has; None until checked
        self.start_time = time.monotonic()
        self._done = threading.Event()
        self._cancelled = threading.Event()

    @property
    def done(self) -> bool:
        """The thread is finished with it: every hit page arrived, or a miss, a failure or cancel."""
        return self._done.is_set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def pages_ready(self) -> int:
        return len(self.pages)

    def cancel(self) -> None:
        self._cancelled.set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._done.wait(timeout)

    def take(self) -> List[torch.Tensor]:
        """Stop the prefetch and return the pages that arrived (a page arriving meanwhile is dropped)."""
        self.cancel()
        return self.pages[:len(self.pages)]


_STOP = object()


class HiCacheStorageController:
    def __init__(self, backend: HiCacheStorage, prefetch_policy: str = "best_effort", page_size: int = 1,
                 timeout: PrefetchTimeout = PrefetchTimeout(), io_batch_pages: int = 8, max_queued_writes: int = 1024):
        if prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"--hicache-storage-prefetch-policy must be one of {', '.join(PREFETCH_POLICIES)}; "
                             f"got {prefetch_policy!r}")
        self.backend = backend
        self.prefetch_policy = prefetch_policy
        self.page_size = page_size
        self.timeout = timeout
        self.io_batch_pages = io_batch_pages
        self.counters = StorageCounters()
        self._counters_lock = threading.Lock()  # both threads count
        self._prefetch_queue: "queue.Queue" = queue.Queue()  # lookups (exists)
        self._read_queue: "queue.Queue" = queue.Queue()  # hits to read: a slow read delays no lookup
        self._backup_queue: "queue.Queue" = queue.Queue(maxsize=max_queued_writes)
        self._io_lock = threading.Lock()  # clear() waits for the write in flight
        self._threads = [
            threading.Thread(target=self._prefetch_loop, name="hicache-prefetch", daemon=True),
            threading.Thread(target=self._read_loop, name="hicache-prefetch-io", daemon=True),
            threading.Thread(target=self._backup_loop, name="hicache-backup", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---- the scheduler's side: none of these waits on storage ----------------------------------
    def backup(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> bool:
        """Write pages under keys, later (fire and forget). The pages must not change afterwards
        (copies, not views of a pool). False: dropped, the queue is full."""
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        if not keys:
            return True
        try:
            self._backup_queue.put_nowait((list(keys), list(pages)))
            return True
        except queue.Full:
            self._count("pages_dropped", len(keys))
            return False

    def prefetch(self, keys: Sequence[str]) -> PrefetchOperation:
        op = PrefetchOperation(keys)
        self._prefetch_queue.put(op)
        return op

    def can_take(self, op: PrefetchOperation) -> bool:
        """Whether a request may go on with what op has brought so far (the policy)."""
        if self.prefetch_policy == "best_effort" or op.done:
            return True
        elapsed = time.monotonic() - op.start_time
        if self.prefetch_policy == "wait_complete":
            return elapsed > self.timeout.max  # the cap that keeps a stuck store from hanging a request
        return elapsed > self.timeout.seconds(len(op.keys) * self.page_size)

    def clear(self) -> bool:
        """Drop the queued work (queued prefetches end empty) and remove every stored page."""
        for item in _drain(self._prefetch_queue) + _drain(self._read_queue):
            if isinstance(item, PrefetchOperation):
                item.cancel()
                item._done.set()
        for item in _drain(self._backup_queue):
            self._count("pages_dropped", len(item[0]))
        # A write the backup thread had taken goes on batch by batch: let it finish, or its later
        # batches would land after the clear (backups are queued by this thread: no new ones come).
        if not self.wait_backups(CLEAR_WAIT_S):
            logger.warning("HiCache storage: a backup still running after %.0f s; clearing anyway", CLEAR_WAIT_S)
        with self._io_lock:
            try:
                return bool(self.backend.clear())
            except Exception as e:
                logger.warning("HiCache storage: clear failed (%s)", e)
                return False

    def wait_backups(self, timeout: float) -> bool:
        """Wait until every queued write is done (tests, shutdown); False if some are left."""
        deadline = time.monotonic() + timeout
        while self._backup_queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def shutdown(self) -> None:
        self._prefetch_queue.put(_STOP)
        self._read_queue.put(_STOP)
        for item in _drain(self._backup_queue):
            self._count("pages_dropped", len(item[0]))
        self._backup_queue.put(_STOP)
        for t in self._threads:
            t.join(timeout=10)
        self.backend.close()

    def _count(self, name: str, n: int) -> None:
        with self._counters_lock:
            setattr(self.counters, name, getattr(self.counters, name) + n)

    # ---- threads -------------------------------------------------------------------------------
    def _prefetch_loop(self) -> None:
        """Lookups (SGLang's prefetch thread): which leading pages storage has; a hit goes on to
        the read thread, so a slow read never holds back another request's lookup (a miss ends here)."""
        while True:
            op = self._prefetch_queue.get()
            if op is _STOP:
                return
            try:
                if not op.cancelled:
                    self._count("lookups", 1)
                    op.hit_pages = self.backend.exists(op.keys)
            except Exception as e:
                logger.warning("HiCache storage: prefetch failed (%s) at the lookup; those pages are recomputed", e)
            if op.cancelled or not op.hit_pages:
                op._done.set()
            else:
                self._read_queue.put(op)

    def _read_loop(self) -> None:
        """Reads of the hit pages (SGLang's prefetch io thread), in order, to the first missing page."""
        while True:
            op = self._read_queue.get()
            if op is _STOP:
                return
            try:
                self._read_pages(op)
            except Exception as e:
                logger.warning("HiCache storage: prefetch failed (%s); those pages are recomputed", e)
                self._count("pages_failed", max(0, (op.hit_pages or 0) - len(op.pages)))
            finally:
                op._done.set()

    def _read_pages(self, op: PrefetchOperation) -> None:
        for start in range(0, op.hit_pages, self.io_batch_pages):
            if op.cancelled:
                return
            batch = op.keys[start:min(start + self.io_batch_pages, op.hit_pages)]
            for page in self.backend.get(batch):
                if page is None:  # said to exist, then gone (evicted, or the store failed)
                    self._count("pages_failed", 1)
                    return
                op.pages.append(page)
                self._count("pages_read", 1)

    def _backup_loop(self) -> None:
        while True:
            item = self._backup_queue.get()
            try:
                if item is _STOP:
                    return
                self._write(*item)
            finally:
                self._backup_queue.task_done()

    def _write(self, keys: List[str], pages: List[torch.Tensor]) -> None:
        for start in range(0, len(keys), self.io_batch_pages):
            end = start + self.io_batch_pages
            with self._io_lock:
                try:
                    ok = self.backend.set(keys[start:end], pages[start:end])
                except Exception as e:
                    logger.warning("HiCache storage: backup failed (%s); %d page(s) not stored", e, len(keys) - start)
                    ok = False
            if not ok:  # the backend logged why; the rest of this write goes too
                self._count("pages_failed", len(keys) - start)
                break
            self._count("pages_written", len(keys[start:end]))


def _drain(q: "queue.Queue") -> List[object]:
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items
        q.task_done()
