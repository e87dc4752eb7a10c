"""HiCacheStorageTier: what HiRadixCache.set_storage takes. It turns the tree's two hooks into
the storage controller's page operations.

    on_host_backup(cache, node)   a node got a host copy: queue its pages for storage
                                  (read from the host pool on io_thread, after the copy landed)
    prefetch(last_host_node, key, extra_key)
                                  the request was queued: start key's prefetch (or find it)
    storage_hit(cache, last_host_node, key, extra_key)
                                  the match ended at last_host_node; `key` is what is left:
                                  the first time, start a prefetch of key's pages; once the policy
                                  lets the request take them, hang the pages that arrived under
                                  last_host_node as a host-only node and return their tokens

Keys are the page hash chain of the tokens from the root (page_hash_chain), so a page's key is
the same in every server and after a restart. A prefetch is found again by the hash of the first
page it fetches, which pins everything before it.

Host slots the storage tier fills are written on io_thread too (run_io): a host slot freed and
handed out again must not be overwritten before a read queued earlier has run.

Nothing here waits on storage. The policies (wait_complete, timeout) say when a request may go on
with what its prefetch brought (controller.can_take); until then a match takes nothing. The
scheduler starts a request's prefetch when the request is queued (`prefetch`) and holds only that
request in the waiting queue until its prefetch may be taken (managers/scheduler_hicache.py), as
SGLang does; the other requests are admitted meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any, List, Optional

import torch

from radixserve.mem_cache.storage.base import page_hash_chain
from radixserve.mem_cache.storage.controller import HiCacheStorageController, PrefetchOperation

logger = logging.getLogger(__name__)

DEFAULT_PREFETCH_THRESHOLD = 256  # tokens (SGLang's): shorter continuations are recomputed, not fetched
# Prefetches whose request never came back for them (aborted, or matched elsewhere) hold their
# pages until they are dropped: the oldest beyond this many, or any older than PENDING_TTL_S.
MAX_PENDING_PREFETCHES = 64
PENDING_TTL_S = 60.0
MISS_REMEMBERED_S = 2.0  # a continuation storage did not have is not asked for again this soon


class HiCacheStorageTier:
    def __init__(self, controller: HiCacheStorageController, page_size: int,
                 prefetch_threshold: int = DEFAULT_PREFETCH_THRESHOLD):
        self.controller = controller
        self.page_size = page_size
        self.prefetch_threshold = max(int(prefetch_threshold), page_size)
        self.pending: "OrderedDict[str, PrefetchOperation]" = OrderedDict()  # by the first page's hash
        self.tokens_inserted = 0  # tokens hung into the tree from storage

    # ---- the hooks ----------------------------------------------------------------------------
    def on_host_backup(self, cache: Any, node: Any) -> None:
        slots = node.host_value
        num_pages = len(slots) // self.page_size
        if num_pages == 0:
            return
        path = _path_tokens(node)
        keys = page_hash_chain(path, self.page_size, node.extra_key)[-num_pages:]
        pool, ps, controller = cache.host_pool, self.page_size, self.controller

        def read_pages() -> None:  # on io_thread: after the device -> host copy of this node
            pages = [pool.get_page_tensor(slots[i * ps:(i + 1) * ps]) for i in range(num_pages)]
            controller.backup(keys, pages)

        cache.run_io(read_pages)

    def prefetch(self, last_host_node: Any, key: List[int], extra_key: Optional[str]) -> Optional[PrefetchOperation]:
        """The prefetch of `key`'s pages after last_host_node: the one in flight (or a recent miss),
        else a new one. None: too short to fetch."""
        hashes = self._hashes(last_host_node, key, extra_key)
        return self._find_or_start(hashes) if hashes else None

    def storage_hit(self, cache: Any, last_host_node: Any, key: List[int], extra_key: Optional[str]) -> int:
        hashes = self._hashes(last_host_node, key, extra_key)
        if not hashes:
            return 0
        op = self._find_or_start(hashes)
        if not op.pages or not self.controller.can_take(op):
            return 0  # nothing yet (it goes on for a later match), or a miss remembered for a while
        del self.pending[hashes[0]]
        # The prefetch may have been for another continuation with the same first page: only
        # the leading pages whose keys agree are this key's.
        same = next((i for i, (a, b) in enumerate(zip(op.keys, hashes)) if a != b), min(len(op.keys), len(hashes)))
        pages = op.take()[:same]
        return self._insert(cache, last_host_node, key, extra_key, pages) if pages else 0

    def clear(self) -> None:
        for op in self.pending.values():
            op.cancel()
        self.pending.clear()

    # ---- internals ----------------------------------------------------------------------------
    def _hashes(self, last_host_node: Any, key: List[int], extra_key: Optional[str]) -> List[str]:
        """The keys of key's pages after last_host_node; none when key is too short to fetch."""
        if len(key) < self.prefetch_threshold:
            return []
        prefix = _path_tokens(last_host_node)
        return page_hash_chain(prefix + list(key), self.page_size, extra_key)[len(prefix) // self.page_size:]

    def _find_or_start(self, hashes: List[str]) -> PrefetchOperation:
        op = self.pending.get(hashes[0])
        if op is not None and op.done and not op.pages and time.monotonic() - op.start_time > MISS_REMEMBERED_S:
            op = None  # an old miss: ask again (another server may have stored it since)
        return op if op is not None else self._start(hashes)

    def _start(self, hashes: List[str]) -> PrefetchOperation:
        op = self.controller.prefetch(hashes)
        self.pending.pop(hashes[0], None)  # an old miss: the new one goes to the end
        self.pending[hashes[0]] = op
        now = time.monotonic()
        while self.pending:  # oldest first (insertion order)
            oldest = next(iter(self.pending.values()))
            if len(self.pending) <= MAX_PENDING_PREFETCHES and now - oldest.start_time < PENDING_TTL_S:
                break
            self.pending.popitem(last=False)
            oldest.cancel()
        return op

    def _insert(self, cache: Any, parent: Any, key: List[int], extra_key: Optional[str], pages: List[torch.Tensor]) -> int:
        num_tokens = len(pages) * self.page_size
        parent.host_ref += 1  # alloc_host may evict host-only leaves: not the one we hang under
        try:
            slots = cache.alloc_host(num_tokens)
        finally:
            parent.host_ref -= 1
        if slots is None:
            logger.info("HiCache storage: no host room for %d prefetched tokens; they are recomputed", num_tokens)
            return 0
        pool, ps = cache.host_pool, self.page_size

        def write_pages() -> None:  # on io_thread, in order with the copies queued before
            for i, page in enumerate(pages):
                pool.set_page_tensor(slots[i * ps:(i + 1) * ps], page)

        cache.run_io(write_pages)
        cache.insert_host_pages(parent, list(key[:num_tokens]), slots, extra_key, from_storage=True)
        self.tokens_inserted += num_tokens
        return num_tokens


def _path_tokens(node: Any) -> List[int]:
    """The tokens from the root to the end of `node`."""
    parts = []
    while node is not None and node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return [t for part in reversed(parts) for t in part]
