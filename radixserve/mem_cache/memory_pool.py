"""The two lower memory levels of seed 003 (the radix tree, L1, is in radix_cache.py).

    L2  ReqToTokenPool          req_pool_idx, position  ->  KV slot index   (int32 table)
    L3  TokenToKVPoolAllocator  which KV slots are free (in pages of page_size tokens)
        MHATokenToKVPool        KV slot index  ->  K and V vectors of every layer

Slot 0 (page 0 when page_size > 1) is never handed out: it is the padding slot that
padded positions and garbage decode rows point at, so writes to it are harmless.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, List, Optional, Tuple, Union

import torch

from radixserve.layers import cpu_kernels
from radixserve.utils import zero_pages_lazily


def zeros_on_demand(shape: Tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """torch.zeros(shape), except that on the CPU its pages get memory when first touched (utils.
    zero_pages_lazily). A pool sized for its worst case (every request at full context, every KV
    slot used) is then resident only as far as it is used, where torch.zeros writes (and keeps) all
    of it: 256 MB of req_to_token and 224 MB of KV for Qwen2.5-1.5B at -c 8192 before the first
    request. llama.cpp's mmap'd weights count the same way. The storage is torch's own (the memory
    saver resizes it)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.device.type != "cpu" or not zero_pages_lazily(t):
        t.zero_()
    return t


@dataclass
class ForwardFence:
    """The overlap loop's batches launched and done (their results popped, so the device is past
    them). The forward reads req_to_token in place: a row freed while batches are in flight (a
    request that finished while its extra step is queued) may still be read by them, so it goes
    back to the pool only once they are done."""

    launched: int = 0
    done: int = 0

    def in_flight(self) -> bool:
        return self.done < self.launched


class ReqToTokenPool:
    """A [size, max_context_len] int32 table: row r holds the KV slot of each token of the
    request that owns row r. Rows are handed out and returned as whole requests come and go.

    Two copies on a GPU: `req_to_token` on the device (the attention kernels read it) and
    `req_to_token_cpu` on the host (the scheduler reads it without waiting for the device).
    Every write goes through write() / write_spans(), which keep them equal. On the CPU they
    are one tensor."""

    def __init__(self, size: int, max_context_len: int, device: str = "cpu"):
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = zeros_on_demand((size, max_context_len), torch.int32, device)
        self.req_to_token_cpu = self.req_to_token if self.req_to_token.device.type == "cpu" else \
            zeros_on_demand((size, max_context_len), torch.int32)
        self.free_slots: List[int] = list(range(size))
        # The overlap loop (KVLedger.defer_row_frees): rows freed while batches were in flight, with
        # the launch count then; they go back once that many batches are done.
        self.fence: Optional[ForwardFence] = None
        self.deferred: Deque[Tuple[int, List[int]]] = deque()

    def available_size(self) -> int:
        self.collect_deferred()
        return len(self.free_slots)

    def alloc(self, need_size: int = 1) -> Optional[List[int]]:
        self.collect_deferred()
        if need_size > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return out

    def free(self, free_index: Union[int, List[int]]) -> None:
        rows = [free_index] if isinstance(free_index, int) else list(free_index)
        if self.fence is not None and self.fence.in_flight():
            self.deferred.append((self.fence.launched, rows))
        else:
            self._release_rows(rows)

    def deferred_size(self) -> int:
        """Rows no request holds that wait for the batches in flight (free once they are done)."""
        self.collect_deferred()
        return sum(len(rows) for _, rows in self.deferred)

    def collect_deferred(self) -> None:
        """Rows whose in-flight batches are done go back to the pool."""
        while self.deferred and self.deferred[0][0] <= self.fence.done:
            self._release_rows(self.deferred.popleft()[1])

    def _release_rows(self, rows: List[int]) -> None:
        self.free_slots.extend(rows)

    def write(self, indices, values: torch.Tensor) -> None:
        """req_to_token[indices] = values in both copies (indices: what a tensor's [] takes)."""
        values = values.to(torch.int32)
        self.req_to_token_cpu[indices] = values.cpu()
        if self.req_to_token_cpu is not self.req_to_token:
            on_device = tuple(i.to(self.req_to_token.device) if isinstance(i, torch.Tensor) else i for i in indices) \
                if isinstance(indices, tuple) else indices
            self.req_to_token[on_device] = values.to(self.req_to_token.device, non_blocking=True)

    def write_spans(self, rows: List[int], starts: List[int], lens: List[int], values: torch.Tensor) -> None:
        """Row rows[i], positions starts[i] .. starts[i] + lens[i] - 1: the next lens[i] values,
        in order (one write for a whole batch)."""
        if not rows:
            return
        lens_t = torch.tensor(lens, dtype=torch.int64)
        firsts = torch.cumsum(lens_t, 0) - lens_t  # each span's first index into values
        cols = torch.arange(int(lens_t.sum())) + torch.repeat_interleave(torch.tensor(starts, dtype=torch.int64) - firsts, lens_t)
        self.write((torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lens_t), cols), values)

    def clear(self) -> None:
        self.free_slots = list(range(self.size))
        self.deferred.clear()


