"""HiRadixCache: the radix tree with a host tier under the device KV pool (SGLang's HiCache).

How HiCache works here:
 1. A node has `value` (device KV slots; None once evicted from the device) and `host_value`
    (host pool slots; None until backed up). An evicted node stays in the tree; its subtree is
    evicted too, so the device part of any path is a prefix of it.
 2. Backup (a device -> host copy) per --hicache-write-policy: write_through when a node is
    inserted, write_through_selective at its second hit, write_back when it is evicted.
 3. Device eviction (LRU over unlocked device nodes whose children are all evicted): a node
    with a host copy just drops its device slots; one without is deleted with its subtree.
 4. match_prefix returns the device prefix (device_indices, last_device_node) and the host-only
    continuation after it (last_host_node, host_hit_length).
 5. At admission the PrefillAdder calls init_load_back: fresh device slots (evicting device
    leaves if needed), a host -> device copy, `value` re-attached: the tokens are a cached prefix.
 6. Host eviction: LRU over host-only leaves no load is reading, when a backup needs room.
 7. Copies are queued on `io_thread` (the overlap loop's forward thread), so each runs after the
    forwards that wrote its source and before the forwards that read its target.
 8. Conservation: host slots held by nodes + free host slots == host pool (check_other_tiers).
 9. The storage tier plugs in with set_storage(controller): on_host_backup(node) after every
    backup, prefetch_from_storage(key) when a request is queued, storage_hit(...) where a
    match's host continuation ends (it takes what the prefetch brought, never waits).
"""

from __future__ import annotations

import heapq
import logging
from typing import Any, Callable, List, Optional, Tuple

import torch

from radixserve.mem_cache.base_prefix_cache import MatchResult, MemoryLeakError
from radixserve.mem_cache.memory_pool import MHATokenToKVPool
from radixserve.mem_cache.memory_pool_host import MHATokenToKVPoolHost
from radixserve.mem_cache.radix_cache import RadixCache, TreeNode, _empty_indices

logger = logging.getLogger(__name__)

# Hits (inserts) after which a node is backed up; write_back backs up at eviction instead.
WRITE_THROUGH_THRESHOLD = {"write_through": 1, "write_through_selective": 2}


class HiTreeNode(TreeNode):
    """A TreeNode whose KV may be on the device (`value`), in the host pool (`host_value`), or both."""

    def __init__(self) -> None:
        super().__init__()
        self.value: Optional[torch.Tensor] = torch.empty(0, dtype=torch.int64)
        self.host_value: Optional[torch.Tensor] = None
        self.host_ref = 0  # > 0 while a load reads host_value: host eviction skips the node
        self.from_storage = False  # host_value came from the storage tier and was not loaded yet

    @property
    def evicted(self) -> bool:
        return self.value is None

    @property
    def backuped(self) -> bool:
        return self.host_value is not None


