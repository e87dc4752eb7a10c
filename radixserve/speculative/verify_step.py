"""One verify step of a chain of drafts, shared by the workers that draft chains (NGRAM,
STANDALONE): slots for the drafts, the target's TARGET_VERIFY forward, acceptance (verify.py),
then the commit (rejected drafts' slots freed at once, seq_lens = the committed lengths) and the
result the scheduler's output processor reads (accept_lens[i] + 1 tokens per request).

    run_verify_step(target_worker, batch, worker_batch, spec, draft_locs=None)

A worker that needs the drafts' slots before the verify (a draft model writes its own KV there)
takes them with alloc_draft_slots and passes them in; otherwise they are taken here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from radixserve.distributed.parallel_state import get_tp_group
from radixserve.model_executor.forward_batch import ForwardMode, ModelWorkerBatch
from radixserve.model_executor.tp_worker import GenerationBatchResult
from radixserve.model_executor.worker_protocol import TargetWorker
from radixserve.speculative.linear_state import advance_linear_states, has_linear_states
from radixserve.speculative.overlap_view import DecodeView
from radixserve.speculative.spec_info import ChainVerifyInput, ChainVerifyOutput
from radixserve.speculative.tree import TreeDrafts, accepted_kv_moves, verify_tree
from radixserve.speculative.verify import verify_chain


# ---- which requests may draft, and how far ---------------------------------------------------
def draft_room(req: Any) -> int:
    """Drafts beyond the request's last token are never committed: a step commits at most
    drafts + 1 tokens, and max_new_tokens keeps them inside the context. (In the overlap loop a
    request that has finished may take one more step: no drafts for it.)"""
    max_new = req.sampling_params.max_new_tokens
    return max(max_new - len(req.output_ids) - 1, 0) if max_new is not None else 0


def can_draft(req: Any) -> bool:
    """False where the next token depends on state the drafts would change (a grammar,
    penalties, min_new_tokens not reached yet) or the request is finishing."""
    sp = req.sampling_params
    return (
        req.grammar is None and req.to_finish is None
        and sp.frequency_penalty == 0 and sp.presence_penalty == 0 and sp.repetition_penalty == 1
        and len(req.output_ids) >= (sp.min_new_tokens or 0)
    )


# ---- slots ------------------------------------------------------------------------------------
def alloc_draft_slots(batch: Any, num_drafts: List[int]) -> List[torch.Tensor]:
    """Slots for each request's drafts at positions L+1 .. L+k_i (after the slot of its last
    token, which prepare_for_decode took), written into its req_to_token row (in the overlap
    loop they are reserved there already: overlap_view.py)."""
    prefix_lens = [s - 1 for s in batch.seq_lens_cpu]  # L: tokens with KV before this step
    flat = batch.alloc_slots_after([p + 1 for p in prefix_lens], [p + 1 + k for p, k in zip(prefix_lens, num_drafts)])
    out, offset = [], 0
    for req, p, k in zip(batch.reqs, prefix_lens, num_drafts):
        locs = flat[offset : offset + k].to(torch.int64)
        offset += k
        if not isinstance(batch, DecodeView):
            batch.ledger.write_row(req, p + 1, locs)
        out.append(locs)
    return out


# ---- the step ----------------------------------------------------------------------------------
def run_verify_step(target_worker: TargetWorker, batch: Any, worker_batch: ModelWorkerBatch,
                    spec: ChainVerifyInput, draft_locs: Optional[List[torch.Tensor]] = None) -> GenerationBatchResult:
    """Verify `spec` (the drafts of a prepared DECODE `batch`) in one target forward and commit.
    Sets batch.output_ids to each request's last committed token. A batch without drafts runs
    the plain decode forward (result.accept_lens is None then)."""
    if not any(spec.num_drafts):  # no request has a draft: the plain decode step
        if draft_locs is not None:  # nothing to free: every list is empty
            assert not any(len(x) for x in draft_locs)
        result = target_worker.forward_batch_generation(worker_batch)
        batch.output_ids = result.next_token_ids
        result.num_drafts = spec.num_drafts
        return result
    if draft_locs is None:
        draft_locs = alloc_draft_slots(batch, spec.num_drafts)
    logits = verify_forward(target_worker, batch, worker_batch, spec, draft_locs)
    out = verify_chain(logits, batch.sampling_info, spec, worker_batch.token_bitmask, batch.return_logprob,
                       batch.top_logprobs_nums if batch.return_logprob else None)
    out = rank0_outcome(out)
    commit(batch, spec, out)
    return result_of(out, spec.num_drafts)


def run_tree_verify_step(target_worker: TargetWorker, batch: Any, worker_batch: ModelWorkerBatch, drafts: TreeDrafts,
                         capture_hidden: bool = False) -> Tuple[ChainVerifyOutput, List[List[int]], Any]:
    """Verify token trees (tree.py) in one target forward under the tree mask and commit: the
    accepted branch's KV moved to its positions, then the chain's commit. Returns the committed
    tokens, each request's accepted branch and (capture_hidden) the target's hidden states."""
    locs = alloc_draft_slots(batch, drafts.num_drafts) if any(drafts.num_drafts) else \
        [torch.empty(0, dtype=torch.int64)] * len(batch.reqs)
    verify_batch = verify_batch_of(batch, worker_batch, drafts.tokens, drafts.extend_lens, locs)
    # A hybrid target's verify leaves its linear-attention states; its traces advance them below.
    traces = {} if has_linear_states(target_worker) else None
    verify_batch = dataclasses.replace(verify_batch, spec_tree=drafts.tree, capture_hidden_states=capture_hidden,
                                       linear_traces=traces)
    out_logits = target_worker.forward_batch_generation(verify_batch, skip_sample=True).logits_output
    out, paths = rank0_outcome(verify_tree(out_logits.all_logits, batch.sampling_info, drafts, worker_batch.token_bitmask,
                                           batch.return_logprob, batch.top_logprobs_nums if batch.return_logprob else None))
    tgt, src = accepted_kv_moves(drafts, paths, verify_batch.out_cache_loc)
    if len(tgt):
        batch.ledger.move_kv(tgt, src)
    if traces is not None:  # the states move on by the accepted tokens only
        advance_linear_states(target_worker, traces, out.accept_lens)
    commit(batch, drafts, out)
    return out, paths, out_logits.hidden_states


def rank0_outcome(outcome: Any) -> Any:
    """Tensor parallelism: every rank commits TP rank 0's acceptance (sampled acceptance draws
    differ between ranks; greedy agrees anyway). Sent over the forward thread's group, in step
    with the forward's all-reduces."""
    tp = get_tp_group()
    if tp.size == 1:
        return outcome
    box = [outcome]
    dist.broadcast_object_list(box, src=tp.first_rank, group=tp.group)
    return box[0]


