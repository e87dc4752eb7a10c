"""Speculative decoding on a hybrid target (Qwen3-Next, Qwen3.5): the linear-attention layers'
states after a verify step are those of the accepted tokens, never of a rejected draft.

A full-attention layer drops a rejected draft by freeing its KV slot; a GatedDeltaNet layer folds
every token it sees into one recurrent state per request, which cannot be unfolded. So:

    verify:   the target's TARGET_VERIFY forward over t, d_1..d_k READS each request's states and
              leaves them as they were; each linear layer records a VerifyTrace
              (layers/gated_delta_net.py: its conv inputs, and per token the key, the delta-rule
              write u and the cumulative log decay) in the batch's linear_traces
    accept:   a drafts accepted (t, d_1..d_a keep their KV)
    advance:  each layer's states move on by t, d_1..d_a from its trace (advance_states: the
              chunked rule's closed form of the state after token a, and the conv inputs ending
              there); no forward

Why this way: SGLang keeps every verify position's full state (dk x dv per head, per layer, per
draft token: num_draft_tokens states per request, sized into the memory budget) and copies the
accepted one; the trace keeps dk + dv + 1 numbers per head and token instead (plus the conv
inputs), lives only through the step, and needs nothing from the pools. (A first version re-ran
the target over the accepted tokens: as exact, but one more forward per step, about 45% of a
step's verify on the test model.) A chain only: a token tree's branches would each need a state,
so --speculative-eagle-topk > 1 is refused on hybrid models."""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from radixserve.layers.gated_delta_net import VerifyTrace, advance_states
from radixserve.model_executor.worker_protocol import TargetWorker


def has_linear_states(target_worker: TargetWorker) -> bool:
    """The target keeps per-request recurrent states (its rows hold state-pool slots)."""
    return hasattr(target_worker.get_memory_pool()[0], "mamba_pool")


def advance_linear_states(target_worker: TargetWorker, traces: Dict[int, VerifyTrace], accept_lens: List[int]) -> None:
    """After a verify's acceptance: every linear layer's states advance by each request's last
    token and its accept_lens[i] accepted drafts (the verify's first 1 + a_i tokens)."""
    pool: Any = target_worker.get_memory_pool()[0].mamba_pool
    keep_lens = torch.tensor([1 + a for a in accept_lens], dtype=torch.int64)
    for layer_id, trace in traces.items():
        conv_state, temporal_state = pool.layer_state(layer_id)
        advance_states(trace, conv_state, temporal_state, keep_lens)
