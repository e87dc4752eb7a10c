"""The token trees of a speculative verify forward (TARGET_VERIFY), as the attention backends read them.

Request i feeds n_i tokens laid out back to back: token 0 is its last committed token (position
L_i = its prefix length), the others are drafts, each with a parent among the tokens before it
(parents[i][j] < j; -1 for token 0). A chain is parents = [-1, 0, 1, ...]; a tree branches.

Token j sits at position L_i + depth(j) and attends to the request's prefix and to its root-to-j
path (itself included): the tree attention mask. The backends take it in one of two forms:

`kv_rows(...)`: every verify token becomes a decode row whose KV slots are listed in a table
(its prefix slots, then the slots of its path): the mask as each row's list of slots, the form
the paged decode kernels (C++ and Triton) already read through req_to_token, and the torch path
gathers. A row serves every token on one root-to-leaf path (a token's row is a leaf's, read to
the token's own length), so a chain needs one row. `ancestor_mask(i)` is the same mask as a matrix.

TokenPaths is the other form the backends take: single tokens (a draft model's step through its
own token tree), each with the slots of its ancestors (written by earlier forwards) and its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch


@dataclass
class SpecTree:
    parents: List[List[int]]  # per request, each verify token's parent (-1: token 0)

    def __post_init__(self) -> None:
        for par in self.parents:
            assert par and par[0] == -1 and all(0 <= p < j for j, p in enumerate(par) if j), par

    @classmethod
    def chains(cls, lens: List[int]) -> "SpecTree":
        return cls([[j - 1 for j in range(n)] for n in lens])

    @property
    def lens(self) -> List[int]:
        return [len(p) for p in self.parents]

    def depths(self, i: int) -> List[int]:
        depth: List[int] = []
        for j, p in enumerate(self.parents[i]):
            depth.append(0 if p < 0 else depth[p] + 1)
        return depth

    def path(self, i: int, j: int) -> List[int]:
        """Token indices from token 0 to token j of request i."""
        out, par = [], self.parents[i]
        while j >= 0:
            out.append(j)
            j = par[j]
        return out[::-1]

    def positions(self, prefix_lens: List[int]) -> torch.Tensor:
        return torch.tensor([p + d for i, p in enumerate(prefix_lens) for d in self.depths(i)], dtype=torch.int64)

    def ancestor_mask(self, i: int) -> torch.Tensor:
        """[n, n] bool: token j attends to token a (a on j's path)."""
        n = len(self.parents[i])
        mask = torch.zeros((n, n), dtype=torch.bool)
        for j in range(n):
            mask[j, self.path(i, j)] = True
        return mask

    def _row_owners(self, i: int) -> List[int]:
        """For each token, a leaf below it (itself if a leaf): the path row it is read from."""
        par = self.parents[i]
        owner = [-1] * len(par)
        for j in range(len(par) - 1, -1, -1):  # children come after their parents
            if owner[j] < 0:
                owner[j] = j
            if par[j] >= 0 and owner[par[j]] < 0:
                owner[par[j]] = owner[j]
        return owner

    def kv_rows(self, req_to_token: torch.Tensor, req_pool_indices: List[int], prefix_lens: List[int],
                out_cache_loc: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(table [rows, max_len] int32, row of each token [num_tokens] int64, length of each
        token [num_tokens] int64): token j of request i reads table[row, :length] = its prefix
        slots then its path's slots. out_cache_loc: the verify tokens' slots, in layout order."""
        loc = out_cache_loc.to(torch.int32).cpu()
        leaves, row_of, len_of, start = [], [], [], 0
        for i, par in enumerate(self.parents):
            owner, depth = self._row_owners(i), self.depths(i)
            row_index = {}
            for j in range(len(par)):
                leaf = owner[j]
                if leaf not in row_index:
                    row_index[leaf] = len(leaves)
                    leaves.append((i, start, leaf))
                row_of.append(row_index[leaf])
                len_of.append(prefix_lens[i] + depth[j] + 1)
            start += len(par)
        max_len = max(len_of)
        table = torch.zeros((len(leaves), max_len), dtype=torch.int32)
        for r, (i, s, leaf) in enumerate(leaves):
            p = prefix_lens[i]
            table[r, :p] = req_to_token[req_pool_indices[i], :p].cpu()
            path = torch.tensor(self.path(i, leaf), dtype=torch.int64) + s
            table[r, p : p + len(path)] = loc[path]
        return table, torch.tensor(row_of, dtype=torch.int64), torch.tensor(len_of, dtype=torch.int64)


@dataclass
class TokenPaths:
    """A forward of single tokens (each its own row of the batch: extend length 1, prefix length
    P_i = L_i + len(paths[i]) - 1) where token i attends to the first L_i slots of its
    req_to_token row, then to paths[i]: its ancestors' slots, its own (out_cache_loc) last."""

    paths: List[List[int]]

    @property
    def lens(self) -> List[int]:
        return [1] * len(self.paths)

    def positions(self, prefix_lens: List[int]) -> torch.Tensor:
        return torch.tensor(prefix_lens, dtype=torch.int64)

    def kv_rows(self, req_to_token: torch.Tensor, req_pool_indices: List[int], prefix_lens: List[int],
                out_cache_loc: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lens = [p + 1 for p in prefix_lens]
        table = torch.zeros((len(self.paths), max(lens)), dtype=torch.int32)
        for i, path in enumerate(self.paths):
            own = prefix_lens[i] + 1 - len(path)  # L_i
            table[i, :own] = req_to_token[req_pool_indices[i], :own].cpu()
            table[i, own : lens[i]] = torch.tensor(path, dtype=torch.int32)
        n = len(self.paths)
        return table, torch.arange(n, dtype=torch.int64), torch.tensor(lens, dtype=torch.int64)
