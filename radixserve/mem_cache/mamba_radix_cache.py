"""The hybrid radix cache (SGLang's MambaRadixCache): prefix sharing for models whose
linear-attention layers keep a recurrent state instead of per-token KV (Qwen3-Next, Qwen3.5).

The KV of the full-attention layers is shared as in RadixCache. The linear layers' state after a
prefix cannot be rebuilt from that KV: a prefix hit is usable only where a state *snapshot* for
that exact prefix is held. A node may hold one (`mamba_value`: a MambaPool slot with every linear
layer's conv and temporal state after the node's last token); a node without one is a tombstone.

    root ── [1 2 3 4]* ──┬── [5 6]        * = holds a snapshot
                         └── [7 8 9]*     a prompt 1 2 3 4 5 6 7 matches 1..6 in KV, but only
                                          1..4 is usable: the hit falls back to the last snapshot

Snapshots are taken where the state is exact: after a chunk of a chunked prefill
(cache_unfinished_req) and at a request's end (cache_finished_req), and only where the inserted
key ends where the request's state does (its kv_committed_len: every forward launched so far has
advanced the state that far). At the end of a request whose last token an extra step of the
overlap loop feeds (still queued when the request finishes), that token is in: the step reads
the request's own row (a row freed while batches are in flight waits for them: ForwardFence in
memory_pool.py), and the snapshot's copy runs after it. The copy into a fresh slot, and the
restore of a snapshot into an admitted request's own slot (restore_prefix_states), run on
io_thread when set: in order with the overlap loop's forwards, which write the slots in place.

Eviction: evicting a leaf (KV pressure) frees its snapshot with it, tombstone leaves first (they
serve no hit); under state-pool pressure evict_mamba drops snapshots alone, inner nodes' first
(the conversation that made one went on past it), least recently used first, never the one a
running request's lock is on (mamba_lock_ref: the node itself only, as SGLang's). Every state slot is free, a request row's, or one node's snapshot
(HybridReqToTokenPool.check_state_slots with all_mamba_values_flatten()).
"""

from __future__ import annotations

from typing import Callable, List, Optional

from radixserve.mem_cache.base_prefix_cache import CacheReq, MatchResult, extra_key_of, kv_committed_len
from radixserve.mem_cache.mamba_pool import HybridReqToTokenPool
from radixserve.mem_cache.memory_pool import TokenToKVPoolAllocator
from radixserve.mem_cache.radix_cache import RadixCache, TreeNode, _empty_indices


def has_state_pool(req_to_token_pool: object) -> bool:
    """Whether a model's rows hold state slots (a hybrid model's: its prefix cache is this one)."""
    return isinstance(req_to_token_pool, HybridReqToTokenPool)


class MambaTreeNode(TreeNode):
    def __init__(self) -> None:
        super().__init__()
        self.mamba_value: Optional[int] = None  # the snapshot's state slot (None: a tombstone)
        self.mamba_lock_ref = 0  # requests whose last_node this is: its snapshot stays


def _snapshot(node: TreeNode) -> Optional[int]:
    return getattr(node, "mamba_value", None)  # (the root and plain split nodes have none)


