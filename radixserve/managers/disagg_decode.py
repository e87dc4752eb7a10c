"""The decode server of PD disaggregation (seed 001 §8.3, SGLang's decode mixin).

    request (bootstrap_room) -> DecodePreallocQueue  until a req_to_token row and KV slots for
        its prompt fit the budget (the running requests' decode reserve counted, as in the
        PrefillAdder); KVReceiver.init sends the slots to the prefill server
        -> DecodeTransferQueue  until the KV and the first token have arrived
        -> a prebuilt batch: the first token is processed as if a local prefill had sampled it,
           then the batch merges into running_batch

A transferred request is an ordinary running request from then on: a retraction frees its KV and
sends it to the waiting queue, where this server prefills it again itself. A request without a
bootstrap_room is served locally, as by a unified server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, List, Tuple

import torch

from radixserve.disaggregation.conn import KVManager, KVReceiver
from radixserve.disaggregation.utils import FirstToken, KVPoll
from radixserve.managers.disagg_prefill import transfer_error
from radixserve.managers.output_processor import SchedulerOutputProcessor
from radixserve.managers.schedule_batch import FINISH_ABORT, Req, ScheduleBatch
from radixserve.mem_cache.kv_ledger import KVLedger
from radixserve.model_executor.forward_batch import ForwardMode
from radixserve.model_executor.tp_worker import GenerationBatchResult
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo

DEFAULT_BOOTSTRAP_PORT = 8998  # sglang-router sends bootstrap_port null for a prefill URL without one


@dataclass
class DecodeRequest:
    req: Req
    kv_receiver: KVReceiver
    since: float = field(default_factory=time.monotonic)  # queued, then: transfer started


class DecodePreallocQueue:
    """Requests waiting for KV slots on this server (SGLang's DecodePreallocQueue)."""

    def __init__(self, kv_manager: KVManager, ledger: KVLedger):
        self.kv_manager = kv_manager
        self.ledger = ledger
        self.queue: List[DecodeRequest] = []

    def add(self, req: Req) -> None:
        port = req.bootstrap_port if req.bootstrap_port is not None else DEFAULT_BOOTSTRAP_PORT
        self.queue.append(DecodeRequest(req, KVReceiver(self.kv_manager, req.bootstrap_host, port, req.bootstrap_room)))

    def pop_preallocated(self, budget_tokens: float, free_running_slots: int, reserve_ratio: float) -> List[DecodeRequest]:
        """Allocate rows and slots for requests in arrival order while they fit; each takes
        its prompt plus its decode reserve (clipped max_new_tokens x new_token_ratio)."""
        out: List[DecodeRequest] = []
        while self.queue and len(out) < free_running_slots:
            dreq = self.queue[0]
            req = dreq.req
            need = len(req.origin_input_ids) + req.clipped_max_new_tokens() * reserve_ratio
            if need > budget_tokens or not self._alloc(req):
                break
            budget_tokens -= need
            self.queue.pop(0)
            dreq.kv_receiver.init(self.ledger.row(req)[: req.kv_committed_len],
                                  req.origin_input_ids)
            dreq.since = time.monotonic()
            out.append(dreq)
        return out

    def _alloc(self, req: Req) -> bool:
        rows = self.ledger.alloc_rows(1)
        if rows is None:
            return False
        n = len(req.origin_input_ids)
        slots = self.ledger.try_alloc_extend([0], [n], [-1])
        if slots is None:
            self.ledger.free_row(rows[0])
            return False
        req.req_pool_idx = rows[0]
        self.ledger.write_row(req, 0, slots)
        req.fill_ids = list(req.origin_input_ids)
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
        req.last_node = None
        req.already_computed = n
        self.ledger.advance(req, n)
        return True


class DecodeTransferQueue:
    """Preallocated requests whose KV is on its way (SGLang's DecodeTransferQueue)."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.queue: List[DecodeRequest] = []

    def pop_transferred(self) -> Tuple[List[Tuple[Req, FirstToken]], List[Tuple[Req, FINISH_ABORT]]]:
        done, failed, keep = [], [], []
        now = time.monotonic()
        for dreq in self.queue:
            rx = dreq.kv_receiver
            state = rx.poll()
            if state == KVPoll.Success:
                done.append((dreq.req, rx.first_token()))
            elif state == KVPoll.Failed:
                failed.append((dreq.req, transfer_error(rx.failure())))
            elif now - dreq.since > self.timeout:
                rx.abort("the decode server stopped waiting for this request's KV")
                failed.append((dreq.req, transfer_error(
                    f"the KV cache did not arrive from the prefill server within {self.timeout:g} s "
                    "(--disaggregation-timeout)", 504)))
            else:
                keep.append(dreq)
                continue
            rx.clear()
        self.queue = keep
        return done, failed


class DecodeDisaggregation:
    """The decode server's two queues, and turning arrived requests into a running batch."""

    def __init__(self, kv_manager: KVManager, ledger: KVLedger, output_processor: SchedulerOutputProcessor,
                 timeout: float):
        self.ledger = ledger
        self.output_processor = output_processor
        self.prealloc_queue = DecodePreallocQueue(kv_manager, ledger)
        self.transfer_queue = DecodeTransferQueue(timeout)

    def __len__(self) -> int:
        return len(self.prealloc_queue.queue) + len(self.transfer_queue.queue)

    def add(self, req: Req) -> None:
        self.prealloc_queue.add(req)

    def process_queues(self, running_batch: ScheduleBatch, max_running_requests: int,
                       new_token_ratio: float) -> List[Tuple[Req, FirstToken]]:
        """One step: fail or collect the transferred requests, preallocate for new ones."""
        done, failed = self.transfer_queue.pop_transferred()
        for req, reason in failed:
            self._release(req)
            self.output_processor.finish(req, reason)
        running = running_batch.reqs + [d.req for d in self.transfer_queue.queue] + [r for r, _ in done]
        reserved = sum(r.clipped_remaining_new_tokens() for r in running) * new_token_ratio
        budget = self.ledger.budget() - reserved
        free_running = min(max_running_requests - len(running), self.ledger.free_rows())
        self.transfer_queue.queue += self.prealloc_queue.pop_preallocated(budget, free_running, new_token_ratio)
        return done

    def _release(self, req: Req) -> None:
        self.ledger.release(req)  # its slots and row (no tree prefix: nothing locked)

    def abort(self, match: Callable[[Req], bool], message: str) -> None:
        for q, holds_kv in ((self.prealloc_queue, False), (self.transfer_queue, True)):
            for dreq in [d for d in q.queue if match(d.req)]:
                q.queue.remove(dreq)
                dreq.kv_receiver.abort(message)
                dreq.kv_receiver.clear()
                if holds_kv:
                    self._release(dreq.req)
                self.output_processor.finish(dreq.req, FINISH_ABORT(message))

    def live_reqs(self) -> List[Req]:
        return [d.req for d in self.transfer_queue.queue]

    def merge_prebuilt(self, arrived: List[Tuple[Req, FirstToken]], new_batch: Callable[[List[Req]], ScheduleBatch],
                       running_batch: ScheduleBatch) -> ScheduleBatch:
        """Arrived requests: their first token is processed like a prefill's result (finish
        checks, grammar, streaming), then the unfinished ones join the running batch."""
        batch = new_batch([r for r, _ in arrived])
        result = prepare_for_prebuilt(batch, [t for _, t in arrived])
        self.output_processor.process_batch_result_decode(batch, result)
        batch.output_ids = result.next_token_ids
        batch.filter_batch()
        if batch.is_empty():
            return running_batch
        batch.sampling_info = SamplingBatchInfo.from_reqs(batch.reqs, batch.vocab_size, batch.device)
        if running_batch.is_empty():
            return batch
        running_batch.merge_batch(batch)
        return running_batch


def prepare_for_prebuilt(batch: ScheduleBatch, first_tokens: List[FirstToken]) -> GenerationBatchResult:
    """Make `batch` (transferred requests) look like a prefill that has just run: its rows and
    lengths, and the prefill server's first tokens as its result (SGLang's
    prepare_for_prebuilt_extend + process_batch_result_prebuilt)."""
    reqs = batch.reqs
    for req, tok in zip(reqs, first_tokens):
        req.cached_tokens = tok.cached_tokens
    batch.forward_mode = ForwardMode.DECODE
    batch.req_pool_indices = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
    batch.seq_lens_cpu = [r.kv_committed_len for r in reqs]
    batch.seq_lens = torch.tensor(batch.seq_lens_cpu, dtype=torch.int64)
    batch.top_logprobs_nums = [r.top_logprobs_num for r in reqs]
    batch.return_logprob = any(r.return_logprob for r in reqs)
    return GenerationBatchResult(
        logits_output=None,
        next_token_ids=torch.tensor([t.token_id for t in first_tokens], dtype=torch.int64),
        next_token_logprobs=torch.tensor([t.logprob or 0.0 for t in first_tokens]) if batch.return_logprob else None,
        top_logprobs_val=[t.top_logprobs_val or [] for t in first_tokens],
        top_logprobs_idx=[t.top_logprobs_idx or [] for t in first_tokens],
    )
