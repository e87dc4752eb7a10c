"""NGRAMWorker: speculative decoding with drafts from an n-gram cache (no draft model).

For a decode batch that ScheduleBatch.prepare_for_decode has prepared (one slot for each
request's last token, at position L = seq_len - 1):

    1. drafts: up to k = --speculative-num-draft-tokens - 1 tokens per request from the NgramCache
       (the request's own prompt and output, and every other request's);
    2. one target forward (TARGET_VERIFY): an EXTEND of 1 + k_i tokens per request over its paged KV
       (the ordinary causal mask: a chain needs no tree mask), logits at every position;
    3. acceptance (verify.py), then the KV of rejected drafts is freed at once and the batch's
       seq_lens are the committed lengths.

A batch where no request got a draft runs the plain decode forward. The scheduler then commits
accept_lens[i] + 1 tokens per request (SchedulerOutputProcessor), checking the stop conditions
after each one. Requests whose next token depends on state the drafts would change (a grammar,
penalties, min_new_tokens not reached yet) get no drafts: their step is an ordinary decode.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, List, Optional

import torch

from radixserve.model_executor.forward_batch import ForwardMode, ModelWorkerBatch
from radixserve.model_executor.tp_worker import GenerationBatchResult, TpModelWorker
from radixserve.speculative.ngram_cache import NgramCache
from radixserve.speculative.spec_info import NgramVerifyInput, NgramVerifyOutput
from radixserve.speculative.verify import verify_chain

logger = logging.getLogger(__name__)


class NGRAMWorker:
    def __init__(self, server_args: Any, target_worker: TpModelWorker, stats: Any = None):
        self.target_worker = target_worker
        # SGLang's meaning: tokens per request in the verify forward, the verified token included.
        self.max_drafts = server_args.speculative_num_draft_tokens - 1
        self.ngram_cache = NgramCache(
            server_args.speculative_ngram_min_match_window_size,
            server_args.speculative_ngram_max_match_window_size,
            server_args.speculative_ngram_capacity,
        )
        self.stats = stats  # SchedulerStats: the spec_* totals
        self._inserted: Dict[str, int] = {}  # rid -> how many of its tokens the cache has seen

    def clear_cache_pool(self) -> None:
        self.ngram_cache.reset()
        self._inserted.clear()

    # ---- the interface the scheduler calls ------------------------------------------------
    def forward_batch(self, batch: Any, worker_batch: ModelWorkerBatch) -> GenerationBatchResult:
        """Run `batch` (the scheduler's run_batch): decode batches with drafts, others as usual
        (NGRAM keeps no state of its own in the KV pools)."""
        if batch.forward_mode.is_decode():
            return self.forward_batch_speculative_generation(batch, worker_batch)
        result = self.target_worker.forward_batch_generation(worker_batch)
        batch.output_ids = result.next_token_ids
        return result

    def forward_batch_speculative_generation(self, batch: Any, worker_batch: ModelWorkerBatch) -> GenerationBatchResult:
        """Run one decode step of `batch` (a prepared DECODE ScheduleBatch; `worker_batch` is its
        ModelWorkerBatch, grammar mask included) with drafts. Sets batch.output_ids to each
        request's last committed token."""
        spec = NgramVerifyInput(self._draft(batch))
        for req, k in zip(batch.reqs, spec.num_drafts):
            req.spec_verify_ct += 1
            req.spec_num_proposed_drafts += k
        if not any(spec.num_drafts):  # no request has a draft: the plain decode step
            result = self.target_worker.forward_batch_generation(worker_batch)
            batch.output_ids = result.next_token_ids
            self._count(len(batch.reqs), len(batch.reqs), 0, 0)
            return result
        logits = self._verify_forward(batch, worker_batch, spec)
        out = verify_chain(logits, batch.sampling_info, spec, worker_batch.token_bitmask, batch.return_logprob,
                           batch.top_logprobs_nums if batch.return_logprob else None)
        self._commit(batch, spec, out)
        self._count(len(batch.reqs), sum(a + 1 for a in out.accept_lens), sum(out.accept_lens), sum(spec.num_drafts))
        return self._result(batch, out)

    # ---- drafting ----------------------------------------------------------------------------
    def _draft(self, batch: Any) -> List[List[int]]:
        drafts, seen = [], {}
        for req in batch.reqs:
            tokens = req.origin_input_ids + req.output_ids
            self.ngram_cache.insert(tokens, self._inserted.get(req.rid, 0))
            seen[req.rid] = len(tokens)
            budget = min(self.max_drafts, self._room(req))
            drafts.append(self.ngram_cache.draft(tokens, budget) if budget > 0 and self._can_draft(req) else [])
        self._inserted = seen  # requests no longer decoding are forgotten
        return drafts

    @staticmethod
    def _room(req: Any) -> int:
        """Drafts beyond the request's last token are never committed: this step commits at
        most drafts + 1 tokens, and max_new_tokens keeps them inside the context."""
        max_new = req.sampling_params.max_new_tokens
        return (max_new - len(req.output_ids) - 1) if max_new is not None else 0

    @staticmethod
    def _can_draft(req: Any) -> bool:
        sp = req.sampling_params
        return (
            req.grammar is None and req.to_finish is None
            and sp.frequency_penalty == 0 and sp.presence_penalty == 0 and sp.repetition_penalty == 1
            and len(req.output_ids) >= (sp.min_new_tokens or 0)
        )

    # ---- the verify forward --------------------------------------------------------------------
    def _verify_forward(self, batch: Any, worker_batch: ModelWorkerBatch, spec: NgramVerifyInput) -> torch.Tensor:
        """Slots for the drafts (after each request's last-token slot), then one EXTEND forward
        of every request's last token and drafts; returns the logits at every position."""
        rows = batch.req_to_token_pool.req_to_token
        prefix_lens = [s - 1 for s in batch.seq_lens_cpu]  # L: tokens with KV before this step
        draft_locs = batch.alloc_slots_after([p + 1 for p in prefix_lens],
                                             [p + n for p, n in zip(prefix_lens, spec.extend_lens)])
        input_ids, out_cache_loc, offset = [], [], 0
        last_tokens, last_locs = batch.input_ids.tolist(), batch.out_cache_loc.tolist()
        for i, (req, drafts) in enumerate(zip(batch.reqs, spec.draft_token_ids)):
            locs = draft_locs[offset : offset + len(drafts)]
            offset += len(drafts)
            p = prefix_lens[i]
            rows[req.req_pool_idx, p + 1 : p + 1 + len(drafts)] = locs.to(torch.int32)
            input_ids += [last_tokens[i]] + drafts
            out_cache_loc += [last_locs[i]] + locs.tolist()
        seq_lens_cpu = [p + n for p, n in zip(prefix_lens, spec.extend_lens)]
        # The decode step's worker batch as an EXTEND (what else it carries, e.g. adapters, stays).
        verify_batch = dataclasses.replace(
            worker_batch,
            forward_mode=ForwardMode.TARGET_VERIFY,
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens_cpu, dtype=torch.int64),
            out_cache_loc=torch.tensor(out_cache_loc, dtype=torch.int64),
            seq_lens_cpu=seq_lens_cpu,
            extend_seq_lens=spec.extend_lens,
            extend_prefix_lens=prefix_lens,
            return_logprob=False,  # logprobs come from every position's logits (verify.py)
            top_logprobs_nums=None,
            capture_all_logits=True,
            token_bitmask=None,  # applied per position by verify_chain
        )
        result = self.target_worker.forward_batch_generation(verify_batch, skip_sample=True)
        return result.logits_output.all_logits

    # ---- after acceptance ----------------------------------------------------------------------
    def _commit(self, batch: Any, spec: NgramVerifyInput, out: NgramVerifyOutput) -> None:
        """KV of the accepted tokens stays, the rejected drafts' slots go back now; seq_lens and
        the sampling state follow the committed tokens."""
        rows = batch.req_to_token_pool.req_to_token
        ps = batch.token_to_kv_pool_allocator.page_size
        freed, new_lens = [], []
        for i, (req, k, a) in enumerate(zip(batch.reqs, spec.num_drafts, out.accept_lens)):
            kept = batch.seq_lens_cpu[i] + a  # L + 1 + a
            end = batch.seq_lens_cpu[i] + k
            # Paged: the rest of the page of the last kept token stays the request's (the next
            # step's tokens fill it); only whole pages past it go back.
            first_free = -(-kept // ps) * ps
            if first_free < end:
                freed.append(rows[req.req_pool_idx, first_free:end].to(torch.int64))
            req.kv_committed_len = kept
            req.spec_num_correct_drafts += a
            new_lens.append(kept)
        if freed:
            batch.token_to_kv_pool_allocator.free(torch.cat(freed))
        batch.seq_lens_cpu = new_lens
        batch.seq_lens = torch.tensor(new_lens, dtype=torch.int64, device=batch.seq_lens.device)
        batch.output_ids = torch.tensor([t[-1] for t in out.token_ids], dtype=torch.int64)
        _cumulate_tokens(batch.sampling_info, out.token_ids)

    def _count(self, num_reqs: int, committed: int, correct: int, proposed: int) -> None:
        if self.stats is None:
            return
        self.stats.spec_verify_ct += num_reqs
        self.stats.spec_num_accept_tokens += committed
        self.stats.spec_num_correct_drafts += correct
        self.stats.spec_num_proposed_drafts += proposed

    @staticmethod
    def _result(batch: Any, out: NgramVerifyOutput) -> GenerationBatchResult:
        """Every committed token back to back (next_token_ids), accept_lens[i] + 1 per request."""
        flat = [t for toks in out.token_ids for t in toks]
        result = GenerationBatchResult(None, torch.tensor(flat, dtype=torch.int64), accept_lens=list(out.accept_lens))
        if out.logprobs is not None:
            result.next_token_logprobs = torch.tensor([v for vals in out.logprobs for v in vals], dtype=torch.float32)
            if out.top_logprobs_val is not None:
                result.top_logprobs_val = [v for vals in out.top_logprobs_val for v in vals]
                result.top_logprobs_idx = [v for vals in out.top_logprobs_idx for v in vals]
            else:
                n = len(flat)
                result.top_logprobs_val, result.top_logprobs_idx = [[] for _ in range(n)], [[] for _ in range(n)]
        return result


def _cumulate_tokens(info: Any, token_ids: List[List[int]]) -> None:
    """SamplingBatchInfo.cumulate_output_tokens for several tokens per row."""
    counts = torch.tensor([len(t) for t in token_ids], dtype=torch.int64, device=info.output_lens.device)
    info.output_lens += counts
    if info.output_token_counts is None and info.seen_token_mask is None:
        return
    rows = torch.repeat_interleave(torch.arange(len(token_ids), device=counts.device), counts)
    ids = torch.tensor([t for toks in token_ids for t in toks], dtype=torch.int64, device=counts.device)
    if info.output_token_counts is not None:
        info.output_token_counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
    if info.seen_token_mask is not None:
        info.seen_token_mask[rows, ids] = True
