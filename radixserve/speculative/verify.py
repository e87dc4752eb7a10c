"""Acceptance of a chain of drafts against the target's logits (speculative sampling).

For each request, positions j = 0..k of its verify forward (spec_info.py's layout), where the
target's distribution p_j (after penalties, bias, grammar, temperature, top-k, top-p, min-p) has
draft d_{j+1} to judge (none at j = k):

    greedy rows:  accept d while d == argmax p_j; then the target's argmax
    sampled rows: accept d with probability p_j(d); on the first rejection draw from p_j with d
                  removed (renormalized); after k acceptances draw from p_k

A draft that does not depend on the target (n-gram) makes the committed tokens distributed
exactly as sampling from the target one token at a time:
P(d) = p(d), and P(x) = (1 - p(d)) * p(x) / (1 - p(d)) = p(x) for x != d.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch

from radixserve.constrained.base_grammar_backend import TokenBitmask
from radixserve.layers.sampler import filter_probs, seed_for_step
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo
from radixserve.speculative.spec_info import ChainVerifyInput, ChainVerifyOutput

# Seeded requests draw their acceptance uniforms from a stream apart from their sampling noise.
_ACCEPT_STREAM = 0x5BEC


@dataclass
class PositionLayout:
    """The flat verify positions: which request each belongs to, its offset in the request,
    and the draft it judges (-1: none, the request's last position)."""

    req_of_pos: List[int]
    offset_of_pos: List[int]
    draft_of_pos: List[int]

    @classmethod
    def of(cls, spec: ChainVerifyInput) -> "PositionLayout":
        req, off, draft = [], [], []
        for i, drafts in enumerate(spec.draft_token_ids):
            for j in range(len(drafts) + 1):
                req.append(i)
                off.append(j)
                draft.append(drafts[j] if j < len(drafts) else -1)
        return cls(req, off, draft)


def expand_sampling_info(info: SamplingBatchInfo, layout: PositionLayout) -> SamplingBatchInfo:
    """One row per verify position (a copy: the batch's info is not touched). A position j
    tokens into the chain has j more output tokens (min_new_tokens bans, seeds)."""
    out = copy.copy(info)
    out.filter_batch(layout.req_of_pos)
    out.output_lens = out.output_lens + torch.tensor(layout.offset_of_pos, dtype=torch.int64, device=out.output_lens.device)
    return out


def expand_bitmask(token_bitmask: Optional[TokenBitmask], spec: ChainVerifyInput) -> Optional[TokenBitmask]:
    """The grammar mask at the verify positions (of a chain or a tree.py TreeDrafts): a grammar
    request has no drafts (its matcher cannot follow them), so its one position takes its row."""
    if token_bitmask is None or not token_bitmask.rows:
        return None
    starts = spec.starts
    req_of_pos = [i for i, n in enumerate(spec.extend_lens) for _ in range(n)]
    assert all(spec.num_drafts[i] == 0 for i in token_bitmask.rows), "a grammar request got drafts"
    bitmask = token_bitmask.bitmask.index_select(0, torch.tensor(req_of_pos, dtype=torch.int64))
    return TokenBitmask(bitmask, [starts[i] for i in token_bitmask.rows], token_bitmask.stats)


@torch.inference_mode()  # as ModelRunner.sample: the penalties update the forward's logits in place
def verify_chain(
    logits: torch.Tensor,
    info: SamplingBatchInfo,
    spec: ChainVerifyInput,
    token_bitmask: Optional[TokenBitmask] = None,
    return_logprob: bool = False,
    top_logprobs_nums: Optional[List[int]] = None,
) -> ChainVerifyOutput:
    """logits [sum(1 + k_i), V] at every verify position; info: the batch's [bs] rows."""
    layout = PositionLayout.of(spec)
    ex, logits = processed_logits(logits, info, layout, token_bitmask, spec)

    draft = torch.tensor(layout.draft_of_pos, dtype=torch.int64, device=logits.device)
    has_draft = draft >= 0
    safe_draft = draft.clamp(min=0)
    argmax = torch.argmax(logits, dim=-1)
    if ex.is_all_greedy:
        accept = has_draft & (argmax == draft)
        probs = None
    else:
        probs = torch.softmax(logits / ex.temperatures, dim=-1)
        probs = filter_probs(probs, ex)
        mass = probs.sum(dim=-1, keepdim=True)
        greedy_row = ~(mass.view(-1) > 0) | (ex.top_ks <= 1)  # no mass left (all -inf): argmax, as the Sampler
        probs = probs / mass.clamp(min=torch.finfo(probs.dtype).tiny)
        p_draft = probs.gather(1, safe_draft.view(-1, 1)).view(-1)
        uniform = _uniforms(ex, logits.shape[0], logits.device)
        accept = has_draft & torch.where(greedy_row, argmax == draft, uniform < p_draft)

    accept_list = accept.tolist()
    accept_lens, final_pos, starts = [], [], spec.starts
    for i, k in enumerate(spec.num_drafts):
        a = 0
        while a < k and accept_list[starts[i] + a]:
            a += 1
        accept_lens.append(a)
        final_pos.append(starts[i] + a)

    pos = torch.tensor(final_pos, dtype=torch.int64, device=logits.device)
    final = argmax[pos]
    if probs is not None:
        final = torch.where(greedy_row[pos], final, draw_residual(probs[pos], draft[pos], ex, pos))
    final_list = final.tolist()
    token_ids = [spec.draft_token_ids[i][:a] + [final_list[i]] for i, a in enumerate(accept_lens)]
    out = ChainVerifyOutput(accept_lens, token_ids, num_drafts=spec.num_drafts)
    if return_logprob:
        add_logprobs(out, logits, [[s + j for j in range(a + 1)] for s, a in zip(starts, accept_lens)], top_logprobs_nums)
    return out


def processed_logits(logits: torch.Tensor, info: SamplingBatchInfo, layout: PositionLayout,
                     token_bitmask: Optional[TokenBitmask], spec: Any) -> Tuple[SamplingBatchInfo, torch.Tensor]:
    """(the sampling rows of every verify position, its float logits after penalties, bias and
    the grammar mask, NaN as -inf): what acceptance reads, for a chain or a tree (spec)."""
    ex = expand_sampling_info(info, layout)
    logits = ex.apply_logits_bias(logits).float()
    bitmask = expand_bitmask(token_bitmask, spec)
    if bitmask is not None:
        bitmask.apply_(logits, ex.vocab_size)
    return ex, logits.masked_fill(torch.isnan(logits), float("-inf"))


def _uniforms(ex: SamplingBatchInfo, n: int, device: Any) -> torch.Tensor:
    u = torch.rand(n, device=device)
    if ex.has_seeds:
        steps = ex.output_lens.tolist()
        for row, seed in enumerate(ex.sampling_seeds):
            if seed is not None:
                gen = torch.Generator(device=u.device)
                gen.manual_seed(seed_for_step(seed ^ _ACCEPT_STREAM, steps[row]))
                u[row] = torch.rand(1, generator=gen, device=u.device)[0]
    return u


def draw_residual(probs: torch.Tensor, rejected: torch.Tensor, ex: SamplingBatchInfo, pos: torch.Tensor) -> torch.Tensor:
    """One draw per row from probs with the rejected draft removed (-1: nothing removed),
    by the Sampler's exponential race (no renormalization needed)."""
    rows = torch.arange(probs.shape[0], device=probs.device)
    residual = probs.clone()
    has = rejected >= 0
    residual[rows[has], rejected[has]] = 0.0
    noise = torch.empty_like(residual).exponential_()
    if ex.has_seeds:
        steps = ex.output_lens[pos].tolist()
        for r, p in enumerate(pos.tolist()):
            seed = ex.sampling_seeds[p]
            if seed is not None:
                gen = torch.Generator(device=probs.device)
                gen.manual_seed(seed_for_step(seed, steps[r]))
                noise[r].exponential_(generator=gen)
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    drawn = torch.argmax(residual / noise, dim=-1)
    # Float rounding can reject a draft that held all the mass: keep it then.
    empty = ~(residual.sum(dim=-1) > 0)
    return torch.where(empty & has, rejected, torch.where(empty, probs.argmax(dim=-1), drawn))


def add_logprobs(out: ChainVerifyOutput, logits: torch.Tensor, judged_at: List[List[int]],
                 top_logprobs_nums: Optional[List[int]]) -> None:
    """Logprobs of the committed tokens at the positions that decided them (judged_at, per
    request), as the Sampler reports them (before temperature and the top-k/top-p filters)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    pos = torch.tensor([p for ps in judged_at for p in ps], dtype=torch.int64, device=logits.device)
    ids = torch.tensor([t for toks in out.token_ids for t in toks], dtype=torch.int64, device=logits.device)
    counts = [len(ps) for ps in judged_at]
    out.logprobs = _split(logprobs[pos, ids].tolist(), counts)
    if not top_logprobs_nums or not any(n > 0 for n in top_logprobs_nums):
        return
    top_v, top_i = torch.topk(logprobs[pos], min(max(top_logprobs_nums), logprobs.shape[-1]), dim=-1)
    out.top_logprobs_val = [[v[:n] for v in rows] for rows, n in zip(_split(top_v.tolist(), counts), top_logprobs_nums)]
    out.top_logprobs_idx = [[v[:n] for v in rows] for rows, n in zip(_split(top_i.tolist(), counts), top_logprobs_nums)]


def _split(flat: list, counts: List[int]) -> List[list]:
    out, k = [], 0
    for n in counts:
        out.append(flat[k : k + n])
        k += n
    return out
