"""The storage tier of HiCache (L3, below the device pool and the host pool): one interface over
key -> page-of-KV stores that outlive a server and can be shared between servers.

    page_hash_chain(token ids)   h0 = sha256(extra_key, page 0)   h1 = sha256(h0, page 1)   ...
                                 (SGLang's get_hash_str: equal prefixes give equal leading keys)
    store key                    f"{namespace}-{h}", namespace = model, KV dtype, TP rank and size
                                 (two models, or two ranks of one model, never read each other)
    page                         one page of KV as one tensor [2, layer_num, page_size, head_num,
                                 head_dim] (K then V): stored as its raw bytes

A backend never raises into its caller once built: a failure logs a line and reads as a miss
(`get` -> None, `exists` stops counting) or drops the write (`set` -> False).
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from abc import ABC, abstractmethod
from typing import Any, List, Optional, Sequence, Tuple

import torch

logger = logging.getLogger(__name__)

def page_hash_chain(
    token_ids: Sequence[int], page_size: int, extra_key: Optional[str] = None, prior_hash: Optional[str] = None,
) -> List[str]:
    """One sha256 hex per full page of token_ids, each chained on the one before (the first on
    prior_hash: the hash of the page just before token_ids). extra_key (a LoRA adapter's name)
    enters the first hash of a chain, so the same tokens under another adapter never match."""
    hashes: List[str] = []
    prev = prior_hash
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        h = hashlib.sha256()
        if prev is not None:
            h.update(bytes.fromhex(prev))
        elif extra_key is not None:
            h.update(extra_key.encode("utf-8") + b"\0")
        for t in token_ids[start:start + page_size]:
            h.update(int(t).to_bytes(4, "little", signed=False))
        prev = h.hexdigest()
        hashes.append(prev)
    return hashes


def storage_namespace(model_id: str, dtype: torch.dtype, tp_rank: int, tp_size: int) -> str:
    """What every key of this server's pages starts with: a file-name-safe model id, the KV dtype
    (same-size dtypes would read as garbage) and the TP rank (each rank holds other heads)."""
    model = re.sub(r"[^A-Za-z0-9._]+", "-", model_id).strip("-") or "model"
    if len(model) > 96:  # file names stay short: the tail of the path and a digest of all of it
        model = f"{model[-64:].lstrip('-')}-{hashlib.sha256(model_id.encode()).hexdigest()[:12]}"
    return f"{model}-{str(dtype).removeprefix('torch.')}-tp{tp_rank}of{tp_size}"


class HiCacheStorage(ABC):
    """Pages of one shape and dtype under one namespace. `keys` are page hashes; the backend adds
    the namespace. Thread-safe enough for one reader thread and one writer thread."""

    def __init__(self, page_shape: Tuple[int, ...], dtype: torch.dtype, namespace: str):
        self.page_shape = tuple(page_shape)
        self.dtype = dtype
        self.namespace = namespace
        self.page_nbytes = math.prod(self.page_shape) * torch.empty((), dtype=dtype).element_size()

    def store_key(self, key: str) -> str:
        return f"{self.namespace}-{key}"

    @abstractmethod
    def exists(self, keys: List[str]) -> int:
        """How many leading keys are present (it stops at the first missing one)."""

    @abstractmethod
    def get(self, keys: List[str]) -> List[Optional[torch.Tensor]]:
        """The page of each key (page_shape, dtype), None where it is missing or unreadable."""

    @abstractmethod
    def set(self, keys: List[str], pages: List[torch.Tensor]) -> bool:
        """Store each page under its key (a key already present is kept); True if all were stored."""

    @abstractmethod
    def clear(self) -> bool:
        """Remove every page of this namespace; True on success."""

    def close(self) -> None:
        """Release connections (a no-op for most backends)."""

    # -- raw bytes <-> pages
    def to_bytes(self, page: torch.Tensor) -> bytes:
        if tuple(page.shape) != self.page_shape or page.dtype != self.dtype:
            raise ValueError(f"a page is {self.page_shape} {self.dtype}, got {tuple(page.shape)} {page.dtype}")
        return page.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()

    def from_bytes(self, data: Any) -> Optional[torch.Tensor]:
        """The page in data, or None when its size is not a page's (a torn or foreign value)."""
        if data is None or len(data) != self.page_nbytes:
            return None
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.dtype).view(self.page_shape)
