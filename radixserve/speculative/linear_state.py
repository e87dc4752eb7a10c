"""Speculative decoding on a hybrid target (Qwen3-Next, Qwen3.5): the linear-attention layers'
states after a verify step are those of the accepted tokens, never of a rejected draft.

A full-attention layer drops a rejected draft by freeing its KV slot; a GatedDeltaNet layer has
folded every token it saw into one recurrent state per request, which cannot be unfolded. So:

    verify:   the target's TARGET_VERIFY forward over t, d_1..d_k READS each request's states
              (LinearAttnMetadata.write_states False: the pool is left as it was before the step)
    accept:   a drafts accepted (t, d_1..d_a keep their KV, positions L .. L + a)
    advance:  one EXTEND forward of the target over t, d_1..d_a from the untouched states
              (advance_linear_states): the states move on by exactly the committed tokens; the
              full-attention layers rewrite the same tokens' KV in the same slots

Why not SGLang's way (the verify keeps every position's intermediate state and the accepted
one is copied into the slot): that needs a buffer of num_draft_tokens states per request and
layer, sized into the memory budget, and a kernel that writes them; this costs one extra target
forward of a + 1 tokens per step instead, is correct by construction (the same extend path that
prefill uses), and needs nothing from the pools. The intermediate states are the faster way
once the cost matters (a chain only: a token tree's branches would each need a state, so
--speculative-eagle-topk > 1 is refused on hybrid models)."""

from __future__ import annotations

import dataclasses
from typing import Any, List

import torch

from radixserve.model_executor.forward_batch import ForwardMode, ModelWorkerBatch
from radixserve.model_executor.worker_protocol import TargetWorker
from radixserve.speculative.overlap_view import slots_of


def has_linear_states(target_worker: TargetWorker) -> bool:
    """The target keeps per-request recurrent states (its rows hold state-pool slots)."""
    return hasattr(target_worker.get_memory_pool()[0], "mamba_pool")


def advance_linear_states(target_worker: TargetWorker, batch: Any, worker_batch: ModelWorkerBatch,
                          last_tokens: List[int], prefix_lens: List[int], token_ids: List[List[int]]) -> None:
    """After a verify step's commit: the target's EXTEND forward over each request's committed
    tokens that have KV (its last token t at L and its accepted drafts: token_ids[i] without the
    target's own last token), from the states the verify left untouched. Logits are not used."""
    tokens = [[t] + toks[:-1] for t, toks in zip(last_tokens, token_ids)]
    lens = [len(t) for t in tokens]
    seq_lens = [p + n for p, n in zip(prefix_lens, lens)]
    locs = [slots_of(batch, i, p, p + n) for i, (p, n) in enumerate(zip(prefix_lens, lens))]
    advance = dataclasses.replace(
        worker_batch,
        forward_mode=ForwardMode.EXTEND,
        input_ids=torch.tensor([t for toks in tokens for t in toks], dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        out_cache_loc=torch.cat(locs),
        seq_lens_cpu=seq_lens,
        extend_seq_lens=lens,
        extend_prefix_lens=list(prefix_lens),
        return_logprob=False, top_logprobs_nums=None, token_ids_logprobs=None, capture_all_logits=False,
        token_bitmask=None, input_logprob_positions=None, input_logprob_token_ids=None,
        spec_tree=None, capture_hidden_states=False, spec_hidden_states=None,
    )
    target_worker.forward_batch_generation(advance, skip_sample=True)
