"""SchedulerOutputProcessor (seed 001 §10, §21): turns a batch's GenerationBatchResult into Req
updates (append the token, logprobs, grammar, finish checks, KV handed to the prefix cache)
and the requests' news into one BatchTokenIDOutput for the detokenizer."""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional

from radixserve.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req, ScheduleBatch
from radixserve.managers.scheduler_stats import SchedulerStats
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache
from radixserve.mem_cache.hiradix_cache import HiRadixCache
from radixserve.mem_cache.kv_ledger import KVLedger
from radixserve.model_executor.tp_worker import GenerationBatchResult
from radixserve.protocol import LOGPROB_KEYS, SPEC_KEYS, BatchTokenIDOutput, HealthCheckOutput

logger = logging.getLogger(__name__)

# Non-streaming requests still report every this many tokens (seed 001 §21.1).
DEFAULT_FORCE_STREAM_INTERVAL = 50


class SchedulerOutputProcessor:
    def __init__(
        self,
        tree_cache: BasePrefixCache,
        ledger: KVLedger,
        send_fn: Callable[[Any], None],
        stream_interval: int,
        stats: Optional[SchedulerStats] = None,
    ):
        self.tree_cache = tree_cache
        self._hicache = isinstance(tree_cache, HiRadixCache)  # report cached_tokens_details
        self.ledger = ledger
        self.send_fn = send_fn
        self.stream_interval = stream_interval
        self.stats = stats if stats is not None else SchedulerStats()  # the spec_* totals
        # /health_generate probes a busy scheduler did not queue: answered after the next
        # batch's results (seed 000's return_health_check_ct, with the rids to answer).
        self.pending_health_checks: List[str] = []
        # PD prefill server: takes over a request whose prefill is done (PrefillDisaggregation).
        self.on_disagg_prefilled: Optional[Callable[[Req, int, GenerationBatchResult, int], None]] = None

    # ---- results --------------------------------------------------------------------------
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
        with self.ledger.free_group():
            for i, req in enumerate(batch.reqs):
                if req.pending_chunks > 0:
                    req.pending_chunks -= 1  # a middle chunk: its sampled token means nothing
                    continue
                if self._is_stale(req):
                    continue
                if req.disagg_kv_sender is not None and self.on_disagg_prefilled is not None:
                    self.on_disagg_prefilled(req, next_ids[i], result, i)  # its KV goes to a decode server
                    continue
                if self.append_token(req, next_ids[i], result, i):
                    continue
                if id(req) not in decoding:
                    # The prompt enters the tree now, so requests behind it can share it.
                    self.ledger.cache_unfinished_req(req)
        self.stream_output(batch.reqs)
        self.answer_health_checks()  # a batch's results: the loop and the forward pass move

    def process_batch_result_decode(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        next_ids = result.next_token_ids.tolist()
        with self.ledger.free_group():
            if result.num_drafts is not None:  # a speculative step: accepted drafts + 1 tokens per request
                self._count_spec_step(batch, result)
                start = 0
                for req, accepted in zip(batch.reqs, result.accept_lens or [0] * len(batch.reqs)):
                    if not self._is_stale(req):
                        self.append_tokens(req, next_ids[start : start + accepted + 1], result, start)
                    start += accepted + 1
            else:
                for i, req in enumerate(batch.reqs):
                    if not self._is_stale(req):
                        self.append_token(req, next_ids[i], result, i)
        self.stream_output(batch.reqs)
        self.answer_health_checks()  # a batch's results: the loop and the forward pass move

    def _count_spec_step(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        """A speculative decode step: each request's verify, drafts and accepted drafts into its
        meta_info and the scheduler's spec_* totals (here, on the scheduler thread, in both
        loops; the overlap loop's extra step of a finished request is not counted)."""
        accept_lens = result.accept_lens or [0] * len(batch.reqs)
        counted = []
        for req, k, a in zip(batch.reqs, result.num_drafts, accept_lens):
            if not self._is_stale(req):
                req.spec_verify_ct += 1
                req.spec_num_proposed_drafts += k
                req.spec_num_correct_drafts += a
                counted.append((k, a))
        st = self.stats
        st.spec_verify_ct += len(counted)
        st.spec_num_accept_tokens += sum(a + 1 for _, a in counted)
        st.spec_num_correct_drafts += sum(a for _, a in counted)
        st.spec_num_proposed_drafts += sum(k for k, _ in counted)
        st.count_spec_accept_lens([a for _, a in counted])

    @staticmethod
    def _is_stale(req: Req) -> bool:
        """Overlap: the batch was launched before this request finished (the extra forward of
        seed 001 §2.8.7) or was retracted; its token is dropped."""
        return req.finished() or req.req_pool_idx is None

    def append_token(self, req: Req, token: int, result: GenerationBatchResult, i: int) -> bool:
        """Append a sampled token, check the finish conditions; a finished request hands its
        KV to the tree. Returns whether it finished."""
        self._add_token(req, token, result, i)
        if not req.finished():
            return False
        if req.kv_allocated_len:  # a prefill's end, its first decode step prepared (spec_overlap.py)
            self.ledger.commit(req, req.kv_committed_len)
        req.grammar = None  # release the matcher
        self.ledger.cache_finished_req(req)
        return True

    def append_tokens(self, req: Req, tokens: List[int], result: GenerationBatchResult, i: int) -> bool:
        """Speculative decoding: commit a verify step's tokens (result rows i, i + 1, ...) one by
        one with the finish checks after each; a request that finishes drops the tokens after its
        finish, and the KV computed for them goes back before the rest goes to the tree."""
        for j, token in enumerate(tokens):
            self._add_token(req, token, result, i + j)
            if req.finished():
                break
        kept = req.seqlen() - 1  # every token but the last has KV, as after a plain decode step
        if not req.finished():
            self.ledger.advance(req, kept)  # (the overlap loop's forward thread left the Req alone)
            return False
        self.ledger.commit(req, kept)  # rejected or dropped drafts' slots, and those reserved ahead
        req.grammar = None
        self.ledger.cache_finished_req(req)
        return True

    def _add_token(self, req: Req, token: int, result: GenerationBatchResult, i: int) -> None:
        if req.is_prefill_only:
            # SGLang's prefill-only request (e.g. its frontend's select, lm-eval's echo scoring):
            # the prompt and its logprobs, no token; the one the prefill sampled is dropped.
            req.finished_reason = FINISH_LENGTH(length=0)
            return
        req.output_ids.append(token)
        try:
            if req.grammar is not None:
                self._accept_grammar_token(req, token)
            req.check_finished()
        except Exception as e:  # a bug one request's grammar or stop check reached: end it alone
            logger.exception("Request %s: processing its token failed; it is aborted", req.rid)
            req.finished_reason = FINISH_ABORT(
                f"Internal error while processing the sampled token: {type(e).__name__}: {e}",
                status_code=500, err_type="InternalServerError",
            )
        self.append_logprobs(req, result, i)
        if req.return_hidden_states:
            self.append_hidden_state(req, result, i)

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
    def append_logprobs(req: Req, result: GenerationBatchResult, i: int) -> None:
        if not req.return_logprob or result.next_token_logprobs is None:
            return
        req.output_token_logprobs_val.append(float(result.next_token_logprobs[i]))
        req.output_token_logprobs_idx.append(req.output_ids[-1])
        if req.top_logprobs_num > 0 and result.top_logprobs_val is not None:
            req.output_top_logprobs_val.append(result.top_logprobs_val[i])
            req.output_top_logprobs_idx.append(result.top_logprobs_idx[i])
        if req.token_ids_logprob is not None:
            vals = result.token_ids_logprobs_val
            if vals is None or vals[i] is None:  # a path that does not compute them (refused at start)
                raise RuntimeError("token_ids_logprob was asked but the batch's sampler did not compute it")
            req.output_token_ids_logprobs_val.append(vals[i])
            req.output_token_ids_logprobs_idx.append(list(req.token_ids_logprob))

    @staticmethod
    def append_hidden_state(req: Req, result: GenerationBatchResult, i: int) -> None:
        """return_hidden_states: the final hidden state the token just appended was sampled from."""
        states = None if result.logits_output is None else result.logits_output.last_hidden_states
        if states is None:  # a path that does not compute them (refused at the front end)
            raise RuntimeError("return_hidden_states was asked but the batch's forward did not return them")
        req.hidden_states.append(states[i].tolist())

    @staticmethod
    def _add_input_logprobs(batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        out = result.logits_output  # None from a worker that computes no logits (the simulator's)
        values = getattr(out, "input_token_logprobs", None)
        values = values.tolist() if values is not None else []
        asked = getattr(out, "input_token_ids_logprobs", None)  # [positions, k]: token_ids_logprob
        top_val = getattr(out, "input_top_logprobs_val", None)
        top_val = top_val.tolist() if top_val is not None else None
        top_idx = getattr(out, "input_top_logprobs_idx", None)
        top_idx = top_idx.tolist() if top_idx is not None else None
        offset = 0
        for req, count in zip(batch.reqs, batch.input_logprob_counts):
            if req.req_pool_idx is None or not req.wants_input_logprobs():  # retracted in flight: recomputed later
                offset += count
                continue
            if not req.input_token_logprobs_idx and not req.output_ids:  # its prompt's first prefill round
                req.add_input_logprob_head()
            first = req.next_input_logprob_token()
            got = values[offset : offset + count]
            n = len(got)  # (count, unless the worker computed none)
            req.input_token_logprobs_val += got
            req.input_token_logprobs_idx += req.origin_input_ids[first : first + n]
            ids = req.token_ids_logprob
            if ids is not None and n:
                if asked is None:
                    raise RuntimeError("token_ids_logprob was asked but the forward did not score the prompt's positions")
                req.input_token_ids_logprobs_val += asked[offset : offset + n, : len(ids)].tolist()
                req.input_token_ids_logprobs_idx += [list(ids)] * n
            k = req.top_logprobs_num
            if k > 0 and n:
                if top_val is None:
                    raise RuntimeError("top_logprobs_num was asked but the forward did not rank the prompt's positions")
                req.input_top_logprobs_val += [row[:k] for row in top_val[offset : offset + n]]
                req.input_top_logprobs_idx += [row[:k] for row in top_idx[offset : offset + n]]
            offset += count

    # ---- output (seed 001 §21) ---------------------------------------------------------------
    def _due(self, req: Req) -> bool:
        """Whether the request has news to send now: its end, or enough new tokens."""
        if req.pending_chunks > 0 or req.finished_sent:
            return False
        n = len(req.output_ids)
        if req.finished():
            return True
        if req.stream:  # the request's own stream_interval, else the server's (seed 001 §21.1)
            interval = req.sampling_params.stream_interval or self.stream_interval
            return n > 0 and (n - req.send_token_offset >= interval or n == 1)
        return n > 0 and n % DEFAULT_FORCE_STREAM_INTERVAL == 0

    def stream_output(self, reqs: List[Req]) -> None:
        """One BatchTokenIDOutput for the requests with news. The per-request fields of features
        no request in it uses (logprobs, hidden states, speculation's counters, HiCache's tiers)
        stay empty lists, which the detokenizer and the TokenizerManager read as "none" (issue 57:
        ten empty lists per request and step were most of the step at large batches)."""
        due = [req for req in reqs if self._due(req)]
        if not due:
            return
        # Field by field (a comprehension each): the cheapest way to touch every request in Python.
        starts = [req.send_token_offset for req in due]
        lens = [len(req.output_ids) for req in due]
        params = [req.sampling_params for req in due]
        reasons = [req.finished_reason for req in due]
        out = BatchTokenIDOutput(
            rids=[req.rid for req in due],
            finished_reasons=[None if r is None else r.to_json() for r in reasons],
            decode_ids=[req.output_ids[k:] for req, k in zip(due, starts)],
            output_ids_len=lens,
            skip_special_tokens=[sp.skip_special_tokens for sp in params],
            spaces_between_special_tokens=[sp.spaces_between_special_tokens for sp in params],
            no_stop_trim=[sp.no_stop_trim for sp in params],
            prompt_tokens=[len(req.origin_input_ids) for req in due],
            completion_tokens=list(lens),
            cached_tokens=[req.cached_tokens for req in due],
            retraction_counts=[req.retraction_count for req in due],
            queue_times=[req.queue_time for req in due],
        )
        if self._hicache:
            out.cached_tokens_details = [dict(req.cached_tokens_details) for req in due]
        if any(req.return_hidden_states for req in due):
            out.output_hidden_states = [req.hidden_states[k:] if req.return_hidden_states else []
                                        for req, k in zip(due, starts)]
        if any(req.spec_verify_ct for req in due):
            for key in SPEC_KEYS:
                setattr(out, key, [getattr(req, key) for req in due])
        if any(req.return_logprob for req in due):
            for req, k in zip(due, starts):
                self._add_logprob_fields(out, req, k)
        for req, n, reason in zip(due, lens, reasons):
            req.send_token_offset = n
            if reason is not None:
                req.finished_sent = True
        self.send_fn(out)

    @staticmethod
    def _add_logprob_fields(out: BatchTokenIDOutput, req: Req, start: int) -> None:
        """A request's new logprobs (empty lists for a request that asked for none)."""
        if not req.return_logprob:
            for key in LOGPROB_KEYS:
                getattr(out, key).append([])
            return
        k = req.input_logprob_send_offset  # the prompt's entries not sent yet; the output's from `start`
        for key in LOGPROB_KEYS:
            getattr(out, key).append(getattr(req, key)[k if key.startswith("input_") else start:])
        req.input_logprob_send_offset = len(req.input_token_logprobs_idx)

    def answer_health_checks(self) -> None:
        """Results were just processed: the loop and the forward pass move, so the probes waiting
        for that proof get their HealthCheckOutput."""
        for rid in self.pending_health_checks:
            self.send_fn(HealthCheckOutput(rid))
        self.pending_health_checks.clear()

    def finish(self, req: Req, reason: Any) -> None:
        """End a request that holds no KV (refused, aborted while queued) and report it."""
        req.finished_reason = reason
        self.stream_output([req])
