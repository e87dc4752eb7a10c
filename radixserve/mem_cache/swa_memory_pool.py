"""The SWA memory pool (seed 001; SGLang's SWATokenToKVPoolAllocator and SWAKVPool): a model
whose windowed layers attend to the last W keys only keeps their KV in a pool of its own, and
only for the tokens still inside some request's window (or cached in the radix tree).

    full slot  (req_to_token, the radix tree)   ->  full layers' K/V (every token of every request)
        |  full_to_swa_index_mapping[full slot]
        v
    swa slot   (0: none held, the padding slot) ->  windowed layers' K/V (the window's tokens only)

Every token gets a full slot and a swa slot when it is allocated; the swa slot of a token that
left the window of its request goes back early (`free_swa`, the ledger's SWA part), while its
full slot stays. `free` of a full slot also frees its swa slot where it still has one. Page size
1 only (the server refuses the SWA pool with --page-size > 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from radixserve.mem_cache.memory_pool import MHATokenToKVPool, TokenToKVPoolAllocator


@dataclass
class SWAForwardLocs:
    """A forward's windowed-layer slots, translated from full slots when its batch is scheduled.

    In the overlap loop the scheduler frees, hands on or moves swa slots (a stash, an eviction, a
    retraction) while the forward scheduled before runs; the K/V *in* a swa slot stays until a
    later forward writes it (forwards run in order), so slots read at schedule time are right
    where a translation at forward time could read a mapping changed under it.

        table[i, :lens[i]]  swa slots of request i's keys first_i .. seq_len_i - 1, the keys its
                            queries see (first_i = max(0, prefix_len_i - W + 1)); unread past lens[i]
        out_cache_loc       swa slots of the forward's new tokens
    """

    out_cache_loc: torch.Tensor  # [num_tokens] int64
    table: torch.Tensor  # [bs, width] int32
    lens: torch.Tensor  # [bs] int64

    def to(self, device) -> "SWAForwardLocs":
        """On the forward's device (lens stays on the host: the kernels take it from there)."""
        return SWAForwardLocs(self.out_cache_loc.to(device, non_blocking=True), self.table.to(device, non_blocking=True),
                              self.lens)


class SWATokenToKVPoolAllocator:
    """Two free lists, one per pool, and the map from a full slot to its swa slot. It stands where
    the TokenToKVPoolAllocator stands: its slot indices, sizes and `is_free` are the full pool's."""

    def __init__(self, size: int, size_swa: int, device: str = "cpu"):
        self.full = TokenToKVPoolAllocator(size, 1, device)
        self.swa = TokenToKVPoolAllocator(size_swa, 1, device)
        self.size, self.size_swa, self.page_size, self.device = size, size_swa, 1, device
        # Host copy (the scheduler reads and writes it); full slot 0 maps to swa slot 0 (padding).
        self.full_to_swa_index_mapping = torch.zeros(size + 1, dtype=torch.int64)

    # The full pool's view, for the code that treats this as the one allocator.
    @property
    def num_pages(self) -> int:
        return self.full.num_pages

    @property
    def is_free(self) -> torch.Tensor:
        return self.full.is_free

    def available_size(self) -> int:
        return self.full.available_size()

    def swa_available_size(self) -> int:
        return self.swa.available_size()

    # ---- alloc -------------------------------------------------------------------------------
    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        if need_size > self.full.available_size() or need_size > self.swa.available_size():
            return None
        out, swa = self.full.alloc(need_size), self.swa.alloc(need_size)
        self.full_to_swa_index_mapping[out] = swa
        return out

    def alloc_extend(self, prefix_lens: List[int], seq_lens: List[int], last_locs: List[int]) -> Optional[torch.Tensor]:
        return self.alloc(sum(s - p for p, s in zip(prefix_lens, seq_lens)))

    def alloc_decode(self, seq_lens: List[int], last_locs: List[int]) -> Optional[torch.Tensor]:
        return self.alloc(len(seq_lens))

    # ---- free --------------------------------------------------------------------------------
    def free(self, free_index: torch.Tensor) -> None:
        """Full slots, and the swa slots they still hold."""
        if free_index.numel() == 0:
            return
        free_index = free_index.to(torch.int64)
        self.free_swa(free_index)
        self.full.free(free_index)

    def free_swa(self, free_index: torch.Tensor) -> None:
        """Only the swa slots of these full slots (those that hold one): their tokens left every
        window; the full slots stay where they are."""
        free_index = free_index.to(torch.int64)
        swa = self.full_to_swa_index_mapping[free_index]
        held = swa > 0
        if bool(held.any()):
            self.swa.free(swa[held])
            self.full_to_swa_index_mapping[free_index[held]] = 0

    def has_swa(self, full_index: torch.Tensor) -> torch.Tensor:
        """Per full slot: does it still hold a swa slot (bool)."""
        return self.full_to_swa_index_mapping[full_index.to(torch.int64)] > 0

    def translate_loc(self, full_index: torch.Tensor) -> torch.Tensor:
        """The swa slots of these full slots (0, the padding slot, where none is held)."""
        swa = self.full_to_swa_index_mapping[full_index.to(torch.int64).cpu()]
        return swa.to(device=full_index.device, dtype=full_index.dtype)

    def forward_locs(self, req_to_token: torch.Tensor, rows: torch.Tensor, prefix_lens: List[int],
                     seq_lens: List[int], window: int, out_cache_loc: torch.Tensor) -> SWAForwardLocs:
        """A batch's windowed-layer slots now (SWAForwardLocs); req_to_token is the host copy."""
        first = (torch.tensor(prefix_lens, dtype=torch.int64) - window + 1).clamp(min=0)
        lens = torch.tensor(seq_lens, dtype=torch.int64) - first
        ar = torch.arange(int(lens.max()) if len(lens) else 0)
        cols = (first[:, None] + ar).clamp(max=req_to_token.shape[1] - 1)
        # (past lens[i] a row holds other slots of the request: the kernels read lens[i] of it)
        flat = (rows.cpu().long()[:, None] * req_to_token.shape[1] + cols).view(-1)
        full = req_to_token.view(-1).index_select(0, flat).long()  # (index_select: ~3x advanced indexing)
        mapping = self.full_to_swa_index_mapping
        table = mapping.index_select(0, full).view(cols.shape).to(torch.int32)  # what the decode kernels take as req_to_token
        out = mapping.index_select(0, out_cache_loc.cpu().long())
        return SWAForwardLocs(out, table, lens)

    def free_group_begin(self) -> None:
        self.full.free_group_begin()
        self.swa.free_group_begin()

    def free_group_end(self) -> None:
        self.full.free_group_end()
        self.swa.free_group_end()

    def clear(self) -> None:
        self.full.clear()
        self.swa.clear()
        self.full_to_swa_index_mapping.zero_()


