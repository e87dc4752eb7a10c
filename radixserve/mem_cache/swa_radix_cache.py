"""The radix tree of a model with windowed layers (SGLang's SWARadixCache): it knows which of its
tokens still hold their windowed layers' KV (the SWA pool, swa_memory_pool.py).

A node is *live* while each of its tokens holds a swa slot, a *tombstone* once they were
dropped (the SWA pool evicted it, or the request that inserted it had moved its window past
them); its full slots stay either way. A node is never part live, part tombstone: insert splits
the new tokens at the boundary.

    root ── [1..40] tombstone ── [41..64] live ── [65..70] live
                                  ^ a match may end here only if the W tokens before it are live

A prefix hit is usable only where the windowed layers still have the window before it: the
match is shortened to the deepest node end with W live tokens before it (or live all the way
from the root). A request that recomputes a tombstone's tokens gives it its swa slots back on
insert (it comes back to life). Evicting from the SWA pool (`evict_swa`) turns unlocked live nodes into
tombstones, least recently used first: it frees swa slots, never full ones. A request's lock
protects the swa slots of the last W tokens of its prefix only (swa_lock_ref), the ones its
windowed layers read; the id of the topmost node it reached (swa_uuid) is kept on the locked
node, so the unlock walks the same nodes after any split.
"""

from __future__ import annotations

import itertools
from typing import List, Optional

import torch

from radixserve.mem_cache.base_prefix_cache import CacheReq, MatchResult
from radixserve.mem_cache.radix_cache import RadixCache, TreeNode
from radixserve.mem_cache.swa_memory_pool import SWATokenToKVPoolAllocator

_swa_uuids = itertools.count(1)


class SWATreeNode(TreeNode):
    def __init__(self) -> None:
        super().__init__()
        self.swa_tombstone = False  # its tokens hold no swa slot any more
        self.swa_lock_ref = 0  # locks whose window covers (part of) this node
        self.swa_uuid: Optional[int] = None  # set on the topmost node some lock's window reached
        self.swa_lock_uuids: List[Optional[int]] = []  # per lock taken at this node: where its window ends


