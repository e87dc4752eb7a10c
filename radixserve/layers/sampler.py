"""Sampler: logits [B,V] + SamplingBatchInfo -> one next token per request.

    logits --apply_logits_bias--> biased --(logprobs taken here)
        all greedy?  argmax
        otherwise    /temperature -> softmax -> top-k, top-p, min-p masks
                     -> exponential race: argmax(probs / q), q ~ Exp(1) per token
                     rows with top_k == 1 take argmax(biased) exactly

The exponential race (argmax of p_i / q_i with i.i.d. q_i ~ Exp(1) picks i with
probability p_i) needs no renormalization after filtering and runs in vocabulary order,
so a seeded request's draw depends only on (seed, output_len, its probs): not on the
other rows, nor on whether this batch needed the sort for top-k/top-p.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import torch
from torch import nn

from radixserve.sampling.sampling_batch_info import SamplingBatchInfo
from radixserve.sampling_params import TOP_K_ALL

_MASK64 = (1 << 64) - 1


@dataclass
class SamplerOutput:
    next_token_ids: torch.Tensor  # [B] int64
    next_token_logprobs: Optional[torch.Tensor] = None  # [B] float32
    top_logprobs_val: Optional[List[List[float]]] = None  # per request, best first
    top_logprobs_idx: Optional[List[List[int]]] = None
    token_ids_logprobs_val: Optional[List[Optional[List[float]]]] = None  # the asked ids' logprobs per request


class Sampler(nn.Module):
    def forward(
        self,
        logits: torch.Tensor,
        sampling_info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_nums: Optional[List[int]] = None,
        token_bitmask: Any = None,
        token_ids_logprobs: Optional[List[Optional[List[int]]]] = None,
    ) -> SamplerOutput:
        info = sampling_info
        logits = info.apply_logits_bias(logits)
        logits = logits.float()
        if token_bitmask is not None:  # grammar bans (constrained.TokenBitmask), -inf like the others
            token_bitmask.apply_(logits, info.vocab_size)
        # A NaN logit must never win an argmax; +inf is kept (softmax then gives NaN and
        # the row falls back to argmax, which picks the +inf token). In place, one pass: a mask
        # and a copy of [batch, vocab] cost ~0.9 ms a step at batch 16 on the CPU.
        logits = torch.nan_to_num_(logits, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))

        if info.is_all_greedy:
            next_ids = torch.argmax(logits, dim=-1)
        else:
            next_ids = self._sample(logits, info)

        out = SamplerOutput(next_token_ids=next_ids)
        if return_logprob:
            # Logprobs are those of the distribution the model (plus penalties, bias and
            # bans) assigns, i.e. log_softmax BEFORE temperature and top-k/top-p/min-p.
            # This matches SGLang's default (and OpenAI's): a returned logprob does not
            # change with the sampling knobs, and greedy requests get the same values.
            logprobs = torch.log_softmax(logits, dim=-1)
            out.next_token_logprobs = logprobs.gather(1, next_ids.view(-1, 1)).view(-1)
            if top_logprobs_nums is not None and any(k > 0 for k in top_logprobs_nums):
                k_max = min(max(top_logprobs_nums), logprobs.shape[-1])
                vals, idx = torch.topk(logprobs, k_max, dim=-1)
                vals, idx = vals.tolist(), idx.tolist()
                out.top_logprobs_val = [vals[i][:k] for i, k in enumerate(top_logprobs_nums)]
                out.top_logprobs_idx = [idx[i][:k] for i, k in enumerate(top_logprobs_nums)]
            elif top_logprobs_nums is not None:
                out.top_logprobs_val = [[] for _ in top_logprobs_nums]
                out.top_logprobs_idx = [[] for _ in top_logprobs_nums]
            if token_ids_logprobs is not None:
                out.token_ids_logprobs_val = gather_token_ids_logprobs(logprobs, token_ids_logprobs)

        info.cumulate_output_tokens(next_ids)
        return out

    @staticmethod
    def _sample(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        probs = torch.softmax(logits / info.temperatures, dim=-1)
        probs = filter_probs(probs, info)

        noise = torch.empty_like(probs).exponential_()
        if info.has_seeds:
            rows = [i for i, s in enumerate(info.sampling_seeds) if s is not None]
            steps = info.output_lens[rows].tolist()
            for row, step in zip(rows, steps):
                gen = torch.Generator(device=probs.device)
                gen.manual_seed(seed_for_step(info.sampling_seeds[row], step))
                noise[row].exponential_(generator=gen)
        # Exp(1) can return exactly 0 on some backends; 0/0 would be NaN.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        sampled = torch.argmax(probs / noise, dim=-1)

        greedy_ids = torch.argmax(logits, dim=-1)
        # Rows whose filtered mass is 0 or NaN (all -inf, +inf logits) fall back to argmax.
        bad = ~(probs.sum(dim=-1) > 0)
        use_argmax = bad | (info.top_ks <= 1)
        return torch.where(use_argmax, greedy_ids, sampled)


# Above this many candidates a full sort is as cheap as torch.topk (which is a partial sort).
TOPK_CANDIDATES_MAX = 1024


def filter_probs(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Zero the probabilities top-k, top-p and min-p exclude (rows are not renormalized).

    top_k = k: keep the k most likely tokens (ties at the boundary: any k of them).
    top_p = p: then keep the smallest most-likely-first prefix of the top-k distribution
      (renormalized) whose mass reaches p, i.e. drop a token once the mass before it >= p.
      (SGLang's torch fallback drops only when that mass is > p; the difference is an
      exact tie, which we resolve by the definition.)
    min_p = m: drop tokens with prob < m * max prob (the max is never dropped).

    Top-k and top-p look only at a row's `filter_bound` most likely tokens, so when every
    row's bound is small (top-k rows, top-p under a top-k) this takes torch.topk of that
    many instead of sorting the whole vocabulary.
    """
    if info.need_top_k_sampling or info.need_top_p_sampling:
        vocab = probs.shape[-1]
        bound = info.filter_bound
        if bound <= TOPK_CANDIDATES_MAX and bound < vocab:
            sorted_probs, sorted_idx = probs.topk(bound, dim=-1)
        else:
            sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
        remove_sorted = _top_k_top_p_remove(sorted_probs, info)
        kept = torch.zeros_like(probs).scatter_(1, sorted_idx, sorted_probs.masked_fill(remove_sorted, 0.0))
        if sorted_probs.shape[-1] < vocab:
            # Tokens outside the candidates are dropped only for rows that filter at all
            # (their bound is within the candidates); the other rows keep everything.
            filters = (info.top_ks < TOP_K_ALL) | (info.top_ps < 1.0)
            kept = torch.where(filters.view(-1, 1), kept, probs)
        probs = kept
    if info.need_min_p_sampling:
        max_p = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < info.min_ps.view(-1, 1) * max_p, 0.0)
    return probs