class SWAKVPool:
    """K/V buffers of a model with windowed and full layers: the full layers' indexed by full
    slots, the windowed layers' by swa slots (a smaller buffer). Callers pass full slots; a
    windowed layer's are translated here (set_kv_buffer) or by the attention backend
    (`translate_loc`, for the index tables it reads through)."""

    def __init__(self, size: int, size_swa: int, dtype: torch.dtype, head_num: int, head_dim: int,
                 window_layers: List[bool], allocator: SWATokenToKVPoolAllocator, device: str = "cpu"):
        self.size, self.size_swa, self.page_size = size, size_swa, 1
        self.dtype, self.head_num, self.head_dim, self.device = dtype, head_num, head_dim, device
        self.window_layers = list(window_layers)
        self.layer_num = len(window_layers)
        self.allocator = allocator
        n_swa = sum(self.window_layers)
        self.full_kv_pool = MHATokenToKVPool(size, 1, dtype, head_num, head_dim, self.layer_num - n_swa, device)
        self.swa_kv_pool = MHATokenToKVPool(size_swa, 1, dtype, head_num, head_dim, n_swa, device)
        # layer_id -> (its pool, its index in that pool)
        self.layers_mapping = []
        counts = [0, 0]
        for windowed in self.window_layers:
            self.layers_mapping.append((self.swa_kv_pool if windowed else self.full_kv_pool, counts[windowed]))
            counts[windowed] += 1

    # Every K and V buffer of both pools (the memory saver frees and restores them in place).
    @property
    def k_buffer(self) -> List[torch.Tensor]:
        return self.full_kv_pool.k_buffer + self.swa_kv_pool.k_buffer

    @property
    def v_buffer(self) -> List[torch.Tensor]:
        return self.full_kv_pool.v_buffer + self.swa_kv_pool.v_buffer

    def is_swa_layer(self, layer_id: int) -> bool:
        return self.window_layers[layer_id]

    def translate_loc(self, full_index: torch.Tensor) -> torch.Tensor:
        return self.allocator.translate_loc(full_index)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        pool, i = self.layers_mapping[layer_id]
        return pool.get_key_buffer(i)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        pool, i = self.layers_mapping[layer_id]
        return pool.get_value_buffer(i)

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      loc_swa: Optional[torch.Tensor] = None) -> None:
        """loc: full slots; a windowed layer writes at loc_swa (translated when the batch was
        scheduled: SWAForwardLocs), or at loc's swa slots now where none is given."""
        pool, i = self.layers_mapping[layer_id]
        if pool is self.swa_kv_pool:
            loc = self.translate_loc(loc) if loc_swa is None else loc_swa
        pool.set_kv_buffer(i, loc, k, v)

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        self.full_kv_pool.move_kv_cache(tgt_loc, src_loc)
        self.swa_kv_pool.move_kv_cache(self.translate_loc(tgt_loc), self.translate_loc(src_loc))

    def mem_bytes(self) -> int:
        """Bytes of every K/V buffer (both pools)."""
        return sum(b.numel() * b.element_size() for b in (*self.k_buffer, *self.v_buffer))

    @staticmethod
    def sizes_for_budget(budget_bytes: float, bytes_per_layer_token: int, n_full: int, n_swa: int,
                         swa_full_tokens_ratio: float) -> "tuple[int, int]":
        """(full slots, swa slots) that fill budget_bytes with size_swa = ratio x size_full."""
        per_full_token = bytes_per_layer_token * (n_full + n_swa * swa_full_tokens_ratio)
        size = int(budget_bytes // max(per_full_token, 1))
        return size, int(size * swa_full_tokens_ratio)
