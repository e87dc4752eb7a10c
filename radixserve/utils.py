"""Small helpers shared across processes."""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from typing import Any, Callable, Iterable, List, Optional, Tuple, Type


class TypeBasedDispatcher:
    """Route a message to the handler registered for its type (seed 000)."""

    def __init__(self, mapping: List[Tuple[Type, Callable[[Any], Any]]]):
        self._mapping = mapping

    def __call__(self, obj: Any) -> Any:
        for ty, fn in self._mapping:
            if isinstance(obj, ty):
                return fn(obj)
        raise ValueError(f"invalid object: {type(obj).__name__}")


def held_suffix_len(text: str, markers: Iterable[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of one of `markers`: a
    stream holds that much back until it knows whether a marker (a stop string, a tool-call or
    think tag) begins there."""
    hold = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), hold, -1):
            if text.endswith(m[:k]):
                hold = k
                break
    return hold


def progress(iterable: Optional[Iterable[Any]] = None, total: Optional[int] = None, desc: str = "",
             unit: str = "it", enabled: bool = True) -> Any:
    """A progress bar on stderr for long work (loading weights, packing them, capturing graphs,
    bench runs): tqdm, shown only where stderr is a terminal (tqdm's disable=None), so logs, CI
    output and a server under a process manager stay free of carriage returns. leave=False: the
    bar goes away when done, and the log line that follows says what was done."""
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True,
                disable=None if enabled else True)


@functools.lru_cache(maxsize=None)
def _libc() -> Optional[ctypes.CDLL]:
    """The process's own C library on Linux (its symbols are global: no ldconfig lookup); None
    elsewhere (macOS's MADV_DONTNEED keeps the pages' contents)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def zero_pages_lazily(t: Any) -> bool:  # a torch.Tensor (torch stays out of this module's imports)
    """Make a CPU tensor all zeros without writing its whole pages: madvise(MADV_DONTNEED) hands the
    pages back, and the kernel maps zeroed memory on the first touch of each (anonymous memory,
    Linux). Only the partial pages at the two ends are written. False where that is unavailable
    (the caller then zeroes it)."""
    addr, n, page = t.data_ptr(), t.numel() * t.element_size(), mmap.PAGESIZE
    start, end = -(-addr // page) * page, (addr + n) // page * page
    libc = _libc()
    if not t.is_contiguous() or end - start < page or libc is None or not hasattr(libc, "madvise"):
        return False
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED) != 0:
        return False
    flat, size = t.view(-1), t.element_size()  # torch's CPU buffers are 64-byte aligned: whole elements
    flat[: (start - addr) // size].zero_()
    flat[(end - addr) // size :].zero_()
    return True


def trim_heap() -> bool:
    """Give the C heap's free memory back to the OS (glibc's malloc_trim; False elsewhere). After
    a load its temporaries (tensors dequantized or converted on the way, the GEMM paths' timing
    buffers) are freed but stay resident in the heap: ~110 MB for Qwen2.5-1.5B Q4_K_M."""
    libc = _libc()
    return libc is not None and hasattr(libc, "malloc_trim") and bool(libc.malloc_trim(0))  # glibc only
