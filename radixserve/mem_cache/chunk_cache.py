"""The prefix cache used with --disable-radix-cache: BasePrefixCache's interface, no sharing.

Every request keeps its own KV slots from admission to finish; chunked prefill still works
because cache_unfinished_req records the slots computed so far in req.prefix_indices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

import torch

from radixserve.mem_cache.base_prefix_cache import BasePrefixCache, CacheReq, MatchResult, kv_committed_len
from radixserve.mem_cache.radix_cache import TreeNode

if TYPE_CHECKING:
    from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator


class ChunkCache(BasePrefixCache):
    disable = True  # nothing is shared: readers skip prefix bookkeeping

    def __init__(self, req_to_token_pool: "ReqToTokenPool", token_to_kv_pool_allocator: "TokenToKVPoolAllocator"):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.device = "cpu"  # slot indices are host tensors (the allocator's), wherever the KV is
        self.reset()

    def reset(self) -> None:
        # A lone root, so that req.last_node is always a TreeNode (locks on it are no-ops).
        self.root_node = TreeNode()
        self.root_node.lock_ref = 1

    def match_prefix(self, key: List[int], extra_key: Optional[str] = None) -> MatchResult:
        return MatchResult(torch.empty((0,), dtype=torch.int64, device=self.device), self.root_node)

    def insert(self, key: List[int], value: Optional[torch.Tensor] = None, chunked: bool = False,
               extra_key: Optional[str] = None) -> int:
        return 0

    def cache_finished_req(self, req: CacheReq, is_insert: bool = True) -> None:
        kv_len = kv_committed_len(req)
        kv_indices = self.req_to_token_pool.req_to_token_cpu[req.req_pool_idx, :kv_len].to(torch.int64)
        self.token_to_kv_pool_allocator.free(kv_indices)
        self.req_to_token_pool.free(req.req_pool_idx)

    def cache_unfinished_req(self, req: CacheReq, chunked: bool = False) -> None:
        row = req.req_pool_idx
        req.prefix_indices = self.req_to_token_pool.req_to_token_cpu[row, : len(req.fill_ids)].to(torch.int64)

    def evict(self, num_tokens: int) -> int:
        return 0

    def evict_extra_key(self, extra_key: str) -> int:
        return 0

    def inc_lock_ref(self, node: TreeNode) -> int:
        return 0

    def dec_lock_ref(self, node: TreeNode) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def all_values_flatten(self) -> torch.Tensor:
        return torch.empty((0,), dtype=torch.int64, device=self.device)

    def pretty_print(self) -> str:
        text = "ChunkCache (no prefix sharing)\n#tokens: 0"
        print(text)
        return text
