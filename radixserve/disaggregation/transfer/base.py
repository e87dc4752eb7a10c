"""The interface of a KV transfer backend, and the KV pool view both backends use."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from radixserve.disaggregation.utils import KVArgs


class KVTransferBackend:
    """Prefill side: `write` the KV of `src` slots to the peer's `dst` slots. A backend that
    writes into the peer's memory itself (Mooncake) returns (None, None); one that cannot (fake)
    returns the K and V tensors, which travel with the KVTransferDone message and are stored by
    the peer's `receive`."""

    name = ""

    def __init__(self, kv_pool: Any):
        self.kv_pool = kv_pool
        k0 = kv_pool.k_buffer[0]
        self.slot_bytes = k0[0].numel() * k0.element_size()

    def kv_args(self) -> KVArgs:
        p = self.kv_pool
        return KVArgs(p.layer_num, p.head_num, p.head_dim, str(p.dtype), self.slot_bytes, backend=self.name)

    def write(self, peer: KVArgs, src: torch.Tensor, dst: torch.Tensor) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        raise NotImplementedError

    def receive(self, dst: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor]) -> None:
        """Decode side: store a payload that came with the message (fake backend only)."""

    def close(self) -> None:
        pass
