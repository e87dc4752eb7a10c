"""The prefix cache's interface (SGLang's BasePrefixCache) and the request fields it uses.

Two implementations: RadixCache (radix_cache.py, prefixes shared between requests) and
ChunkCache (chunk_cache.py, --disable-radix-cache: no sharing). The scheduler, the
PrefillAdder and the output processor only call what is declared here.

The caches live below the managers (the layering contract in pyproject.toml), so they do not
import the scheduler's `Req`: `CacheReq` lists exactly what they read and write on one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional, Protocol

import torch

if TYPE_CHECKING:
    from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator


class CacheReq(Protocol):
    """The fields of a request (managers/schedule_batch.py's Req) a prefix cache uses.

    Optionally `kv_committed_len: int` (see kv_committed_len() below) and `lora_path:
    Optional[str]` (see extra_key_of() below) too."""

    origin_input_ids: List[int]  # read: the prompt
    output_ids: List[int]  # read: tokens generated so far
    fill_ids: List[int]  # read: the tokens whose KV the forwards so far computed
    req_pool_idx: Optional[int]  # read: the request's row in req_to_token
    # read and written: the KV slots of the cached prefix (cache_unfinished_req sets them)
    prefix_indices: torch.Tensor
    # read and written: the tree node the request's lock is on (None: holds no lock)
    last_node: Any


def kv_committed_len(req: CacheReq) -> int:
    """Number of tokens of `req` whose KV is in the pool.

    Every token except the last sampled one (it has not been fed to the model yet). A request
    that has no output yet stopped during (possibly chunked) prefill: its KV is its fill_ids."""
    tracked = getattr(req, "kv_committed_len", None)  # the scheduler's Req tracks it exactly
    if tracked is not None:
        return tracked
    if req.output_ids:
        return len(req.origin_input_ids) + len(req.output_ids) - 1
    return len(req.fill_ids)


def extra_key_of(req: CacheReq) -> Optional[str]:
    """The namespace a request's prefixes are cached under (SGLang's Req.extra_key): its LoRA
    adapter's name, since the same tokens have other KV under another adapter; None = the
    base model (whose prefixes only base requests share)."""
    return getattr(req, "lora_path", None)


@dataclass
class MatchResult:
    device_indices: torch.Tensor  # int64 KV slots of the matched prefix
    last_device_node: Any  # the node the match ends at (lock it to keep the prefix)
    # HiCache (hiradix_cache.py): the match goes on past the device prefix through nodes whose
    # KV is only in the host pool: the deepest such node and how many tokens they hold.
    last_host_node: Any = None
    host_hit_length: int = 0


class BasePrefixCache(ABC):
    """Maps token prefixes to KV slot indices. Slots it holds are either evictable (no
    running request uses them) or protected (locked by inc_lock_ref)."""

    req_to_token_pool: Optional["ReqToTokenPool"]
    token_to_kv_pool_allocator: Optional["TokenToKVPoolAllocator"]
    root_node: Any  # the tree's root; a lock on it is a no-op
    disable: bool = False  # True: nothing is shared between requests
    # Where device KV copies are queued (HiCache; the Scheduler sets the overlap loop's forward
    # thread, so copies run in order with the forwards); None: run them at once.
    io_thread: Any = None

    @abstractmethod
    def reset(self) -> None:
        """Forget every cached prefix (the caller clears the allocator)."""

    @abstractmethod
    def match_prefix(self, key: List[int], extra_key: Optional[str] = None) -> MatchResult:
        """Longest prefix of `key` cached under `extra_key` (extra_key_of(req)), and the node
        it ends at. Prefixes cached under another extra_key never match."""

    @abstractmethod
    def insert(self, key: List[int], value: Optional[torch.Tensor] = None, chunked: bool = False,
               extra_key: Optional[str] = None) -> int:
        """Add key -> value under `extra_key`; returns how many leading tokens of `key` were
        already cached there."""

    @abstractmethod
    def cache_finished_req(self, req: CacheReq, is_insert: bool = True) -> None:
        """A finished or aborted request: keep its KV under extra_key_of(req) (or free it),
        free its row, drop its lock."""

    @abstractmethod
    def cache_unfinished_req(self, req: CacheReq, chunked: bool = False) -> None:
        """After a prefill chunk: cache the KV computed so far under extra_key_of(req), set
        req.prefix_indices and move req's lock to req.last_node."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` evictable slots if there are; returns how many were freed."""

    @abstractmethod
    def evict_extra_key(self, extra_key: str) -> int:
        """Free the unlocked prefixes cached under `extra_key` (an unloaded LoRA adapter's);
        returns how many slots were freed."""

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> int:
        """Protect node's prefix from eviction; returns the change of evictable_size() (<= 0)."""

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> int:
        """Release an inc_lock_ref; returns the change of evictable_size() (>= 0)."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Slots in the cache no request locks."""

    @abstractmethod
    def protected_size(self) -> int:
        """Slots in the cache some request locks."""

    @abstractmethod
    def total_size(self) -> int:
        """Every slot the cache holds (evictable + protected)."""

    @abstractmethod
    def all_values_flatten(self) -> torch.Tensor:
        """Every slot the cache holds, as one int64 tensor (for invariant checks)."""

    @abstractmethod
    def pretty_print(self) -> str:
        """Print the cache's contents and return the text."""

    def init_load_back(self, last_host_node: Any, host_hit_length: int) -> "tuple[torch.Tensor, Any]":
        """HiCache: bring a host hit (host_hit_length tokens ending at last_host_node) back to the
        device; returns the new device slots and the node they end at. Without a host tier
        there is no host hit: no slots, and the node itself."""
        return torch.empty((0,), dtype=torch.int64), last_host_node

    def all_mamba_values_flatten(self) -> List[int]:
        """The state slots of the prefix snapshots the cache holds (the hybrid radix cache's)."""
        return []

    def check_other_tiers(self, thorough: bool = True) -> None:
        """Raise MemoryLeakError if a slot of a tier beyond the device pool (HiCache's host
        pool) is lost (thorough: or held twice, page by page); nothing to check here."""