class HiRadixCache(RadixCache):
    def __init__(
        self,
        req_to_token_pool: Any,
        token_to_kv_pool_allocator: Any,
        kv_pool: MHATokenToKVPool,
        host_size: int,
        page_size: int = 1,
        write_policy: str = "write_through",
        eviction_policy: str = "lru",
    ):
        if write_policy not in (*WRITE_THROUGH_THRESHOLD, "write_back"):
            raise ValueError(f"unknown HiCache write policy {write_policy!r}")
        self.host_pool = MHATokenToKVPoolHost(kv_pool, host_size, page_size)
        self.write_policy = write_policy
        self.write_through_threshold = WRITE_THROUGH_THRESHOLD.get(write_policy, 0)
        self.storage: Any = None  # set_storage: the storage tier's controller
        self.loaded_storage_tokens = 0  # of the last load_back, tokens the storage tier had supplied
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size=page_size,
                         eviction_policy=eviction_policy)
        logger.info("HiCache: host pool of %d tokens (device pool %d), write policy %s",
                    self.host_pool.size, token_to_kv_pool_allocator.size, write_policy)

    @classmethod
    def from_server_args(cls, req_to_token_pool: Any, allocator: Any, kv_pool: MHATokenToKVPool, args: Any) -> "HiRadixCache":
        host_size = MHATokenToKVPoolHost.size_for(kv_pool, allocator.size, args.hicache_ratio, args.hicache_size)
        return cls(req_to_token_pool, allocator, kv_pool, host_size, args.page_size,
                   args.hicache_write_policy, args.radix_eviction_policy)

    # ---- the RadixCache API, over two tiers -----------------------------------------------------
    def reset(self) -> None:
        super().reset()
        self.root_node = HiTreeNode()
        self.root_node.lock_ref = 1
        self.host_pool.clear()

    def match_prefix(self, key: List[int], extra_key: Optional[str] = None) -> MatchResult:
        """The device prefix of the longest match, then the host-only nodes after it."""
        key = self._page_align(key)
        if len(key) == 0:
            return MatchResult(_empty_indices(self.device), self.root_node, self.root_node, 0)
        values, last_node = self._match_prefix_helper(key, extra_key)
        indices, device_node, host_hit_length = self._split_tiers(values, last_node)
        matched = len(indices) + host_hit_length
        if matched < len(key) and self.storage is not None:
            if self.storage_hit(last_node, key[matched:], extra_key) > 0:
                values, last_node = self._match_prefix_helper(key, extra_key)
                indices, device_node, host_hit_length = self._split_tiers(values, last_node)
        return MatchResult(indices, device_node, last_node, host_hit_length)

    def prefetch_from_storage(self, key: List[int], extra_key: Optional[str] = None) -> Optional[Any]:
        """A request was queued: start the storage prefetch of what the tree lacks of `key` (or
        find the one in flight). Returns its PrefetchOperation; None when nothing is fetched."""
        key = self._page_align(key)
        if self.storage is None or len(key) == 0:
            return None
        values, last_node = self._match_prefix_helper(key, extra_key)
        indices, _, host_hit_length = self._split_tiers(values, last_node)
        matched = len(indices) + host_hit_length
        return self.storage.prefetch(last_node, key[matched:], extra_key) if matched < len(key) else None

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device slots: least recently used unlocked nodes whose
        children are all evicted go first; a node with a host copy stays in the tree."""
        if num_tokens <= 0:
            return 0
        heap = [(self._priority(n), n.id, n) for n in self._nodes() if self._is_device_leaf(n)]
        heapq.heapify(heap)
        freed: List[torch.Tensor] = []
        num_evicted = 0
        while num_evicted < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if not self._is_device_leaf(node):  # changed since it was pushed
                continue
            parent = node.parent
            freed.append(self._evict_device_node(node))
            num_evicted += len(freed[-1])
            if self._is_device_leaf(parent):
                heapq.heappush(heap, (self._priority(parent), parent.id, parent))
        if freed:
            self.token_to_kv_pool_allocator.free(torch.cat(freed))
        return num_evicted

    def evict_extra_key(self, extra_key: str) -> int:
        """Drop every unlocked node cached under `extra_key` from both tiers."""
        nodes = [n for n in self._nodes() if n.extra_key == extra_key]  # pre-order
        freed: List[torch.Tensor] = []
        for node in reversed(nodes):  # children first
            if node.lock_ref == 0 and not node.children and node.host_ref == 0:
                if node.value is not None:
                    freed.append(node.value)
                if node.host_value is not None:
                    self.host_pool.free(node.host_value)
                self._delete_leaf(node)
        if freed:
            self.token_to_kv_pool_allocator.free(torch.cat(freed))
        return sum(len(v) for v in freed)

    def total_size(self) -> int:
        return sum(len(n.value) for n in self._nodes() if n.value is not None)

    def all_values_flatten(self) -> torch.Tensor:
        values = [n.value for n in self._nodes() if n is not self.root_node and n.value is not None]
        return torch.cat(values) if values else _empty_indices(self.device)

    def check_other_tiers(self, thorough: bool = True) -> None:
        """Host slots held by nodes + free host slots == the host pool, and an evicted node has
        a host copy; thorough: page by page, each host page free or held by exactly one node."""
        held: List[torch.Tensor] = []
        for n in self._nodes():
            if n.evicted and not n.backuped:
                raise MemoryLeakError(f"HiCache: {n} is evicted from the device without a host copy")
            if n.evicted and any(not c.evicted for c in n.children.values()):
                raise MemoryLeakError(f"HiCache: {n} is evicted but has a child on the device")
            if n.host_value is not None:
                held.append(n.host_value)
        pool = self.host_pool
        num_held = sum(len(h) for h in held)
        if num_held + pool.available_size() != pool.size:
            raise MemoryLeakError(f"HiCache host pool leak: held by nodes {num_held} + free {pool.available_size()} "
                                  f"!= size {pool.size}")
        if not thorough:
            return
        slots = torch.cat(held) if held else _empty_indices("cpu")
        # slots held per page: page_size for a page one node holds (host_value is whole pages)
        pages_per = torch.bincount(slots // pool.page_size, minlength=pool.num_pages) // pool.page_size
        twice = (pages_per > 1).nonzero().flatten()[:4].tolist()
        both = ((pages_per > 0) & pool.is_free).nonzero().flatten()[:4].tolist()
        lost = ((pages_per == 0) & ~pool.is_free).nonzero().flatten()[:4].tolist()
        if twice or both or lost or len(pool.free_pages) != int(pool.is_free.sum()):
            raise MemoryLeakError(f"HiCache host pool: pages held twice {twice}, both free and held {both}, "
                                  f"neither free nor held {lost}")

    # ---- load back (the PrefillAdder) ------------------------------------------------------------
    def init_load_back(self, last_host_node: HiTreeNode, host_hit_length: int) -> Tuple[torch.Tensor, HiTreeNode]:
        """Bring the host-only nodes ending at `last_host_node` (host_hit_length tokens) back to
        the device. Returns their new device slots (in key order) and last_host_node; or no
        slots and the deepest device ancestor when the device pool cannot make room."""
        if last_host_node.evicted:
            loaded = self.load_back(last_host_node)
            if loaded is not None:
                return loaded, last_host_node
            node = last_host_node
            while node.evicted:
                node = node.parent
            return _empty_indices(self.device), node
        return _empty_indices(self.device), last_host_node

    def load_back(self, node: HiTreeNode) -> Optional[torch.Tensor]:
        """Device slots for `node` and its evicted ancestors, filled from their host copies, or
        None when the device pool cannot make room. The copy is queued on io_thread."""
        nodes: List[HiTreeNode] = []
        while node.evicted:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        ancestor = node
        need = sum(len(n.host_value) for n in nodes)
        for n in nodes:
            n.host_ref += 1  # a write_back eviction below may need host room: not these pages
        self.inc_lock_ref(ancestor)  # nor may it evict the prefix above them
        try:
            allocator = self.token_to_kv_pool_allocator
            if allocator.available_size() < need:
                self.evict(need - allocator.available_size())
            device = allocator.alloc(need)
        finally:
            self.dec_lock_ref(ancestor)
            for n in nodes:
                n.host_ref -= 1
        if device is None:
            return None
        host = torch.cat([n.host_value for n in nodes])
        self.run_io(self.host_pool.load_to_device, device, host)
        offset, self.loaded_storage_tokens = 0, 0
        for n in nodes:
            n.value = device[offset : offset + len(n.host_value)].clone()
            offset += len(n.host_value)
            if n.from_storage:
                self.loaded_storage_tokens += len(n.host_value)
                n.from_storage = False
        self.evictable_size_ += need
        return device

    # ---- backup and host eviction --------------------------------------------------------------
    def write_backup(self, node: HiTreeNode) -> bool:
        """Copy a device node's KV into fresh host slots (host eviction makes room if needed).
        Returns whether the node has a host copy now."""
        if node.backuped or node.evicted:
            return node.backuped
        n = len(node.value)
        host = self.host_pool.alloc(n)
        if host is None:
            self.evict_host(n - self.host_pool.available_size())
            host = self.host_pool.alloc(n)
            if host is None:
                return False  # the host pool is held by nodes being loaded: no copy
        node.host_value = host
        self.run_io(self.host_pool.backup_from_device, host, node.value)
        self.on_host_backup(node)
        return True

    def evict_host(self, num_tokens: int) -> int:
        """Free at least `num_tokens` host slots: least recently used host-only leaves first."""
        heap = [(self._priority(n), n.id, n) for n in self._nodes() if self._is_host_leaf(n)]
        heapq.heapify(heap)
        num_evicted = 0
        while num_evicted < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self.host_pool.free(node.host_value)
            num_evicted += len(node.host_value)
            self._delete_leaf(node)
            if self._is_host_leaf(parent):
                heapq.heappush(heap, (self._priority(parent), parent.id, parent))
        return num_evicted

    # ---- the storage tier's seam -------------------------------------------------------------------
    def set_storage(self, controller: Any) -> None:
        """Plug in the storage tier's controller (mem_cache/storage/). It is called back through
        on_host_backup and storage_hit."""
        self.storage = controller

    def on_host_backup(self, node: HiTreeNode) -> None:
        """Hook: `node` just got a host copy in node.host_value (whole pages, key order). The copy
        itself is queued on io_thread: read the pages with run_io(...), which runs after it.
        The storage controller backs the pages up to the storage tier from here."""
        if self.storage is not None:
            self.storage.on_host_backup(self, node)

    def storage_hit(self, last_host_node: HiTreeNode, key: List[int], extra_key: Optional[str]) -> int:
        """Hook, at match time: the match ended at `last_host_node` and `key` (page-aligned,
        non-empty) is the rest of the wanted key. The storage controller may hang host-only
        nodes with the leading pages of `key` it has under last_host_node (insert_host_pages)
        and return how many tokens it added; the match then goes on through them. 0: none."""
        if self.storage is None:
            return 0
        return self.storage.storage_hit(self, last_host_node, key, extra_key)

    def alloc_host(self, num_tokens: int) -> Optional[torch.Tensor]:
        """Host slots (whole pages) for the storage tier, evicting host-only leaves if needed."""
        host = self.host_pool.alloc(num_tokens)
        if host is None:
            self.evict_host(num_tokens - self.host_pool.available_size())
            host = self.host_pool.alloc(num_tokens)
        return host

    def insert_host_pages(self, parent: HiTreeNode, key: List[int], host_value: torch.Tensor,
                          extra_key: Optional[str] = None, from_storage: bool = True) -> HiTreeNode:
        """Hang a host-only node (key -> host_value, from alloc_host and filled) under `parent`,
        where no child starts with key's first page. Its KV is a hit of tier "storage" when loaded."""
        assert len(key) == len(host_value) and len(key) % self.page_size == 0 and len(key) > 0
        child_key = self._child_key(key, extra_key)
        assert child_key not in parent.children, "a child already starts with this page"
        node = HiTreeNode()
        node.parent, node.key, node.extra_key = parent, list(key), extra_key
        node.value, node.host_value, node.from_storage = None, host_value, from_storage
        node.last_access_time = self._now()
        parent.children[child_key] = node
        return node

    def run_io(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run a copy in order with the forwards: on io_thread when set, else now."""
        if self.io_thread is not None:
            self.io_thread.submit(fn, *args)
        else:
            fn(*args)

    # ---- internals --------------------------------------------------------------------------------
    def _nodes(self) -> List[HiTreeNode]:
        """Every node, root first, each before its descendants."""
        out, stack = [], [self.root_node]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _is_device_leaf(self, node: HiTreeNode) -> bool:
        return (node is not self.root_node and not node.evicted and node.lock_ref == 0
                and all(c.evicted for c in node.children.values()))

    def _is_host_leaf(self, node: HiTreeNode) -> bool:
        return node is not self.root_node and node.evicted and not node.children and node.host_ref == 0

    def _split_tiers(self, values: List[Optional[torch.Tensor]], last_node: HiTreeNode) -> Tuple[torch.Tensor, HiTreeNode, int]:
        """A matched path's device slots, the node they end at, and the host-only tokens after."""
        device_values = [v for v in values if v is not None]  # the evicted nodes are the tail
        node, host_len = last_node, 0
        while node.evicted:
            host_len += len(node.host_value)
            node = node.parent
        indices = torch.cat(device_values) if device_values else _empty_indices(self.device)
        return indices, node, host_len

    def _evict_device_node(self, node: HiTreeNode) -> torch.Tensor:
        """Take `node`'s device slots (returned, to be freed): it stays as a host-only node when
        it has (write_back: gets) a host copy, else it goes with its host-only subtree."""
        if not node.backuped and self.write_policy == "write_back":
            self.write_backup(node)
        value = node.value
        if node.backuped:
            node.value = None
            self.evictable_size_ -= len(value)
        else:
            self._delete_subtree(node)
        return value

    def _delete_subtree(self, node: HiTreeNode) -> None:
        stack, doomed = [node], []
        while stack:
            n = stack.pop()
            doomed.append(n)
            stack.extend(n.children.values())
        for n in reversed(doomed):  # leaves first
            if n is not node and n.host_value is not None:
                self.host_pool.free(n.host_value)
            self._delete_leaf(n)

    def _delete_leaf(self, node: HiTreeNode) -> None:
        removed = node.parent.children.pop(self._child_key(node.key, node.extra_key), None)
        assert removed is node, "tree is corrupt: leaf not found under its parent"
        if node.value is not None:  # only unlocked nodes are deleted
            self.evictable_size_ -= len(node.value)
        node.parent = None

    def _update_leaf_status(self, node: TreeNode) -> None:
        pass  # eviction candidates are collected when needed (_is_device_leaf, _is_host_leaf)

    def _split_node(self, child: HiTreeNode, split_len: int) -> HiTreeNode:
        """parent -> child  becomes  parent -> new_node (the first split_len tokens) -> child,
        on both tiers."""
        assert 0 < split_len < len(child.key)
        new_node = HiTreeNode()
        new_node.parent, new_node.key, new_node.extra_key = child.parent, child.key[:split_len], child.extra_key
        new_node.lock_ref, new_node.hit_count = child.lock_ref, child.hit_count
        new_node.last_access_time, new_node.from_storage = child.last_access_time, child.from_storage
        new_node.host_ref = child.host_ref
        if child.value is not None:
            new_node.value, child.value = child.value[:split_len].clone(), child.value[split_len:].clone()
        else:
            new_node.value = None
        if child.host_value is not None:
            new_node.host_value = child.host_value[:split_len].clone()
            child.host_value = child.host_value[split_len:].clone()
        child.parent, child.key = new_node, child.key[split_len:]
        new_node.children[self._child_key(child.key, child.extra_key)] = child
        new_node.parent.children[self._child_key(new_node.key, new_node.extra_key)] = new_node
        return new_node

    # Hooks of RadixCache's insert.
    node_class = HiTreeNode

    def _matched_on_insert(self, child: HiTreeNode, value: torch.Tensor) -> int:
        """An evicted node on the path takes the caller's slots back (they are not duplicates:
        only device-cached tokens count)."""
        if not child.evicted:
            return len(value)
        child.value = value.clone()
        self.evictable_size_ += len(value)  # an evicted node is never locked
        return 0

    def _on_new_leaf(self, parent: HiTreeNode, leaf: HiTreeNode) -> None:
        """Nothing to track: HiRadixCache.evict walks the tree."""

    def _count_hit(self, node: HiTreeNode) -> None:
        node.hit_count += 1
        if self.write_through_threshold and node.hit_count >= self.write_through_threshold:
            self.write_backup(node)
