"""Release and resume the memory a ModelRunner holds, by tag (SGLang's /release_memory_occupation
and /resume_memory_occupation; its TorchMemorySaverAdapter's pause / resume).

    kv_cache    the KV pool's K and V buffers and the req_to_token table (and a hybrid model's state
                pool with its row -> slot map): freed, and on resume
                allocated again, zeroed (the caller flushed the radix cache: nothing refers to them)
    weights     every parameter and buffer of the model and the packed copies the CPU's bf16 GEMM
                uses (layers/linear.py PackedWeight): their bytes are saved first, then freed, and
                written back on resume, so the model is restored bit for bit
    cuda_graph  the decode CUDA graphs (which hold the addresses of both): dropped, recaptured on
                resume once the KV pool and the weights are back

Only a tensor's storage goes (`untyped_storage().resize_(0)`): the tensor objects stay, so every
reference to them (layers, attention backends, the packed-weight records) is valid again after
the resume, with no rebuild of the model. Where the saved weight bytes live (StorageStash): on a
CPU in an unlinked temporary file in TMPDIR (gone with the process, whatever ends it), so that
the process's resident memory really drops (a tmpfs TMPDIR would keep them in RAM, outside the
process); on a GPU in pinned host memory, as SGLang's --enable-weights-cpu-backup does. The packed bf16 copies are saved as they are: restoring their
bytes gives the exact packed layout back, without keeping the original layout or repacking.
On the CPU freed memory goes back to the OS with malloc_trim (glibc keeps freed blocks below its
mmap threshold otherwise); on CUDA with empty_cache.
"""

from __future__ import annotations

import ctypes
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional

import torch

from radixserve.layers.linear import PackedWeight
from radixserve.layers.moe import FusedMoE
from radixserve.layers.quantization import GGUFLinearMethod

GPU_MEMORY_TYPE_KV_CACHE = "kv_cache"
GPU_MEMORY_TYPE_WEIGHTS = "weights"
GPU_MEMORY_TYPE_CUDA_GRAPH = "cuda_graph"
GPU_MEMORY_ALL_TYPES = [GPU_MEMORY_TYPE_KV_CACHE, GPU_MEMORY_TYPE_WEIGHTS, GPU_MEMORY_TYPE_CUDA_GRAPH]

COPY_CHUNK_BYTES = 16 * 1024**2  # a saved storage goes through a buffer of this size to and from the file


def unique_storages(tensors: Iterable[torch.Tensor]) -> List[torch.UntypedStorage]:
    """The storages behind these tensors, each once (tied weights, views), empty ones left out."""
    seen: Dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes() > 0:
            seen.setdefault(s.data_ptr(), s)
    return list(seen.values())


