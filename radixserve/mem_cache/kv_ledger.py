"""The KV ledger: the one owner of KV memory (DESIGN.md, "Memory: three levels").

Everything that allocates, frees or locks KV goes through here: a request's row in the
request-to-token table (L2), the slots of its tokens (L3), and the lock on its matched prefix
in the tree (L1). A request's row holds, in order:

    [0, len(prefix_indices))       the matched prefix: the tree's slots, locked (lock_ref > 0)
    [.., kv_committed_len)         slots whose KV was computed for its tokens (private)
    [.., kv_allocated_len)         slots reserved ahead (speculation in the overlap loop)

Operations (SGLang's vocabulary): `match` / `load_back` (HiCache) find and lock a prefix;
`reserve` hands out slots (prefill chunks, decode steps, speculative windows); `commit(req,
kept)` keeps the first `kept` tokens' KV and frees the whole pages past it; `release(req)`
gives back all a retracted or dropped request holds that the tree does not. `budget()` is what
the PrefillAdder admits against; `check_idle` / `check_conserved` are slot conservation.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Protocol, Tuple

import torch

from radixserve.mem_cache.base_prefix_cache import (
    BasePrefixCache, CacheReq, MatchResult, check_pages_conserved, check_pools_idle,
)
from radixserve.mem_cache.mamba_pool import MambaPool
from radixserve.mem_cache.mamba_radix_cache import MambaRadixCache
from radixserve.mem_cache.memory_pool import ForwardFence, MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.mem_cache.radix_cache import TreeNode


@dataclass(frozen=True)
class MambaTokenInfo:
    """A hybrid model's two pools: KV slots (full attention) and state slots (linear attention)."""

    full_num_used: int  # held by running requests
    full_size: int
    full_available: int
    full_evictable: int
    mamba_num_used: int  # rows' slots and locked snapshots
    mamba_size: int
    mamba_available: int
    mamba_evictable: int  # unlocked snapshots
    mamba_snapshots: int  # all snapshots the radix cache holds

    @property
    def full_token_usage(self) -> float:
        return self.full_num_used / max(self.full_size, 1)

    @property
    def mamba_usage(self) -> float:
        return self.mamba_num_used / max(self.mamba_size, 1)


class LedgerReq(Protocol):
    """The fields of a request (managers/schedule_batch.py's Req) the ledger reads and writes."""

    req_pool_idx: Optional[int]  # its row (None: holds none)
    kv_committed_len: int  # positions of the row whose KV was computed
    kv_allocated_len: int  # positions of the row with slots reserved ahead (0: none)
    prefix_indices: torch.Tensor  # the tree's slots at the start of the row (locked)
    last_node: Optional[TreeNode]  # where the lock on the prefix is (None: holds no lock)


def held_len(req: LedgerReq) -> int:
    """Positions of a request's row that hold its slots (committed, or reserved ahead)."""
    return max(req.kv_committed_len, req.kv_allocated_len)


