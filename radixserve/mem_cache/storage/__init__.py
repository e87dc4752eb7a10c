"""HiCache's storage tier (L3): backends behind one interface (base.py; file.py, mooncake.py, by
name in backend_factory.py), the threads that move pages to and from them (controller.py), and
the tier HiRadixCache calls at backup and match time (tier.py)."""

from radixserve.mem_cache.storage.backend_factory import STORAGE_BACKENDS, create_storage_backend
from radixserve.mem_cache.storage.base import HiCacheStorage, page_hash_chain, storage_namespace
from radixserve.mem_cache.storage.controller import (
    PREFETCH_POLICIES, HiCacheStorageController, PrefetchOperation, PrefetchTimeout, StorageCounters,
)

__all__ = [
    "STORAGE_BACKENDS", "HiCacheStorage", "create_storage_backend", "page_hash_chain", "storage_namespace",
    "PREFETCH_POLICIES", "HiCacheStorageController", "PrefetchOperation", "PrefetchTimeout", "StorageCounters",
]
