"""Per-request sampling parameters of a batch, as tensors the sampler can use at once.

One row per request, in the batch's request order (B rows, vocabulary V):

    temperatures [B,1] f32   top_ps [B] f32   top_ks [B] i64   min_ps [B] f32
    frequency/presence/repetition_penalties [B] f32
    output_lens [B] i64      min_new_tokens [B] i64   sampling_seeds: list[Optional[int]]
    output_token_counts [B,V] f32   only if some row has a frequency/presence penalty
    seen_token_mask     [B,V] bool  only if some row has repetition_penalty != 1
                                    (token occurred in the prompt or the output)
    stop_token_mask     [B,V] bool  only if some row has min_new_tokens > 0
    logit_bias          [B,V] f32   only if some row has a logit_bias

    custom_logit_processor / custom_params: list[Optional]  only if some row names a
                                    processor (sampling/custom_logit_processor.py)

(A grammar's bans are not here: they come per forward as a packed bitmask, which the
sampler applies after apply_logits_bias; see constrained.TokenBitmask.)

The scheduler keeps it aligned with its request list: `filter_batch` when finished
requests leave, `merge_batch` when a prefill batch joins the running batch. The sampler
calls `apply_logits_bias` before sampling and `cumulate_output_tokens` after it.

A dense [B,V] tensor that only one side of a merge has is filled with zeros (or False)
for the other side's rows; that is exact, because those rows have a zero penalty, no
bias and min_new_tokens == 0, so their entries are never read.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from radixserve.sampling.custom_logit_processor import apply_custom_logit_processors
from radixserve.sampling_params import TOP_K_ALL

# The [B,V] tensors that filter/merge must keep aligned, with their fill for absent rows.
_DENSE_FIELDS = (
    ("output_token_counts", torch.float32),
    ("seen_token_mask", torch.bool),
    ("stop_token_mask", torch.bool),
    ("logit_bias", torch.float32),
)
# The per-request [B] (or [B,1]) tensors.
_ROW_FIELDS = (
    "temperatures",
    "top_ps",
    "top_ks",
    "min_ps",
    "frequency_penalties",
    "presence_penalties",
    "repetition_penalties",
    "output_lens",
    "min_new_tokens",
)


@dataclass
class SamplingBatchInfo:
    vocab_size: int
    device: str
    temperatures: torch.Tensor  # [B,1] float32 (1.0 for greedy rows)
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64; TOP_K_ALL = no limit, 1 = greedy
    min_ps: torch.Tensor  # [B] float32
    frequency_penalties: torch.Tensor  # [B] float32
    presence_penalties: torch.Tensor  # [B] float32
    repetition_penalties: torch.Tensor  # [B] float32
    output_lens: torch.Tensor  # [B] int64: tokens generated so far
    min_new_tokens: torch.Tensor  # [B] int64
    sampling_seeds: List[Optional[int]]
    is_all_greedy: bool = True
    need_top_p_sampling: bool = False
    need_top_k_sampling: bool = False  # some row has 1 < top_k < TOP_K_ALL (top_k 1 = argmax)
    need_min_p_sampling: bool = False
    # Top-k/top-p only ever keep a row's `filter_bound` most likely tokens: its top_k, or V for
    # a top-p row without one. The sampler takes torch.topk(max over rows) instead of a full
    # sort when that is small. Kept on the host so choosing costs no device sync.
    filter_bound: int = 0
    output_token_counts: Optional[torch.Tensor] = None
    seen_token_mask: Optional[torch.Tensor] = None
    stop_token_mask: Optional[torch.Tensor] = None
    logit_bias: Optional[torch.Tensor] = None
    # --enable-custom-logit-processor: each row's processor name (None: none) and its params
    custom_logit_processor: Optional[List[Optional[str]]] = None
    custom_params: Optional[List[Optional[Dict[str, Any]]]] = None

    def __post_init__(self) -> None:
        b = self.temperatures.shape[0]
        assert self.temperatures.shape == (b, 1), self.temperatures.shape
        assert len(self.sampling_seeds) == b
        for name in _ROW_FIELDS[1:]:
            assert getattr(self, name).shape == (b,), (name, getattr(self, name).shape)
        for name, _ in _DENSE_FIELDS:
            t = getattr(self, name)
            assert t is None or t.shape == (b, self.vocab_size), (name, t.shape)

    def __len__(self) -> int:
        return self.temperatures.shape[0]

    @property
    def has_seeds(self) -> bool:
        return any(s is not None for s in self.sampling_seeds)

    # ------------------------------------------------------------------ building
    @classmethod
    def from_reqs(cls, reqs: Sequence[Any], vocab_size: int, device: str = "cpu") -> "SamplingBatchInfo":
        """Build from requests carrying `sampling_params` (normalized), `output_ids`,
        `origin_input_ids` and `eos_token_ids`. Output ids already present (a retracted
        request that restarts) count for penalties and output_lens."""
        sps = [r.sampling_params for r in reqs]
        outs = [list(getattr(r, "output_ids", None) or []) for r in reqs]
        b, v = len(reqs), vocab_size

        def t(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        temps = [float(p.temperature) for p in sps]
        top_ps = [float(p.top_p) for p in sps]
        top_ks = [TOP_K_ALL if p.top_k in (-1, None) else int(p.top_k) for p in sps]
        min_ps = [float(p.min_p) for p in sps]
        freq = [float(p.frequency_penalty) for p in sps]
        pres = [float(p.presence_penalty) for p in sps]
        rep = [float(p.repetition_penalty) for p in sps]
        min_new = [int(p.min_new_tokens or 0) for p in sps]

        info = cls(
            vocab_size=v,
            device=device,
            temperatures=t(temps, torch.float32).view(b, 1),
            top_ps=t(top_ps, torch.float32),
            top_ks=t(top_ks, torch.int64),
            min_ps=t(min_ps, torch.float32),
            frequency_penalties=t(freq, torch.float32),
            presence_penalties=t(pres, torch.float32),
            repetition_penalties=t(rep, torch.float32),
            output_lens=t([len(o) for o in outs], torch.int64),
            min_new_tokens=t(min_new, torch.int64),
            sampling_seeds=[p.sampling_seed for p in sps],
            is_all_greedy=all(k <= 1 for k in top_ks),
            need_top_p_sampling=any(p < 1.0 for p in top_ps),
            need_top_k_sampling=any(1 < k < TOP_K_ALL for k in top_ks),
            need_min_p_sampling=any(p > 0.0 for p in min_ps),
            filter_bound=max((_filter_bound(k, p, v) for k, p in zip(top_ks, top_ps)), default=0),
        )

        if any(f != 0.0 for f in freq) or any(p != 0.0 for p in pres):
            info.output_token_counts = _dense_from_ids(outs, v, device, torch.float32)
        if any(r != 1.0 for r in rep):
            # an input_embeds prompt's ids are placeholders: it has no prompt tokens to penalize
            prompts = [[] if getattr(r, "input_embeds", None) is not None else list(getattr(r, "origin_input_ids", None) or [])
                       for r in reqs]
            seen = [p + o for p, o in zip(prompts, outs)]
            info.seen_token_mask = _dense_from_ids(seen, v, device, torch.bool)
        if any(m > 0 for m in min_new):
            # Suppress every token that would end the request: EOS ids (req.eos_token_ids,
            # empty under ignore_eos) and the request's stop_token_ids.
            stops = [
                sorted(set(getattr(r, "eos_token_ids", None) or ()) | set(p.stop_token_ids or ()))
                if m > 0 else []
                for r, p, m in zip(reqs, sps, min_new)
            ]
            info.stop_token_mask = _dense_from_ids(stops, v, device, torch.bool)
        if any(p.logit_bias for p in sps):
            rows, cols, vals = [], [], []
            for i, p in enumerate(sps):
                for k, val in (p.logit_bias or {}).items():
                    rows.append(i)
                    cols.append(int(k))
                    vals.append(float(val))
            bias = torch.zeros(b, v, dtype=torch.float32, device=device)
            bias[t(rows, torch.int64), t(cols, torch.int64)] = t(vals, torch.float32)
            info.logit_bias = bias
        names = [getattr(r, "custom_logit_processor", None) for r in reqs]
        if any(n is not None for n in names):
            info.custom_logit_processor = names
            info.custom_params = [p.custom_params for p in sps]
        return info

    # ------------------------------------------------------- keep in sync with batch
    def filter_batch(self, keep_indices: Union[List[int], torch.Tensor]) -> None:
        """Keep only rows `keep_indices` (in that order)."""
        if isinstance(keep_indices, torch.Tensor):
            keep_list = keep_indices.tolist()
        else:
            keep_list = list(keep_indices)
        idx = torch.tensor(keep_list, dtype=torch.int64, device=self.device)
        for name in _ROW_FIELDS:
            setattr(self, name, getattr(self, name).index_select(0, idx))
        for name, _ in _DENSE_FIELDS:
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, tensor.index_select(0, idx))
        self.sampling_seeds = [self.sampling_seeds[i] for i in keep_list]
        if self.custom_logit_processor is not None:
            self.custom_logit_processor = [self.custom_logit_processor[i] for i in keep_list]
            self.custom_params = [self.custom_params[i] for i in keep_list]
            if all(n is None for n in self.custom_logit_processor):
                self.custom_logit_processor = self.custom_params = None
        self._refresh_flags()

    def merge_batch(self, other: "SamplingBatchInfo") -> None:
        """Append `other`'s rows after this batch's rows."""
        assert other.vocab_size == self.vocab_size, (other.vocab_size, self.vocab_size)
        b1, b2 = len(self), len(other)
        for name in _ROW_FIELDS:
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)], dim=0))
        for name, dtype in _DENSE_FIELDS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is None and theirs is None:
                continue
            if mine is None:
                mine = torch.zeros(b1, self.vocab_size, dtype=dtype, device=self.device)
            if theirs is None:
                theirs = torch.zeros(b2, self.vocab_size, dtype=dtype, device=self.device)
            setattr(self, name, torch.cat([mine, theirs], dim=0))
        self.sampling_seeds = self.sampling_seeds + other.sampling_seeds
        if self.custom_logit_processor is not None or other.custom_logit_processor is not None:
            self.custom_logit_processor = (self.custom_logit_processor or [None] * b1) + (other.custom_logit_processor or [None] * b2)
            self.custom_params = (self.custom_params or [None] * b1) + (other.custom_params or [None] * b2)
        self.is_all_greedy = self.is_all_greedy and other.is_all_greedy
        self.need_top_p_sampling |= other.need_top_p_sampling
        self.need_top_k_sampling |= other.need_top_k_sampling
        self.need_min_p_sampling |= other.need_min_p_sampling
        self.filter_bound = max(self.filter_bound, other.filter_bound)

    def _refresh_flags(self) -> None:
        """Recompute the flags from the rows (one device sync) and drop [B,V] tensors
        no remaining row needs."""
        flags = torch.stack(
            [
                (self.top_ks <= 1).all(),
                (self.top_ps < 1.0).any(),
                ((self.top_ks > 1) & (self.top_ks < TOP_K_ALL)).any(),
                (self.min_ps > 0.0).any(),
                ((self.frequency_penalties != 0) | (self.presence_penalties != 0)).any(),
                (self.repetition_penalties != 1.0).any(),
                (self.min_new_tokens > 0).any(),
                self.logit_bias.any() if self.logit_bias is not None else torch.tensor(False, device=self.device),
                _filter_bounds(self.top_ks, self.top_ps, self.vocab_size).max(),
            ]
        ).tolist()
        (self.is_all_greedy, self.need_top_p_sampling, self.need_top_k_sampling,
         self.need_min_p_sampling, need_counts, need_seen, need_stop, need_bias) = map(bool, flags[:-1])
        self.filter_bound = int(flags[-1])
        if not need_counts:
            self.output_token_counts = None
        if not need_seen:
            self.seen_token_mask = None
        if not need_stop:
            self.stop_token_mask = None
        if not need_bias:
            self.logit_bias = None

    # ------------------------------------------------------------------ per step
    def cumulate_output_tokens(self, next_token_ids: torch.Tensor) -> None:
        """Record one sampled token per row: output_lens += 1, counts/seen updated."""
        ids = next_token_ids.to(device=self.output_lens.device, dtype=torch.int64).view(-1)
        assert ids.shape[0] == len(self), (ids.shape, len(self))
        self.output_lens += 1
        if self.output_token_counts is None and self.seen_token_mask is None:
            return
        rows = torch.arange(len(self), device=ids.device)
        # Rows are distinct, so plain indexed updates have no collisions.
        if self.output_token_counts is not None:
            self.output_token_counts[rows, ids] += 1.0
        if self.seen_token_mask is not None:
            self.seen_token_mask[rows, ids] = True

    def apply_logits_bias(self, logits: torch.Tensor) -> torch.Tensor:
        """Apply penalties, bias and bans to `logits` [B, >=V] in place; returns it.

        Order: repetition penalty on the model's own logits (its sign test is HF's), then
        frequency/presence, then logit_bias, then custom logit processors, then the min_new_tokens -inf bans last so that
        nothing added afterwards can lift a banned token (the grammar's bans come after
        this, in the sampler).
        """
        view = logits[:, : self.vocab_size]
        if self.seen_token_mask is not None:
            pen = self.repetition_penalties.view(-1, 1).to(view.dtype)
            scaled = torch.where(view > 0, view / pen, view * pen)
            view.copy_(torch.where(self.seen_token_mask, scaled, view))
        if self.output_token_counts is not None:
            counts = self.output_token_counts
            sub = self.frequency_penalties.view(-1, 1) * counts
            sub += self.presence_penalties.view(-1, 1) * (counts > 0)
            view.sub_(sub.to(view.dtype))
        if self.logit_bias is not None:
            view.add_(self.logit_bias.to(view.dtype))
        if self.custom_logit_processor is not None:
            apply_custom_logit_processors(view, self.custom_logit_processor, self.custom_params)
        if self.stop_token_mask is not None:
            active = (self.output_lens < self.min_new_tokens).view(-1, 1)
            view.masked_fill_(self.stop_token_mask & active, float("-inf"))
        return logits


def _filter_bound(top_k: int, top_p: float, vocab_size: int) -> int:
    if 1 < top_k < TOP_K_ALL:
        return min(top_k, vocab_size)
    return vocab_size if top_p < 1.0 and top_k > 1 else 0


def _filter_bounds(top_ks: torch.Tensor, top_ps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """_filter_bound of every row, on the device (int64; empty batches give a 0 row)."""
    limited = (top_ks > 1) & (top_ks < TOP_K_ALL)
    top_p_only = (top_ps < 1.0) & (top_ks >= TOP_K_ALL)
    bounds = torch.where(limited, top_ks.clamp(max=vocab_size), torch.where(top_p_only, vocab_size, 0))
    return torch.cat([bounds.to(torch.int64), bounds.new_zeros(1)])


def _dense_from_ids(ids_per_row: List[List[int]], vocab_size: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    """[B,V] tensor: float counts of each id per row, or a bool 'occurs' mask.
    One scatter_add on a flattened (row * V + token) index; the ids are joined in C."""
    b = len(ids_per_row)
    counts = torch.zeros(b * vocab_size, dtype=torch.float32, device=device)
    tokens = torch.tensor(list(itertools.chain.from_iterable(ids_per_row)), dtype=torch.int64, device=device)
    if tokens.numel():
        lengths = torch.tensor([len(r) for r in ids_per_row], dtype=torch.int64, device=device)
        rows = torch.repeat_interleave(torch.arange(b, device=device), lengths)
        # an image's pad values (multimodal/mm_inputs.py) are ids above the vocabulary: not tokens
        in_vocab = tokens < vocab_size
        rows, tokens = rows[in_vocab], tokens[in_vocab]
        index = rows * vocab_size + tokens
        counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.float32))
    counts = counts.view(b, vocab_size)
    return counts > 0 if dtype == torch.bool else counts.to(dtype)
