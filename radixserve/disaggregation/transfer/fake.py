"""The `fake` transfer backend: gather the request's K and V on the prefill side, send them in
the ZeroMQ message, scatter them into the preallocated slots on the decode side. No extra
dependency; a copy through the CPU, so for tests and machines without Mooncake."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from radixserve.disaggregation.transfer.base import KVTransferBackend
from radixserve.disaggregation.utils import KVArgs


class FakeTransferBackend(KVTransferBackend):
    name = "fake"

    def write(self, peer: KVArgs, src: torch.Tensor, dst: torch.Tensor) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        p = self.kv_pool
        src = src.to(p.k_buffer[0].device)
        k = torch.stack([buf[src] for buf in p.k_buffer]).cpu()
        v = torch.stack([buf[src] for buf in p.v_buffer]).cpu()
        return k, v

    def receive(self, dst: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor]) -> None:
        assert k is not None and v is not None, "the fake backend's message carries the KV"
        p = self.kv_pool
        dst = dst.to(p.k_buffer[0].device)
        for layer in range(p.layer_num):
            p.k_buffer[layer][dst] = k[layer].to(p.k_buffer[layer].device)
            p.v_buffer[layer][dst] = v[layer].to(p.v_buffer[layer].device)
