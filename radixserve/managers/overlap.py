"""Zero-overhead (overlap) scheduling support (seed 001 §2): the FutureMap and the device
ForwardThread that runs forwards in order while the scheduler thread prepares the next batch.

    scheduler thread:  Pre N+1 | launch N+1 | Post N (process N's result) | Pre N+2 ...
    forward thread:          ... forward N+1 (+ sample, store_to_map) ...

Batch N+1 is scheduled before N's tokens are known: its decode inputs are -future_index,
and resolve_future replaces them on the forward thread, right before N+1's forward, by the
tokens N stored in the map. The thread runs its work in order, so N has stored them by then.

With speculative decoding a step commits up to k + 1 tokens per request: the map also keeps
them (the draft state the next step drafts from; managers/spec_overlap.py has the picture).
"""

from __future__ import annotations

import atexit
import functools
import itertools
import queue
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, List, Optional, Tuple

import torch

from radixserve.mem_cache.kv_ledger import ForwardFence, KVLedger
from radixserve.speculative.overlap_view import DecodeView, ExtendView, decode_view, decode_worker_batch


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
        # Speculation: the tokens a step committed per future index and the request's length
        # after them (on the host, where drafting is).
        self.committed: List[Tuple[List[int], int]] = [([], 0)] * self.future_buffer_len

    def alloc_future_indices(self, bs: int) -> torch.Tensor:
        """bs consecutive indices >= 1 (0 cannot be negated into a placeholder)."""
        start = self.future_ct + 1
        self.future_ct = (self.future_ct + bs) % self.future_limit
        return torch.arange(start, start + bs, dtype=torch.int64)

    def resolve_future(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Negative entries are placeholders: -i means "the token stored at index i"."""
        input_ids = input_ids.to(self.token_ids_buf.device, non_blocking=True)  # the scheduler's are on the host
        return torch.where(input_ids < 0, self.token_ids_buf[torch.clamp(-input_ids, min=0)], input_ids)

    def store_to_map(self, future_indices: torch.Tensor, next_token_ids: torch.Tensor) -> None:
        self.token_ids_buf[future_indices.to(self.token_ids_buf.device)] = next_token_ids

    def store_committed(self, future_indices: torch.Tensor, committed: List[List[int]], lens_after: List[int]) -> None:
        """A speculative step's (or a prefill's) committed tokens per request and its length after
        them; the last token is the next step's input."""
        for idx, toks, n in zip(future_indices.tolist(), committed, lens_after):
            self.committed[idx] = (toks, n)
        last = torch.tensor([t[-1] for t in committed], dtype=torch.int64, device=self.token_ids_buf.device)
        self.store_to_map(future_indices, last)

    def resolve_committed(self, input_ids: torch.Tensor, known_lens: List[int]) -> List[List[int]]:
        """Per request, the tokens of its placeholder's step that the scheduler had not processed
        when it took its snapshot of known_lens tokens (the placeholder of a step processed since
        stands for tokens the snapshot has)."""
        out = []
        for i, known in zip(input_ids.tolist(), known_lens):
            toks, n = self.committed[-i] if i < 0 else ([], 0)
            out.append(toks[len(toks) - (n - known):] if n > known else [])
        return out


