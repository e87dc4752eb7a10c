"""The Scheduler (seeds 000, 001, 003): takes tokenized requests, forms batches with the
radix cache and the PrefillAdder, runs them on the TpModelWorker, and reports tokens.

    recv_requests -> process_input_requests -> get_next_batch_to_run -> run_batch
        -> process_batch_result (SchedulerOutputProcessor) -> BatchTokenIDOutput

The same class runs in its own process in the served runtime (messages over ZeroMQ) and
in-process under the offline Engine: it talks to the world only through `recv_fn` (returns
the messages that arrived, never blocks) and `send_fn` (takes one outgoing message).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from radixserve.distributed.parallel_state import broadcast_pyobj, destroy_distributed_environment
from radixserve.managers.batch_runner import GrammarMaskRunner, select_batch_runner
from radixserve.managers.encode_queue import EncodeQueue
from radixserve.managers.grammar import GrammarQueue
from radixserve.managers.loop_state import BatchSlot, LoopState, LoopSteps, loop_field
from radixserve.managers.output_processor import SchedulerOutputProcessor
from radixserve.managers.overlap import TpModelWorkerClient
from radixserve.managers.schedule_batch import FINISH_ABORT, Req, ScheduleBatch
from radixserve.managers.scheduler_disagg import init_disaggregation
from radixserve.managers.scheduler_embedding import EmbeddingOutputProcessor, SchedulerEmbedding
from radixserve.managers.scheduler_internal_state import SETTABLE_AT_RUN_TIME, SchedulerInternalState
from radixserve.managers.scheduler_lora import SchedulerLoRA
from radixserve.managers.scheduler_memory_saver import SchedulerMemorySaver
from radixserve.managers.scheduler_pause import GenerationPause, expects_progress
from radixserve.managers.scheduler_pp import PPLoop, SchedulerPP
from radixserve.managers.scheduler_eplb import SchedulerEPLB
from radixserve.managers.scheduler_expert_distribution import SchedulerExpertDistribution
from radixserve.managers.scheduler_profiler import SchedulerProfiler
from radixserve.managers.schedule_policy import NewTokenRatio, PrefillAdder, SchedulePolicy
from radixserve.managers.scheduler_stats import SchedulerStats
from radixserve.managers.scheduler_builder import SchedulerParts, build_scheduler_parts
from radixserve.managers.scheduler_update_weights import SchedulerUpdateWeights, SettleLoop, WeightsUpdateGroupJoined
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache, MemoryLeakError
from radixserve.mem_cache.kv_ledger import KVLedger, MambaTokenInfo
from radixserve.model_executor.tp_worker import GenerationBatchResult
from radixserve.model_executor.worker_protocol import ModelWorker
from radixserve.protocol import (
    AbortReq, BatchTokenizedGenerateReqInput, FlushCacheReqInput, FlushCacheReqOutput, GetInternalStateReq,
    GetInternalStateReqOutput, TokenizedGenerateReqInput, is_health_check_generate_req,
)
from radixserve.sampling_params import input_ids_error
from radixserve.server_args import ServerArgs
from radixserve.utils import TypeBasedDispatcher

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns the waiting queue, the running batch, the chunked request and the prefix cache,
    and decides what runs next (seed 001's loop). Its collaborators: the TpModelWorker
    (forward + sample), the SchedulerOutputProcessor (results -> Req updates -> outputs), the
    GrammarQueue (structured-output admission), the SchedulePolicy and PrefillAdder
    (admission order and budgets), and in the overlap loop a TpModelWorkerClient (a
    ForwardThread and a FutureMap)."""

    # The loop state lives in self.loop (loop_state.py), which the pause, the memory saver and PP share.
    waiting_queue = loop_field("waiting_queue")
    running_batch = loop_field("running_batch")
    last_batch = loop_field("last_batch")
    chunked_req = loop_field("chunked_req")

    def __init__(
        self,
        server_args: ServerArgs,
        recv_fn: Callable[[], List[Any]] = lambda: [],
        send_fn: Callable[[Any], None] = lambda obj: None,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_worker: Optional[ModelWorker] = None,  # injected (the simulator's SimModelWorker); None: load the model
        parts: Optional[SchedulerParts] = None,  # None: build_scheduler_parts (over tp_worker)
    ):
        self.server_args = args = server_args
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.recv_fn = recv_fn
        self.send_fn = send_fn if tp_rank == 0 else (lambda obj: None)
        # Built outside (scheduler_builder.py): the worker, the cache and the ledger, grammar, speculative, HiCache.
        assert parts is None or tp_worker is None, "pass the worker in the parts (build_scheduler_parts(..., tp_worker))"
        parts = parts or build_scheduler_parts(args, tp_rank, tp_size, tp_worker)
        self.tokenizer, tp_worker = parts.tokenizer, parts.tp_worker
        self.tp_worker, self.model_config, self.device = tp_worker, tp_worker.model_config, tp_worker.device
        self.max_total_num_tokens = tp_worker.max_total_num_tokens
        self.max_running_requests = tp_worker.max_running_requests
        self.context_len, self.vocab_size = tp_worker.context_len, self.model_config.vocab_size
        self.page_size = args.page_size
        self.req_to_token_pool, self.token_to_kv_pool_allocator = tp_worker.get_memory_pool()
        # The SWA pool (--enable-hybrid-swa-memory on a windowed model): its tree and its ledger part.
        self.swa_pool = parts.swa_pool
        self.tree_cache: BasePrefixCache = parts.tree_cache
        # The one owner of KV: rows, slots and tree locks (everything below asks it).
        self.ledger: KVLedger = parts.ledger
        self.policy = SchedulePolicy(
            args.schedule_policy, self.tree_cache, args.enable_priority_scheduling,
            args.schedule_low_priority_values_first, args.seed,
        )
        self.chunked_prefill_size = args.chunked_prefill_size_on(self.device)
        self.max_prefill_tokens = args.max_prefill_tokens
        self.is_mixed_chunk = args.enable_mixed_chunk and self.chunked_prefill_size is not None

        # Overlap scheduling (the default on GPU): forwards run in order on a ForwardThread
        # while this thread schedules the next batch; results are processed one iteration late.
        self.enable_overlap = args.overlap_schedule_enabled(self.device)
        self.overlap_worker = TpModelWorkerClient(
            tp_worker, self.max_running_requests, self.chunked_prefill_size, self.context_len, self.ledger,
        ) if self.enable_overlap else None
        # Overlap: sampling-state changes are queued on the forward thread, behind the forwards in flight.
        self.forward_thread = self.overlap_worker.forward_thread if self.overlap_worker else None
        self.tree_cache.io_thread = self.forward_thread  # HiCache's copies run in order with the forwards
        self.stats = SchedulerStats()
        self.spec_worker = parts.spec_worker  # --speculative-algorithm; None: off

        self.output_processor = (EmbeddingOutputProcessor if args.is_embedding else SchedulerOutputProcessor)(self.tree_cache, self.ledger, self.send_fn, args.stream_interval, self.stats)
        self.grammar_backend = parts.grammar_backend
        # Structured output: requests wait here while their grammar compiles (seed 000).
        self.grammar_queue = GrammarQueue(args, self.grammar_backend, self._reject_bad_grammar, tp_rank, tp_size)
        # Images: requests wait here while the encoder thread encodes them (beside the decode of others).
        self.encode_queue = EncodeQueue(None if args.disable_mm_encode_ahead else tp_worker.image_embedder())
        self.embedding = SchedulerEmbedding(args, tp_worker, self._validate_request, self._enqueue, self.output_processor.finish)
        self.batch_runner = select_batch_runner(tp_worker, self.embedding, self.spec_worker, self.overlap_worker, self.grammar_backend)
        self.loop = LoopState(BatchSlot(self.empty_batch()))  # waiting_queue, running/last batch, chunked_req
        self.forward_ct = 0
        self.new_token_ratio = NewTokenRatio(args.schedule_conservativeness)
        # PD disaggregation (seed 001 §8): the prefill or decode server's queues over one KVManager.
        self.disaggregation_mode, self.disagg_prefill, self.disagg_decode, self.kv_manager = init_disaggregation(args, self.ledger, self.output_processor)
        self.pp = SchedulerPP(PPLoop(self.loop, self.get_next_batch_to_run, self.empty_batch, self.on_idle, self.count_forward,
                                     self.stats, self.grammar_backend, self.ledger, self.output_processor, self.max_running_requests),
                              args, tp_worker) if args.pp_size > 1 else None  # --pp-size: micro-batches in flight (seed 001 §27)

        self.weight_updater = SchedulerUpdateWeights(tp_worker, SettleLoop(self.has_work, self.run_step, self.results_pending, self.flush_cache),
                                                     self.forward_thread, self.tree_cache, args.pp_size)  # weight updates without a restart
        self.generation_pause = GenerationPause(self.loop, self.ledger, self.output_processor, LoopSteps(
            self.drain_results, self.get_next_batch_to_run, self.abort_request, self.empty_batch, self.requeue))
        self.memory_saver = SchedulerMemorySaver(tp_worker.memory_saver(), args, self.loop, self.grammar_queue, self.encode_queue, self.ledger,
                                                 self.new_token_ratio, self.output_processor, self.generation_pause, self.waiting_on_peer)
        self.profiler = SchedulerProfiler(tp_rank, lambda: self.forward_ct)
        self.hicache = parts.hicache  # its storage tier, /clear_hicache_storage_backend
        self._dispatcher = TypeBasedDispatcher([
            (TokenizedGenerateReqInput, self.handle_generate_request),
            (BatchTokenizedGenerateReqInput, self.handle_batch_generate_request),
            (AbortReq, self.abort_request),
            (FlushCacheReqInput, self.flush_cache_wrapped),
            (GetInternalStateReq, self.get_internal_state),
            *self.weight_updater.dispatch_entries(),
            *self.generation_pause.dispatch_entries(), *self.memory_saver.dispatch_entries(), *self.profiler.dispatch_entries(),
            *self.embedding.dispatch_entries(), *SchedulerLoRA(tp_worker.lora_manager, self.ledger, self.forward_thread, self.live_reqs).dispatch_entries(), *self.hicache.dispatch_entries(),
            *SchedulerInternalState(SchedulerInternalState.limits_of(
                self.max_running_requests, self.page_size, self.context_len, self.chunked_prefill_size,
                self.enable_overlap, self.pp is not None), self.settable_state, self.apply_internal_state,
            ).dispatch_entries(),  # /set_internal_state
            *SchedulerExpertDistribution(tp_worker.expert_recorder).dispatch_entries(),  # EPLB's record
            *SchedulerEPLB(tp_worker.eplb_rebalance, self.forward_thread).dispatch_entries(),  # EPLB's rebalance
        ])
        logger.info("Scheduler ready (pid %d): max_total_num_tokens=%d, max_running_requests=%d, context_len=%d, page_size=%d",
                    os.getpid(), self.max_total_num_tokens, self.max_running_requests, self.context_len, self.page_size)

    def empty_batch(self) -> ScheduleBatch:
        return self._new_batch([])

    def _new_batch(self, reqs: List[Req], chunked_req: Optional[Req] = None) -> ScheduleBatch:
        return ScheduleBatch.init_new(reqs, self.ledger, self.vocab_size, self.device, chunked_req, self.forward_thread,
                                      self.spec_worker.max_drafts if self.spec_worker is not None else 0,
                                      spec_overlap=self.spec_worker is not None and self.enable_overlap)

    # ---- the loop (seed 001 §2): run_scheduler_process and the Engine call these ----------------
    def run_step(self) -> Optional[ScheduleBatch]:
        """One loop iteration after intake. Returns the batch launched."""
        batch = self.pp.run_step() if self.pp else self.run_step_overlap() if self.enable_overlap else self.run_step_normal()
        if self.server_args.test_check_memory:
            self.check_slot_conservation()
        return batch

    def run_step_normal(self) -> Optional[ScheduleBatch]:
        """An iteration of SGLang's event_loop_normal: schedule, run, process, one batch at a time."""
        t0 = time.perf_counter()
        batch = self.get_next_batch_to_run()
        t1 = time.perf_counter()
        self.stats.schedule_s += t1 - t0
        if batch is not None:
            result = self.run_batch(batch)
            t2 = time.perf_counter()
            self.output_processor.process_batch_result(batch, result)
            self.stats.forward_s += t2 - t1
            self.stats.process_s += time.perf_counter() - t2
        else:
            self.on_idle()
        self.last_batch = batch
        return batch

    def run_step_overlap(self) -> Optional[ScheduleBatch]:
        """An iteration of SGLang's event_loop_overlap (seed 001 §2.2): Pre Schedule N+1,
        launch N+1, Post Schedule N while N+1 computes (sampling runs inside N+1's launch)."""
        t0 = time.perf_counter()
        batch = self.get_next_batch_to_run()
        self.stats.schedule_s += time.perf_counter() - t0
        disable_overlap_for_batch = self.is_disable_overlap_for_batch(batch)
        if disable_overlap_for_batch:
            self.pop_and_process()
        if batch is not None:
            self.run_batch(batch)  # launch N+1 on the forward thread
        if self.last_batch is not None and not disable_overlap_for_batch:
            self.pop_and_process()  # Post Schedule N, while N+1 computes
        elif batch is None:
            self.on_idle()
        self.last_batch = batch
        return batch

    def is_disable_overlap_for_batch(self, batch: Optional[ScheduleBatch]) -> bool:
        """Seed 001 §20: with --disable-consecutive-prefill-overlap, a prefill after a prefill
        first processes the previous result (its first token goes out a step earlier).
        Structured output with speculative decoding (the seed's one exception): a decode (or
        mixed) batch with grammar requests waits for the token in flight to be accepted before
        its drafts are verified against the mask. Without speculation it overlaps: its mask is
        filled while its forward runs (batch_runner.GrammarMaskRunner)."""
        return (
            self.server_args.disable_consecutive_prefill_overlap
            and batch is not None and batch.forward_mode.is_extend()
            and self.last_batch is not None and self.last_batch.forward_mode.is_extend()
        ) or (
            self.spec_worker is not None and batch is not None and self.results_pending()
            and (batch.forward_mode.is_decode() or batch.forward_mode.is_mixed())
            and any(r.grammar is not None for r in batch.reqs)
        )

    def pop_and_process(self) -> None:
        masks = self.batch_runner if isinstance(self.batch_runner, GrammarMaskRunner) else None
        t0 = time.perf_counter()
        try:  # a failed forward (raised by pop_result) or processing: the batch in flight must not wait for its mask forever
            item = self.overlap_worker.pop_result(self.stats)
            if item is None:
                return
            self.output_processor.process_batch_result(*item)
        except BaseException as e:
            if masks is not None:
                masks.fail_deferred(e)
            raise
        if masks is not None:  # the tokens are accepted: the next batch's grammar mask now
            masks.on_result_processed()
        self.stats.process_s += time.perf_counter() - t0

    def drain_results(self) -> None:
        """Process every result in flight (a pause settles the loop with it)."""
        while self.results_pending():
            self.pop_and_process()

    def results_pending(self) -> bool:
        return (self.overlap_worker is not None and bool(self.overlap_worker.result_queue)) or (self.pp is not None and self.pp.has_work())

    def on_idle(self) -> None:
        self.self_check_during_idle()
        self.new_token_ratio.reset()
        self.hicache.wait_idle()  # requests held for their storage prefetch: wait, do not spin

    def expects_progress(self) -> bool:
        """It has work and is not paused: what the watchdog and the idle poll wait on."""
        return expects_progress(self.has_work(), self.generation_pause)

    def has_work(self) -> bool:
        last_prefill_to_merge = (
            self.last_batch is not None and self.last_batch.forward_mode is not None
            and self.last_batch.forward_mode.is_extend() and not self.last_batch.is_empty()
        )
        return bool(self.waiting_queue or len(self.grammar_queue) or len(self.encode_queue) or self.results_pending()) or (
            not self.running_batch.is_empty() or self.chunked_req is not None or last_prefill_to_merge
        )

    def live_reqs(self) -> Iterator[Req]:
        """Every request this scheduler holds: waiting, running, in the last batch (a prefill not
        merged yet, or the overlap loop's batch in flight), compiling its grammar, chunked."""
        yield from self.waiting_queue
        yield from self.running_batch.reqs
        if self.last_batch is not None:
            yield from self.last_batch.reqs
        yield from (r for r in self.grammar_queue if hasattr(r, "lora_path"))
        yield from self.encode_queue
        if self.chunked_req is not None:
            yield self.chunked_req

    def batch_coming(self) -> bool:
        """A batch runs or will run now, so its results come soon (a health check waits for them;
        a grammar still compiling alone does not count: it may take long)."""
        return bool(self.waiting_queue or self.results_pending()) or (
            not self.running_batch.is_empty() or self.chunked_req is not None)

    def waiting_on_peer(self) -> bool:
        """PD: requests wait for the other server (handshake, KV transfer), not for a forward.
        The loop then polls often (the news comes on the KVManager's thread) and the watchdog
        leaves it alone (--disaggregation-timeout bounds the wait)."""
        return any(d is not None and len(d) > 0 for d in (self.disagg_prefill, self.disagg_decode))

    def get_stats(self) -> SchedulerStats:
        """A snapshot of the counters (the forward thread's busy time filled in)."""
        busy = self.forward_thread.busy_s if self.forward_thread is not None else 0.0
        return dataclasses.replace(self.stats, forward_thread_busy_s=busy)

    def shutdown(self) -> None:
        if self.overlap_worker is not None:
            self.overlap_worker.close()
        if self.kv_manager is not None:
            self.kv_manager.close()
        self.grammar_queue.shutdown()
        self.encode_queue.shutdown()
        if self.pp is not None:
            self.pp.shutdown()
        elif self.tp_size > 1:
            destroy_distributed_environment()

    # ---- intake (seed 000) -------------------------------------------------------------------
    def recv_requests(self) -> List[Any]:
        """Rank 0 reads the socket; with --tp-size > 1 it broadcasts what it got, so every
        rank schedules the same batches (only rank 0 talks to the outside)."""
        reqs = self.recv_fn() if self.tp_rank == 0 else None
        if self.tp_rank == 0 and self.weight_updater.join_done():  # every rank agrees on it now,
            reqs = [WeightsUpdateGroupJoined()] + list(reqs or [])  # before an update to that group
        return broadcast_pyobj(reqs) if self.tp_size > 1 else reqs

    def process_input_requests(self, recv_reqs: List[Any]) -> None:
        for recv_req in self.generation_pause.input_blocker.handle(recv_reqs):  # held while paused
            if is_health_check_generate_req(recv_req) and self.batch_coming():
                # seed 000: a busy scheduler does not queue the probe behind its work; the
                # output processor answers it once the next batch's results are in
                self.output_processor.pending_health_checks.append(recv_req.rid)
                continue
            out = self._dispatcher(recv_req)
            if out is not None:
                self.send_fn(out)

    def handle_batch_generate_request(self, recv: BatchTokenizedGenerateReqInput) -> None:
        for r in recv.batch:
            self.handle_generate_request(r)

    def handle_generate_request(self, recv: TokenizedGenerateReqInput) -> None:
        req = Req.from_tokenized(recv, self.model_config.eos_token_ids, self.vocab_size, self.tokenizer)
        try:
            self._admit(req)
        except Exception as e:  # a bug one request's input reached: end that request, serve the rest
            logger.exception("Failed to admit request %s; it is aborted", req.rid)
            if req in self.waiting_queue:
                self.waiting_queue.remove(req)
            self.grammar_queue.discard(req)
            self.output_processor.finish(req, FINISH_ABORT(
                f"Internal error while admitting the request: {type(e).__name__}: {e}",
                status_code=500, err_type="InternalServerError",
            ))

    def _admit(self, req: Req) -> None:
        """Check the request, then queue it: in the grammar queue while its grammar compiles,
        else in the waiting queue. A refused request is finished with its 4xx/503 here."""
        error = self._validate_request(req)
        if error is not None:
            message, status = error
            err_type = "BadRequestError" if status == 400 else "ServiceUnavailable"
            self.output_processor.finish(req, FINISH_ABORT(message, status_code=status, err_type=err_type))
        elif self.grammar_queue.admit(req) and self.encode_queue.admit(req):
            self._enqueue(req)

    def _enqueue(self, req: Req) -> None:
        """A request ready to schedule: PD requests first wait for the other server."""
        if req.wait_queue_entry_time is None:  # meta_info queue_time starts here (after its grammar)
            req.wait_queue_entry_time = time.perf_counter()
        if req.bootstrap_room is not None and self.disagg_prefill is not None:
            self.disagg_prefill.add(req)
        elif req.bootstrap_room is not None and self.disagg_decode is not None:
            self.disagg_decode.add(req)
        else:
            self.waiting_queue.append(req)
            self.hicache.on_enqueue(req)  # HiCache storage: its prefetch starts now

    def _validate_request(self, req: Req) -> Optional[Tuple[str, int]]:
        """The front end has validated the request; the scheduler checks its input again (it
        is also driven directly), sets max_new_tokens to the room left in the context when the
        request gave none, and refuses work beyond --max-queued-requests."""
        mm = req.multimodal_inputs  # its images' pad values stand for vocabulary ids here
        ids = req.origin_input_ids if mm is None else mm.unpadded(req.origin_input_ids)
        error = input_ids_error(ids, self.context_len, self.vocab_size)
        if error is not None:
            return error, 400
        if len(req.origin_input_ids) >= self.max_total_num_tokens:  # could never be prefilled (§9.2)
            return (f"The prompt ({len(req.origin_input_ids)} tokens) does not fit in the KV cache pool "
                    f"({self.max_total_num_tokens} tokens)."), 400
        sp = req.sampling_params
        room = self.context_len - len(req.origin_input_ids) - 1
        sp.max_new_tokens = room if sp.max_new_tokens is None else min(sp.max_new_tokens, room)
        max_queued = self.server_args.max_queued_requests
        if max_queued is not None and len(self.waiting_queue) + len(self.grammar_queue) + len(self.encode_queue) >= max_queued:
            return "The request queue is full.", 503
        return None

    def _reject_bad_grammar(self, req: Req, message: str) -> None:
        req.grammar = None
        self.output_processor.finish(req, FINISH_ABORT(message, status_code=400, err_type="BadRequestError"))

    def requeue(self, req: Req) -> None:
        """A retracted or preempted request goes back to the waiting queue, outputs kept."""
        if req.grammar is not None:
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
                self.ledger.cache_unfinished_req(self.chunked_req, chunked=True)

        # 2. Merge the last prefill batch into the running batch (PD prefill: not the requests
        # whose KV is on its way to a decode server).
        if self.disagg_prefill is not None:
            chunked_to_exclude += self.disagg_prefill.inflight_queue
        if self.last_batch is not None and self.last_batch.forward_mode.is_extend():
            self.last_batch.filter_batch(chunked_req_to_exclude=chunked_to_exclude)
            if not self.last_batch.is_empty():
                if self.running_batch.is_empty():
                    self.running_batch = self.last_batch
                else:
                    self.running_batch.merge_batch(self.last_batch)

        self._process_disagg_queues()
        if self.running_batch.is_empty():  # nothing left whose end would clear a "full" mark
            self.running_batch.batch_is_full = False

        if self.generation_pause.hold_batches() or self.memory_saver.hold_batches():  # paused, or memory released
            return None
        # 3. Prefill first; 4. otherwise decode.
        idle = not self.waiting_queue and self.running_batch.is_empty() and self.chunked_req is None and not self.results_pending()
        for req in self.grammar_queue.pop_ready(scheduler_idle=idle):
            if self.encode_queue.admit(req):
                self._enqueue(req)
        for req in self.encode_queue.pop_ready(scheduler_idle=idle):
            self._enqueue(req)
        new_batch = self.get_new_batch_prefill()
        if new_batch is not None:
            return new_batch
        if self.running_batch.is_empty():
            return None
        self.running_batch = self.update_running_batch(self.running_batch)
        return None if self.running_batch.is_empty() else self.running_batch

    def _process_disagg_queues(self) -> None:
        """PD prefill: bootstrapped requests join the waiting queue, finished transfers end.
        PD decode: arrived requests join the running batch, new ones get their slots."""
        if self.disagg_prefill is not None:
            self.disagg_prefill.process_inflight_queue()
            self.waiting_queue += self.disagg_prefill.pop_bootstrapped()
        if self.disagg_decode is not None:
            arrived = self.disagg_decode.process_queues(self.running_batch, self.request_limit(), self.new_token_ratio.value)
            if arrived:
                self.running_batch = self.disagg_decode.merge_prebuilt(arrived, self._new_batch, self.running_batch)

    def request_limit(self) -> int:
        """--max-running-requests, or (PP) the share of it the slot being scheduled may hold."""
        limit = self.loop.slot.request_limit
        return self.max_running_requests if limit is None else limit

    def batch_slots(self) -> List[BatchSlot]:
        """Every slot's batches: PP's micro-batches, else the loop's one."""
        return self.pp.slots if self.pp is not None else [self.loop.slot]

    def get_num_allocatable_reqs(self, running_bs: int) -> int:
        # Free rows too: in the overlap loop a finished request's row waits for its extra step.
        limit = min(self.request_limit() - running_bs, self.ledger.free_rows())
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
            self.page_size, self.ledger, self.running_batch,
            self.new_token_ratio.value, self.max_prefill_tokens, self.chunked_prefill_size,
            mixed_with_decode_tokens=running_bs if self.is_mixed_chunk else 0,
            priority_scheduling_preemption_threshold=self.server_args.priority_scheduling_preemption_threshold,
            policy=self.policy,
        )
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)

        adder.add_waiting_reqs(self.hicache.admissible(self.waiting_queue), self.get_num_allocatable_reqs, try_preemption,
                               has_chunked_req=self.chunked_req is not None)
        for r in adder.preempt_list:
            self.stats.num_preempted_reqs += 1
            self.requeue(r)
        can_run_list = adder.can_run_list
        if not can_run_list:
            return None
        chosen = set(id(r) for r in can_run_list)
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in chosen]
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.pending_chunks += 1
        self.stats.count_prefill(can_run_list, adder.log_hit_tokens, chunked=self.chunked_req is not None)

        new_batch = self._new_batch(can_run_list, self.chunked_req)
        new_batch.prepare_for_extend()

        # Mixed chunk: the running batch decodes inside this extend forward (seed 001 §11).
        if self.is_mixed_chunk and not self.running_batch.is_empty():
            self.running_batch.filter_batch()
            if not self.running_batch.is_empty():
                self.running_batch.prepare_for_decode()
                new_batch.mix_with_running(self.running_batch)
                new_batch.decoding_reqs = self.running_batch.reqs
            batch_is_full = self.running_batch.batch_is_full
            self.running_batch = self.empty_batch()
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
            priority_key = self.policy.priority_key if self.server_args.enable_priority_scheduling else None
            retracted, self.new_token_ratio.value, reqs_to_abort = batch.retract_decode(priority_key)
            self.stats.num_retractions += 1
            self.stats.num_retracted_reqs += len(retracted)
            logger.info("KV cache pool is full. Retract requests. #retracted_reqs: %d, #new_token_ratio: %.4f",
                        len(retracted), self.new_token_ratio.value)
            for req in retracted:
                self.requeue(req)
            if reqs_to_abort:  # outgrew the whole pool alone (§9.2): ended, not retracted forever
                logger.warning("Aborted %d request(s) that do not fit in the KV cache pool", len(reqs_to_abort))
                self.output_processor.stream_output(reqs_to_abort)
            if batch.is_empty():  # the last one ended, or waits for other batches' KV (PP, a chunk)
                batch.batch_is_full = False
                return batch
        else:
            self.new_token_ratio.step()
        if batch.batch_size() < initial_bs:
            batch.batch_is_full = False
        batch.prepare_for_decode()
        return batch

    # ---- running ------------------------------------------------------------------------------
    def run_batch(self, batch: ScheduleBatch) -> Optional[GenerationBatchResult]:
        """Normal loop: run and return the result. Overlap loop: launch on the forward thread
        (the result is processed later); batch.output_ids become future placeholders."""
        self.count_forward(batch)
        # embedding / speculative / overlap / plain, grammar mask or not: chosen at start (batch_runner.py)
        return self.batch_runner(batch, batch.get_model_worker_batch())

    def count_forward(self, batch: ScheduleBatch) -> None:
        """A forward launched (here or by PP): the count the watchdog and the profiler read, the stats."""
        self.forward_ct += 1
        self.profiler.on_forward()
        self.stats.count_batch(batch.forward_mode)

    # ---- abort / flush / state ------------------------------------------------------------------------
    def abort_request(self, recv: AbortReq) -> None:
        def match(r: Req) -> bool:
            return recv.abort_all or r.rid == recv.rid

        message = recv.abort_message or "Aborted by AbortReq."
        for disagg in (self.disagg_prefill, self.disagg_decode):
            if disagg is not None:
                disagg.abort(match, message)
        queued = [r for r in self.waiting_queue if match(r)] + self.grammar_queue.remove(match) + self.encode_queue.remove(match)
        self.waiting_queue = [r for r in self.waiting_queue if not match(r)]
        for r in queued:  # holds no KV: finish now
            r.grammar = None
            r.finished_reason = FINISH_ABORT(message)
        if queued:
            self.output_processor.stream_output(queued)
        # Running and chunked requests finish at their next check_finished (or stash).
        running: List[Req] = []
        for slot in self.batch_slots():  # PP: every micro-batch's
            running += slot.running_batch.reqs
            if slot.last_batch is not None:
                running += slot.last_batch.reqs
        if self.chunked_req is not None:
            running.append(self.chunked_req)
        for r in running:
            if match(r) and not r.finished():
                r.to_finish = FINISH_ABORT(message)

    def _release_aborted_chunked_req(self, req: Req) -> None:
        """A request aborted between two chunks: cache its chunk, then let everything go."""
        self.ledger.cache_unfinished_req(req, chunked=True)
        self.empty_batch().release_req(req)
        reason, req.to_finish = req.to_finish, None
        self.output_processor.finish(req, reason)

    def flush_cache(self) -> bool:
        if self.has_work() or self.waiting_on_peer():
            logger.warning("Cache not flushed because there are pending requests.")
            return False
        self.ledger.clear()
        self.grammar_queue.reset()
        if self.spec_worker is not None:  # SGLang's flush clears the n-gram store too
            self.spec_worker.clear_cache_pool()
        self.new_token_ratio.reset()
        self.last_batch = None
        return True

    def flush_cache_wrapped(self, recv: FlushCacheReqInput) -> FlushCacheReqOutput:
        ok = self.flush_cache()
        return FlushCacheReqOutput(ok, "" if ok else "Cache not flushed: requests are running or waiting.", recv.query_id)

    def get_internal_state(self, recv: GetInternalStateReq) -> GetInternalStateReqOutput:
        return GetInternalStateReqOutput(self.internal_state(), recv.query_id, with_dashboard=recv.with_dashboard)

    def settable_state(self) -> Dict[str, Any]:
        return {name: getattr(self, name) for name in SETTABLE_AT_RUN_TIME}

    def apply_internal_state(self, values: Dict[str, Any]) -> None:
        """/set_internal_state's checked values (scheduler_internal_state.py)."""
        for name, value in values.items():
            setattr(self, name, value)  # read by the next get_new_batch_prefill
        # derived at start from chunked_prefill_size: chunking turned on now can mix with decode too
        self.is_mixed_chunk = self.server_args.enable_mixed_chunk and self.chunked_prefill_size is not None
        self.running_batch.batch_is_full = False  # a higher limit may admit requests again

    def internal_state(self) -> Dict[str, Any]:
        return dict(
            self.get_stats().to_dict(),
            max_total_num_tokens=self.max_total_num_tokens,
            max_running_requests=self.max_running_requests,
            chunked_prefill_size=self.chunked_prefill_size,
            context_len=self.context_len,
            new_token_ratio=self.new_token_ratio.value,
            num_waiting_reqs=len(self.waiting_queue),
            num_grammar_queue_reqs=len(self.grammar_queue),
            num_encode_queue_reqs=len(self.encode_queue),
            num_running_reqs=self.running_batch.batch_size(),
            disaggregation_mode=self.disaggregation_mode.value,
            num_disagg_queue_reqs=len(self.disagg_prefill or self.disagg_decode or ()),
            available_tokens=self.ledger.available_size(),
            evictable_tokens=self.tree_cache.evictable_size(),
            protected_tokens=self.tree_cache.protected_size(),
            **(self.ledger.get_swa_token_info() if self.swa_pool else {}),  # the SWA pool's (SGLang's _get_swa_token_info)
            **self.generation_pause.internal_state(), **self.memory_saver.internal_state(),
            **self.grammar_queue.internal_state(),  # SGLang's grammar metrics
            **(self._mamba_state() if self.ledger.state_pool is not None else {}),
        )

    def _mamba_state(self) -> Dict[str, Any]:
        """/get_server_info of a hybrid model: the state pool beside the KV pool."""
        info = self._get_mamba_token_info()
        return dict(mamba_pool_size=info.mamba_size, available_mamba_slots=info.mamba_available,
                    evictable_mamba_slots=info.mamba_evictable, mamba_snapshots=info.mamba_snapshots,
                    mamba_usage=info.mamba_usage)

    # ---- invariants ---------------------------------------------------------------------------------
    def self_check_during_idle(self) -> None:
        """With nothing running, every slot is free or in the tree and no node is locked."""
        if self.running_batch.is_empty() and self.chunked_req is None and not self.waiting_on_peer():
            self.check_memory()

    def check_memory(self) -> None:
        """Raises MemoryLeakError (which ends the process) if a slot or a row was lost."""
        if self.ledger.state_pool is not None:
            return self._check_hybrid_memory()
        self.ledger.check_idle(self.max_total_num_tokens)

    def _check_hybrid_memory(self) -> None:
        """A hybrid model's idle check: every KV slot free or in the tree, every state slot free
        or a snapshot's, nothing locked (seed 001 §30)."""
        self.ledger.check_idle(self.max_total_num_tokens)
        info = self._get_mamba_token_info()
        if info.mamba_num_used != 0:
            raise MemoryLeakError(f"state pool leak detected! {info}")

    def _get_mamba_token_info(self) -> MambaTokenInfo:
        return self.ledger.mamba_token_info()

    def check_slot_conservation(self) -> None:
        """--test-check-memory, after every step (see check_pages_conserved)."""
        live = list(self.running_batch.reqs) + ([self.chunked_req] if self.chunked_req is not None else [])
        if self.last_batch is not None:
            live += self.last_batch.reqs
        for disagg in (self.disagg_prefill, self.disagg_decode):
            if disagg is not None:
                live += disagg.live_reqs()
        self.ledger.check_conserved([r for r in live if r.req_pool_idx is not None and not r.finished()])