def _bytes_of(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over the storage's bytes (no copy; the storage stays resizable)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,))


def trim_host_memory() -> None:
    """Give freed heap memory back to the OS (glibc only; elsewhere a no-op)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass
class _Saved:
    storage: torch.UntypedStorage
    nbytes: int
    offset: int = 0  # in the stash file (CPU)
    host_copy: Optional[torch.Tensor] = None  # pinned (CUDA)


class StorageStash:
    """Saves the bytes of some storages and frees them; restore() allocates and fills them again."""

    def __init__(self, storages: List[torch.UntypedStorage]):
        self.saved = [_Saved(s, s.nbytes()) for s in storages]
        self.file: Optional[Any] = None  # the CPU storages' bytes, one after another

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.saved)

    def save(self) -> None:
        """Copy the bytes out (nothing is freed yet: a full disk leaves everything as it was)."""
        try:
            self._save()
        except BaseException:
            self.discard()
            raise

    def _save(self) -> None:
        cpu = [s for s in self.saved if s.storage.device.type == "cpu"]
        if cpu:
            # Unlinked at once: the bytes live as long as this open file, and never outlive the process.
            self.file = tempfile.TemporaryFile(prefix="radixserve-weights-")
            buf = torch.empty(COPY_CHUNK_BYTES, dtype=torch.uint8)
            view = memoryview(buf.numpy())
            for s in cpu:
                s.offset = self.file.tell()
                src = _bytes_of(s.storage, s.nbytes)
                for start in range(0, s.nbytes, COPY_CHUNK_BYTES):
                    n = min(COPY_CHUNK_BYTES, s.nbytes - start)
                    buf[:n].copy_(src[start : start + n])
                    self.file.write(view[:n])
            self.file.flush()
        for s in self.saved:
            if s.storage.device.type != "cpu":
                s.host_copy = torch.empty(s.nbytes, dtype=torch.uint8, pin_memory=True)
                s.host_copy.copy_(_bytes_of(s.storage, s.nbytes))

    def free(self) -> None:
        for s in self.saved:
            s.storage.resize_(0)

    def restore(self) -> None:
        buf = torch.empty(COPY_CHUNK_BYTES, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        for s in self.saved:
            s.storage.resize_(s.nbytes)
            dst = _bytes_of(s.storage, s.nbytes)
            if s.host_copy is not None:
                dst.copy_(s.host_copy)
                s.host_copy = None
                continue
            self.file.seek(s.offset)
            for start in range(0, s.nbytes, COPY_CHUNK_BYTES):
                n = min(COPY_CHUNK_BYTES, s.nbytes - start)
                if self.file.readinto(view[:n]) != n:
                    raise RuntimeError("the saved weights are truncated")
                dst[start : start + n].copy_(buf[:n])
        self.discard()

    def discard(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        for s in self.saved:
            s.host_copy = None


class MemorySaverAdapter:
    """Frees and restores, by tag, the KV pool and the weights of one ModelRunner (one TP rank)."""

    def __init__(self, model_runner: Any):
        self.runner = model_runner
        self.released: List[str] = []
        self._weights: Optional[StorageStash] = None
        self._kv_storages: List[torch.UntypedStorage] = []
        self._kv_nbytes: List[int] = []
        self._graphs_dropped = False

    # ---- what each tag covers ---------------------------------------------------------------
    def kv_cache_tensors(self) -> List[torch.Tensor]:
        pool, rows = self.runner.token_to_kv_pool, self.runner.req_to_token_pool
        # A hybrid model's state pool (its rows' states and the radix cache's snapshots, flushed with it).
        states = getattr(rows, "mamba_pool", None)
        state_tensors = [states.conv_state, states.temporal_state, rows.req_index_to_mamba_index] if states else []
        return list(pool.k_buffer) + list(pool.v_buffer) + [rows.req_to_token] + state_tensors

    def weight_tensors(self) -> List[torch.Tensor]:
        model = self.runner.model
        out = list(model.parameters()) + list(model.buffers())
        out += [m.weight_packed.data for m in model.modules() if isinstance(getattr(m, "weight_packed", None), PackedWeight)]
        out += [s.data for m in model.modules() if isinstance(getattr(m, "quant_method", None), GGUFLinearMethod)
                for s in m.quant_method.ordered]  # GGUF weights kept in their blocks
        out += [p.gguf_blocks.data for p in model.parameters() if getattr(p, "gguf_blocks", None) is not None]
        out += [t for m in model.modules() if isinstance(m, FusedMoE) for t in m.weight_storage()]  # packed / GGUF experts
        return out

    # ---- release / resume -------------------------------------------------------------------
    def check_can_release(self, tags: List[str]) -> Optional[str]:
        """Why these storages cannot be freed in place (a tensor over memory torch does not own,
        e.g. an mmap), or None."""
        for tag in tags:
            if tag == GPU_MEMORY_TYPE_CUDA_GRAPH:
                continue
            tensors = self.kv_cache_tensors() if tag == GPU_MEMORY_TYPE_KV_CACHE else self.weight_tensors()
            if not all(s.resizable() for s in unique_storages(tensors)):
                return f"the {tag} memory cannot be freed in place (a tensor over memory torch does not own)"
        return None

    def release(self, tags: List[str]) -> int:
        """Free the memory of these tags (not released yet). Returns the bytes freed."""
        freed = 0
        stash = None
        if GPU_MEMORY_TYPE_WEIGHTS in tags:
            stash = StorageStash(unique_storages(self.weight_tensors()))
            stash.save()  # may fail (disk full): then nothing was freed
        self._drop_cuda_graphs()
        if stash is not None:
            stash.free()
            self._weights = stash
            freed += stash.nbytes
        if GPU_MEMORY_TYPE_KV_CACHE in tags:
            self._kv_storages = unique_storages(self.kv_cache_tensors())
            self._kv_nbytes = [s.nbytes() for s in self._kv_storages]
            for s in self._kv_storages:
                s.resize_(0)
            freed += sum(self._kv_nbytes)
        self.released += [t for t in tags if t not in self.released]
        self._return_freed_memory()
        return freed

    def resume(self, tags: List[str]) -> None:
        if GPU_MEMORY_TYPE_KV_CACHE in tags:
            for s, n in zip(self._kv_storages, self._kv_nbytes):
                s.resize_(n)
                _bytes_of(s, n).zero_()  # as allocated: no stale values under a masked position
            self._kv_storages, self._kv_nbytes = [], []
            self.runner.req_to_token_pool.req_to_token_cpu.zero_()  # its host copy, as the device's (one tensor on a CPU)
        if GPU_MEMORY_TYPE_WEIGHTS in tags and self._weights is not None:
            self._weights.restore()
            self._weights = None
        self.released = [t for t in self.released if t not in tags]
        if not self.released:
            self._recapture_cuda_graphs()

    # ---- CUDA graphs and the allocator --------------------------------------------------------
    def _drop_cuda_graphs(self) -> None:
        """The graphs replay at the addresses they captured: they go with the memory."""
        if getattr(self.runner, "cuda_graph_runner", None) is not None:
            self.runner.cuda_graph_runner = None
            self._graphs_dropped = True

    def _recapture_cuda_graphs(self) -> None:
        if self._graphs_dropped:
            self._graphs_dropped = False
            self.runner.cuda_graph_runner = self.runner.init_cuda_graphs()

    def _return_freed_memory(self) -> None:
        if torch.cuda.is_available() and str(getattr(self.runner, "device", "cpu")).startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        trim_host_memory()
