"""Pipeline parallelism (seed 001 §27, SGLang's event_loop_pp): the model's layers split over
--pp-size stages, pp_loop_size = pp_size + --pp-async-batch-depth micro-batches in flight.

    stage 0 (SchedulerPP)           stage 1 .. P-2 (PPStage)        stage P-1 (PPStage)
    schedule mb k (radix cache,
    pools' bookkeeping)
    embed + its layers  --PPBatchMessage(batch, hidden, residual)-->  its layers --> ... -->
                                                                     its layers, norm, LM head,
    process mb k's result  <------------------ PPBatchResult (sampled tokens) ------ sample
    (while mb k+1 .. k+L-1 are on the stages)

The first stage's Scheduler owns the requests, the radix cache and the slot allocator: the
other stages only run layers, into their own layers' KV buffers indexed by the same slots (the
first stage sends each EXTEND batch's req_to_token rows along). Requests are split over the
micro-batch slots: slot i is a BatchSlot of its own (slots[i]: a running batch and a last batch;
the Scheduler's LoopState points at it while slot i is scheduled), so a request is in one micro-batch at a time and its next step is scheduled
only after its token came back. Every stage handles micro-batches in the order stage 0 sent
them, which keeps a slot freed and reused by a later micro-batch consistent on every stage.

Messages are pickled on a gloo group (parallel_state.pp_send_pyobj): sends never block (their
works are reaped later), receives block up to --watchdog-timeout, so a dead or hung stage ends
its neighbours (non-zero exit) and the launcher takes the server down. An idle first stage
sends PPKeepAlive now and then so that the waiting stages' receives do not time out.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from typing import Any, Callable, Deque, List, Optional, Tuple

import torch

from radixserve.distributed.parallel_state import (
    destroy_distributed_environment, get_pp_group, pp_commit_sends, pp_recv_pyobj, pp_send_pyobj, stage_layers,
)
from radixserve.managers.grammar import GrammarQueue
from radixserve.managers.loop_state import BatchSlot, LoopState
from radixserve.managers.output_processor import SchedulerOutputProcessor
from radixserve.managers.schedule_batch import ScheduleBatch
from radixserve.managers.scheduler_stats import SchedulerStats
from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.mem_cache.kv_ledger import KVLedger
from radixserve.model_executor.forward_batch import ModelWorkerBatch
from radixserve.model_executor.tp_worker import GenerationBatchResult, TpModelWorker
from radixserve.model_executor.worker_protocol import ModelWorker
from radixserve.server_args import ServerArgs
from radixserve.protocol import PPBatchMessage, PPBatchResult, PPKeepAlive, PPStop

logger = logging.getLogger(__name__)

MAX_BUSY_INTERVALS = 100_000  # forward (start, end) times kept for pp_busy.py


@dataclasses.dataclass
class BusyLog:
    """When this stage computed: perf_counter() (start, end) of each forward."""

    intervals: List[Tuple[float, float]] = dataclasses.field(default_factory=list)

    def add(self, start: float, end: float) -> None:
        if len(self.intervals) < MAX_BUSY_INTERVALS:
            self.intervals.append((start, end))


class GlooTransport:
    """The stages' messages on torch.distributed (parallel_state); the simulator brings its
    own (sim/pipeline.py: a virtual clock instead of processes) through the worker's pp_transport."""

    def send(self, obj: Any, dst_stage: int) -> None:
        pp_commit_sends(wait=False)
        pp_send_pyobj(obj, dst_stage)

    def recv(self, src_stage: int) -> Any:
        return pp_recv_pyobj(src_stage)

    def close(self) -> None:
        pp_commit_sends(wait=True)
        destroy_distributed_environment()


def keepalive_interval(server_args: Any) -> float:
    return min(server_args.watchdog_timeout / 4, 10.0)


def req_to_token_rows(req_to_token: torch.Tensor, wb: ModelWorkerBatch) -> torch.Tensor:
    """Each request's slots [0, seq_len), back to back (the next stages' copy of the rows)."""
    rows = [req_to_token[i, :n] for i, n in zip(wb.req_pool_indices.tolist(), wb.seq_lens_cpu)]
    return torch.cat(rows).cpu()


def write_req_to_token(ledger: KVLedger, wb: ModelWorkerBatch, rows: Optional[torch.Tensor]) -> None:
    """A later stage: make its req_to_token agree with the first stage's for this batch."""
    if rows is None:  # DECODE: one new slot per request, at position seq_len - 1
        ledger.write_at(wb.req_pool_indices, wb.seq_lens - 1, wb.out_cache_loc)
        return
    n = len(wb.seq_lens_cpu)
    ledger.write_spans(wb.req_pool_indices.tolist(), [0] * n, wb.seq_lens_cpu, rows)


def proxy_to(proxy: Any, device: Any) -> Any:
    """PPProxyTensors on `device` (the host for pickling, the stage's device for its forward)."""
    if proxy is None:  # the simulator's worker computes nothing
        return None
    res = proxy.residual
    return dataclasses.replace(proxy, hidden_states=proxy.hidden_states.to(device),
                               residual=None if res is None else res.to(device))


