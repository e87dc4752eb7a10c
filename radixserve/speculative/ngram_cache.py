"""NgramCache: the n-grams seen in prompts and outputs of all requests, and what followed them.

SGLang's NGRAM cache is a trie of token sequences walked breadth first into a token tree. A plain
table serves both a chain (`draft`) and SGLang's tree (`draft_tree`, --speculative-ngram-max-bfs-breadth > 1):

    (t_1, ..., t_w)  ->  {next token: count}      for every window w in [min_window, max_window]

Drafting takes the longest suffix of the request's tokens that is in the table, appends its most
frequent continuation (the latest one on a tie), and repeats. The table holds at most `capacity`
n-grams (the least recently updated go first) and each n-gram at most MAX_CONTINUATIONS tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Sequence, Tuple

# Continuations kept per n-gram (the rarest goes when a new one arrives): drafting reads the top one.
MAX_CONTINUATIONS = 8


class NgramCache:
    def __init__(self, min_window: int, max_window: int, capacity: int):
        assert 1 <= min_window <= max_window, (min_window, max_window)
        assert capacity >= 1, capacity
        self.min_window, self.max_window, self.capacity = min_window, max_window, capacity
        self._table: "OrderedDict[Tuple[int, ...], Dict[int, int]]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def reset(self) -> None:
        self._table.clear()

    def insert(self, tokens: Sequence[int], start: int = 0) -> None:
        """Record the continuation tokens[p] of each window ending at p - 1, for p >= start
        (a request's tokens are inserted once: `start` is how many were inserted before)."""
        table = self._table
        for p in range(max(start, self.min_window), len(tokens)):
            nxt = tokens[p]
            for w in range(self.min_window, min(self.max_window, p) + 1):
                key = tuple(tokens[p - w : p])
                counts = table.get(key)
                if counts is None:
                    counts = table[key] = {}
                else:
                    table.move_to_end(key)
                _count(counts, nxt)
        while len(table) > self.capacity:
            table.popitem(last=False)

    def lookup(self, context: Sequence[int]) -> Dict[int, int]:
        """The continuations of the longest suffix of `context` in the table ({} if none)."""
        for w in range(min(self.max_window, len(context)), self.min_window - 1, -1):
            counts = self._table.get(tuple(context[len(context) - w :]))
            if counts:
                return counts
        return {}

    def draft(self, context: Sequence[int], num_tokens: int) -> List[int]:
        """Up to `num_tokens` tokens likely to follow `context` (fewer where no n-gram matches)."""
        ctx = list(context[-self.max_window :])
        out: List[int] = []
        while len(out) < num_tokens:
            counts = self.lookup(ctx)
            if not counts:
                break
            best = max(counts.values())
            nxt = [t for t, c in counts.items() if c == best][-1]  # dict order = recency: the latest
            out.append(nxt)
            ctx = ctx[1:] + [nxt] if len(ctx) >= self.max_window else ctx + [nxt]
        return out


    def draft_tree(self, context: Sequence[int], num_tokens: int, breadth: int) -> Tuple[List[int], List[int]]:
        """Up to `num_tokens` drafts as a tree (SGLang's BFS over the n-grams): from the context,
        each node's `breadth` most frequent continuations become its children, level by level.
        Returns (tokens, parents) in the layout of speculative/tree.py (parent 0: the context's
        last token; parents[0] = -1 stands for it)."""
        tokens: List[int] = []
        parents = [-1]
        queue = [(list(context[-self.max_window :]), 0)]
        while queue and len(tokens) < num_tokens:
            ctx, node = queue.pop(0)
            counts = self.lookup(ctx)
            # most frequent first; on a tie the latest (dict order is recency)
            ranked = sorted(reversed(list(counts)), key=lambda t: -counts[t])[:breadth]
            for tok in ranked[: num_tokens - len(tokens)]:
                tokens.append(tok)
                parents.append(node)
                child = ctx[1:] + [tok] if len(ctx) >= self.max_window else ctx + [tok]
                queue.append((child, len(tokens)))
        return tokens, parents


def _count(counts: Dict[int, int], token: int) -> None:
    """counts[token] += 1, moved to the end (the most recent); at most MAX_CONTINUATIONS kept."""
    n = counts.pop(token, 0) + 1
    if n == 1 and len(counts) >= MAX_CONTINUATIONS:
        rarest = min(counts, key=counts.__getitem__)  # the oldest of the rarest (dict order)
        del counts[rarest]
    counts[token] = n
