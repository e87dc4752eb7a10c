"""The storage backends by their --hicache-storage-backend name (SGLang's StorageBackendFactory)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from radixserve.mem_cache.storage.base import HiCacheStorage
from radixserve.mem_cache.storage.file import HiCacheFile
from radixserve.mem_cache.storage.mooncake import MooncakeStore  # imports Mooncake's client only when built

STORAGE_BACKENDS = ("file", "mooncake")


def create_storage_backend(
    name: str, extra_config: Optional[Dict[str, Any]], page_shape: Tuple[int, ...], dtype: torch.dtype,
    namespace: str,
) -> HiCacheStorage:
    """--hicache-storage-backend NAME with --hicache-storage-backend-extra-config (a dict)."""
    extra_config = dict(extra_config or {})
    if name == "file":
        return HiCacheFile(page_shape, dtype, namespace, extra_config.get("path"))
    if name == "mooncake":
        return MooncakeStore(page_shape, dtype, namespace, extra_config)
    raise ValueError(f"--hicache-storage-backend must be one of {', '.join(STORAGE_BACKENDS)}; got {name!r}")
