"""Zero-overhead (overlap) scheduling support (seed 001 §2): the FutureMap and the device
stream that runs forwards in order while the scheduler thread prepares the next batch.

    scheduler thread:  Pre N+1 | launch N+1 | Post N (process N's result) | Pre N+2 ...
    device stream:           ... forward N+1 (+ sample, store_to_map) ...

Batch N+1 is scheduled before N's tokens are known: its decode inputs are -future_index,
and resolve_future replaces them on the stream, right before N+1's forward, by the tokens
N stored in the map. The stream is FIFO, so N has always stored them by then.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from typing import Any, Callable, Optional

import torch


class FutureMap:
    """A circular buffer of sampled token ids on the device, indexed by future index."""

    def __init__(self, max_running_requests: int, chunked_prefill_size: Optional[int], context_len: int, device: str):
        chunk = chunked_prefill_size or context_len
        max_num_chunks = (context_len + chunk - 1) // chunk
        # Indices in use at once: the batch in flight, the one being scheduled, and the
        # chunks of a chunked request; the slack of 2x keeps a live index from being reused.
        self.future_limit = max_running_requests * (3 + max_num_chunks)
        self.future_buffer_len = self.future_limit + 2 * max_running_requests
        self.future_ct = 0
        self.token_ids_buf = torch.zeros(self.future_buffer_len, dtype=torch.int64, device=device)

    def alloc_future_indices(self, bs: int) -> torch.Tensor:
        """bs consecutive indices >= 1 (0 cannot be negated into a placeholder)."""
        start = self.future_ct + 1
        self.future_ct = (self.future_ct + bs) % self.future_limit
        return torch.arange(start, start + bs, dtype=torch.int64)

    def resolve_future(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Negative entries are placeholders: -i means "the token stored at index i"."""
        return torch.where(input_ids < 0, self.token_ids_buf[torch.clamp(-input_ids, min=0)], input_ids)

    def store_to_map(self, future_indices: torch.Tensor, next_token_ids: torch.Tensor) -> None:
        self.token_ids_buf[future_indices.to(self.token_ids_buf.device)] = next_token_ids


class DeviceStream:
    """An in-order queue of device work run by one worker thread: the CPU stand-in for a CUDA
    stream (on CUDA the thread also launches onto a dedicated torch.cuda.Stream).
    Work submitted here sees the effects of all work submitted before it."""

    def __init__(self, device: str):
        self.device = device
        self.cuda_stream = torch.cuda.Stream() if device == "cuda" else None
        self._tasks: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._error: Optional[BaseException] = None
        self.busy = threading.Event()  # set while a task runs (tests check overlap with it)
        self.busy_s = 0.0  # seconds spent running tasks (the "device" time)
        self._thread = threading.Thread(target=self._run, name="radixserve-forward", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # stop the thread before the interpreter tears torch down

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._error is not None:
            raise RuntimeError("the forward thread failed") from self._error
        self._tasks.put((fn, args))

    def synchronize(self) -> None:
        done = threading.Event()
        self.submit(done.set)
        done.wait()
        if self._error is not None:
            raise RuntimeError("the forward thread failed") from self._error

    def close(self) -> None:
        if self._thread.is_alive():
            self._tasks.put(None)
            self._thread.join(timeout=10)

    def _run(self) -> None:
        ctx = torch.cuda.stream(self.cuda_stream) if self.cuda_stream is not None else None
        if ctx is not None:
            ctx.__enter__()
        while True:
            item = self._tasks.get()
            if item is None:
                return
            fn, args = item
            self.busy.set()
            t0 = time.perf_counter()
            try:
                with torch.inference_mode():
                    fn(*args)
            except BaseException as e:  # surfaced to the scheduler thread by result.wait()
                self._error = e
            finally:
                self.busy_s += time.perf_counter() - t0
                self.busy.clear()


class PendingResult:
    """Filled by the stream once the batch is launched; `wait()` blocks the scheduler until
    the sampled tokens are on the host."""

    def __init__(self) -> None:
        self.copy_done = threading.Event()
        self.result: Any = None
        self.error: Optional[BaseException] = None

    def set(self, result: Any) -> None:
        self.result = result
        self.copy_done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.copy_done.set()

    def wait(self) -> Any:
        self.copy_done.wait()
        if self.error is not None:
            raise RuntimeError("the forward of a batch failed") from self.error
        event = getattr(self.result, "copy_done", None)
        if event is not None:  # CUDA: the launch is done; wait for the device -> host copy
            event.synchronize()
        return self.result