def verify_forward(target_worker: TargetWorker, batch: Any, worker_batch: ModelWorkerBatch,
                   spec: ChainVerifyInput, draft_locs: List[torch.Tensor]) -> torch.Tensor:
    """One EXTEND forward of every request's last token and drafts (spec_info.py's layout);
    returns the logits at every position."""
    verify_batch = verify_batch_of(batch, worker_batch, spec.draft_token_ids, spec.extend_lens, draft_locs)
    result = target_worker.forward_batch_generation(verify_batch, skip_sample=True)
    return result.logits_output.all_logits


def verify_batch_of(batch: Any, worker_batch: ModelWorkerBatch, drafts: List[List[int]], extend_lens: List[int],
                    draft_locs: List[torch.Tensor]) -> ModelWorkerBatch:
    """The decode step's worker batch as a TARGET_VERIFY EXTEND of each request's last token and
    drafts (what else it carries, e.g. adapters, stays); logits at every position."""
    prefix_lens = [s - 1 for s in batch.seq_lens_cpu]
    input_ids, out_cache_loc = [], []
    last_tokens, last_locs = batch.input_ids.tolist(), batch.out_cache_loc.tolist()
    for i, toks in enumerate(drafts):
        assert len(draft_locs[i]) == len(toks), (len(draft_locs[i]), len(toks))
        input_ids += [last_tokens[i]] + toks
        out_cache_loc += [last_locs[i]] + draft_locs[i].tolist()
    seq_lens_cpu = [p + n for p, n in zip(prefix_lens, extend_lens)]
    return dataclasses.replace(
        worker_batch,
        forward_mode=ForwardMode.TARGET_VERIFY,
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens_cpu, dtype=torch.int64),
        out_cache_loc=torch.tensor(out_cache_loc, dtype=torch.int64),
        seq_lens_cpu=seq_lens_cpu,
        extend_seq_lens=extend_lens,
        extend_prefix_lens=prefix_lens,
        return_logprob=False,  # logprobs come from every position's logits (verify.py / tree.py)
        top_logprobs_nums=None,
        capture_all_logits=True,
        token_bitmask=None,  # applied per position by the acceptance
    )


def commit(batch: Any, spec: ChainVerifyInput, out: ChainVerifyOutput) -> None:
    """KV of the accepted tokens stays, the rejected drafts' slots go back now; seq_lens and
    the sampling state follow the committed tokens (the ledger frees the whole pages past the
    last kept token, up to the last draft's)."""
    new_lens = []
    for i, (req, k, a) in enumerate(zip(batch.reqs, spec.num_drafts, out.accept_lens)):
        kept = batch.seq_lens_cpu[i] + a  # L + 1 + a
        batch.ledger.commit(req, kept, held=batch.seq_lens_cpu[i] + k)
        new_lens.append(kept)
    batch.seq_lens_cpu = new_lens
    batch.seq_lens = torch.tensor(new_lens, dtype=torch.int64, device=batch.seq_lens.device)
    batch.output_ids = torch.tensor([t[-1] for t in out.token_ids], dtype=torch.int64)
    cumulate_tokens(batch.sampling_info, out.token_ids)


def result_of(out: ChainVerifyOutput, num_drafts: List[int]) -> GenerationBatchResult:
    """Every committed token back to back (next_token_ids), accept_lens[i] + 1 per request, and
    the drafts each request verified (the output processor counts them into its meta_info)."""
    flat = [t for toks in out.token_ids for t in toks]
    result = GenerationBatchResult(None, torch.tensor(flat, dtype=torch.int64), accept_lens=list(out.accept_lens),
                                   num_drafts=list(num_drafts))
    if out.logprobs is not None:
        result.next_token_logprobs = torch.tensor([v for vals in out.logprobs for v in vals], dtype=torch.float32)
        if out.top_logprobs_val is not None:
            result.top_logprobs_val = [v for vals in out.top_logprobs_val for v in vals]
            result.top_logprobs_idx = [v for vals in out.top_logprobs_idx for v in vals]
        else:
            n = len(flat)
            result.top_logprobs_val, result.top_logprobs_idx = [[] for _ in range(n)], [[] for _ in range(n)]
    return result


def cumulate_tokens(info: Any, token_ids: List[List[int]]) -> None:
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
