"""The `mooncake` transfer backend (SGLang's default): Mooncake's TransferEngine, with P2P
handshake metadata (no metadata server). Each side registers its K and V buffers; the prefill
side writes straight into the decode side's preallocated slots, one transfer per run of slots
that is contiguous on both sides. Protocol "tcp" here; the same engine does RDMA on GPU clusters.

Install: `pip install mooncake-transfer-engine-non-cuda` (and on Debian `apt-get install
libibverbs1 librdmacm1 libnuma1 libcurl4`), or `mooncake-transfer-engine` on CUDA machines."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

from radixserve.disaggregation.transfer.base import KVTransferBackend
from radixserve.disaggregation.utils import KVArgs, contiguous_runs

INSTALL_HINT = (
    "the mooncake transfer backend needs Mooncake: pip install mooncake-transfer-engine-non-cuda "
    "(Debian also needs: apt-get install libibverbs1 librdmacm1 libnuma1 libcurl4), "
    "or use --disaggregation-transfer-backend fake"
)


class MooncakeTransferBackend(KVTransferBackend):
    name = "mooncake"

    def __init__(self, kv_pool: Any, host: str):
        super().__init__(kv_pool)
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise RuntimeError(f"{INSTALL_HINT} ({e})") from None
        self.engine = TransferEngine()
        protocol = "rdma" if kv_pool.k_buffer[0].is_cuda else "tcp"
        if self.engine.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol}) failed")
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"
        self.buffers: List[torch.Tensor] = list(kv_pool.k_buffer) + list(kv_pool.v_buffer)
        for buf in self.buffers:
            if self.engine.register_memory(buf.data_ptr(), buf.numel() * buf.element_size()) != 0:
                raise RuntimeError("Mooncake could not register the KV cache buffers")

    def kv_args(self) -> KVArgs:
        args = super().kv_args()
        args.session_id = self.session_id
        args.k_ptrs = [b.data_ptr() for b in self.kv_pool.k_buffer]
        args.v_ptrs = [b.data_ptr() for b in self.kv_pool.v_buffer]
        return args

    def write(self, peer: KVArgs, src: torch.Tensor, dst: torch.Tensor) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        src_starts, dst_starts, lengths = contiguous_runs(src.cpu(), dst.cpu())
        n = self.slot_bytes
        src_addrs: List[int] = []
        dst_addrs: List[int] = []
        sizes: List[int] = []
        for mine, theirs in ((self.kv_pool.k_buffer, peer.k_ptrs), (self.kv_pool.v_buffer, peer.v_ptrs)):
            for layer, buf in enumerate(mine):
                base, peer_base = buf.data_ptr(), theirs[layer]
                src_addrs += [base + s * n for s in src_starts]
                dst_addrs += [peer_base + d * n for d in dst_starts]
                sizes += [length * n for length in lengths]
        if src_addrs and self.engine.batch_transfer_sync_write(peer.session_id, src_addrs, dst_addrs, sizes) != 0:
            raise RuntimeError(f"Mooncake transfer to {peer.session_id} failed")
        return None, None

    def close(self) -> None:
        for buf in self.buffers:
            self.engine.unregister_memory(buf.data_ptr())