class TokenToKVPoolAllocator:
    """Free-list allocator over KV slots 1..size, in pages of `page_size` tokens.

    page_size == 1: any slot can be handed out alone.
    page_size  > 1: slots are handed out as whole pages; a request's tokens fill its last
    page before a new one is taken (alloc_extend / alloc_decode), so a page belongs to one
    request or one radix-tree node, never two.
    """

    def __init__(self, size: int, page_size: int = 1, device: str = "cpu"):
        assert size % page_size == 0, "pool size must be a whole number of pages"
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.device = device
        # is_free[p] is True while page p is in the free list; page 0 is the padding page.
        self.is_free = torch.zeros(self.num_pages + 1, dtype=torch.bool)
        self.free_group: List[torch.Tensor] = []
        self.is_not_in_free_group = True
        self.clear()

    # ---- sizes -------------------------------------------------------------------------
    def available_size(self) -> int:
        """Free tokens (a whole number of pages)."""
        return len(self.free_pages) * self.page_size

    # ---- alloc -------------------------------------------------------------------------
    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """`need_size` slots (a multiple of page_size) on whole free pages, or None."""
        assert need_size % self.page_size == 0, "alloc() takes whole pages"
        num_pages = need_size // self.page_size
        if num_pages > len(self.free_pages):
            return None
        pages, self.free_pages = self.free_pages[:num_pages], self.free_pages[num_pages:]
        self.is_free[pages] = False
        return self._pages_to_slots(pages)

    def alloc_extend(
        self, prefix_lens: List[int], seq_lens: List[int], last_locs: List[int]
    ) -> Optional[torch.Tensor]:
        """Slots for tokens prefix_len..seq_len-1 of each request, concatenated.

        `last_locs[i]` is the slot of token prefix_len-1 of request i (-1 when it has none);
        with page_size > 1 the rest of that page is used before new pages are taken."""
        if self.page_size == 1:
            return self.alloc(sum(s - p for p, s in zip(prefix_lens, seq_lens)))
        ps = self.page_size
        new_pages = sum(_ceil_div(s, ps) - _ceil_div(p, ps) for p, s in zip(prefix_lens, seq_lens))
        if new_pages > len(self.free_pages):
            return None
        pages, self.free_pages = self.free_pages[:new_pages], self.free_pages[new_pages:]
        self.is_free[pages] = False
        out: List[torch.Tensor] = []
        cursor = 0
        for p, s, last in zip(prefix_lens, seq_lens, last_locs):
            # Tail of the page that token p-1 sits on (empty when p is page-aligned).
            tail = min(s, _ceil_div(p, ps) * ps) - p
            if tail > 0:
                out.append(torch.arange(last + 1, last + 1 + tail, dtype=torch.int64))
            n = _ceil_div(s, ps) - _ceil_div(p, ps)
            if n > 0:
                slots = self._pages_to_slots(pages[cursor : cursor + n])
                out.append(slots[: s - p - tail])
                cursor += n
        return torch.cat(out) if out else torch.empty(0, dtype=torch.int64)

    def alloc_decode(self, seq_lens: List[int], last_locs: List[int]) -> Optional[torch.Tensor]:
        """One slot per request for token seq_len-1 (seq_lens already include it)."""
        if self.page_size == 1:
            return self.alloc(len(seq_lens))
        return self.alloc_extend([s - 1 for s in seq_lens], seq_lens, last_locs)

    # ---- free --------------------------------------------------------------------------
    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if not self.is_not_in_free_group:
            self.free_group.append(free_index)
            return
        pages = torch.unique(free_index.to(torch.int64) // self.page_size)
        if pages.numel() and (self.is_free[pages].any() or pages.min() < 1):
            bad = pages[self.is_free[pages] | (pages < 1)][:4].tolist()
            raise RuntimeError(f"double free of KV pages {bad} (page_size={self.page_size})")
        self.is_free[pages] = True
        self.free_pages = torch.cat([self.free_pages, pages])

    def free_group_begin(self) -> None:
        """Batch several frees into one (seed 004): collect until free_group_end()."""
        self.is_not_in_free_group = False
        self.free_group = []

    def free_group_end(self) -> None:
        self.is_not_in_free_group = True
        group, self.free_group = self.free_group, []
        if not group:
            return
        # free() dedups the pages of one call (several slots of a page are normal), so a
        # page named by two calls of the group would slip through as one: check it here.
        pages = torch.cat([torch.unique(t.to(torch.int64) // self.page_size) for t in group])
        uniq, counts = torch.unique(pages, return_counts=True)
        if (counts > 1).any():
            bad = uniq[counts > 1][:4].tolist()
            raise RuntimeError(f"double free of KV pages {bad} within a free group (page_size={self.page_size})")
        self.free(torch.cat(group))

    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        self.is_free.zero_()
        self.is_free[1:] = True
        self.free_group = []
        self.is_not_in_free_group = True

    def _pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        if self.page_size == 1:
            return pages.clone()
        offs = torch.arange(self.page_size, dtype=torch.int64)
        return (pages[:, None] * self.page_size + offs[None, :]).reshape(-1)


class MHATokenToKVPool:
    """Per-layer K and V buffers of shape [size + page_size, head_num, head_dim]."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str = "cpu",
    ):
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.layer_num = layer_num
        self.device = device
        shape = (size + page_size, head_num, head_dim)
        self.k_buffer = [zeros_on_demand(shape, dtype, device) for _ in range(layer_num)]
        self.v_buffer = [zeros_on_demand(shape, dtype, device) for _ in range(layer_num)]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        ops = cpu_kernels.kernels_for(k)
        if ops is not None:  # one call instead of two casts and two index_puts per layer
            ops.store_kv(self.k_buffer[layer_id], self.v_buffer[layer_id], loc, k, v)
            return
        self.k_buffer[layer_id][loc] = k.to(self.dtype)
        self.v_buffer[layer_id][loc] = v.to(self.dtype)

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """Copy the KV at src_loc to tgt_loc in every layer (speculative decoding: the accepted
        branch of a token tree moves into the slots of its positions)."""
        for buf in (*self.k_buffer, *self.v_buffer):
            buf[tgt_loc] = buf[src_loc]

    @staticmethod
    def bytes_per_token(head_num: int, head_dim: int, layer_num: int, dtype: torch.dtype) -> int:
        return 2 * head_num * head_dim * layer_num * torch.tensor([], dtype=dtype).element_size()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
