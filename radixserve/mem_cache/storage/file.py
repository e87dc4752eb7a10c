"""--hicache-storage-backend file: one file per page in a directory (SGLang's HiCacheFile).

    {dir}/{namespace}-{page hash}.bin     the page's raw bytes

dir: extra_config {"path": ...}, else $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else /tmp/hicache.
A write goes to a temporary file that is then renamed over the final name, so a reader (another
server on the same directory, or this one after a crash) sees a whole page or none.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import uuid
from typing import List, Optional, Tuple

import torch

from radixserve.mem_cache.storage.base import HiCacheStorage

logger = logging.getLogger(__name__)

DEFAULT_DIR = "/tmp/hicache"
ENV_DIR = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"


class HiCacheFile(HiCacheStorage):
    def __init__(self, page_shape: Tuple[int, ...], dtype: torch.dtype, namespace: str, path: Optional[str] = None):
        super().__init__(page_shape, dtype, namespace)
        self.path = path or os.environ.get(ENV_DIR) or DEFAULT_DIR
        os.makedirs(self.path, exist_ok=True)

    def _file(self, key: str) -> str:
        return os.path.join(self.path, f"{self.store_key(key)}.bin")

    def exists(self, keys: List[str]) -> int:
        for i, key in enumerate(keys):
            if not os.path.exists(self._file(key)):
                return i
        return len(keys)

    def get(self, keys: List[str]) -> List[Optional[torch.Tensor]]:
        return [self._read(key) for key in keys]

    def _read(self, key: str) -> Optional[torch.Tensor]:
        try:
            with open(self._file(key), "rb") as f:
                data = f.read(self.page_nbytes + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.warning("HiCache file storage: reading %s failed (%s); a miss", key, e)
            return None
        page = self.from_bytes(data)
        if page is None:
            logger.warning("HiCache file storage: %s holds %d bytes, not a page's %d; a miss", key, len(data), self.page_nbytes)
        return page

    def set(self, keys: List[str], pages: List[torch.Tensor]) -> bool:
        ok = True
        for key, page in zip(keys, pages):
            ok = self._write(key, page) and ok
        return ok

    def _write(self, key: str, page: torch.Tensor) -> bool:
        final = self._file(key)
        if os.path.exists(final):  # a page's bytes depend only on its key: nothing to do
            return True
        tmp = f"{final}.tmp.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                f.write(self.to_bytes(page))
            os.replace(tmp, final)
            return True
        except (OSError, ValueError) as e:
            logger.warning("HiCache file storage: writing %s failed (%s); the page is not stored", key, e)
            try:
                os.remove(tmp)
            except OSError:
                pass
            return False

    def clear(self) -> bool:
        """Remove this namespace's pages (and torn temporary files); other namespaces stay."""
        ours = re.compile(re.escape(self.namespace) + r"-[0-9a-f]{64}\.bin(\.tmp\..*)?")
        try:
            names = [n for n in os.listdir(self.path) if ours.fullmatch(n)]
            for name in names:
                try:
                    os.remove(os.path.join(self.path, name))
                except FileNotFoundError:
                    pass
            logger.info("HiCache file storage: removed %d pages of %s from %s", len(names), self.namespace, self.path)
            return True
        except OSError as e:
            logger.warning("HiCache file storage: clearing %s failed (%s)", self.path, e)
            return False
