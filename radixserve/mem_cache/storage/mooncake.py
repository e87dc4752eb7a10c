"""--hicache-storage-backend mooncake: pages in a Mooncake Store (SGLang's MooncakeStore), shared
by every server that joins the same `mooncake_master`.

    mooncake_master -rpc_port 50051          (the wheel mooncake-transfer-engine-non-cuda ships it)
    --hicache-storage-backend mooncake
    --hicache-storage-backend-extra-config '{"master_server_address": "127.0.0.1:50051"}'

extra_config keys, as SGLang's MooncakeStoreConfig reads them: master_server_address (required),
local_hostname ("localhost"), metadata_server ("P2PHANDSHAKE"), global_segment_size ("4gb": the
memory this server lends to the store; pages live in the segments of the servers that wrote
them), local_buffer_size (16 MiB), protocol ("tcp"), device_name (""). A key it does not give
comes from SGLang's environment variables (MOONCAKE_MASTER, MOONCAKE_LOCAL_HOSTNAME,
MOONCAKE_TE_META_DATA_SERVER, MOONCAKE_GLOBAL_SEGMENT_SIZE, MOONCAKE_PROTOCOL, MOONCAKE_DEVICE).

Failures at run time (the master died, a peer is gone, a timeout inside the client) log a line
and read as misses; a failed put drops the rest of that write. Mooncake's own timeouts bound
every call (one to a dead master returns an error after ~4 s); after a failure the store is not
asked again for RETRY_AFTER_S (misses, dropped writes), then tried again. A page read in the
last lease period (the master's -default_kv_lease_ttl, 10 s by default) survives `clear`.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from radixserve.mem_cache.storage.base import HiCacheStorage

logger = logging.getLogger(__name__)

MASTER_CONNECT_TIMEOUT = 3.0  # seconds; setup() itself waits ~90 s for a master that is not there
# After a failed call the store reads as empty (and drops writes) this long without asking the
# client: a call to a dead master blocks ~4 s, and a prefetch per request would add them up.
RETRY_AFTER_S = 10.0


# SGLang's environment variables behind each extra_config key
ENV_KEYS = {
    "master_server_address": "MOONCAKE_MASTER", "local_hostname": "MOONCAKE_LOCAL_HOSTNAME",
    "metadata_server": "MOONCAKE_TE_META_DATA_SERVER", "global_segment_size": "MOONCAKE_GLOBAL_SEGMENT_SIZE",
    "protocol": "MOONCAKE_PROTOCOL", "device_name": "MOONCAKE_DEVICE",
}


def parse_size(value: Any) -> int:
    """8589934592, "8gb", "512mb" -> bytes."""
    if isinstance(value, int):
        return value
    s = str(value).strip().lower()
    for suffix, scale in (("gb", 1 << 30), ("mb", 1 << 20), ("kb", 1 << 10)):
        if s.endswith(suffix):
            return int(float(s[:-len(suffix)]) * scale)
    return int(s)


@dataclass
class MooncakeStoreConfig:
    master_server_address: str
    local_hostname: str = "localhost"
    metadata_server: str = "P2PHANDSHAKE"
    global_segment_size: int = 4 << 30
    local_buffer_size: int = 16 << 20
    protocol: str = "tcp"
    device_name: str = ""

    @staticmethod
    def from_extra_config(extra_config: Dict[str, Any]) -> "MooncakeStoreConfig":
        from_env = {key: os.environ[env] for key, env in ENV_KEYS.items() if os.environ.get(env)}
        extra_config = {**from_env, **{k: v for k, v in extra_config.items() if v is not None}}
        if not extra_config.get("master_server_address"):
            raise ValueError('--hicache-storage-backend mooncake needs "master_server_address" (host:port of '
                             'mooncake_master) in --hicache-storage-backend-extra-config (or $MOONCAKE_MASTER)')
        c = MooncakeStoreConfig(str(extra_config["master_server_address"]))
        for name in ("local_hostname", "metadata_server", "protocol", "device_name"):
            if extra_config.get(name) is not None:
                setattr(c, name, str(extra_config[name]))
        for name in ("global_segment_size", "local_buffer_size"):
            if extra_config.get(name) is not None:
                setattr(c, name, parse_size(extra_config[name]))
        return c


def check_master_reachable(address: str) -> None:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=MASTER_CONNECT_TIMEOUT).close()
    except (OSError, ValueError) as e:
        raise RuntimeError(f"mooncake_master is not reachable at {address!r} ({e}): start it, or fix "
                           '"master_server_address" of --hicache-storage-backend-extra-config') from None


class MooncakeStore(HiCacheStorage):
    def __init__(self, page_shape: Tuple[int, ...], dtype: torch.dtype, namespace: str,
                 extra_config: Dict[str, Any], store: Optional[Any] = None):
        super().__init__(page_shape, dtype, namespace)
        self.config = MooncakeStoreConfig.from_extra_config(extra_config)
        if store is None:
            from mooncake.store import MooncakeDistributedStore

            check_master_reachable(self.config.master_server_address)
            store = MooncakeDistributedStore()
            c = self.config
            rc = store.setup(c.local_hostname, c.metadata_server, c.global_segment_size, c.local_buffer_size,
                             c.protocol, c.device_name, c.master_server_address)
            if rc != 0:
                raise RuntimeError(f"Mooncake Store setup against {c.master_server_address} failed (error {rc})")
        self.store = store
        self._down_until = 0.0  # monotonic time before which the store is not asked
        logger.info("HiCache storage: Mooncake Store at %s, namespace %s", self.config.master_server_address, namespace)

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, detail: Any, consequence: str) -> None:
        self._down_until = time.monotonic() + RETRY_AFTER_S
        logger.warning("HiCache mooncake: %s failed (%s); %s; not asked again for %.0f s", what, detail, consequence,
                       RETRY_AFTER_S)

    def exists(self, keys: List[str]) -> int:
        if not keys or not self.available():
            return 0
        try:
            found = self.store.batch_is_exist([self.store_key(k) for k in keys])
        except Exception as e:  # the client's own errors: a miss, never the caller's problem
            self._failed("is_exist", e, "a miss")
            return 0
        for i, r in enumerate(found):
            if r != 1:
                if r < 0:
                    self._failed("is_exist", f"error {r}", "a miss")
                return i
        return len(keys)

    def get(self, keys: List[str]) -> List[Optional[torch.Tensor]]:
        pages: List[Optional[torch.Tensor]] = []
        for key in keys:
            data = None
            if self.available():
                try:
                    data = self.store.get(self.store_key(key))
                except Exception as e:
                    self._failed("get", e, "a miss")
            page = self.from_bytes(data) if data else None
            if data and page is None:
                logger.warning("HiCache mooncake: %s holds %d bytes, not a page's %d; a miss", key, len(data), self.page_nbytes)
            pages.append(page)
            if page is None:  # pages are used up to the first miss: the rest is not worth the wait
                pages.extend([None] * (len(keys) - len(pages)))
                break
        return pages

    def set(self, keys: List[str], pages: List[torch.Tensor]) -> bool:
        if not self.available():
            return False
        for i, (key, page) in enumerate(zip(keys, pages)):
            try:
                rc = self.store.put(self.store_key(key), self.to_bytes(page))  # a present key stays as it is
            except Exception as e:
                rc, err = -1, e
            else:
                err = None
            if rc != 0:
                self._failed("put", err or f"error {rc}", f"{len(keys) - i} page(s) dropped")
                return False
        return True

    def clear(self) -> bool:
        try:
            rc = self.store.remove_by_regex("^" + re.escape(self.namespace) + "-")
        except Exception as e:
            rc = e
        if not isinstance(rc, int) or rc < 0:
            logger.warning("HiCache mooncake: clearing %s failed (%s)", self.namespace, rc)
            return False
        logger.info("HiCache mooncake: removed %d pages of %s", rc, self.namespace)
        return True

    def close(self) -> None:
        try:
            self.store.close()
        except Exception as e:
            logger.warning("HiCache mooncake: close failed (%s)", e)
