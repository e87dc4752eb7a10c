"""Speculative decoding in the overlap loop: the forward thread's half (the scheduler's half and
the picture are in managers/spec_overlap.py).

The workers (NGRAM, STANDALONE, EAGLE) take a prepared decode batch; in the overlap loop the
forward thread hands them a DecodeView instead of the ScheduleBatch, built right before the step
from what the scheduler froze at schedule time (SpecOverlapInput) and what the step before
committed (the FutureMap's draft state):

    tokens     = the snapshot of prompt + output, then the tokens the step in flight committed
    seq_len    = len(tokens);  the last token goes at position seq_len - 1
    slots      = the request's window of reserved slots, from that position on
                 (alloc_slots_after hands them out; the view's ledger frees nothing: the slots
                 stay reserved for the request's next step, and go when it finishes)

The view never writes a req_to_token row: a request that finished while this step was in flight
may have given its row to another one already.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from radixserve.mem_cache.kv_ledger import KVLedger, ReservedSlots  # the ledger's face for a reserved window
from radixserve.model_executor.forward_batch import ForwardMode, ModelWorkerBatch


@dataclass
class ReqView:
    """A request as the step sees it (the workers read these fields; writes stay here)."""

    rid: str
    origin_input_ids: List[int]
    output_ids: List[int]
    sampling_params: Any
    grammar: Any
    to_finish: Any
    req_pool_idx: int
    lora_path: Optional[str] = None
    kv_committed_len: int = 0


@dataclass
class ExtendView:
    """A prefill (extend) batch on the forward thread: the workers read its requests only."""

    reqs: List[Any]
    forward_mode: ForwardMode
    output_ids: Optional[torch.Tensor] = None


@dataclass
class DecodeView:
    """The fields of a prepared decode ScheduleBatch the speculative workers use."""

    reqs: List[ReqView]
    seq_lens_cpu: List[int]
    seq_lens: torch.Tensor
    input_ids: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    ledger: ReservedSlots
    sampling_info: Any
    return_logprob: bool
    top_logprobs_nums: List[int]
    windows: torch.Tensor  # [bs, 2k + 2] reserved slots from position window_starts[i]
    window_starts: List[int]
    forward_mode: ForwardMode = ForwardMode.DECODE
    output_ids: Optional[torch.Tensor] = None

    def slots(self, i: int, start: int, end: int) -> torch.Tensor:
        """Request i's reserved slots of positions start .. end-1."""
        s = self.window_starts[i]
        return self.windows[i, start - s : end - s]

    def alloc_slots_after(self, prefix_lens: List[int], seq_lens: List[int]) -> torch.Tensor:
        """ScheduleBatch.alloc_slots_after, from the reserved slots (nothing is allocated)."""
        return torch.cat([self.slots(i, p, s) for i, (p, s) in enumerate(zip(prefix_lens, seq_lens))])


def decode_view(inp: Any, pending: List[List[int]], worker_batch: ModelWorkerBatch, ledger: KVLedger,
                return_logprob: bool, top_logprobs_nums: List[int], verify_width: int) -> DecodeView:
    """The step's DecodeView: `inp` is the scheduler's SpecOverlapInput, pending[i] the tokens the
    step in flight committed for request i (empty when the scheduler had them already),
    verify_width the slots a verify uses at most (1 + drafts verified); the rest of each
    request's reserved slots past it are spare (ReservedSlots); `ledger` is the scheduler's."""
    reqs, lens, last, offsets = [], [], [], []
    for i, snap in enumerate(inp.reqs):
        output = snap.output_ids + pending[i]
        reqs.append(ReqView(snap.rid, snap.origin_input_ids, output, snap.sampling_params, snap.grammar,
                            snap.to_finish, snap.req_pool_idx, snap.lora_path))
        lens.append(len(snap.origin_input_ids) + len(output))
        last.append(output[-1])  # (a decoding request has output)
        offsets.append(lens[-1] - inp.known_lens[i])  # 0 .. k + 1
    rows = torch.arange(len(reqs))
    offs = torch.tensor(offsets, dtype=torch.int64)
    cols = torch.arange(inp.windows.shape[1])
    reserved = torch.tensor(inp.reserved_lens, dtype=torch.int64) - torch.tensor(inp.known_lens) + 1
    spare_mask = (cols[None, :] >= offs[:, None] + verify_width) & (cols[None, :] < reserved[:, None])
    return DecodeView(
        reqs=reqs, seq_lens_cpu=lens, seq_lens=torch.tensor(lens, dtype=torch.int64),
        input_ids=torch.tensor(last, dtype=torch.int64), out_cache_loc=inp.windows[rows, offs],
        req_pool_indices=worker_batch.req_pool_indices,
        ledger=ReservedSlots(inp.windows[spare_mask], ledger),
        sampling_info=worker_batch.sampling_info, return_logprob=return_logprob, top_logprobs_nums=top_logprobs_nums,
        windows=inp.windows, window_starts=[n - 1 for n in inp.known_lens],
    )


def decode_worker_batch(view: DecodeView, worker_batch: ModelWorkerBatch) -> ModelWorkerBatch:
    """The scheduler's decode ModelWorkerBatch with the step's real tokens, lengths and slots."""
    return dataclasses.replace(worker_batch, input_ids=view.input_ids, seq_lens=view.seq_lens,
                               seq_lens_cpu=list(view.seq_lens_cpu), out_cache_loc=view.out_cache_loc)


def slots_of(batch: Any, i: int, start: int, end: int) -> torch.Tensor:
    """Request i's slots of positions start .. end-1: from its req_to_token row, or in the
    overlap loop from its reserved window (the row may be another request's by now)."""
    if isinstance(batch, DecodeView):
        return batch.slots(i, start, end)
    return batch.ledger.row(batch.reqs[i])[start:end].to(torch.int64)