class KVLedger:
    """Rows, slots and tree locks: the only code that allocates, frees or locks KV."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator,
                 tree_cache: BasePrefixCache, kv_pool: Optional[MHATokenToKVPool] = None):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.kv_pool = kv_pool  # the K/V buffers (None: a simulated worker has none)
        self.num_evicted_tokens = 0  # slots make_room took back from the tree (the dashboard's count)

    @property
    def page_size(self) -> int:
        return self.allocator.page_size

    @property
    def row_width(self) -> int:
        return self.req_to_token_pool.max_context_len

    # ---- the budget ---------------------------------------------------------------------------
    def available_size(self) -> int:
        return self.allocator.available_size()

    def budget(self) -> int:
        """Slots a new request may take: free ones and the tree's evictable ones."""
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    # The SWA pool's budget (SWAKVLedger); a ledger without one has none.
    sliding_window_size: Optional[int] = None

    def swa_room(self) -> Optional[int]:
        """Swa slots a prefill may take now (free and evictable); None without a SWA pool."""
        return None

    def total_size(self) -> int:
        """Slots of the whole pool: what one request alone can hold at most."""
        return self.allocator.size

    def free_rows(self) -> int:
        return self.req_to_token_pool.available_size()

    def make_room(self, num_tokens: int) -> bool:
        """Evict from the tree until `num_tokens` slots are free; False if it cannot."""
        available = self.allocator.available_size()
        if available < num_tokens:
            self.num_evicted_tokens += self.tree_cache.evict(num_tokens - available)
        return self.allocator.available_size() >= num_tokens

    def evict_extra_key(self, extra_key: str) -> int:
        """Free the unlocked prefixes cached under `extra_key` (an unloaded LoRA adapter's)."""
        return self.tree_cache.evict_extra_key(extra_key)

    def mem_report(self) -> str:
        return (f"available={self.allocator.available_size()}, "
                f"evictable={self.tree_cache.evictable_size()}, protected={self.tree_cache.protected_size()}")

    # ---- match and lock (L1) ----------------------------------------------------------------------
    def match_prefix(self, key: List[int], extra_key: Optional[str] = None) -> MatchResult:
        """The longest cached prefix of `key` under `extra_key` (a LoRA adapter; None: the base
        model), with the host part HiCache could load back (`load_back`). Locks nothing."""
        return self.tree_cache.match_prefix(key, extra_key)

    match = match_prefix  # SGLang's short name; match_prefix lets a Req match on a cache or the ledger

    def lock(self, node: TreeNode) -> None:
        """The prefix ending at `node` may not be evicted while a request uses it."""
        self.tree_cache.inc_lock_ref(node)

    def unlock(self, node: TreeNode) -> None:
        self.tree_cache.dec_lock_ref(node)

    @contextmanager
    def locked(self, node: TreeNode) -> Iterator[None]:
        self.lock(node)
        try:
            yield
        finally:
            self.unlock(node)

    def load_back(self, last_host_node: TreeNode, host_hit_length: int) -> Tuple[torch.Tensor, TreeNode]:
        """HiCache: device slots for a host hit (BasePrefixCache.init_load_back)."""
        return self.tree_cache.init_load_back(last_host_node, host_hit_length)

    # ---- rows (L2) -------------------------------------------------------------------------------
    def alloc_rows(self, n: int) -> Optional[List[int]]:
        self.make_state_room(n)  # a hybrid model's row takes a state slot with it
        return self.req_to_token_pool.alloc(n)

    def free_row(self, row: int) -> None:
        self.req_to_token_pool.free(row)

    def defer_row_frees(self, fence: ForwardFence) -> None:
        """The overlap loop: a row freed while batches are in flight (a finished request's extra
        step, a preempted request's last step) goes back once they are done, since their forwards
        read the row in place. So that step computes its token's KV over the request's own tokens
        (the tree keeps that KV, and a hybrid model's end snapshot the state after it)."""
        self.req_to_token_pool.fence = fence

    def collect_deferred_rows(self) -> None:
        """Rows (and their state slots) whose in-flight batches are done go back to the pool."""
        self.req_to_token_pool.collect_deferred()

    def row(self, req: LedgerReq) -> torch.Tensor:
        """The request's row of slot indices (host copy)."""
        return self.req_to_token_pool.req_to_token_cpu[req.req_pool_idx]

    @property
    def rows_cpu(self) -> torch.Tensor:
        """The whole request-to-token table, host copy (read only: a batch's windows, PP's rows)."""
        return self.req_to_token_pool.req_to_token_cpu

    def write_spans(self, rows: List[int], starts: List[int], lens: List[int], slots: torch.Tensor) -> None:
        """Row rows[i], positions starts[i] .. starts[i] + lens[i] - 1 get the next lens[i] slots
        (a prefill's prefix and chunk, a later PP stage copying the first stage's rows)."""
        self.req_to_token_pool.write_spans(rows, starts, lens, slots)

    def write_at(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Row rows[i], position positions[i] gets slots[i] (a decode step's new token)."""
        self.req_to_token_pool.write((rows, positions), slots)

    def write_row(self, req: LedgerReq, start: int, slots: torch.Tensor) -> None:
        """The request's positions start .. start + len(slots) - 1 get `slots` (drafts, a PD transfer)."""
        self.req_to_token_pool.write((req.req_pool_idx, slice(start, start + len(slots))), slots)

    # ---- slots (L3): reserve ------------------------------------------------------------------------
    def alloc_slots(self, num_tokens: int) -> torch.Tensor:
        """`num_tokens` slots (page_size 1, or whole pages of scratch); raises when out of memory."""
        self.make_room(num_tokens)
        out = self.allocator.alloc(num_tokens)
        if out is None:
            raise RuntimeError(f"KV cache out of memory: need {num_tokens} slots. {self.mem_report()}")
        return out

    def _paged_need(self, prefix_lens: List[int], seq_lens: List[int]) -> int:
        ps = self.page_size
        return sum(-(-s // ps) - -(-p // ps) for p, s in zip(prefix_lens, seq_lens)) * ps

    def try_alloc_extend(self, prefix_lens: List[int], seq_lens: List[int], last_locs: List[int]) -> Optional[torch.Tensor]:
        """Slots for positions prefix_len .. seq_len-1 of each request (a paged alloc continues the
        page of last_locs[i]), concatenated; None when the pool (after eviction) has no room."""
        self.make_room(self._paged_need(prefix_lens, seq_lens))
        return self.allocator.alloc_extend(prefix_lens, seq_lens, last_locs)

    def reserve(self, prefix_lens: List[int], seq_lens: List[int], last_locs: List[int]) -> torch.Tensor:
        """try_alloc_extend, raising when out of memory (a prefill chunk, a decode step, a window)."""
        if self.page_size == 1:
            return self.alloc_slots(sum(s - p for p, s in zip(prefix_lens, seq_lens)))
        out = self.try_alloc_extend(prefix_lens, seq_lens, last_locs)
        if out is None:
            need = self._paged_need(prefix_lens, seq_lens)
            raise RuntimeError(f"KV cache out of memory: need {need} slots. {self.mem_report()}")
        return out

    def last_locs(self, reqs: List[LedgerReq], prefix_lens: List[int]) -> List[int]:
        """Slot of each request's token prefix_len-1 (-1 if none): a paged reserve continues its page."""
        if self.page_size == 1:
            return [-1] * len(prefix_lens)
        rows = self.rows_cpu
        return [int(rows[r.req_pool_idx, p - 1]) if p > 0 else -1 for r, p in zip(reqs, prefix_lens)]

    def reserve_ahead(self, reqs: List[LedgerReq], targets: List[int]) -> None:
        """Each request holds slots for its first targets[i] positions (at least what it holds
        now): the speculative overlap loop's window, reserved before the step's drafts are known."""
        bases = [held_len(r) for r in reqs]
        targets = [max(t, b) for t, b in zip(targets, bases)]
        if any(t > b for t, b in zip(targets, bases)):
            flat = self.reserve(bases, targets, self.last_locs(reqs, bases))
            self.write_spans([r.req_pool_idx for r in reqs], bases, [t - b for b, t in zip(bases, targets)], flat)
        for r, t in zip(reqs, targets):
            r.kv_allocated_len = t

    def free_slots(self, slots: torch.Tensor) -> None:
        """Scratch slots that no row holds (EAGLE's tree forwards)."""
        self.allocator.free(slots)

    @contextmanager
    def free_group(self) -> Iterator[None]:
        """Frees inside are batched into one (the output processor's per-batch loop)."""
        self.allocator.free_group_begin()
        try:
            yield
        finally:
            self.allocator.free_group_end()

    def move_kv(self, tgt: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the K/V of slots `src` into slots `tgt` (a tree verify's accepted branch)."""
        self.kv_pool.move_kv_cache(tgt, src)

    # ---- commit and release ----------------------------------------------------------------------
    def advance(self, req: LedgerReq, committed: int) -> None:
        """The request's KV now covers its first `committed` tokens (a prefill chunk or a decode
        step ran; slots reserved past them stay reserved)."""
        req.kv_committed_len = committed

    def commit(self, req: LedgerReq, kept: int, held: Optional[int] = None) -> None:
        """The request keeps the KV of its first `kept` tokens; its slots past them, up to `held`
        (default: all it holds), go back. Paged: the rest of the last kept token's page stays
        (the next tokens fill it); only whole pages past it go."""
        held = held_len(req) if held is None else held
        ps = self.page_size
        first_free = -(-kept // ps) * ps
        if first_free < held:
            self.allocator.free(self.row(req)[first_free:held].to(torch.int64))
        req.kv_committed_len, req.kv_allocated_len = kept, 0

    def cache_unfinished_req(self, req: CacheReq, chunked: bool = False) -> None:
        """A prefill chunk ran: its KV goes into the tree, the request's lock moves to its end."""
        self.tree_cache.cache_unfinished_req(req, chunked=chunked)

    def cache_finished_req(self, req: CacheReq, is_insert: bool = True) -> None:
        """A finished or aborted request: its KV goes into the tree (or back), its row and lock go."""
        self.tree_cache.cache_finished_req(req, is_insert=is_insert)

    def release(self, req: LedgerReq) -> None:
        """Everything a request holds that the tree does not (retract, preempt, a failed PD
        transfer): its private slots, its row, the lock on its prefix. The prefix stays in the
        tree, unlocked (evictable)."""
        # Slots of the locked tree prefix stay in the tree; everything after is private.
        ps = self.page_size
        protected = 0 if self.tree_cache.disable else len(req.prefix_indices) // ps * ps
        self.allocator.free(self.row(req)[protected:held_len(req)].to(torch.int64))
        self.req_to_token_pool.free(req.req_pool_idx)
        if req.last_node is not None:
            self.unlock(req.last_node)
        req.req_pool_idx = None
        req.kv_committed_len = req.kv_allocated_len = 0

    def clear(self) -> None:
        """flush_cache / release_memory_occupation: every slot and row free, the tree empty."""
        self.tree_cache.reset()
        self.allocator.clear()
        self.req_to_token_pool.clear()

    # ---- the state pool (hybrid models: mem_cache/mamba_pool.py, mamba_radix_cache.py) -----------
    # A row of a HybridReqToTokenPool takes its state slot with it (alloc_rows, free_row, release);
    # the hybrid radix cache holds the prefix snapshots in the same pool.
    @property
    def state_pool(self) -> Optional[MambaPool]:
        return getattr(self.req_to_token_pool, "mamba_pool", None)

    @property
    def snapshot_cache(self) -> Optional[MambaRadixCache]:
        return self.tree_cache if isinstance(self.tree_cache, MambaRadixCache) else None

    def state_slots(self, req_pool_indices: torch.Tensor) -> Optional[torch.Tensor]:
        """Each row's state slot now, for a batch being scheduled (None: no state pool). The
        forward must use these: by the time it runs in the overlap loop, a finished request's row
        may be freed and handed on, and its extra step must not write another request's slot."""
        return self.req_to_token_pool.mamba_indices(req_pool_indices) if self.state_pool is not None else None

    def swa_forward_locs(self, req_pool_indices: torch.Tensor, prefix_lens: List[int], seq_lens: List[int],
                         out_cache_loc: torch.Tensor) -> Optional[Any]:
        """A batch's windowed-layer slots, read as it is scheduled (the SWA pool: SWAKVLedger);
        None without one."""
        return None

    def make_state_room(self, num_states: int) -> bool:
        """Drop snapshots until num_states state slots are free; False if it cannot."""
        pool, cache = self.state_pool, self.snapshot_cache
        if pool is None:
            return True
        self.req_to_token_pool.collect_deferred()  # rows (and their slots) whose batches are done
        if cache is not None and pool.available_size() < num_states:
            cache.evict_mamba(num_states - pool.available_size())
        return pool.available_size() >= num_states

    def restore_prefix_states(self, reqs: List[LedgerReq]) -> None:
        """Requests just given rows: where a prefix came from the tree, their state starts from
        its snapshot (a no-op without the hybrid radix cache: no prefix then)."""
        if self.snapshot_cache is not None:
            self.snapshot_cache.restore_prefix_states(reqs)

    def mamba_token_info(self) -> "MambaTokenInfo":
        """Both pools' use (SGLang's _get_mamba_token_info)."""
        cache, pool = self.snapshot_cache, self.state_pool
        deferred = self.req_to_token_pool.deferred_size()  # (first: it returns the rows whose batches are done)
        full_available, full_evictable = self.allocator.available_size(), self.tree_cache.evictable_size()
        mamba_available = pool.available_size()
        mamba_evictable = cache.mamba_evictable_size() if cache is not None else 0
        return MambaTokenInfo(
            full_num_used=self.allocator.size - full_available - full_evictable, full_size=self.allocator.size,
            full_available=full_available, full_evictable=full_evictable,
            # (a row freed while a batch is in flight keeps its slot until that batch is done: no request's)
            mamba_num_used=pool.size - mamba_available - mamba_evictable - deferred,
            mamba_size=pool.size,
            mamba_available=mamba_available, mamba_evictable=mamba_evictable,
            mamba_snapshots=len(cache.all_mamba_values_flatten()) if cache is not None else 0)

    # ---- invariants ------------------------------------------------------------------------------
    def check_idle(self, max_total_num_tokens: int) -> None:
        """No request running: every slot free or in the tree, unlocked; every row free."""
        check_pools_idle(self.tree_cache, self.allocator, self.req_to_token_pool, max_total_num_tokens)

    def check_conserved(self, live_reqs: List[CacheReq]) -> None:
        """--test-check-memory: every page free, in the tree, or held by one live request."""
        check_pages_conserved(self.tree_cache, self.allocator, self.req_to_token_pool, live_reqs)


class ReservedSlots:
    """The ledger a speculative step of the overlap loop sees (speculative/overlap_view.py's
    DecodeView; KVLedger's operations a speculative step uses): `alloc_slots` hands out the batch's spare reserved slots (EAGLE's scratch for its tree
    forwards), `free_slots` and `commit` keep them reserved (the scheduler's ledger frees them
    when the request finishes), `move_kv` goes to the scheduler's ledger."""

    page_size = 1  # slots here are single positions of reserved pages

    def __init__(self, spare: torch.Tensor, ledger: Optional[KVLedger] = None):
        self.spare = spare
        self.ledger = ledger  # the scheduler's KVLedger

    def alloc_slots(self, n: int) -> torch.Tensor:
        assert n <= len(self.spare), f"{n} scratch slots wanted, {len(self.spare)} reserved"
        out, self.spare = self.spare[:n], self.spare[n:]
        return out

    def free_slots(self, slots: torch.Tensor) -> None:
        """Nothing to do: rejected drafts' slots are the ones the next step writes."""

    def commit(self, req: LedgerReq, kept: int, held: Optional[int] = None) -> None:
        """The view's request (the forward thread's copy, speculative/overlap_view.py's ReqView) keeps
        `kept` tokens' KV; nothing goes back (see free_slots)."""
        req.kv_committed_len = kept

    def move_kv(self, tgt: torch.Tensor, src: torch.Tensor) -> None:
        self.ledger.move_kv(tgt, src)
