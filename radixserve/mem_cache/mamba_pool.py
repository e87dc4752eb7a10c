"""The state pool of hybrid models (SGLang's MambaPool and HybridReqToTokenPool).

A linear-attention layer (Qwen3-Next's GatedDeltaNet) keeps no per-token KV: each request
carries a fixed-size state per such layer instead, the last conv_kernel - 1 inputs of its causal
conv1d (the conv state) and the recurrent delta-rule matrix (the temporal state):

    MambaPool.conv_state[l]      [size + 1, conv_kernel - 1, conv_dim]          activation dtype
    MambaPool.temporal_state[l]  [size + 1, num_heads, head_k_dim, head_v_dim]  float32

Slot 0 is padding (never handed out): a row that holds no slot maps to it, so a forward that
still reads a freed row writes there harmlessly. The pool's slots are reached only through
HybridReqToTokenPool: a request's row and its state slot are allocated together at admission and
freed together (finish, abort, retraction), so every path that already returns a row returns
its slot, and there is no second place to forget.

The hybrid radix cache (mamba_radix_cache.py) takes the other slots for its prefix snapshots:
the model runner sizes the pool at twice the rows, and every slot is free, a row's, or one
snapshot's (check_state_slots).

A slot's contents are not cleared at allocation: the layer starts from zeros wherever the
request has no prefix computed yet (extend_prefix_len == 0), or from the snapshot restored into it
(a prefix hit). Clearing here would race with a forward still in flight in the overlap loop that
writes the slot's previous owner's state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from radixserve.mem_cache.memory_pool import ReqToTokenPool


@dataclass(frozen=True)
class MambaStateShape:
    """What one request's state holds in each linear-attention layer."""

    num_layers: int  # linear-attention layers (the full-attention ones keep paged KV instead)
    conv_dim: int  # channels of the causal conv1d (q, k and v together)
    conv_kernel: int  # the conv keeps the last conv_kernel - 1 inputs
    num_heads: int  # value heads of the delta rule
    head_k_dim: int
    head_v_dim: int

    def __post_init__(self) -> None:
        assert self.num_layers > 0 and self.conv_kernel >= 2, self

    def bytes_per_slot(self, conv_dtype: torch.dtype) -> int:
        conv = (self.conv_kernel - 1) * self.conv_dim * _element_size(conv_dtype)
        temporal = self.num_heads * self.head_k_dim * self.head_v_dim * _element_size(torch.float32)
        return self.num_layers * (conv + temporal)


class MambaPool:
    """`size` state slots (1..size), each a conv and a temporal state for every linear layer."""

    def __init__(self, size: int, shape: MambaStateShape, conv_dtype: torch.dtype, device: str = "cpu"):
        self.size, self.shape, self.device = size, shape, device
        self.conv_dtype = conv_dtype
        n = size + 1  # + the padding slot 0
        self.conv_state = torch.zeros((shape.num_layers, n, shape.conv_kernel - 1, shape.conv_dim),
                                      dtype=conv_dtype, device=device)
        self.temporal_state = torch.zeros((shape.num_layers, n, shape.num_heads, shape.head_k_dim, shape.head_v_dim),
                                          dtype=torch.float32, device=device)
        self.clear()

    @staticmethod
    def bytes_for(size: int, shape: MambaStateShape, conv_dtype: torch.dtype) -> int:
        """What a pool of `size` slots takes (the padding slot included): mem_bytes() before it exists."""
        return (size + 1) * shape.bytes_per_slot(conv_dtype)

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int) -> Optional[List[int]]:
        if need_size > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        self.is_free[out] = False
        return out

    def free(self, slots: List[int]) -> None:
        if not slots:
            return
        idx = torch.tensor(slots, dtype=torch.int64)
        if (idx < 1).any() or self.is_free[idx].any() or len(set(slots)) != len(slots):
            raise RuntimeError(f"double free of state slots {slots[:4]}")
        self.is_free[idx] = True
        self.free_slots.extend(slots)

    def clear(self) -> None:
        self.free_slots: List[int] = list(range(1, self.size + 1))
        self.is_free = torch.ones(self.size + 1, dtype=torch.bool)
        self.is_free[0] = False  # padding

    def copy_slots(self, src: List[int], dst: List[int]) -> None:
        """Every linear layer's conv and temporal state of slots src into slots dst (a prefix's
        snapshot taken into the radix cache, or restored into a request's own slot)."""
        s = torch.tensor(src, dtype=torch.int64, device=self.device)
        d = torch.tensor(dst, dtype=torch.int64, device=self.device)
        self.conv_state[:, d] = self.conv_state[:, s]
        self.temporal_state[:, d] = self.temporal_state[:, s]

    def layer_state(self, layer_id: int):
        """(conv_state, temporal_state) of linear layer layer_id, all slots: index by slot."""
        return self.conv_state[layer_id], self.temporal_state[layer_id]

    def mem_bytes(self) -> int:
        return self.conv_state.numel() * self.conv_state.element_size() + \
            self.temporal_state.numel() * self.temporal_state.element_size()


