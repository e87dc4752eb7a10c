"""The KV ledger's SWA part (seed 001's SWA token pool, `_get_swa_token_info`,
`_check_hybrid_memory`): the same ledger over the SWA allocator (swa_memory_pool.py) and the
SWA-aware tree (swa_radix_cache.py), plus what only the windowed layers' pool needs:

- a request's private swa slots older than its window go back as it moves on (`advance`), one
  forward late: a forward that starts at position q reads keys from q - W + 1 on, and in the
  overlap loop the previous forward may still be running when the next is scheduled;
- room is made in both pools (`make_room`): the full one by evicting tree leaves as before, the
  SWA one by turning unlocked live nodes into tombstones (their full slots stay);
- `swa_room()` is the SWA pool's free and evictable slots: the PrefillAdder clamps a chunk to it
  and admits against it (rem_swa_tokens, a window per request); `budget()` stays the full pool's;
- `swa_forward_locs`: a batch's windowed-layer slots, read as it is scheduled (the overlap loop's
  next schedule frees and moves swa slots in the map while the forward runs; the K/V in a freed
  slot stays until a later forward writes it, and forwards run in order);
- the invariants cover both pools.

Per request row: `swa_evicted_seqlen` (SGLang's name: positions before it hold no swa slot of
the request's own) and the KV lengths after its last two forwards were scheduled.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from radixserve.mem_cache.base_prefix_cache import BasePrefixCache, CacheReq, MemoryLeakError
from radixserve.mem_cache.kv_ledger import KVLedger, LedgerReq, held_len
from radixserve.mem_cache.memory_pool import ReqToTokenPool
from radixserve.mem_cache.swa_memory_pool import SWAForwardLocs, SWAKVPool, SWATokenToKVPoolAllocator


class SWAKVLedger(KVLedger):
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: SWATokenToKVPoolAllocator,
                 tree_cache: BasePrefixCache, kv_pool: Optional[SWAKVPool], sliding_window_size: int):
        super().__init__(req_to_token_pool, allocator, tree_cache, kv_pool)
        self.swa_allocator = allocator
        self.sliding_window_size = sliding_window_size
        self.swa_evicted_seqlen: Dict[int, int] = {}  # row -> positions [.., this) hold no own swa slot
        self.swa_scheduled_lens: Dict[int, Tuple[int, int]] = {}  # row -> KV lengths after its last two schedules

    # ---- the SWA pool's budget -------------------------------------------------------------------
    def _swa_evictable(self) -> int:
        return self.tree_cache.swa_evictable_size() if hasattr(self.tree_cache, "swa_evictable_size") else 0

    def _swa_protected(self) -> int:
        return self.tree_cache.swa_protected_size() if hasattr(self.tree_cache, "swa_protected_size") else 0

    def swa_room(self) -> Optional[int]:
        """Swa slots a prefill chunk may take now: free ones and the tree's unlocked live ones."""
        return self.swa_allocator.swa_available_size() + self._swa_evictable()

    def make_room(self, num_tokens: int) -> bool:
        full_ok = super().make_room(num_tokens)
        available = self.swa_allocator.swa_available_size()
        if available < num_tokens and hasattr(self.tree_cache, "evict_swa"):
            self.tree_cache.evict_swa(num_tokens - available)
        return full_ok and self.swa_allocator.swa_available_size() >= num_tokens

    def get_swa_token_info(self) -> Dict[str, int]:
        """The SWA pool's numbers (SGLang's _get_swa_token_info), for stats and /get_server_info."""
        available = self.swa_allocator.swa_available_size()
        evictable, protected = self._swa_evictable(), self._swa_protected()
        total = self.swa_allocator.size_swa
        return dict(swa_max_total_num_tokens=total, swa_available_tokens=available, swa_evictable_tokens=evictable,
                    swa_protected_tokens=protected, swa_used_tokens=total - available - evictable,
                    sliding_window_size=self.sliding_window_size)

    def mem_report(self) -> str:
        info = self.get_swa_token_info()
        return (f"full: {super().mem_report()}; swa: available={info['swa_available_tokens']}, "
                f"evictable={info['swa_evictable_tokens']}, protected={info['swa_protected_tokens']}")

    def swa_forward_locs(self, req_pool_indices: torch.Tensor, prefix_lens: List[int], seq_lens: List[int],
                         out_cache_loc: torch.Tensor) -> Optional[SWAForwardLocs]:
        """The windowed layers' slots of a batch being scheduled (SWAForwardLocs: the overlap loop
        may free or move them in the map before the forward runs; their K/V stays till then)."""
        if not seq_lens:
            return None
        return self.swa_allocator.forward_locs(self.rows_cpu, req_pool_indices, prefix_lens, seq_lens,
                                               self.sliding_window_size, out_cache_loc)

    # ---- rows: the per-row window state starts afresh --------------------------------------------
    def alloc_rows(self, n: int) -> Optional[List[int]]:
        rows = super().alloc_rows(n)
        for r in rows or ():
            self.swa_evicted_seqlen[r] = 0
            self.swa_scheduled_lens[r] = (0, 0)
        return rows

    # ---- the window moves on ------------------------------------------------------------------------
    def advance(self, req: LedgerReq, committed: int) -> None:
        row = req.req_pool_idx
        older, last = self.swa_scheduled_lens.get(row, (0, 0))
        # Forwards scheduled from now on, and the one maybe still running, start at or after
        # `older`: keys before older - W + 1 are read by none of them.
        self._evict_swa(req, older - self.sliding_window_size + 1)
        self.swa_scheduled_lens[row] = (last, committed)
        super().advance(req, committed)

    def _evict_swa(self, req: LedgerReq, end: int) -> None:
        """Free the request's own swa slots of positions before `end` (its tree prefix is the tree's)."""
        row = req.req_pool_idx
        protected = 0 if self.tree_cache.disable else len(req.prefix_indices)
        start = max(self.swa_evicted_seqlen.get(row, 0), protected)
        end = min(end, held_len(req))
        if end > start:
            self.swa_allocator.free_swa(self.row(req)[start:end])
            self.swa_evicted_seqlen[row] = end

    # ---- invariants (SGLang's _check_hybrid_memory) ------------------------------------------------
    def check_idle(self, max_total_num_tokens: int) -> None:
        super().check_idle(max_total_num_tokens)
        self._check_hybrid_memory()

    def _check_hybrid_memory(self) -> None:
        """No request running: every swa slot free or in the tree's live nodes, none locked."""
        info = self.get_swa_token_info()
        if info["swa_available_tokens"] + info["swa_evictable_tokens"] != info["swa_max_total_num_tokens"] \
                or info["swa_protected_tokens"] != 0:
            raise MemoryLeakError(f"SWA KV cache memory leak detected! {self.mem_report()}, "
                                  f"total={info['swa_max_total_num_tokens']}")

    def check_conserved(self, live_reqs: List[CacheReq]) -> None:
        """Both pools: the full one as before; every swa slot free or mapped from exactly one held
        full slot, the tree's nodes all live or all tombstone, each live request's window held."""
        super().check_conserved(live_reqs)
        alloc = self.swa_allocator
        mapping = alloc.full_to_swa_index_mapping
        used = mapping[mapping > 0]
        uniq = torch.unique(used)
        if len(uniq) != len(used):
            raise MemoryLeakError("SWA pool: a swa slot is mapped from two full slots")
        both = alloc.swa.is_free[uniq].nonzero().flatten()[:4].tolist()
        in_use = torch.zeros(alloc.size_swa + 1, dtype=torch.bool)
        in_use[uniq] = True
        lost = ((~in_use & ~alloc.swa.is_free)[1:].nonzero().flatten()[:4] + 1).tolist()
        free_full = (mapping > 0) & alloc.full.is_free
        if both or lost or bool(free_full[1:].any()):
            raise MemoryLeakError(f"SWA pool: swa slots both free and mapped: {both}; neither: {lost}; "
                                  f"free full slots still mapped: {free_full.nonzero().flatten()[:4].tolist()}")
        if hasattr(self.tree_cache, "check_swa_nodes"):
            try:
                self.tree_cache.check_swa_nodes()
            except RuntimeError as e:
                raise MemoryLeakError(str(e)) from None
        window = self.sliding_window_size
        for r in live_reqs:
            n = getattr(r, "kv_committed_len", 0)
            tail = self.row(r)[max(0, n - window + 1) : n]
            if not bool(alloc.has_swa(tail).all()):
                raise MemoryLeakError(f"SWA pool: request {getattr(r, 'rid', r)} lost swa slots inside its window "
                                      f"(KV length {n}, cached prefix {len(r.prefix_indices)}, "
                                      f"held: {alloc.has_swa(tail).int().tolist()})")
