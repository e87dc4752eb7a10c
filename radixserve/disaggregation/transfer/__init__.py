"""How KV moves between the servers: `mooncake` (Mooncake's transfer engine, SGLang's default:
TCP here, RDMA on GPU clusters) or `fake` (the K and V tensors ride in a ZeroMQ message)."""

from __future__ import annotations

from typing import Any

from radixserve.disaggregation.transfer.base import KVTransferBackend
from radixserve.disaggregation.transfer.fake import FakeTransferBackend

TRANSFER_BACKENDS = ("mooncake", "fake")


def create_transfer_backend(name: str, kv_pool: Any, host: str) -> KVTransferBackend:
    if name == "fake":
        return FakeTransferBackend(kv_pool)
    from radixserve.disaggregation.transfer.mooncake import MooncakeTransferBackend

    return MooncakeTransferBackend(kv_pool, host)