def _top_k_top_p_remove(sorted_probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Which of the most-likely-first candidates [B, C] top-k and then top-p remove."""
    remove = torch.zeros_like(sorted_probs, dtype=torch.bool)
    if info.need_top_k_sampling:
        ranks = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device).view(1, -1)
        remove |= ranks >= info.top_ks.view(-1, 1)
    if info.need_top_p_sampling:
        kept = sorted_probs.masked_fill(remove, 0.0)
        mass_before = kept.cumsum(dim=-1) - kept
        total = kept.sum(dim=-1, keepdim=True)
        top_ps = info.top_ps.view(-1, 1)
        remove |= (mass_before >= top_ps * total) & (top_ps < 1.0)
    return remove


def seed_for_step(seed: int, step: int) -> int:
    """A 63-bit generator seed from (request seed, step): splitmix64 of both."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + (int(step) + 1) * 0xD1B54A32D192ED03) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return x & ((1 << 63) - 1)


def gather_token_ids_logprobs(logprobs: torch.Tensor, token_ids: List[Optional[List[int]]]) -> List[Optional[List[float]]]:
    """Each row's logprobs of its asked ids (None where a row asked none): one padded gather."""
    width = max((len(ids) for ids in token_ids if ids), default=0)
    if width == 0:
        return [None if ids is None else [] for ids in token_ids]
    index = torch.tensor([(ids or []) + [0] * (width - len(ids or [])) for ids in token_ids],
                         dtype=torch.int64, device=logprobs.device)
    rows = logprobs.gather(1, index).tolist()
    return [None if ids is None else row[: len(ids)] for row, ids in zip(rows, token_ids)]