@dataclasses.dataclass(frozen=True)
class PPLoop:
    """What the first stage's loop uses of the Scheduler: its LoopState (pointed at each micro-batch
    slot's BatchSlot in turn), the loop's steps (bound methods: the batch selection runs once per
    slot), and the parts that launch and process the micro-batches."""

    loop: LoopState
    get_next_batch_to_run: Callable[[], Optional[ScheduleBatch]]
    empty_batch: Callable[[], ScheduleBatch]
    on_idle: Callable[[], None]
    count_forward: Callable[[ScheduleBatch], None]  # the forward count, the profiler, the batch stats
    stats: SchedulerStats
    grammar_backend: Any  # None: no structured output
    ledger: KVLedger
    output_processor: SchedulerOutputProcessor
    max_running_requests: int


class SchedulerPP:
    """The first stage's loop: Scheduler.run_step calls run_step (one micro-batch slot per call)."""

    def __init__(self, loop: PPLoop, args: ServerArgs, worker: ModelWorker):
        self.sched = s = loop
        self.worker = worker
        self.pp_size = args.pp_size
        self.transport = worker.pp_transport or GlooTransport()
        self.pp_loop_size = args.pp_size + args.pp_async_batch_depth
        self.slots: List[BatchSlot] = [BatchSlot(s.empty_batch()) for _ in range(self.pp_loop_size)]
        s.loop.slot = self.slots[0]
        self.inflight: Deque[Tuple[int, ScheduleBatch]] = deque()  # (slot, batch), in launch order
        self.mb_id = 0
        self.max_running_requests = s.max_running_requests
        self.micro_batch_cap = args.pp_max_micro_batch_size or max(1, s.max_running_requests // args.pp_size)
        self.keepalive_s = keepalive_interval(args)
        self.last_send = time.monotonic()
        self.busy = BusyLog()
        self.max_inflight = 0  # the most micro-batches ever in flight at once (tests, pp_busy.py)

    # ---- the loop ---------------------------------------------------------------------------
    def run_step(self) -> Optional[ScheduleBatch]:
        """Slot mb_id: process its micro-batch's result, schedule its next one, launch it."""
        s, mb = self.sched, self.mb_id
        while any(slot == mb for slot, _ in self.inflight):  # results come back in launch order
            self._pp_process_batch_result()
        slot = s.loop.slot = self.slots[mb]  # the Scheduler's selection runs over this micro-batch's batches
        last = slot.last_batch
        if last is not None and last.forward_mode.is_extend() and last.chunked_req is not None:
            # A middle chunk: its request goes on in a later micro-batch, it never joins this slot.
            # (Only an extend batch's chunked_req is its own: a running batch keeps the field stale.)
            last.filter_batch(chunked_req_to_exclude=[last.chunked_req])
        slot.request_limit = self._slot_request_limit(mb)
        try:
            t0 = time.perf_counter()
            batch = s.get_next_batch_to_run()
            s.stats.schedule_s += time.perf_counter() - t0
        finally:
            slot.request_limit = None
        slot.last_batch = batch
        if batch is not None:
            self._pp_launch_batch(mb, batch)
        elif not self.has_work():
            s.on_idle()
            if time.monotonic() - self.last_send > self.keepalive_s:
                self._send(PPKeepAlive())
        self.mb_id = (mb + 1) % self.pp_loop_size
        return batch

    def _slot_request_limit(self, mb: int) -> int:
        """Requests slot mb may hold: its micro-batch cap, and what the other slots leave of
        --max-running-requests (the PrefillAdder only sees this slot's running batch)."""
        others = 0
        for i, slot in enumerate(self.slots):
            if i != mb:
                others += slot.running_batch.batch_size()
                last = slot.last_batch
                if last is not None and last is not slot.running_batch and last.forward_mode.is_extend():
                    others += len(last.reqs)
        return max(0, min(self.micro_batch_cap, self.max_running_requests - others))

    def _pp_launch_batch(self, mb: int, batch: ScheduleBatch) -> None:
        """Run this stage's layers on the micro-batch and send it on (SGLang's _pp_launch_batch
        and _pp_send_dict_to_next_stage)."""
        s = self.sched
        s.count_forward(batch)
        wb = batch.get_model_worker_batch()
        if s.grammar_backend is not None:  # the last stage applies it; the matchers have seen every token
            wb.token_bitmask = s.grammar_backend.fill_token_bitmask(batch.reqs, GrammarQueue.fail_request)
        rows = None if wb.forward_mode.is_decode() else req_to_token_rows(s.ledger.rows_cpu, wb)
        t0 = time.perf_counter()
        proxy = self.worker.forward_batch_generation(wb, skip_sample=True).logits_output
        t1 = time.perf_counter()
        self.busy.add(t0, t1)
        s.stats.forward_s += t1 - t0
        self._send(PPBatchMessage(wb, proxy_to(proxy, "cpu"), rows))
        self.inflight.append((mb, batch))
        self.max_inflight = max(self.max_inflight, len(self.inflight))

    def _pp_process_batch_result(self) -> None:
        """The oldest micro-batch's tokens from the last stage -> the requests (as the normal loop)."""
        s = self.sched
        _, batch = self.inflight.popleft()
        msg = self.transport.recv(self.pp_size - 1)
        if not isinstance(msg, PPBatchResult):
            raise RuntimeError(f"pipeline out of step: expected a PPBatchResult, got {type(msg).__name__}")
        result: GenerationBatchResult = msg.result
        batch.output_ids = result.next_token_ids
        if batch.sampling_info is not None:  # the last stage's sampler did this to its copy
            batch.sampling_info.cumulate_output_tokens(result.next_token_ids)
        t0 = time.perf_counter()
        s.output_processor.process_batch_result(batch, result)
        s.stats.process_s += time.perf_counter() - t0

    def _send(self, obj: Any) -> None:
        self.transport.send(obj, 1)
        self.last_send = time.monotonic()

    # ---- what the Scheduler asks ----------------------------------------------------------------
    def has_work(self) -> bool:
        """Anything in flight or held by any slot (the Scheduler sees only the current slot)."""
        return bool(self.inflight) or any(not slot.running_batch.is_empty() for slot in self.slots) or any(
            b is not None and b.forward_mode.is_extend() and not b.is_empty() for b in (slot.last_batch for slot in self.slots)
        )

    def shutdown(self) -> None:
        """Tell the other stages to leave, then leave the process group with them."""
        self._send(PPStop())
        self.transport.close()


class PPStage:
    """A stage after the first: receive a micro-batch and the hidden states, run this stage's
    layers, send them on, or (the last stage) sample and send the tokens back to the first."""

    def __init__(self, server_args: Any, model_config: Any, tp_rank: int, pp_rank: int):
        self.server_args = server_args
        self.tp_worker = TpModelWorker(server_args, model_config, tp_rank, server_args.tp_size, pp_rank)
        # Its rows mirror the first stage's (which owns requests and slots); no prefix sharing here.
        self.ledger = KVLedger(*self.tp_worker.get_memory_pool(), ChunkCache(*self.tp_worker.get_memory_pool()))
        self.pp = get_pp_group()
        self.layer_range = stage_layers(model_config.num_hidden_layers)
        self.forward_ct = 0
        self.busy = BusyLog()

    def step(self) -> bool:
        """Handle the next message; False on PPStop (passed on first)."""
        msg = pp_recv_pyobj(self.pp.rank - 1)
        if isinstance(msg, (PPStop, PPKeepAlive)):
            if not self.pp.is_last_rank:
                self._send(msg, self.pp.rank + 1)
            return not isinstance(msg, PPStop)
        if not isinstance(msg, PPBatchMessage):
            raise RuntimeError(f"pipeline out of step: unexpected {type(msg).__name__}")
        self._pp_launch_batch(msg)
        return True

    def _pp_launch_batch(self, msg: PPBatchMessage) -> None:
        wb: ModelWorkerBatch = msg.worker_batch
        write_req_to_token(self.ledger, wb, msg.req_to_token_rows)
        wb.pp_proxy_tensors = proxy_to(msg.proxy, self.tp_worker.device)  # _pp_recv_proxy_tensors
        t0 = time.perf_counter()
        result = self.tp_worker.forward_batch_generation(wb, skip_sample=not self.pp.is_last_rank)
        self.busy.add(t0, time.perf_counter())
        self.forward_ct += 1
        if not self.pp.is_last_rank:
            self._send(PPBatchMessage(dataclasses.replace(wb, pp_proxy_tensors=None), proxy_to(result.logits_output, "cpu"),
                                      msg.req_to_token_rows), self.pp.rank + 1)
            return
        self._send(PPBatchResult(_for_first_stage(result)), 0)

    def _send(self, obj: Any, dst_stage: int) -> None:
        pp_commit_sends(wait=False)
        pp_send_pyobj(obj, dst_stage)

    def run(self) -> None:
        while self.step():
            pass

    def shutdown(self) -> None:
        pp_commit_sends(wait=True)
        destroy_distributed_environment()


def _for_first_stage(result: GenerationBatchResult) -> GenerationBatchResult:
    """What the first stage's output processor reads: tokens, logprobs, input logprobs (the
    vocabulary-sized next-token logits stay here)."""
    lo = result.logits_output
    if lo is not None:
        lo = dataclasses.replace(lo, next_token_logits=None, hidden_states=None)
        lo = dataclasses.replace(lo, **{k: v.cpu() for k, v in vars(lo).items() if isinstance(v, torch.Tensor)})
    ids = result.next_token_ids.cpu()
    lps = None if result.next_token_logprobs is None else result.next_token_logprobs.cpu()
    return dataclasses.replace(result, logits_output=lo, next_token_ids=ids, next_token_logprobs=lps)