class MambaRadixCache(RadixCache):
    node_class = MambaTreeNode

    def __init__(self, req_to_token_pool: HybridReqToTokenPool, token_to_kv_pool_allocator: TokenToKVPoolAllocator,
                 page_size: int = 1, eviction_policy: str = "lru"):
        self.mamba_pool = req_to_token_pool.mamba_pool
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size, eviction_policy=eviction_policy)

    def reset(self) -> None:
        """Forget the tree; its snapshot slots go with the pool's clear (KVLedger.clear)."""
        super().reset()
        self._kv_only_match = False  # RadixCache.cache_unfinished_req re-matches its own insert
        self.root_node.mamba_lock_ref = 1
        self.snapshot_nodes: set = set()

    # ---- match: only up to the last snapshot ---------------------------------------------------
    def match_prefix(self, key: List[int], extra_key: Optional[str] = None) -> MatchResult:
        match = super().match_prefix(key, extra_key)
        if self._kv_only_match:
            return match
        node, dropped = match.last_device_node, 0
        while node is not self.root_node and _snapshot(node) is None:
            dropped += len(node.key)
            node = node.parent
        indices = match.device_indices[: len(match.device_indices) - dropped]
        return MatchResult(indices if len(indices) else _empty_indices(self.device), node)

    def restore_prefix_states(self, reqs: List[CacheReq]) -> None:
        """Requests just given a row with a cached prefix: their own slot starts from the snapshot
        their match ended at (the forward reads it: has_initial_state)."""
        pool: HybridReqToTokenPool = self.req_to_token_pool
        src, dst = [], []
        for r in reqs:
            if len(r.prefix_indices) == 0:
                continue
            slot = _snapshot(r.last_node)
            if slot is None:
                raise RuntimeError(f"a prefix hit of {len(r.prefix_indices)} tokens without a state snapshot")
            src.append(slot)
            dst.append(pool.mamba_index_cpu[r.req_pool_idx])
        if src:
            self._run_io(self.mamba_pool.copy_slots, src, dst)

    # ---- insert: snapshots where the state is exact ------------------------------------------
    def cache_finished_req(self, req: CacheReq, is_insert: bool = True) -> None:
        row = req.req_pool_idx
        state_slot = self.req_to_token_pool.mamba_index_cpu[row]
        kv_len = kv_committed_len(req)
        # kv_len may count the token the overlap loop's extra step feeds (still queued): the copy
        # below runs after it, and the row waits for it (ReqToTokenPool.fence), so that step reads
        # this request's own row and leaves the state after every one of the kv_len tokens.
        keys = self._page_align((list(req.origin_input_ids) + list(req.output_ids))[:kv_len])
        super().cache_finished_req(req, is_insert)  # frees the row: its slot is read below, in order
        if is_insert and not self.disable and 0 < len(keys) == kv_len:
            _, node = self._match_prefix_helper(keys, extra_key_of(req))
            self._take_snapshot(node, state_slot)

    def cache_unfinished_req(self, req: CacheReq, chunked: bool = False) -> None:
        self._kv_only_match = True  # its re-match must find the whole insert, snapshot or not
        try:
            super().cache_unfinished_req(req, chunked)
        finally:
            self._kv_only_match = False
        node = req.last_node
        aligned = len(req.fill_ids) // self.page_size * self.page_size
        if not self.disable and node is not self.root_node and aligned == kv_committed_len(req):
            self._take_snapshot(node, self.req_to_token_pool.mamba_index_cpu[req.req_pool_idx])

    def _take_snapshot(self, node: TreeNode, state_slot: int) -> None:
        """node's snapshot = the state in state_slot (skipped where one is held or none is free)."""
        if node is self.root_node or _snapshot(node) is not None:
            return
        slot = self.alloc_mamba_slot()
        if slot is None:
            return  # every slot is a row's or a locked snapshot's: the prefix stays a tombstone
        self._run_io(self.mamba_pool.copy_slots, [state_slot], [slot])
        node.mamba_value = slot
        self.snapshot_nodes.add(node)

    def alloc_mamba_slot(self) -> Optional[int]:
        self.req_to_token_pool.collect_deferred()  # rows' slots whose batches are done first
        if self.mamba_pool.available_size() == 0:
            self.evict_mamba(1)
        slots = self.mamba_pool.alloc(1)
        return slots[0] if slots else None

    # ---- eviction ---------------------------------------------------------------------------
    def evict_mamba(self, num_states: int) -> int:
        """Drop at least num_states snapshots of nodes no request's lock is on (least recently
        used first); the nodes stay, as tombstones. Returns how many were dropped."""
        if self.disable or num_states <= 0:
            return 0
        # Inner nodes' first (a chunk boundary its conversation went past: that one hits deeper),
        # then leaves', least recently used first within each.
        victims = sorted((n for n in self.snapshot_nodes if n.mamba_lock_ref == 0),
                         key=lambda n: (not n.children, n.last_access_time))
        victims = victims[:num_states]
        for node in victims:
            self._drop_snapshot(node)
        return len(victims)

    def _drop_snapshot(self, node: TreeNode) -> None:
        self.mamba_pool.free([node.mamba_value])
        node.mamba_value = None
        self.snapshot_nodes.discard(node)

    def _delete_leaf(self, node: TreeNode) -> None:
        if _snapshot(node) is not None:
            self._drop_snapshot(node)
        super()._delete_leaf(node)

    def _priority(self, node: TreeNode):
        return (_snapshot(node) is not None, *super()._priority(node))  # tombstone leaves first

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        new_node = super()._split_node(child, split_len)  # the snapshot stays with child (its end)
        new_node.mamba_value, new_node.mamba_lock_ref = None, 0
        return new_node

    # ---- locks: a request's last node keeps its snapshot ---------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> int:
        if not self.disable and node is not None and node is not self.root_node:
            node.mamba_lock_ref += 1
        return super().inc_lock_ref(node)

    def dec_lock_ref(self, node: TreeNode) -> int:
        if not self.disable and node is not None and node is not self.root_node:
            if node.mamba_lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref below zero on the snapshot lock of {node}")
            node.mamba_lock_ref -= 1
        return super().dec_lock_ref(node)

    # ---- sizes ------------------------------------------------------------------------------
    def mamba_evictable_size(self) -> int:
        return sum(1 for n in self.snapshot_nodes if n.mamba_lock_ref == 0)

    def mamba_protected_size(self) -> int:
        return len(self.snapshot_nodes) - self.mamba_evictable_size()

    def all_mamba_values_flatten(self) -> List[int]:
        """Every state slot the tree's snapshots hold (for invariant checks)."""
        return [n.mamba_value for n in self.snapshot_nodes]

    def _run_io(self, fn: Callable[..., None], *args) -> None:
        """Run a state copy in order with the forwards: on io_thread when set, else now."""
        if self.io_thread is not None:
            self.io_thread.submit(fn, *args)
        else:
            fn(*args)
