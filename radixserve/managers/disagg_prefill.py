"""The prefill server of PD disaggregation (seed 001 §8.2, SGLang's prefill mixin).

    request (bootstrap_room) -> PrefillBootstrapQueue  until the decode side has preallocated
        -> waiting_queue -> the normal PrefillAdder path -> prefill forward (first token)
        -> disagg_prefill_inflight_queue  while the KV is sent (KVSender.send)
        -> finished: its KV stays in the radix tree, the 1-token result goes to the client

A request without a bootstrap_room is served locally, as by a unified server.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, List

from radixserve.disaggregation.conn import KVManager, KVSender
from radixserve.disaggregation.utils import FirstToken, KVPoll
from radixserve.managers.output_processor import SchedulerOutputProcessor
from radixserve.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req
from radixserve.mem_cache.kv_ledger import KVLedger
from radixserve.model_executor.tp_worker import GenerationBatchResult

logger = logging.getLogger(__name__)


def transfer_error(message: str, status_code: int = 500) -> FINISH_ABORT:
    return FINISH_ABORT(message, status_code=status_code, err_type="InternalServerError" if status_code >= 500 else "BadRequestError")


class PrefillBootstrapQueue:
    """Requests whose decode side has not preallocated yet (KVSender Bootstrapping)."""

    def __init__(self, kv_manager: KVManager, timeout: float):
        self.kv_manager = kv_manager
        self.timeout = timeout
        self.queue: List[Req] = []

    def add(self, req: Req) -> None:
        req.disagg_kv_sender = KVSender(self.kv_manager, req.bootstrap_room)
        req.disagg_queued_at = time.monotonic()
        self.queue.append(req)

    def pop_bootstrapped(self) -> tuple:
        """(requests ready to prefill, [(request, failure reason)])."""
        ready, failed, keep = [], [], []
        now = time.monotonic()
        for req in self.queue:
            state = req.disagg_kv_sender.poll()
            if state == KVPoll.WaitingForInput:
                ready.append(req)
            elif state == KVPoll.Failed:
                failed.append((req, transfer_error(req.disagg_kv_sender.failure())))
            elif now - req.disagg_queued_at > self.timeout:
                failed.append((req, transfer_error(
                    f"no decode server preallocated this request's KV within {self.timeout:g} s "
                    "(--disaggregation-timeout)", 504)))
            else:
                keep.append(req)
        self.queue = keep
        return ready, failed


class PrefillDisaggregation:
    """The prefill server's two queues and what it does with a prefilled request."""

    def __init__(self, kv_manager: KVManager, ledger: KVLedger, output_processor: SchedulerOutputProcessor,
                 timeout: float):
        self.kv_manager = kv_manager
        self.ledger = ledger  # the request's row (read: its slots to send), its KV to the tree
        self.output_processor = output_processor
        self.bootstrap_queue = PrefillBootstrapQueue(kv_manager, timeout)
        self.inflight_queue: List[Req] = []  # SGLang's disagg_prefill_inflight_queue
        output_processor.on_disagg_prefilled = self.on_prefilled

    def __len__(self) -> int:
        return len(self.bootstrap_queue.queue) + len(self.inflight_queue)

    def add(self, req: Req) -> None:
        req.sampling_params.max_new_tokens = 1  # this server samples the first token only
        self.bootstrap_queue.add(req)

    def pop_bootstrapped(self) -> List[Req]:
        ready, failed = self.bootstrap_queue.pop_bootstrapped()
        for req, reason in failed:
            req.disagg_kv_sender.clear()
            self.output_processor.finish(req, reason)
        return ready

    def on_prefilled(self, req: Req, token: int, result: GenerationBatchResult, i: int) -> None:
        """The last chunk of a request's prefill ran: send its KV and first token."""
        sender = req.disagg_kv_sender
        if req.to_finish is not None:  # aborted while it waited or prefilled: finish it here
            sender.abort(req.to_finish.to_json().get("message", "aborted"))
            sender.clear()
            self.output_processor.append_token(req, token, result, i)
            return
        req.output_ids.append(token)
        self.output_processor.append_logprobs(req, result, i)
        req.grammar = None  # the decode server's matcher takes over from the first token
        first = FirstToken(token, cached_tokens=req.cached_tokens)
        if req.return_logprob and req.output_token_logprobs_val:
            first.logprob = req.output_token_logprobs_val[-1]
            if req.output_top_logprobs_val:
                first.top_logprobs_val = list(req.output_top_logprobs_val[-1])
                first.top_logprobs_idx = list(req.output_top_logprobs_idx[-1])
        slots = self.ledger.row(req)[: len(req.origin_input_ids)]
        sender.send(slots, req.origin_input_ids, first)
        self.inflight_queue.append(req)

    def process_inflight_queue(self) -> None:
        """Finish the requests whose transfer ended; their KV goes to the tree only now."""
        done, keep = [], []
        for req in self.inflight_queue:
            state = req.disagg_kv_sender.poll()
            if state == KVPoll.Success:
                reason = req.to_finish or FINISH_LENGTH(length=len(req.output_ids))
            elif state == KVPoll.Failed:
                reason = transfer_error(req.disagg_kv_sender.failure())
            else:
                keep.append(req)
                continue
            req.disagg_kv_sender.clear()
            req.to_finish, req.finished_reason = None, reason
            self.ledger.cache_finished_req(req)
            done.append(req)
        self.inflight_queue = keep
        if done:
            self.output_processor.stream_output(done)

    def abort(self, match: Callable[[Req], bool], message: str) -> None:
        queued = [r for r in self.bootstrap_queue.queue if match(r)]
        self.bootstrap_queue.queue = [r for r in self.bootstrap_queue.queue if not match(r)]
        for req in queued:
            req.disagg_kv_sender.abort(message)
            req.disagg_kv_sender.clear()
            self.output_processor.finish(req, FINISH_ABORT(message))
        for req in self.inflight_queue:  # the transfer is under way: finish when it ends
            if match(req):
                req.to_finish = FINISH_ABORT(message)

    def live_reqs(self) -> List[Req]:
        return list(self.inflight_queue)