class SWARadixCache(RadixCache):
    node_class = SWATreeNode

    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator: SWATokenToKVPoolAllocator,
                 sliding_window_size: int, page_size: int = 1, disable: bool = False, eviction_policy: str = "lru"):
        assert page_size == 1, "the SWA pool runs with page_size 1"
        self.sliding_window_size = sliding_window_size
        self._raw_match = False
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size, disable, eviction_policy)

    def reset(self) -> None:
        super().reset()
        self.root_node = SWATreeNode()
        self.root_node.lock_ref = 1
        self.swa_evictable_size_ = 0
        self.swa_protected_size_ = 0

    # ---- sizes of the SWA pool's part ----------------------------------------------------------
    def swa_evictable_size(self) -> int:
        return self.swa_evictable_size_

    def swa_protected_size(self) -> int:
        return self.swa_protected_size_

    # ---- match: only where the window's KV is held ------------------------------------------------
    def match_prefix(self, key: List[int], extra_key: Optional[str] = None) -> MatchResult:
        res = super().match_prefix(key, extra_key)
        if self._raw_match or len(res.device_indices) == 0:
            return res
        path = []
        node = res.last_device_node
        while node is not self.root_node:
            path.append(node)
            node = node.parent
        path.reverse()
        # The deepest node end with W live tokens before it, or live from the root.
        best, depth, run, all_live = 0, 0, 0, True
        best_node: TreeNode = self.root_node
        for node in path:
            depth += len(node.key)
            if node.swa_tombstone:
                run, all_live = 0, False
                continue
            run += len(node.key)
            if all_live or run >= self.sliding_window_size:
                best, best_node = depth, node
        return MatchResult(res.device_indices[:best], best_node)

    def cache_unfinished_req(self, req: CacheReq, chunked: bool = False) -> None:
        # The request re-points its row at the tree's slots of everything it inserted, window or not.
        self._raw_match = True
        try:
            super().cache_unfinished_req(req, chunked)
        finally:
            self._raw_match = False

    # ---- insert: live and tombstone runs become nodes of their own ------------------------------
    def insert(self, key: List[int], value: Optional[torch.Tensor] = None, chunked: bool = False,
               extra_key: Optional[str] = None) -> int:
        if self.disable or value is None or len(key) == 0:
            return super().insert(key, value, chunked, extra_key)
        live = self.token_to_kv_pool_allocator.has_swa(value)
        # Ends of the runs of equal liveness; each prefix up to one is inserted in turn, so each
        # new leaf is all live or all tombstone (_on_new_leaf reads which).
        ends = (torch.nonzero(live[1:] != live[:-1]).flatten() + 1).tolist() + [len(key)]
        cached, new_from = 0, None
        for i, end in enumerate(ends):
            # After the first new token, the rest is new too and no hit (chunked=True: not counted).
            n = super().insert(key[:end], value[:end], chunked or i > 0, extra_key)
            if new_from is None:
                cached = n
                if n < end:
                    new_from = n
        return cached

    def _matched_on_insert(self, child: SWATreeNode, value: torch.Tensor) -> int:
        """A tombstone the inserter has live KV for comes back to life with the inserter's swa
        slots (a request that recomputed a prefix whose window was dropped); its full slots stay
        the tree's, and the inserter's duplicates are freed by the caller as usual."""
        alloc = self.token_to_kv_pool_allocator
        if child.swa_tombstone and len(value) == len(child.value) and bool(alloc.has_swa(value).all()):
            mapping = alloc.full_to_swa_index_mapping
            mapping[child.value], mapping[value] = mapping[value].clone(), 0
            child.swa_tombstone = False
            if child.swa_lock_ref > 0:
                self.swa_protected_size_ += len(child.key)
            else:
                self.swa_evictable_size_ += len(child.key)
        return super()._matched_on_insert(child, value)

    def _on_new_leaf(self, parent: TreeNode, leaf: SWATreeNode) -> None:
        super()._on_new_leaf(parent, leaf)
        if bool(self.token_to_kv_pool_allocator.has_swa(leaf.value[:1]).all()):
            self.swa_evictable_size_ += len(leaf.key)
        else:
            leaf.swa_tombstone = True

    def _split_node(self, child: SWATreeNode, split_len: int) -> SWATreeNode:
        new_node = super()._split_node(child, split_len)
        # super() made a plain TreeNode: give it the SWA fields (the upper part of child).
        new_node.__class__ = SWATreeNode
        new_node.swa_tombstone, new_node.swa_lock_ref = child.swa_tombstone, child.swa_lock_ref
        new_node.swa_lock_uuids = []
        # A window that reached child reaches its upper part first: the uuid moves up.
        new_node.swa_uuid, child.swa_uuid = child.swa_uuid, None
        return new_node

    # ---- locks: a request's window of its prefix ---------------------------------------------------
    def inc_lock_ref(self, node: SWATreeNode) -> int:
        delta = super().inc_lock_ref(node)
        if self.disable or node is None or node is self.root_node:
            return delta
        walked, cur, top = 0, node, None
        while cur is not self.root_node and walked < self.sliding_window_size:
            if cur.swa_lock_ref == 0 and not cur.swa_tombstone:
                self.swa_evictable_size_ -= len(cur.key)
                self.swa_protected_size_ += len(cur.key)
            cur.swa_lock_ref += 1
            walked += len(cur.key)
            top, cur = cur, cur.parent
        if top.swa_uuid is None:
            top.swa_uuid = next(_swa_uuids)
        node.swa_lock_uuids.append(top.swa_uuid)
        return delta

    def dec_lock_ref(self, node: SWATreeNode) -> int:
        delta = super().dec_lock_ref(node)
        if self.disable or node is None or node is self.root_node:
            return delta
        uuid = node.swa_lock_uuids.pop()
        cur = node
        while True:
            assert cur is not self.root_node, "swa lock: its window's top node is not on the path"
            if cur.swa_lock_ref <= 0:
                raise RuntimeError(f"swa dec_lock_ref below zero on {cur}")
            cur.swa_lock_ref -= 1
            if cur.swa_lock_ref == 0 and not cur.swa_tombstone:
                self.swa_evictable_size_ += len(cur.key)
                self.swa_protected_size_ -= len(cur.key)
            if cur.swa_uuid == uuid:
                return delta
            cur = cur.parent

    # ---- eviction ----------------------------------------------------------------------------------
    def evict_swa(self, num_tokens: int) -> int:
        """Free at least `num_tokens` swa slots (fewer if not enough are unlocked) by turning live
        nodes no request's window covers into tombstones, least recently used first; their full
        slots stay. Returns the number of swa slots freed."""
        if self.disable or num_tokens <= 0:
            return 0
        candidates = [n for n in self._nodes() if not n.swa_tombstone and n.swa_lock_ref == 0]
        candidates.sort(key=lambda n: n.last_access_time)
        freed = 0
        for node in candidates:
            if freed >= num_tokens:
                break
            self.token_to_kv_pool_allocator.free_swa(node.value)
            node.swa_tombstone = True
            self.swa_evictable_size_ -= len(node.key)
            freed += len(node.key)
        return freed

    def _delete_leaf(self, node: SWATreeNode) -> None:
        if not node.swa_tombstone:  # (its full slots' free frees its swa slots too)
            self.swa_evictable_size_ -= len(node.key)
        super()._delete_leaf(node)

    def _nodes(self) -> List[SWATreeNode]:
        out, stack = [], list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def check_swa_nodes(self) -> None:
        """Each node all live or all tombstone, as its flag says (for invariant checks)."""
        for node in self._nodes():
            has = self.token_to_kv_pool_allocator.has_swa(node.value)
            if bool(has.any()) == node.swa_tombstone or (not node.swa_tombstone and not bool(has.all())):
                raise RuntimeError(f"swa tree node {node} (tombstone={node.swa_tombstone}) holds swa slots for "
                                   f"{int(has.sum())} of its {len(has)} tokens")

    def live_swa_values(self) -> torch.Tensor:
        """The full slots of every live node (their swa slots are the tree's)."""
        vals = [n.value for n in self._nodes() if not n.swa_tombstone]
        return torch.cat(vals) if vals else torch.empty(0, dtype=torch.int64)