class MemoryLeakError(RuntimeError):
    """A KV slot or a request row is lost: a broken invariant takes the process down."""


def check_pools_idle(tree_cache: BasePrefixCache, token_to_kv_pool_allocator: Any, req_to_token_pool: Any,
                     max_total_num_tokens: int) -> None:
    """With no request running, every slot is free or in the tree (unlocked), and every
    request row is free (DESIGN.md's conservation invariant)."""
    available = token_to_kv_pool_allocator.available_size()
    evictable, protected = tree_cache.evictable_size(), tree_cache.protected_size()
    # Rows freed while a batch is in flight (the overlap loop's extra step) wait for it: no request's.
    deferred = req_to_token_pool.deferred_size()
    free_rows, rows = req_to_token_pool.available_size() + deferred, req_to_token_pool.size
    if available + evictable != max_total_num_tokens or protected != 0:
        raise MemoryLeakError(f"KV cache memory leak detected! available={available}, evictable={evictable}, "
                              f"protected={protected}, total={max_total_num_tokens}")
    if free_rows != rows:
        raise MemoryLeakError(f"req_to_token_pool leak detected! free rows={free_rows}, size={rows}")
    state_pool = getattr(req_to_token_pool, "mamba_pool", None)  # a hybrid model's (mamba_pool.py)
    snapshots = len(tree_cache.all_mamba_values_flatten())  # the hybrid radix cache's, unlocked when idle
    if state_pool is not None and state_pool.available_size() + snapshots + deferred != state_pool.size:
        raise MemoryLeakError(f"state pool leak detected! free slots={state_pool.available_size()}, "
                              f"snapshots={snapshots}, deferred rows' slots={deferred}, size={state_pool.size}")
    tree_cache.check_other_tiers(thorough=False)  # the page-by-page check is --test-check-memory's


def check_pages_conserved(tree_cache: BasePrefixCache, token_to_kv_pool_allocator: Any, req_to_token_pool: Any,
                          live_reqs: List[CacheReq]) -> None:
    """While requests run: every KV page is free, in the tree, or held by a live request's
    row (its first kv_committed_len slots, or kv_allocated_len where speculation in the overlap
    loop reserved slots ahead), and no page is both free and held."""
    allocator = token_to_kv_pool_allocator
    rows = req_to_token_pool.req_to_token_cpu
    held = [tree_cache.all_values_flatten().to(torch.int64)]
    held += [rows[r.req_pool_idx, : max(kv_committed_len(r), getattr(r, "kv_allocated_len", 0))].to(torch.int64)
             for r in live_reqs]
    used = torch.zeros(allocator.num_pages + 1, dtype=torch.bool)
    used[torch.cat(held) // allocator.page_size] = True
    both = (used & allocator.is_free).nonzero().flatten()[:4].tolist()
    lost = ((~used & ~allocator.is_free)[1:].nonzero().flatten()[:4] + 1).tolist()  # page 0 is padding
    if both or lost:
        raise MemoryLeakError(f"KV pages both free and in use: {both}; pages neither free nor held: {lost}")
    if getattr(req_to_token_pool, "mamba_pool", None) is not None:  # a hybrid model's state slots (mamba_pool.py)
        try:
            req_to_token_pool.check_state_slots([r.req_pool_idx for r in live_reqs], tree_cache.all_mamba_values_flatten())
        except RuntimeError as e:
            raise MemoryLeakError(str(e)) from None
    tree_cache.check_other_tiers()