class HybridReqToTokenPool(ReqToTokenPool):
    """A ReqToTokenPool whose rows each hold a MambaPool slot too (SGLang's name): alloc and free
    of a row take and return its state slot; `mamba_indices(rows)` maps rows to slots for a forward."""

    def __init__(self, size: int, max_context_len: int, mamba_pool: MambaPool, device: str = "cpu"):
        super().__init__(size, max_context_len, device)
        assert mamba_pool.size >= size, "every row needs a state slot"
        self.mamba_pool = mamba_pool
        # row -> its state slot (0, the padding slot, while the row is free); on the device, where
        # the forward reads it.
        self.req_index_to_mamba_index = torch.zeros(size, dtype=torch.int64, device=device)
        self.mamba_index_cpu: List[int] = [0] * size

    def alloc(self, need_size: int = 1) -> Optional[List[int]]:
        self.collect_deferred()
        if need_size > min(len(self.free_slots), self.mamba_pool.available_size()):
            return None
        rows = super().alloc(need_size)
        slots = self.mamba_pool.alloc(need_size)
        assert rows is not None and slots is not None
        self._map(rows, slots)
        return rows

    def _release_rows(self, rows: List[int]) -> None:
        """The rows and their state slots go back (a deferred free too: the extra step of the
        overlap loop wrote the slot, and nobody else may until it ran)."""
        slots = [self.mamba_index_cpu[r] for r in rows]
        if any(s == 0 for s in slots):
            raise RuntimeError(f"free of request rows {rows[:4]} that hold no state slot (double free?)")
        self.mamba_pool.free(slots)
        self._map(rows, [0] * len(rows))
        super()._release_rows(rows)

    def clear(self) -> None:
        super().clear()
        self.mamba_pool.clear()
        self.mamba_index_cpu = [0] * self.size
        self.req_index_to_mamba_index.zero_()

    def mamba_indices(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        """The state slot of each row of a batch (int64, on the pool's device)."""
        return self.req_index_to_mamba_index[req_pool_indices]

    def check_state_slots(self, live_rows: List[int], cached_slots: Sequence[int] = ()) -> None:
        """Raise RuntimeError unless rows and state slots pair one to one: every held row holds
        its own slot (live_rows among them), and every slot is free, held by exactly one row, or
        holds one of the radix cache's prefix snapshots (cached_slots)."""
        free_rows = set(self.free_slots)
        held = {r: s for r, s in enumerate(self.mamba_index_cpu) if s != 0}
        problems = []
        if set(held) != set(range(self.size)) - free_rows:
            problems.append(f"rows without a slot: {sorted(set(range(self.size)) - free_rows - set(held))[:4]}, "
                            f"free rows with one: {sorted(set(held) & free_rows)[:4]}")
        owned = list(held.values()) + list(cached_slots)
        if len(set(owned)) != len(owned) or any(self.mamba_pool.is_free[s] for s in owned):
            problems.append("a state slot held twice (by rows or snapshots), or held and free")
        if len(owned) + self.mamba_pool.available_size() != self.mamba_pool.size:
            problems.append(f"{len(held)} held by rows + {len(cached_slots)} snapshots + "
                            f"{self.mamba_pool.available_size()} free != {self.mamba_pool.size} slots")
        if any(self.mamba_index_cpu[r] == 0 for r in live_rows):
            problems.append("a running request's row holds no state slot")
        if problems:
            raise RuntimeError("state slots not conserved: " + "; ".join(problems))

    def _map(self, rows: List[int], slots: List[int]) -> None:
        for r, s in zip(rows, slots):
            self.mamba_index_cpu[r] = s
        self.req_index_to_mamba_index[torch.tensor(rows, dtype=torch.int64, device=self.device)] = \
            torch.tensor(slots, dtype=torch.int64, device=self.device)


def _element_size(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()
