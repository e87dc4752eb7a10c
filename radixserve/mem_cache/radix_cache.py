"""L1 of seed 003: the radix tree that maps token prefixes to KV slot indices.

    root ── [1 2 3] ──┬── [4 5]        a node's key is a run of token ids and its value
                      │                the KV slot of each of them (same length);
                      └── [7 8 9]      children are keyed by their first token
                                       (by their first page, as a tuple, when page_size > 1)

Namespaces (SGLang's RadixKey.extra_key): a prefix computed under a LoRA adapter has other KV
than the same tokens under the base model, so every node carries the `extra_key` it was
inserted under (the adapter's name; None = the base model) and a child's key is
(extra_key, first token or page) for a non-None extra_key. Each namespace is thus its own
subtree under the root; matching never crosses from one to another.

    root ──┬── 1 ──────── [1 2 3]      base model
           └── ("A", 1) ─ [1 2 3]      the same tokens under adapter "A": other slots

Ownership of KV slots (the invariant the tests check after every step):

    allocator.available_size() + total_size() + (slots held privately by running requests)
        == pool size,          total_size() == evictable_size() + protected_size()

A node is *protected* while some running request holds a lock on it or on a descendant
(`lock_ref > 0`); only unlocked leaves are evicted, and evicting one may turn its parent
into an unlocked leaf in turn.

Index ranges of one request row in req_to_token (page_size = 4 in the picture):

    0           protected_len        new_prefix_len      len(keys)   kv_len
    |-- in tree, locked --|-- private, now also in tree --|-- new --|- tail -|
                          (duplicates: freed, the row is   (inserted) (< 1 page,
                           re-pointed at the tree's slots)             stays private)
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple, Union

import torch

# (MatchResult and kv_committed_len stay importable from here too.)
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache, CacheReq, MatchResult, extra_key_of, kv_committed_len

if TYPE_CHECKING:
    from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator

# The first token (or page) of a node's key, prefixed by the node's extra_key when it has one.
ChildKey = Union[int, Tuple[int, ...], Tuple[str, Union[int, Tuple[int, ...]]]]

_node_ids = itertools.count()


class TreeNode:
    """One run of tokens with the KV slots that hold them."""

    def __init__(self) -> None:
        self.children: Dict[ChildKey, TreeNode] = {}
        self.parent: Optional[TreeNode] = None
        self.key: List[int] = []
        self.extra_key: Optional[str] = None  # the namespace (LoRA adapter) of key; None = base
        self.value: torch.Tensor = torch.empty(0, dtype=torch.int64)
        self.lock_ref = 0
        self.last_access_time = time.monotonic()
        self.hit_count = 0  # how many requests inserted this prefix (LFU)
        self.id = next(_node_ids)

    def __lt__(self, other: "TreeNode") -> bool:
        return self.last_access_time < other.last_access_time

    def __repr__(self) -> str:
        head = self.key[:8]
        more = "..." if len(self.key) > 8 else ""
        ns = f", extra_key={self.extra_key!r}" if self.extra_key is not None else ""
        return f"TreeNode(id={self.id}, len={len(self.key)}, key={head}{more}{ns}, lock_ref={self.lock_ref})"


def _empty_indices(device) -> torch.Tensor:
    return torch.empty((0,), dtype=torch.int64, device=device)


class RadixCache(BasePrefixCache):
    def __init__(
        self,
        req_to_token_pool: Optional["ReqToTokenPool"],
        token_to_kv_pool_allocator: Optional["TokenToKVPoolAllocator"],
        page_size: int = 1,
        disable: bool = False,
        eviction_policy: str = "lru",
    ):
        assert page_size >= 1
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.disable = disable
        self.eviction_policy = eviction_policy.lower()
        if self.eviction_policy not in ("lru", "lfu"):
            raise ValueError(f"unknown eviction policy {eviction_policy!r}; choose 'lru' or 'lfu'")
        self.device = "cpu"  # slot indices are host tensors (the allocator's), wherever the KV is
        self._last_time = 0.0
        self.reset()

    # ---- public API --------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the whole tree. Its slots are *not* freed: the caller clears the allocator."""
        self.root_node = TreeNode()
        self.root_node.lock_ref = 1  # the root is never evicted
        self.evictable_size_ = 0
        self.protected_size_ = 0
        # Unlocked nodes without children: the eviction candidates.
        self.evictable_leaves: set = set()

    def match_prefix(self, key: List[int], extra_key: Optional[str] = None) -> MatchResult:
        """Longest cached prefix of `key` among those inserted under `extra_key`
        (page-aligned when page_size > 1).

        Refreshes last_access_time along the path; splits the last node when the match
        ends inside it, so that the returned node covers exactly the matched prefix."""
        if self.disable or len(key) == 0:
            return MatchResult(_empty_indices(self.device), self.root_node)
        key = self._page_align(key)
        if len(key) == 0:
            return MatchResult(_empty_indices(self.device), self.root_node)
        values, last_node = self._match_prefix_helper(key, extra_key)
        indices = torch.cat(values) if values else _empty_indices(self.device)
        return MatchResult(indices, last_node)

    def insert(self, key: List[int], value: Optional[torch.Tensor] = None, chunked: bool = False,
               extra_key: Optional[str] = None) -> int:
        """Add key -> value under `extra_key`; returns how many leading tokens of `key` were
        already cached there (their slots in `value` are duplicates the caller still owns and
        should free)."""
        if self.disable:
            return 0
        if value is None:
            value = torch.tensor(key, dtype=torch.int64)
        assert len(key) == len(value), f"key and value differ in length: {len(key)} != {len(value)}"
        assert len(key) % self.page_size == 0, (
            f"insert() takes page-aligned keys (len {len(key)}, page_size {self.page_size})"
        )
        return self._insert_helper(list(key), value.to(torch.int64), chunked, extra_key)

    def cache_finished_req(self, req: CacheReq, is_insert: bool = True) -> None:
        """Hand a finished (or aborted) request's KV to the tree and release its row and lock."""
        kv_len = kv_committed_len(req)
        kv_indices = self.req_to_token_pool.req_to_token_cpu[req.req_pool_idx, :kv_len].to(torch.int64)
        allocator = self.token_to_kv_pool_allocator

        if self.disable:
            allocator.free(kv_indices)
            self.req_to_token_pool.free(req.req_pool_idx)
            return

        token_ids = (list(req.origin_input_ids) + list(req.output_ids))[:kv_len]
        keys = self._page_align(token_ids)
        protected_len = self._protected_len(req)
        if is_insert:
            new_prefix_len = self.insert(keys, kv_indices[: len(keys)].clone(), extra_key=extra_key_of(req))
            # Slots of tokens another request cached meanwhile: ours are duplicates.
            allocator.free(kv_indices[protected_len:new_prefix_len])
        else:
            allocator.free(kv_indices[protected_len : len(keys)])
        # The unaligned tail (less than a page) never enters the tree.
        allocator.free(kv_indices[len(keys) :])

        self.req_to_token_pool.free(req.req_pool_idx)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)

    def cache_unfinished_req(self, req: CacheReq, chunked: bool = False) -> None:
        """Insert the KV computed so far (after a prefill chunk) and lock it for `req`."""
        token_ids = list(req.fill_ids)
        row = req.req_pool_idx
        kv_indices = self.req_to_token_pool.req_to_token_cpu[row, : len(token_ids)].to(torch.int64)
        if self.disable:
            req.prefix_indices = kv_indices
            return

        keys = self._page_align(token_ids)
        protected_len = self._protected_len(req)
        extra_key = extra_key_of(req)
        new_prefix_len = self.insert(keys, kv_indices[: len(keys)].clone(), chunked=chunked, extra_key=extra_key)
        self.token_to_kv_pool_allocator.free(kv_indices[protected_len:new_prefix_len])

        # Re-point the row at the tree's slots (they differ where we just freed duplicates).
        match = self.match_prefix(keys, extra_key)
        new_indices, new_last_node = match.device_indices, match.last_device_node
        assert len(new_indices) == len(keys), f"{len(new_indices)=} != {len(keys)=}"
        self.req_to_token_pool.write((row, slice(protected_len, len(new_indices))), new_indices[protected_len:])

        self.inc_lock_ref(new_last_node)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)

        # The unaligned tail stays private to the request; keep it in prefix_indices.
        if len(new_indices) < len(kv_indices):
            req.prefix_indices = torch.cat([new_indices, kv_indices[len(new_indices) :]])
        else:
            req.prefix_indices = new_indices
        req.last_node = new_last_node

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots from unlocked leaves (fewer if not enough are
        evictable), least recently used first (LRU) or least often hit first (LFU).
        Returns the number of slots freed."""
        if self.disable or num_tokens <= 0:
            return 0
        heap = [(self._priority(n), n.id, n) for n in self.evictable_leaves]
        heapq.heapify(heap)
        freed: List[torch.Tensor] = []
        num_evicted = 0
        while num_evicted < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            freed.append(node.value)
            num_evicted += len(node.value)
            parent = node.parent
            self._delete_leaf(node)
            if parent is not self.root_node and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (self._priority(parent), parent.id, parent))
        if freed:
            self.token_to_kv_pool_allocator.free(torch.cat(freed))
        return num_evicted

    def evict_extra_key(self, extra_key: str) -> int:
        """Free every unlocked prefix cached under `extra_key`: an unloaded adapter's KV is of
        no use, and its name may be loaded again with other weights (SGLang keys by a fresh
        lora_id per load instead). Returns the number of slots freed."""
        if self.disable:
            return 0
        nodes: List[TreeNode] = []  # pre-order: every node before its descendants
        stack = [c for c in self.root_node.children.values() if c.extra_key == extra_key]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        freed: List[torch.Tensor] = []
        for node in reversed(nodes):  # children first, so a parent may become a leaf in turn
            if node.lock_ref == 0 and not node.children:
                freed.append(node.value)
                self._delete_leaf(node)
        if freed:
            self.token_to_kv_pool_allocator.free(torch.cat(freed))
        return sum(len(v) for v in freed)

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock node and its ancestors. Returns the change of evictable_size() (<= 0)."""
        if self.disable or node is None:
            return 0
        delta = 0
        while node is not self.root_node:
            if node.lock_ref == 0:
                self.evictable_size_ -= len(node.key)
                self.protected_size_ += len(node.key)
                delta -= len(node.key)
                self.evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent
            assert node is not None, "node is not in this tree"
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Release a lock taken by inc_lock_ref. Returns the change of evictable_size() (>= 0)."""
        if self.disable or node is None:
            return 0
        delta = 0
        while node is not self.root_node:
            if node.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref below zero on {node}")
            if node.lock_ref == 1:
                self.evictable_size_ += len(node.key)
                self.protected_size_ -= len(node.key)
                delta += len(node.key)
            node.lock_ref -= 1
            self._update_leaf_status(node)
            node = node.parent
            assert node is not None, "node is not in this tree"
        return delta

    def evictable_size(self) -> int:
        return self.evictable_size_

    def protected_size(self) -> int:
        return self.protected_size_

    def total_size(self) -> int:
        total = 0
        stack = [self.root_node]
        while stack:
            node = stack.pop()
            total += len(node.value)
            stack.extend(node.children.values())
        return total

    def all_values_flatten(self) -> torch.Tensor:
        """Every KV slot the tree holds (for invariant checks)."""
        values = []
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            values.append(node.value)
            stack.extend(node.children.values())
        return torch.cat(values) if values else _empty_indices(self.device)

    def pretty_print(self) -> str:
        lines = []
        stack = [(self.root_node, 0)]
        while stack:
            node, depth = stack.pop()
            head = node.key[:10]
            ns = f" [{node.extra_key}]" if node.extra_key is not None else ""
            lines.append(f"{'  ' * depth}{len(node.key)}{ns} {head}{'...' if len(node.key) > 10 else ''} r={node.lock_ref}")
            for child in reversed(list(node.children.values())):
                stack.append((child, depth + 1))
        lines.append(f"#tokens: {self.total_size()}")
        text = "\n".join(lines)
        print(text)
        return text

    # ---- internals ---------------------------------------------------------------------
    def _now(self) -> float:
        # Strictly increasing, so that LRU order is exact even for back-to-back calls.
        t = max(time.monotonic(), math.nextafter(self._last_time, math.inf))
        self._last_time = t
        return t

    def _page_align(self, key: List[int]) -> List[int]:
        if self.page_size == 1:
            return key
        return key[: len(key) // self.page_size * self.page_size]

    def _protected_len(self, req: CacheReq) -> int:
        """Length of the request's prefix that lies in the tree under its lock. With
        page_size > 1, prefix_indices may end with a private partial page (see
        cache_unfinished_req); that part is not in the tree."""
        n = len(req.prefix_indices) if req.prefix_indices is not None else 0
        return n // self.page_size * self.page_size

    def _child_key(self, key: List[int], extra_key: Optional[str]) -> ChildKey:
        first = key[0] if self.page_size == 1 else tuple(key[: self.page_size])
        return first if extra_key is None else (extra_key, first)

    def _key_match(self, key0: List[int], key1: List[int]) -> int:
        """Length of the common prefix, in whole pages when page_size > 1."""
        n = min(len(key0), len(key1))
        ps = self.page_size
        if ps == 1:
            i = 0
            while i < n and key0[i] == key1[i]:
                i += 1
            return i
        i = 0
        while i + ps <= n and key0[i : i + ps] == key1[i : i + ps]:
            i += ps
        return i

    def _priority(self, node: TreeNode):
        if self.eviction_policy == "lfu":
            return (node.hit_count, node.last_access_time)
        return (node.last_access_time,)

    def _match_prefix_helper(self, key: List[int], extra_key: Optional[str]) -> Tuple[List[torch.Tensor], TreeNode]:
        now = self._now()
        node = self.root_node
        node.last_access_time = now
        values: List[torch.Tensor] = []
        while len(key) > 0:
            child = node.children.get(self._child_key(key, extra_key))
            if child is None:
                break
            child.last_access_time = now
            prefix_len = self._key_match(child.key, key)
            if prefix_len < len(child.key):
                new_node = self._split_node(child, prefix_len)
                values.append(new_node.value)
                node = new_node
                break
            values.append(child.value)
            node = child
            key = key[prefix_len:]
        return values, node

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """parent -> child  becomes  parent -> new_node (child.key[:split_len]) -> child."""
        assert 0 < split_len < len(child.key)
        parent = child.parent
        new_node = TreeNode()
        new_node.parent = parent
        new_node.key = child.key[:split_len]
        new_node.extra_key = child.extra_key
        new_node.value = child.value[:split_len].clone()
        new_node.lock_ref = child.lock_ref  # every lock on child passes through new_node
        new_node.hit_count = child.hit_count
        new_node.last_access_time = child.last_access_time
        child.parent = new_node
        child.key = child.key[split_len:]
        child.value = child.value[split_len:].clone()
        new_node.children[self._child_key(child.key, child.extra_key)] = child
        parent.children[self._child_key(new_node.key, new_node.extra_key)] = new_node
        # Sizes are unchanged; new_node has a child so it is not a leaf; child keeps its status.
        return new_node

    def _insert_helper(self, key: List[int], value: torch.Tensor, chunked: bool, extra_key: Optional[str]) -> int:
        now = self._now()
        node = self.root_node
        node.last_access_time = now
        total_prefix_len = 0
        while len(key) > 0:
            child = node.children.get(self._child_key(key, extra_key))
            if child is None:
                break
            child.last_access_time = now
            prefix_len = self._key_match(child.key, key)
            if prefix_len < len(child.key):
                child = self._split_node(child, prefix_len)
            total_prefix_len += self._matched_on_insert(child, value[:prefix_len])
            key = key[prefix_len:]
            value = value[prefix_len:]
            if not chunked:  # a chunked request re-inserting its own chunks is no new hit
                self._count_hit(child)
            node = child

        if len(key) > 0:
            new_node = self.node_class()
            new_node.parent = node
            new_node.key = key
            new_node.extra_key = extra_key
            new_node.value = value.clone()
            new_node.last_access_time = now
            if not chunked:
                self._count_hit(new_node)
            node.children[self._child_key(key, extra_key)] = new_node
            self.evictable_size_ += len(key)
            self._on_new_leaf(node, new_node)
        return total_prefix_len

    # Hooks of the insert (HiRadixCache changes what a matched node and a hit mean).
    node_class = TreeNode

    def _matched_on_insert(self, child: TreeNode, value: torch.Tensor) -> int:
        """An insert's path runs through `child` for len(value) tokens: how many of them count as
        already cached (the caller's slots for those are duplicates)."""
        return len(value)

    def _count_hit(self, node: TreeNode) -> None:
        node.hit_count += 1

    def _on_new_leaf(self, parent: TreeNode, leaf: TreeNode) -> None:
        self.evictable_leaves.discard(parent)
        self.evictable_leaves.add(leaf)

    def _delete_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        removed = parent.children.pop(self._child_key(node.key, node.extra_key), None)
        assert removed is node, "tree is corrupt: leaf not found under its parent"
        self.evictable_size_ -= len(node.key)
        self.evictable_leaves.discard(node)
        node.parent = None
        self._update_leaf_status(parent)

    def _update_leaf_status(self, node: TreeNode) -> None:
        if node is self.root_node or node.lock_ref > 0 or node.children:
            self.evictable_leaves.discard(node)
        else:
            self.evictable_leaves.add(node)