class ForwardThread:
    """An in-order queue of device work run by one worker thread: it plays the part of a CUDA
    stream in SGLang's overlap loop (on CUDA the thread also launches onto its own
    torch.cuda.Stream), and works the same on the CPU.
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
        # On CUDA the task waits for the device work the submitting thread queued on its own
        # stream before it (its req_to_token writes for this batch, say).
        submitted = None
        if self.cuda_stream is not None:
            submitted = torch.cuda.Event()
            submitted.record()
        self._tasks.put((fn, args, submitted))

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
            fn, args, submitted = item
            if submitted is not None:
                self.cuda_stream.wait_event(submitted)
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
    """Filled by the forward thread once the batch is launched; `wait()` blocks the scheduler
    until the sampled tokens are on the host."""

    def __init__(self) -> None:
        self.ready = threading.Event()  # the forward thread set result (or error)
        self.result: Any = None
        self.error: Optional[BaseException] = None

    def set(self, result: Any) -> None:
        self.result = result
        self.ready.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.ready.set()

    def wait(self) -> Any:
        self.ready.wait()
        if self.error is not None:
            raise RuntimeError("the forward of a batch failed") from self.error
        event = getattr(self.result, "copy_done", None)
        if event is not None:  # CUDA: the launch is done; wait for the device -> host copy
            event.synchronize()
        return self.result


class TpModelWorkerClient:
    """The overlap loop's handle on the TpModelWorker (SGLang's name): `launch` queues a
    forward on the ForwardThread and returns at once with a PendingResult and the placeholders
    (-future_index) that stand for the batch's sampled tokens until they are known."""

    def __init__(self, tp_worker: Any, max_running_requests: int, chunked_prefill_size: Optional[int], context_len: int,
                 ledger: Optional[KVLedger] = None):
        self.worker = tp_worker
        self.ledger = ledger  # the speculative step's view reads rows and moves KV through it
        self.forward_thread = ForwardThread(tp_worker.device)
        self.future_map = FutureMap(max_running_requests, chunked_prefill_size, context_len, tp_worker.device)
        # (what processing a batch's result needs, its PendingResult), in launch order
        self.result_queue: Deque[Tuple[Any, PendingResult]] = deque()
        # Batches launched and done: rows freed meanwhile wait for the ones in flight (the ledger's).
        self.fence = ForwardFence()
        if ledger is not None:
            ledger.defer_row_frees(self.fence)

    def launch(self, batch: Any, worker_batch: Any) -> torch.Tensor:
        """Queue the forward of `batch` (a detached copy is kept for its result); returns the
        placeholders of its sampled tokens."""
        future_indices = self.future_map.alloc_future_indices(batch.batch_size())
        pending = PendingResult()
        self.fence.launched += 1
        self.forward_thread.submit(self._forward, worker_batch, future_indices, pending)
        self.result_queue.append((batch.copy(), pending))
        return -future_indices

    def launch_spec(self, spec_worker: Any, batch: Any, worker_batch: Any) -> torch.Tensor:
        """launch() for --speculative-algorithm: the worker's step runs on the forward thread, on
        a view of `batch` (speculative/overlap_view.py) made when the step before is done."""
        future_indices = self.future_map.alloc_future_indices(batch.batch_size())
        pending = PendingResult()
        if batch.forward_mode.is_decode():
            make_view = functools.partial(self._decode_view, batch.spec_overlap_input, batch.return_logprob,
                                          list(batch.top_logprobs_nums), spec_worker.verify_width)
            lens_before = None  # known on the forward thread
        else:
            make_view = functools.partial(ExtendView, list(batch.reqs), batch.forward_mode)
            lens_before = [len(r.origin_input_ids) + len(r.output_ids) for r in batch.reqs]
        self.fence.launched += 1
        self.forward_thread.submit(self._forward_spec, spec_worker, make_view, worker_batch, lens_before,
                                   future_indices, pending)
        self.result_queue.append((batch.copy(), pending))
        return -future_indices

    def _decode_view(self, inp: Any, return_logprob: bool, top_logprobs_nums: List[int], verify_width: int,
                     worker_batch: Any) -> Tuple[DecodeView, Any]:
        view = decode_view(inp, self.future_map.resolve_committed(inp.input_ids, inp.known_lens), worker_batch,
                           self.ledger, return_logprob, top_logprobs_nums, verify_width)
        return view, decode_worker_batch(view, worker_batch)

    def _forward_spec(self, spec_worker: Any, make_view: Callable, worker_batch: Any, lens_before: Optional[List[int]],
                      future_indices: torch.Tensor, pending: PendingResult) -> None:
        """On the ForwardThread: the view, the worker's step, the committed tokens into the map."""
        try:
            if worker_batch.forward_mode.is_decode():
                view, worker_batch = make_view(worker_batch)
                lens_before = view.seq_lens_cpu
            else:
                view = make_view()
                worker_batch.input_ids = self.future_map.resolve_future(worker_batch.input_ids)
            result = spec_worker.forward_batch(view, worker_batch)
            flat = result.next_token_ids.tolist()
            counts = [a + 1 for a in result.accept_lens] if result.accept_lens is not None else [1] * len(flat)
            starts = itertools.accumulate([0] + counts)
            self.future_map.store_committed(future_indices, [flat[s : s + n] for s, n in zip(starts, counts)],
                                            [b + n for b, n in zip(lens_before, counts)])
            result.next_token_ids, result.copy_done = self.worker.to_host(result.next_token_ids)
            pending.set(result)
        except BaseException as e:
            pending.fail(e)
            raise

    def pop_result(self, stats: Any) -> Optional[Tuple[Any, Any]]:
        """The oldest launched batch and its result, waiting for it if needed; counts into
        `stats` (a SchedulerStats) whether the next forward was running meanwhile."""
        if not self.result_queue:
            return None
        batch, pending = self.result_queue.popleft()
        stats.results_processed += 1
        stats.results_processed_while_busy += self.forward_thread.busy.is_set()
        stats.results_processed_overlapped += bool(self.result_queue)  # the next batch is launched
        t0 = time.perf_counter()
        result = pending.wait()
        self.fence.done += 1  # (in launch order: every batch before it is done too)
        if self.ledger is not None:
            self.ledger.collect_deferred_rows()  # the rows freed while it was in flight, back now
        stats.wait_s += time.perf_counter() - t0
        return batch, result

    def _forward(self, worker_batch: Any, future_indices: torch.Tensor, pending: PendingResult) -> None:
        """On the ForwardThread: resolve placeholders, forward + sample, publish the tokens."""
        try:
            worker_batch.input_ids = self.future_map.resolve_future(worker_batch.input_ids)
            result = self.worker.forward_batch_generation(worker_batch)
            self.future_map.store_to_map(future_indices, result.next_token_ids)
            result.next_token_ids, result.copy_done = self.worker.to_host(result.next_token_ids)
            pending.set(result)
        except BaseException as e:
            pending.fail(e)
            raise

    def close(self) -> None:
        self.forward_thread.close()
