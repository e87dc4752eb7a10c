"""The host tier of HiCache (SGLang's MHATokenToKVPoolHost): KV of radix-tree nodes evicted
from the device pool, kept in host memory until a prefix hit loads it back.

    kv_buffer  [2, layer_num, size, head_num, head_dim]     K = kv_buffer[0], V = kv_buffer[1]
               one slot per token, as MHATokenToKVPool's per-layer buffers, but all layers in
               one tensor ("layer first"), so a page of every layer is one index away

Slots are handed out in whole pages of `page_size` (a node's key is whole pages). Unlike the
device allocator there is no padding page: every host slot is usable. The copies run wherever
they are called (HiRadixCache queues them behind the forwards in flight); on CUDA the buffer
is pinned so host<->device copies can be asynchronous.
"""

from __future__ import annotations

from typing import Optional

import torch

from radixserve.mem_cache.memory_pool import MHATokenToKVPool


class MHATokenToKVPoolHost:
    """A host copy pool shaped like `device_pool`, `size` token slots (a multiple of page_size)."""

    def __init__(self, device_pool: MHATokenToKVPool, size: int, page_size: int, pin_memory: Optional[bool] = None):
        size = size // page_size * page_size
        if size <= 0:
            raise ValueError(f"HiCache host pool must hold at least one page of {page_size} tokens")
        self.device_pool = device_pool
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.layer_num = device_pool.layer_num
        self.dtype = device_pool.dtype
        if pin_memory is None:
            pin_memory = str(device_pool.device).startswith("cuda")
        shape = (2, self.layer_num, size, device_pool.head_num, device_pool.head_dim)
        need = 2 * self.layer_num * size * device_pool.head_num * device_pool.head_dim * device_pool.k_buffer[0].element_size()
        available = _available_host_memory()
        if available is not None and need > 0.9 * available:  # as SGLang: refuse rather than swap or die later
            raise ValueError(f"HiCache host pool needs {need / 1e9:.2f} GB but only {available / 1e9:.2f} GB of host "
                             "memory is available; lower --hicache-ratio or --hicache-size")
        self.kv_buffer = torch.zeros(shape, dtype=self.dtype, pin_memory=pin_memory)
        self.is_free = torch.ones(self.num_pages, dtype=torch.bool)  # per page
        self.clear()

    @staticmethod
    def size_for(device_pool: MHATokenToKVPool, device_size: int, ratio: float, size_gb: int) -> int:
        """SGLang's sizing: --hicache-size GB when given, else --hicache-ratio x the device pool."""
        if size_gb > 0:
            per_token = MHATokenToKVPool.bytes_per_token(device_pool.head_num, device_pool.head_dim,
                                                         device_pool.layer_num, device_pool.dtype)
            return int(size_gb * 1e9) // per_token
        return int(device_size * ratio)

    # ---- slots -------------------------------------------------------------------------
    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """`need_size` slots (whole pages) or None when too few are free."""
        assert need_size % self.page_size == 0, "host alloc() takes whole pages"
        n = need_size // self.page_size
        if n > len(self.free_pages):
            return None
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        self.is_free[pages] = False
        offs = torch.arange(self.page_size, dtype=torch.int64)
        return (pages[:, None] * self.page_size + offs[None, :]).reshape(-1)

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        pages = torch.unique(slots.to(torch.int64) // self.page_size)
        if self.is_free[pages].any():
            raise RuntimeError(f"double free of host KV pages {pages[self.is_free[pages]][:4].tolist()}")
        self.is_free[pages] = True
        self.free_pages = torch.cat([self.free_pages, pages])

    def clear(self) -> None:
        self.free_pages = torch.arange(self.num_pages, dtype=torch.int64)
        self.is_free[:] = True

    # ---- copies (every layer at once) ------------------------------------------------------
    def backup_from_device(self, host_idx: torch.Tensor, device_idx: torch.Tensor) -> None:
        """Copy the KV of device slots `device_idx` into host slots `host_idx` (same length)."""
        dev = self.device_pool
        dev_idx = device_idx.to(dev.k_buffer[0].device)
        k = torch.stack([buf[dev_idx] for buf in dev.k_buffer])  # [layer, n, head, dim]
        v = torch.stack([buf[dev_idx] for buf in dev.v_buffer])
        self.kv_buffer[:, :, host_idx] = torch.stack([k, v]).to("cpu", non_blocking=False)

    def load_to_device(self, device_idx: torch.Tensor, host_idx: torch.Tensor) -> None:
        """Copy host slots `host_idx` into device slots `device_idx` (same length)."""
        dev = self.device_pool
        target = dev.k_buffer[0].device
        kv = self.kv_buffer[:, :, host_idx].to(target, non_blocking=True)  # one transfer
        dev_idx = device_idx.to(target)
        for layer in range(self.layer_num):
            dev.k_buffer[layer][dev_idx] = kv[0, layer]
            dev.v_buffer[layer][dev_idx] = kv[1, layer]

    # ---- pages for the storage tier ---------------------------------------------------------
    def get_page_tensor(self, host_slots: torch.Tensor) -> torch.Tensor:
        """The KV of one page's host slots as one contiguous tensor
        [2, layer_num, page_size, head_num, head_dim] (a copy)."""
        assert len(host_slots) == self.page_size, "one page of host slots"
        return self.kv_buffer[:, :, host_slots.to(torch.int64)].contiguous()

    def set_page_tensor(self, host_slots: torch.Tensor, t: torch.Tensor) -> None:
        """Write one page (shaped as get_page_tensor returns it) into host slots `host_slots`."""
        assert len(host_slots) == self.page_size, "one page of host slots"
        self.kv_buffer[:, :, host_slots.to(torch.int64)] = t.to(self.dtype)


def _available_host_memory() -> Optional[int]:
    """MemAvailable of /proc/meminfo in bytes (None where there is none to read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
