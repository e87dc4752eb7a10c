"""Speculative decoding in the overlap loop: the scheduler thread's half (seed 001 §2 with
speculation; the forward thread's half is speculative/overlap_view.py).

In the overlap loop, decode step N+1 is scheduled while step N runs, and a speculative step
commits a variable number of tokens: the scheduler does not know, when it prepares N+1, how
long each request will be after N. So it prepares N+1 for every length N can leave:

    S  = len(origin_input_ids + output_ids)    the tokens the scheduler has processed
    S' = the length after the step in flight   S <= S' <= S + 1 + k   (k = max_drafts)
    N+1 writes KV at positions S'-1 .. S'-1+k  (the last token, then up to k drafts)

  * slots: each request's req_to_token row holds slots up to position S + 2k + 1
    (req.kv_allocated_len, KVLedger.reserve_ahead), so whatever N commits, N+1 finds its slots already there; the
    slots a step does not use are used by the next one, and all go back when the request
    finishes or is retracted (at most 2k + 2 per request are reserved ahead);
  * the window: the row's slots of positions S-1 .. S+2k, copied at schedule time (a request
    that finishes meanwhile gives its row to another; the copy keeps N+1 off that row);
  * the draft state: the tokens N commits travel in the FutureMap (overlap.py) to the forward
    thread, which appends them to the snapshot of each request's tokens taken here.

The scheduler learns the committed lengths when it processes N's result
(SchedulerOutputProcessor.append_tokens sets kv_committed_len).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from radixserve.mem_cache.kv_ledger import held_len  # positions of a row that hold its slots
from radixserve.model_executor.forward_batch import ForwardMode


@dataclass
class SpecReqSnapshot:
    """What the forward thread may read of a request: taken on the scheduler thread."""

    rid: str
    origin_input_ids: List[int]
    output_ids: List[int]  # a copy: the scheduler appends to the Req's list meanwhile
    sampling_params: Any
    grammar: Any
    to_finish: Any
    req_pool_idx: int
    lora_path: Optional[str] = None


@dataclass
class SpecOverlapInput:
    """A speculative decode step as the scheduler hands it to the forward thread."""

    reqs: List[SpecReqSnapshot]
    known_lens: List[int]  # S per request
    reserved_lens: List[int]  # positions with reserved slots (kv_allocated_len)
    windows: torch.Tensor  # [bs, 2k + 2] slots of positions S-1 .. S+2k (clamped to the row)
    input_ids: torch.Tensor  # each request's last token, or -future_index while it is in flight


def reserve_target(req: Any, max_drafts: int, row_width: int) -> int:
    """Positions with slots a request needs before its next step: S + 2k + 1 (module docstring)."""
    return min(req.seqlen() + 2 * max_drafts + 1, row_width)


def new_slots_needed(reqs: List[Any], max_drafts: int, row_width: int, page_size: int) -> int:
    """Slots the next prepare_decode takes (whole pages when page_size > 1)."""
    need = 0
    for r in reqs:
        base, target = held_len(r), reserve_target(r, max_drafts, row_width)
        if target > base:
            need += page_size * (-(-target // page_size) - -(-base // page_size))
    return need


def prepare_decode(batch: Any) -> None:
    """ScheduleBatch.prepare_for_decode in the overlap loop with speculation: slots reserved
    ahead and the step's SpecOverlapInput (batch.spec_overlap_input); seq_lens stay the known
    lengths S (the forward thread works with the real ones)."""
    batch.forward_mode = ForwardMode.DECODE
    batch.input_ids, batch.output_ids = batch.output_ids, None
    k = batch.spec_max_drafts
    ledger = batch.ledger
    width = ledger.row_width
    ledger.reserve_ahead(batch.reqs, [reserve_target(r, k, width) for r in batch.reqs])
    targets = [r.kv_allocated_len for r in batch.reqs]
    known = [r.seqlen() for r in batch.reqs]
    positions = torch.tensor(known, dtype=torch.int64)[:, None] - 1 + torch.arange(2 * k + 2)
    # (on the host, as the verify step's other index tensors: the forward thread picks from it)
    rows = ledger.rows_cpu
    windows = rows[batch.req_pool_indices[:, None], positions.clamp(max=width - 1)].to(torch.int64)
    batch.seq_lens_cpu = known
    batch.seq_lens = torch.tensor(known, dtype=torch.int64)
    batch.out_cache_loc = windows[:, 0]  # nominal: the forward thread picks each request's slots
    batch.spec_overlap_input = SpecOverlapInput(
        reqs=[SpecReqSnapshot(r.rid, r.origin_input_ids, list(r.output_ids), r.sampling_params, r.grammar,
                              r.to_finish, r.req_pool_idx, r.lora_path) for r in batch.reqs],
        known_lens=known, reserved_lens=targets, windows=windows, input_ids=batch.input_ids,
    )
