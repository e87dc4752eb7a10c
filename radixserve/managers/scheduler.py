"""The Scheduler (seeds 000, 001, 003): takes tokenized requests, forms batches with the
radix cache and the PrefillAdder, runs them on the TpModelWorker, and reports tokens.

The same class runs in its own process in the served runtime (messages over ZeroMQ) and
in-process under the offline Engine: it talks to the world only through `recv_fn` (returns
the messages that arrived, never blocks) and `send_fn` (takes one outgoing message).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent import futures
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch

from radixserve.constrained.base_grammar_backend import (
    InvalidGrammarObject,
    create_grammar_backend,
    grammar_key,
    grammar_unavailable_message,
    is_invalid_grammar,
)
from radixserve.managers.schedule_batch import (
    FINISH_ABORT,
    Req,
    ScheduleBatch,
)
from radixserve.distributed.parallel_state import broadcast_pyobj, destroy_distributed_environment
from radixserve.managers.overlap import DeviceStream, FutureMap, PendingResult
from radixserve.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy
from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.mem_cache.radix_cache import RadixCache
from radixserve.model_executor.tp_worker import GenerationBatchResult, TpModelWorker
from radixserve.models.model_config import ModelConfig
from radixserve.protocol import (
    AbortReq,
    BatchTokenIDOutput,
    BatchTokenizedGenerateReqInput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    TokenizedGenerateReqInput,
)
from radixserve.server_args import ServerArgs
from radixserve.utils import TypeBasedDispatcher

logger = logging.getLogger(__name__)

# new_token_ratio schedule (seed 001 §9.3; SGLang's defaults)
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
# Non-streaming requests still report every this many tokens (seed 001 §21.1).
DEFAULT_FORCE_STREAM_INTERVAL = 50


class MemoryLeakError(RuntimeError):
    pass


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def resolve_model_path(server_args: ServerArgs) -> str:
    if server_args.model_path:
        return server_args.model_path
    from radixserve.tiny_model import get_tiny_model_path

    return str(get_tiny_model_path())


class Scheduler:
    def __init__(
        self,
        server_args: ServerArgs,
        recv_fn: Callable[[], List[Any]] = lambda: [],
        send_fn: Callable[[Any], None] = lambda obj: None,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_worker: Optional[Any] = None,  # an injected worker (the simulator's); None: load the model
    ):
        self.server_args = args = server_args
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.recv_fn = recv_fn
        self.send_fn = send_fn if tp_rank == 0 else (lambda obj: None)
        model_path = None if tp_worker is not None else resolve_model_path(args)
        self.model_config = tp_worker.model_config if tp_worker is not None else ModelConfig.from_pretrained(model_path)
        self.tokenizer = None if args.skip_tokenizer_init else load_tokenizer(args.tokenizer_path or model_path)
        self.tp_worker = tp_worker or TpModelWorker(args, self.model_config, tp_rank, tp_size)
        self.device = self.tp_worker.device
        self.max_total_num_tokens = self.tp_worker.max_total_num_tokens
        self.max_running_requests = self.tp_worker.max_running_requests
        self.context_len = self.tp_worker.context_len
        self.vocab_size = self.model_config.vocab_size
        self.page_size = args.page_size
        self.req_to_token_pool, self.token_to_kv_pool_allocator = self.tp_worker.get_memory_pool()

        cache_cls = ChunkCache if args.disable_radix_cache else RadixCache
        kwargs = {} if args.disable_radix_cache else {"eviction_policy": args.radix_eviction_policy}
        self.tree_cache = cache_cls(self.req_to_token_pool, self.token_to_kv_pool_allocator, page_size=self.page_size, **kwargs)
        self.policy = SchedulePolicy(
            args.schedule_policy, self.tree_cache, args.enable_priority_scheduling,
            args.schedule_low_priority_values_first, args.seed,
        )
        self.chunked_prefill_size = args.chunked_prefill_size
        self.max_prefill_tokens = args.max_prefill_tokens
        self.is_mixed_chunk = args.enable_mixed_chunk and self.chunked_prefill_size is not None

        # Overlap scheduling (the default on GPU): forwards run in order on a DeviceStream while
        # this thread schedules the next batch; results are processed one iteration late.
        self.enable_overlap = args.overlap_schedule_enabled(self.device)
        self.stream: Optional[DeviceStream] = None
        self.result_queue: Deque[Tuple[ScheduleBatch, PendingResult]] = deque()
        if self.enable_overlap:
            self.stream = DeviceStream(self.device)
            self.future_map = FutureMap(self.max_running_requests, self.chunked_prefill_size, self.context_len, self.device)
        self.stats_overlap = dict(results_processed=0, results_processed_while_busy=0)
        # Seconds of this (CPU scheduling) thread per phase, for bench offline's breakdown.
        self.timing = dict(schedule_s=0.0, forward_s=0.0, process_s=0.0, wait_s=0.0)

        self.waiting_queue: List[Req] = []
        # Structured output: requests wait here while their grammar compiles (seed 000).
        self.grammar_queue: List[Req] = []
        self.grammar_backend = create_grammar_backend(args, self.tokenizer, self.vocab_size, self.model_config.eos_token_ids)
        self.running_batch: ScheduleBatch = self._empty_batch()
        self.cur_batch: Optional[ScheduleBatch] = None
        self.last_batch: Optional[ScheduleBatch] = None
        self.chunked_req: Optional[Req] = None
        self.forward_ct = 0

        self.init_new_token_ratio = min(INIT_NEW_TOKEN_RATIO * args.schedule_conservativeness, 1.0)
        self.min_new_token_ratio = min(self.init_new_token_ratio * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.new_token_ratio_decay = (self.init_new_token_ratio - self.min_new_token_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_new_token_ratio

        # Counters (tests and metrics read them).
        self.stats: Dict[str, int] = dict(
            num_retractions=0, num_retracted_reqs=0, num_preempted_reqs=0, num_prefill_batches=0,
            num_decode_batches=0, num_mixed_batches=0, num_chunked_prefills=0,
            prompt_tokens=0, cached_tokens=0,
        )
        self._dispatcher = TypeBasedDispatcher([
            (TokenizedGenerateReqInput, self.handle_generate_request),
            (BatchTokenizedGenerateReqInput, self.handle_batch_generate_request),
            (AbortReq, self.abort_request),
            (FlushCacheReqInput, self.flush_cache_wrapped),
            (GetInternalStateReq, self.get_internal_state),
        ])
        logger.info(
            "Scheduler ready: max_total_num_tokens=%d, max_running_requests=%d, context_len=%d, page_size=%d",
            self.max_total_num_tokens, self.max_running_requests, self.context_len, self.page_size,
        )

    def _empty_batch(self) -> ScheduleBatch:
        return ScheduleBatch.init_new(
            [], self.req_to_token_pool, self.token_to_kv_pool_allocator, self.tree_cache, self.vocab_size,
            self.device, stream=self.stream,
        )

    # ---- event loop ---------------------------------------------------------------------------
    def event_loop_normal(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Receive, schedule, run, process: one batch at a time (seed 001 §2)."""
        while not should_stop():
            self.process_input_requests(self.recv_requests())
            self.run_step_normal()

    def event_loop_overlap(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """The four phases per iteration (seed 001 §2.2): Pre Schedule N+1, launch N+1,
        Post Schedule N (while N+1 computes), and sampling inside N+1's launch."""
        while not should_stop():
            self.process_input_requests(self.recv_requests())
            self.run_step_overlap()

    def run_step(self) -> Optional[ScheduleBatch]:
        """One loop iteration after intake (the Engine calls this). Returns the batch launched."""
        return self.run_step_overlap() if self.enable_overlap else self.run_step_normal()

    def run_step_normal(self) -> Optional[ScheduleBatch]:
        t0 = time.perf_counter()
        batch = self.get_next_batch_to_run()
        self.cur_batch = batch
        t1 = time.perf_counter()
        self.timing["schedule_s"] += t1 - t0
        if batch is not None:
            result = self.run_batch(batch)
            t2 = time.perf_counter()
            self.process_batch_result(batch, result)
            self.timing["forward_s"] += t2 - t1
            self.timing["process_s"] += time.perf_counter() - t2
        else:
            self.on_idle()
        self.last_batch = batch
        return batch

    def run_step_overlap(self) -> Optional[ScheduleBatch]:
        t0 = time.perf_counter()
        batch = self.get_next_batch_to_run()  # Pre Schedule N+1
        self.cur_batch = batch
        self.timing["schedule_s"] += time.perf_counter() - t0
        disable_overlap_for_batch = self.is_disable_overlap_for_batch(batch)
        if disable_overlap_for_batch:
            self.pop_and_process()
        if batch is not None:
            pending = self.run_batch(batch)  # launch N+1 on the stream
            self.result_queue.append((batch.copy(), pending))
        if self.last_batch is not None and not disable_overlap_for_batch:
            self.pop_and_process()  # Post Schedule N, while N+1 computes
        elif batch is None:
            self.on_idle()
        self.last_batch = batch
        return batch

    def is_disable_overlap_for_batch(self, batch: Optional[ScheduleBatch]) -> bool:
        """Seed 001 §20: with --disable-consecutive-prefill-overlap, a prefill after a prefill
        first processes the previous result (its first token goes out a step earlier).
        Structured output: a decode (or mixed) batch with grammar requests needs the token in
        flight accepted by their matchers before its mask can be filled, so it waits too."""
        return (
            self.server_args.disable_consecutive_prefill_overlap
            and batch is not None and batch.forward_mode.is_extend()
            and self.last_batch is not None and self.last_batch.forward_mode.is_extend()
        ) or (
            batch is not None and bool(self.result_queue)
            and (batch.forward_mode.is_decode() or batch.forward_mode.is_mixed())
            and any(r.grammar is not None for r in batch.reqs)
        )

    def pop_and_process(self) -> None:
        if not self.result_queue:
            return
        batch, pending = self.result_queue.popleft()
        self.stats_overlap["results_processed"] += 1
        if self.stream.busy.is_set():
            self.stats_overlap["results_processed_while_busy"] += 1
        t0 = time.perf_counter()
        result = pending.wait()
        t1 = time.perf_counter()
        self.process_batch_result(batch, result)
        self.timing["wait_s"] += t1 - t0
        self.timing["process_s"] += time.perf_counter() - t1

    def on_idle(self) -> None:
        self.self_check_during_idle()
        self.new_token_ratio = self.init_new_token_ratio

    def has_work(self) -> bool:
        return bool(self.waiting_queue) or bool(self.grammar_queue) or not self.running_batch.is_empty() or self.chunked_req is not None or bool(
            self.result_queue
        ) or (
            self.last_batch is not None and self.last_batch.forward_mode is not None
            and self.last_batch.forward_mode.is_extend() and not self.last_batch.is_empty()
        )

    def shutdown(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self.grammar_backend is not None:
            self.grammar_backend.shutdown()
        if self.tp_size > 1:
            destroy_distributed_environment()

    # ---- intake (seed 000) -------------------------------------------------------------------
    def recv_requests(self) -> List[Any]:
        """Rank 0 reads the socket; with --tp-size > 1 it broadcasts what it got, so every
        rank schedules the same batches (only rank 0 talks to the outside)."""
        reqs = self.recv_fn() if self.tp_rank == 0 else None
        return broadcast_pyobj(reqs) if self.tp_size > 1 else reqs

    def process_input_requests(self, recv_reqs: List[Any]) -> None:
        for recv_req in recv_reqs:
            out = self._dispatcher(recv_req)
            if out is not None:
                self.send_fn(out)

    def handle_batch_generate_request(self, recv: BatchTokenizedGenerateReqInput) -> None:
        for r in recv.batch:
            self.handle_generate_request(r)

    def handle_generate_request(self, recv: TokenizedGenerateReqInput) -> None:
        req = Req(
            recv.rid, recv.input_text, recv.input_ids, recv.sampling_params,
            return_logprob=recv.return_logprob, top_logprobs_num=recv.top_logprobs_num,
            logprob_start_len=recv.logprob_start_len, stream=recv.stream, priority=recv.priority,
            eos_token_ids=set(self.model_config.eos_token_ids), vocab_size=self.vocab_size,
            tokenizer=self.tokenizer,
        )
        try:
            self._admit(req)
        except Exception as e:  # a bug one request's input reached: end that request, serve the rest
            logger.exception("Failed to admit request %s; it is aborted", req.rid)
            for queue in (self.waiting_queue, self.grammar_queue):
                if req in queue:
                    queue.remove(req)
            req.finished_reason = FINISH_ABORT(
                f"Internal error while admitting the request: {type(e).__name__}: {e}",
                status_code=500, err_type="InternalServerError",
            )
            self.stream_output([req])

    def _admit(self, req: Req) -> None:
        """Validate the request, then queue it: in the grammar queue while its grammar compiles,
        else in the waiting queue. A refused request is finished with its 4xx/503 here."""
        error = self._validate_request(req)
        if error is not None:
            message, status = error
            req.finished_reason = FINISH_ABORT(message, status_code=status, err_type="BadRequestError" if status == 400 else "ServiceUnavailable")
            self.stream_output([req])
            return
        key = grammar_key(req.sampling_params)
        if key is not None:
            if self.grammar_backend is None:
                self._abort_grammar_req(req, grammar_unavailable_message(self.server_args))
                return
            value, cache_hit = self.grammar_backend.get_cached_or_future_value(key)
            if not cache_hit:  # compiling: wait in the grammar queue
                req.grammar, req.grammar_key = value, key
                req.grammar_queued_at = time.monotonic()
                self.grammar_queue.append(req)
                return
            if is_invalid_grammar(value):  # a cached invalid grammar fails fast
                self._abort_grammar_req(req, value.message)
                return
            req.grammar = value
        self._add_request_to_queue(req)

    # ---- grammar queue (seed 000, seed 001 §12) ---------------------------------------------
    def move_ready_grammar_requests(self) -> None:
        """Requests whose grammar compiled go to the waiting queue (in arrival order); an
        invalid grammar or one older than --grammar-timeout finishes the request with a 400.
        With TP, rank 0 decides and the other ranks follow (they wait for their own compile)."""
        if self.grammar_backend is None:
            return
        if self._grammar_idle():
            # Nothing else to run: wait a little for a compile instead of spinning.
            futures.wait([self.grammar_queue[0].grammar], timeout=0.005)
        timeout = self.server_args.grammar_timeout
        now = time.monotonic()
        decisions = [
            "ready" if req.grammar.done() else "timeout" if now - req.grammar_queued_at > timeout else "wait"
            for req in self.grammar_queue
        ]
        if self.tp_size > 1:
            decisions = broadcast_pyobj(decisions if self.tp_rank == 0 else None)
        still_waiting: List[Req] = []
        for req, decision in zip(self.grammar_queue, decisions):
            if decision == "wait":
                still_waiting.append(req)
            elif decision == "timeout":
                req.grammar.cancel()
                message = f"Grammar compilation timed out after {timeout:g} s (--grammar-timeout)."
                # Cache it as invalid: the same grammar fails fast instead of timing out again.
                self.grammar_backend.set_cache(req.grammar_key, InvalidGrammarObject(message))
                self._abort_grammar_req(req, message)
            else:
                value = req.grammar.result()
                if is_invalid_grammar(value):
                    self._abort_grammar_req(req, value.message)
                else:
                    req.grammar = value
                    self._add_request_to_queue(req)
        self.grammar_queue = still_waiting

    def _grammar_idle(self) -> bool:
        return bool(self.grammar_queue) and not self.waiting_queue and self.running_batch.is_empty() and (
            self.chunked_req is None and not self.result_queue
        )

    def _abort_grammar_req(self, req: Req, message: str) -> None:
        req.grammar = None
        req.finished_reason = FINISH_ABORT(message, status_code=400, err_type="BadRequestError")
        self.stream_output([req])

    def _validate_request(self, req: Req) -> Optional[tuple]:
        n = len(req.origin_input_ids)
        if n == 0:
            return "The input is empty: give a prompt or input_ids.", 400
        if n >= self.context_len:
            return (
                f"The input ({n} tokens) is longer than the model's context length ({self.context_len} tokens).",
                400,
            )
        if any(not 0 <= t < self.vocab_size for t in req.origin_input_ids):
            return f"Input token ids must be in [0, {self.vocab_size}).", 400
        sp = req.sampling_params
        room = self.context_len - n - 1
        sp.max_new_tokens = room if sp.max_new_tokens is None else min(sp.max_new_tokens, room)
        max_queued = self.server_args.max_queued_requests
        if max_queued is not None and len(self.waiting_queue) + len(self.grammar_queue) >= max_queued:
            return "The request queue is full.", 503
        return None

    def _add_request_to_queue(self, req: Req, is_retracted: bool = False) -> None:
        if is_retracted and req.grammar is not None:
            req.grammar.reset_to(req.output_ids)  # the matcher follows the output_ids kept
        self.waiting_queue.append(req)

    # ---- batch selection (seed 001 §4) ----------------------------------------------------------
    def get_next_batch_to_run(self) -> Optional[ScheduleBatch]:
        # 1. Stash the chunked request: its chunk so far goes into the tree (and stays locked).
        chunked_to_exclude: List[Req] = []
        if self.chunked_req is not None:
            chunked_to_exclude.append(self.chunked_req)
            if self.chunked_req.to_finish is not None:
                self._release_aborted_chunked_req(self.chunked_req)
                self.chunked_req = None
            else:
                self.tree_cache.cache_unfinished_req(self.chunked_req, chunked=True)

        # 2. Merge the last prefill batch into the running batch.
        if self.last_batch is not None and self.last_batch.forward_mode.is_extend():
            self.last_batch.filter_batch(chunked_req_to_exclude=chunked_to_exclude)
            if not self.last_batch.is_empty():
                if self.running_batch.is_empty():
                    self.running_batch = self.last_batch
                else:
                    self.running_batch.merge_batch(self.last_batch)

        # 3. Prefill first; 4. otherwise decode.
        if self.grammar_queue:
            self.move_ready_grammar_requests()
        new_batch = self.get_new_batch_prefill()
        if new_batch is not None:
            return new_batch
        if self.running_batch.is_empty():
            return None
        self.running_batch = self.update_running_batch(self.running_batch)
        return None if self.running_batch.is_empty() else self.running_batch

    def get_num_allocatable_reqs(self, running_bs: int) -> int:
        limit = self.max_running_requests - running_bs
        if self.server_args.prefill_max_requests is not None:
            limit = min(limit, self.server_args.prefill_max_requests)
        return limit

    def get_new_batch_prefill(self) -> Optional[ScheduleBatch]:
        try_preemption = self.server_args.enable_priority_scheduling
        if (self.running_batch.batch_is_full or not self.waiting_queue) and self.chunked_req is None:
            if not (try_preemption and self.waiting_queue):
                return None
        running_bs = self.running_batch.batch_size()
        if self.get_num_allocatable_reqs(running_bs) <= 0 and self.chunked_req is None and not try_preemption:
            self.running_batch.batch_is_full = True
            return None

        self.policy.calc_priority(self.waiting_queue)
        adder = PrefillAdder(
            self.page_size, self.tree_cache, self.token_to_kv_pool_allocator, self.running_batch,
            self.new_token_ratio, self.max_prefill_tokens, self.chunked_prefill_size,
            mixed_with_decode_tokens=running_bs if self.is_mixed_chunk else 0,
            priority_scheduling_preemption_threshold=self.server_args.priority_scheduling_preemption_threshold,
            policy=self.policy,
        )
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)

        for req in self.waiting_queue:
            running_bs = self.running_batch.batch_size()
            slots_full = len(adder.can_run_list) >= self.get_num_allocatable_reqs(running_bs)
            if slots_full or self.running_batch.batch_is_full:
                req.init_next_round_input(self.tree_cache)
                if not (try_preemption and adder.preempt_to_schedule(req, need_slot=slots_full)):
                    self.running_batch.batch_is_full = True
                    break
                self.running_batch.batch_is_full = False
            req.init_next_round_input(self.tree_cache)
            res = adder.add_one_req(req, has_chunked_req=self.chunked_req is not None)
            if res == AddReqResult.NO_TOKEN and try_preemption and req not in adder.can_run_list:
                if adder.preempt_to_schedule(req, need_slot=False):
                    res = adder.add_one_req(req, has_chunked_req=self.chunked_req is not None)
            if res != AddReqResult.CONTINUE:
                if res == AddReqResult.NO_TOKEN:
                    self.running_batch.batch_is_full = True
                break

        for r in adder.preempt_list:
            self.stats["num_preempted_reqs"] += 1
            self._add_request_to_queue(r, is_retracted=True)
        can_run_list = adder.can_run_list
        if not can_run_list:
            return None
        chosen = set(id(r) for r in can_run_list)
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in chosen]
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.is_chunked += 1
            self.stats["num_chunked_prefills"] += 1
        for r in can_run_list:
            if r.is_chunked <= 1 and r.already_computed == 0:
                self.stats["prompt_tokens"] += len(r.origin_input_ids)
        self.stats["cached_tokens"] += adder.log_hit_tokens

        new_batch = ScheduleBatch.init_new(
            can_run_list, self.req_to_token_pool, self.token_to_kv_pool_allocator, self.tree_cache,
            self.vocab_size, self.device, chunked_req=self.chunked_req, stream=self.stream,
        )
        new_batch.prepare_for_extend()

        # Mixed chunk: the running batch decodes inside this extend forward (seed 001 §11).
        if self.is_mixed_chunk and not self.running_batch.is_empty():
            self.running_batch.filter_batch()
            if not self.running_batch.is_empty():
                self.running_batch.prepare_for_decode()
                new_batch.mix_with_running(self.running_batch)
                new_batch.decoding_reqs = self.running_batch.reqs
            batch_is_full = self.running_batch.batch_is_full
            self.running_batch = self._empty_batch()
            self.running_batch.batch_is_full = batch_is_full
        return new_batch

    def update_running_batch(self, batch: ScheduleBatch) -> ScheduleBatch:
        initial_bs = batch.batch_size()
        batch.filter_batch()
        if batch.is_empty():
            batch.batch_is_full = False
            return batch
        interval = self.server_args.test_retract_interval
        force_retract = interval is not None and self.forward_ct % interval == 0 and batch.batch_size() > 1
        if force_retract or not batch.check_decode_mem():
            retracted, self.new_token_ratio = batch.retract_decode()
            self.stats["num_retractions"] += 1
            self.stats["num_retracted_reqs"] += len(retracted)
            logger.info(
                "KV cache pool is full. Retract requests. #retracted_reqs: %d, #new_token_ratio: %.4f",
                len(retracted), self.new_token_ratio,
            )
            for req in retracted:
                self._add_request_to_queue(req, is_retracted=True)
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)
        if batch.batch_size() < initial_bs:
            batch.batch_is_full = False
        batch.prepare_for_decode()
        return batch

    # ---- running ------------------------------------------------------------------------------
    def run_batch(self, batch: ScheduleBatch) -> Any:
        """Normal loop: run and return the GenerationBatchResult. Overlap loop: launch on the
        stream and return a PendingResult; batch.output_ids become future placeholders."""
        self.forward_ct += 1
        mode = batch.forward_mode
        key = "num_decode_batches" if mode.is_decode() else "num_mixed_batches" if mode.is_mixed() else "num_prefill_batches"
        self.stats[key] += 1
        worker_batch = batch.get_model_worker_batch()
        if self.grammar_backend is not None:
            # This forward's grammar mask, filled now on this thread (the matchers have seen
            # every earlier token: see is_disable_overlap_for_batch).
            worker_batch.token_bitmask = self.grammar_backend.fill_token_bitmask(batch.reqs)
        if not self.enable_overlap:
            result = self.tp_worker.forward_batch_generation(worker_batch)
            batch.output_ids = result.next_token_ids
            return result
        future_indices = self.future_map.alloc_future_indices(batch.batch_size())
        pending = PendingResult()
        self.stream.submit(self._forward_on_stream, worker_batch, future_indices, pending)
        batch.output_ids = -future_indices
        return pending

    def _forward_on_stream(self, worker_batch, future_indices: torch.Tensor, pending: PendingResult) -> None:
        """Runs on the DeviceStream: resolve placeholders, forward + sample, publish tokens."""
        try:
            worker_batch.input_ids = self.future_map.resolve_future(worker_batch.input_ids)
            result = self.tp_worker.forward_batch_generation(worker_batch)
            self.future_map.store_to_map(future_indices, result.next_token_ids)
            result.next_token_ids, result.copy_done = self.tp_worker.to_host(result.next_token_ids)
            pending.set(result)
        except BaseException as e:
            pending.fail(e)
            raise

    # ---- results (seed 001 §10) ------------------------------------------------------------------
    def process_batch_result(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        if batch.forward_mode.is_decode():
            self.process_batch_result_decode(batch, result)
        else:
            self.process_batch_result_prefill(batch, result)

    def process_batch_result_prefill(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        next_ids = result.next_token_ids.tolist()
        if batch.input_logprob_counts:
            self._add_input_logprobs(batch, result)
        decoding = set(id(r) for r in (batch.decoding_reqs or []))
        self.token_to_kv_pool_allocator.free_group_begin()
        for i, req in enumerate(batch.reqs):
            if req.is_chunked > 0:
                req.is_chunked -= 1  # a middle chunk: its sampled token means nothing
                continue
            if self._is_stale(req):
                continue
            if self._append_token(req, next_ids[i], result, i):
                continue
            if id(req) not in decoding:
                # The prompt enters the tree now, so requests behind it can share it.
                self.tree_cache.cache_unfinished_req(req)
        self.token_to_kv_pool_allocator.free_group_end()
        self.stream_output(batch.reqs)

    @staticmethod
    def _add_input_logprobs(batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        values = result.logits_output.input_token_logprobs
        values = values.tolist() if values is not None else []
        offset = 0
        for req, n in zip(batch.reqs, batch.input_logprob_counts):
            if n == 0 or req.req_pool_idx is None:  # retracted while in flight: recomputed later
                offset += n
                continue
            if not req.input_token_logprobs_idx and req.logprob_start_len == 0:
                req.input_token_logprobs_val.append(None)  # the first token has no context
                req.input_token_logprobs_idx.append(req.origin_input_ids[0])
            first = req.next_input_logprob_token()
            req.input_token_logprobs_val += values[offset : offset + n]
            req.input_token_logprobs_idx += req.origin_input_ids[first : first + n]
            offset += n

    def _append_token(self, req: Req, token: int, result: GenerationBatchResult, i: int) -> bool:
        """Append a sampled token, check the finish conditions; a finished request hands its
        KV to the tree. Returns whether it finished."""
        req.output_ids.append(token)
        if req.grammar is not None:
            self._accept_grammar_token(req, token)
        req.check_finished()
        self._append_logprobs(req, result, i)
        if not req.finished():
            return False
        req.grammar = None  # release the matcher
        self.tree_cache.cache_finished_req(req)
        return True

    @staticmethod
    def _accept_grammar_token(req: Req, token: int) -> None:
        """Advance the request's matcher; a rejected token (the mask was not applied, or a
        NaN made an impossible token) ends the request instead of corrupting its output."""
        if not req.grammar.accept_token(token) and req.to_finish is None:
            logger.error("Request %s: the grammar rejected token %d after %d tokens.", req.rid, token, len(req.output_ids) - 1)
            req.to_finish = FINISH_ABORT(
                f"Internal error: the grammar rejected the sampled token {token}.", status_code=500,
                err_type="InternalServerError",
            )

    @staticmethod
    def _is_stale(req: Req) -> bool:
        """Overlap: the batch was launched before this request finished (the extra forward of
        seed 001 §2.8.7) or was retracted; its token is dropped."""
        return req.finished() or req.req_pool_idx is None

    def process_batch_result_decode(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        next_ids = result.next_token_ids.tolist()
        self.token_to_kv_pool_allocator.free_group_begin()
        for i, req in enumerate(batch.reqs):
            if not self._is_stale(req):
                self._append_token(req, next_ids[i], result, i)
        self.token_to_kv_pool_allocator.free_group_end()
        self.stream_output(batch.reqs)

    @staticmethod
    def _append_logprobs(req: Req, result: GenerationBatchResult, i: int) -> None:
        if not req.return_logprob or result.next_token_logprobs is None:
            return
        req.output_token_logprobs_val.append(float(result.next_token_logprobs[i]))
        req.output_token_logprobs_idx.append(req.output_ids[-1])
        if req.top_logprobs_num > 0 and result.top_logprobs_val is not None:
            req.output_top_logprobs_val.append(result.top_logprobs_val[i])
            req.output_top_logprobs_idx.append(result.top_logprobs_idx[i])

    # ---- output (seed 001 §21) --------------------------------------------------------------------
    def stream_output(self, reqs: List[Req]) -> None:
        out = BatchTokenIDOutput([], [], [], [], [], [], [], [], [], [])
        interval = self.server_args.stream_interval
        for req in reqs:
            if req.is_chunked > 0:
                continue
            n = len(req.output_ids)
            if req.finished_sent:
                continue
            if req.finished():
                req.finished_sent = True
            elif req.stream:
                if n == 0 or (n - req.send_token_offset < interval and n != 1):
                    continue
            elif n == 0 or n % DEFAULT_FORCE_STREAM_INTERVAL != 0:
                continue
            start = req.send_token_offset
            sp = req.sampling_params
            out.rids.append(req.rid)
            out.finished_reasons.append(req.finished_reason.to_json() if req.finished() else None)
            out.decode_ids.append(req.output_ids[start:])
            out.output_ids_len.append(n)
            out.prompt_tokens.append(len(req.origin_input_ids))
            out.completion_tokens.append(n)
            out.cached_tokens.append(req.cached_tokens)
            out.skip_special_tokens.append(sp.skip_special_tokens)
            out.spaces_between_special_tokens.append(sp.spaces_between_special_tokens)
            out.no_stop_trim.append(sp.no_stop_trim)
            out.retraction_counts.append(req.retraction_count)
            if req.return_logprob:
                k = req.input_logprob_send_offset
                out.input_token_logprobs_val.append(req.input_token_logprobs_val[k:])
                out.input_token_logprobs_idx.append(req.input_token_logprobs_idx[k:])
                req.input_logprob_send_offset = len(req.input_token_logprobs_idx)
                out.output_token_logprobs_val.append(req.output_token_logprobs_val[start:])
                out.output_token_logprobs_idx.append(req.output_token_logprobs_idx[start:])
                out.output_top_logprobs_val.append(req.output_top_logprobs_val[start:])
                out.output_top_logprobs_idx.append(req.output_top_logprobs_idx[start:])
            else:
                for lst in (out.input_token_logprobs_val, out.input_token_logprobs_idx,
                            out.output_token_logprobs_val, out.output_token_logprobs_idx,
                            out.output_top_logprobs_val, out.output_top_logprobs_idx):
                    lst.append([])
            req.send_token_offset = n
        if out.rids:
            self.send_fn(out)

    # ---- abort / flush / state ------------------------------------------------------------------------
    def abort_request(self, recv: AbortReq) -> None:
        def match(r: Req) -> bool:
            return recv.abort_all or r.rid == recv.rid

        message = "Aborted by AbortReq."
        aborted = [r for r in self.waiting_queue + self.grammar_queue if match(r)]
        self.waiting_queue = [r for r in self.waiting_queue if not match(r)]
        self.grammar_queue = [r for r in self.grammar_queue if not match(r)]
        for r in aborted:  # holds no KV: finish now
            if isinstance(r.grammar, futures.Future):
                r.grammar.cancel()  # still compiling
            r.grammar = None
            r.finished_reason = FINISH_ABORT(message)
        if aborted:
            self.stream_output(aborted)
        # Running and chunked requests finish at their next check_finished (or stash).
        running = list(self.running_batch.reqs)
        if self.last_batch is not None:
            running += self.last_batch.reqs
        if self.chunked_req is not None:
            running.append(self.chunked_req)
        for r in running:
            if match(r) and not r.finished():
                r.to_finish = FINISH_ABORT(message)

    def _release_aborted_chunked_req(self, req: Req) -> None:
        """A request aborted between two chunks: cache its chunk, then let everything go."""
        self.tree_cache.cache_unfinished_req(req, chunked=True)
        self._empty_batch().release_req(req)
        req.finished_reason, req.to_finish = req.to_finish, None
        self.stream_output([req])

    def flush_cache(self) -> bool:
        if self.has_work():
            logger.warning("Cache not flushed because there are pending requests.")
            return False
        self.tree_cache.reset()
        self.token_to_kv_pool_allocator.clear()
        self.req_to_token_pool.clear()
        if self.grammar_backend is not None:
            self.grammar_backend.reset()  # compiled grammars too (SGLang does the same)
        self.new_token_ratio = self.init_new_token_ratio
        self.last_batch = None
        return True

    def flush_cache_wrapped(self, recv: FlushCacheReqInput) -> FlushCacheReqOutput:
        ok = self.flush_cache()
        return FlushCacheReqOutput(ok, "" if ok else "Cache not flushed: requests are running or waiting.")

    def get_internal_state(self, recv: GetInternalStateReq) -> GetInternalStateReqOutput:
        return GetInternalStateReqOutput(self.internal_state())

    def internal_state(self) -> Dict[str, Any]:
        return dict(
            self.stats,
            max_total_num_tokens=self.max_total_num_tokens,
            max_running_requests=self.max_running_requests,
            context_len=self.context_len,
            new_token_ratio=self.new_token_ratio,
            num_waiting_reqs=len(self.waiting_queue),
            num_grammar_queue_reqs=len(self.grammar_queue),
            num_running_reqs=self.running_batch.batch_size(),
            available_tokens=self.token_to_kv_pool_allocator.available_size(),
            evictable_tokens=self.tree_cache.evictable_size(),
            protected_tokens=self.tree_cache.protected_size(),
        )

    # ---- invariants ---------------------------------------------------------------------------------
    def self_check_during_idle(self) -> None:
        """With nothing running, every slot is free or in the tree and no node is locked."""
        if not self.running_batch.is_empty() or self.chunked_req is not None:
            return
        self.check_memory()

    def check_memory(self) -> None:
        available = self.token_to_kv_pool_allocator.available_size()
        evictable = self.tree_cache.evictable_size()
        protected = self.tree_cache.protected_size()
        if available + evictable != self.max_total_num_tokens or protected != 0:
            msg = (
                f"KV cache memory leak detected! available={available}, evictable={evictable}, "
                f"protected={protected}, total={self.max_total_num_tokens}"
            )
            logger.error(msg)
            raise MemoryLeakError(msg)
        if self.req_to_token_pool.available_size() != self.req_to_token_pool.size:
            msg = (
                f"req_to_token_pool leak detected! free rows={self.req_to_token_pool.available_size()}, "
                f"size={self.req_to_token_pool.size}"
            )
            logger.error(msg)
            raise MemoryLeakError(msg)
