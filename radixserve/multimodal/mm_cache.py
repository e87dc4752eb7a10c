"""MultimodalEmbeddingCache (SGLang's MultiModalCache): the encoder's output per image hash,
bounded in bytes, least recently used out first. A second request (a second turn, or the next
chunk of a chunked prefill) about the same image takes its embedding from here instead of
running the vision encoder again. It lives beside the model in the scheduler's process."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch

DEFAULT_MM_CACHE_BYTES = 512 * 1024 * 1024


@dataclass
class MMCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class MultimodalEmbeddingCache:
    def __init__(self, max_bytes: int = DEFAULT_MM_CACHE_BYTES):
        assert max_bytes >= 0
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self.stats = MMCacheStats()
        self._entries: "OrderedDict[int, torch.Tensor]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def get(self, key: int) -> Optional[torch.Tensor]:
        emb = self._entries.get(key)
        if emb is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return emb

    def peek(self, key: int) -> Optional[torch.Tensor]:
        """The entry under key, not counted as a use (neither a hit nor more recent)."""
        return self._entries.get(key)

    def put(self, key: int, emb: torch.Tensor) -> None:
        """Keep emb under key; evicts the least recently used to fit. One larger than the whole
        cache is not kept (its request uses it; the next one recomputes it)."""
        size = emb.numel() * emb.element_size()
        if key in self._entries:
            self.used_bytes -= self._nbytes(self._entries.pop(key))
        if size > self.max_bytes:
            return
        while self.used_bytes + size > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.used_bytes -= self._nbytes(old)
            self.stats.evictions += 1
        self._entries[key] = emb
        self.used_bytes += size

    def clear(self) -> None:
        self._entries.clear()
        self.used_bytes = 0

    @staticmethod
    def _nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()
