"""What a batch looks like below the scheduler (seed 003):

    ScheduleBatch (scheduler, CPU lists and Req objects)
      -> ModelWorkerBatch (only what the worker needs: tensors + a few lists)
        -> ForwardBatch (tensors for the model: positions, start offsets, backends)

A batch's tokens are laid out request after request. For request i of an EXTEND batch:

    req_to_token[req_pool_indices[i]]:  | prefix (cached) | extend (new)  |
                                         0          prefix_len       seq_len
    input_ids / out_cache_loc:           ...| extend tokens of i |...
                                            ^ extend_start_loc[i]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, auto
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch

from radixserve.mem_cache.swa_memory_pool import SWAForwardLocs

if TYPE_CHECKING:
    from radixserve.layers.attention.spec_tree import SpecTree
    from radixserve.sampling.sampling_batch_info import SamplingBatchInfo


class ForwardMode(IntEnum):
    EXTEND = auto()  # prefill, possibly after a cached prefix, possibly a chunk
    DECODE = auto()  # one new token per request
    MIXED = auto()  # a prefill chunk and decode requests in one forward (--enable-mixed-chunk)
    # Speculative decoding: an EXTEND of each request's last token and its drafts (a chain: the
    # ordinary causal mask), logits at every position (radixserve/speculative/)
    TARGET_VERIFY = auto()

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY)

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED


@dataclass
class ModelWorkerBatch:
    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64; negative = a future token (overlap)
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64, lengths after this forward
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slots for the new tokens
    seq_lens_cpu: List[int]
    extend_seq_lens: Optional[List[int]] = None  # new tokens per request (EXTEND/MIXED)
    extend_prefix_lens: Optional[List[int]] = None
    sampling_info: Optional["SamplingBatchInfo"] = None
    return_logprob: bool = False
    top_logprobs_nums: Optional[List[int]] = None
    token_ids_logprobs: Optional[List[Optional[List[int]]]] = None  # per request, SGLang's token_ids_logprob
    # Logits of every extend position (tests, input logprobs); default: last positions only.
    capture_all_logits: bool = False
    # Structured output: this forward's grammar mask (constrained.TokenBitmask), None when no
    # request has a grammar. Per forward, not on the shared sampling_info (overlap mode).
    token_bitmask: Any = None
    input_logprob_positions: Optional[torch.Tensor] = None  # flat token positions to score
    input_logprob_token_ids: Optional[torch.Tensor] = None  # the prompt token each one scores
    lora_paths: Optional[List[Optional[str]]] = None  # --enable-lora: each request's adapter (None: base)
    # TARGET_VERIFY over token trees (layers/attention/spec_tree.py); None: chains (causal)
    spec_tree: Optional["SpecTree"] = None
    # EAGLE: the target returns its final hidden states; the draft head reads one feature per token
    capture_hidden_states: bool = False
    spec_hidden_states: Optional[torch.Tensor] = None
    pp_proxy_tensors: Any = None  # --pp-size, a stage after the first: the previous stage's hidden states
    # Images (multimodal.MultimodalInputs), one per request (None: text); None when no request has any
    multimodal_inputs: Optional[List[Any]] = None
    # A hybrid model: each request's state slot, read when the batch was scheduled (in the overlap
    # loop a row may be freed or handed on before this forward runs); None: read at the forward
    mamba_state_slots: Optional[torch.Tensor] = None
    # A hybrid model's speculative verify: an empty dict its linear layers fill with what advancing
    # their states by the accepted tokens needs (gated_delta_net.VerifyTrace, by layer); None: not one
    linear_traces: Optional[Dict[int, Any]] = None
    # The SWA pool: the windowed layers' slots of this batch, translated when it was scheduled
    # (the overlap loop moves swa slots while a forward runs); None: translated at the forward
    swa_locs: Optional[SWAForwardLocs] = None
    # return_hidden_states: the final hidden state (after the final norm) at each request's last
    # position comes back in LogitsProcessorOutput.last_hidden_states
    return_hidden_states: bool = False
    # token_ids_logprob at prompt positions: [positions, k] the ids scored at each
    # input_logprob_positions row (padded with 0; each request reads its own k columns)
    input_token_ids_logprob_ids: Optional[torch.Tensor] = None
    # top_logprobs_num at prompt positions: the k best tokens of each input_logprob_positions row
    # (the batch's largest k; each request keeps its own)
    input_top_logprobs_k: int = 0
    # input_embeds (SGLang's): the rows of input_ids whose embedding is given ([n] flat token
    # indices) and those embeddings ([n, hidden]); the model uses them instead of embed_tokens
    input_embeds_rows: Optional[torch.Tensor] = None
    input_embeds: Optional[torch.Tensor] = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: List[int]
    out_cache_loc: torch.Tensor
    extend_seq_lens_cpu: List[int]  # DECODE: all ones
    extend_prefix_lens_cpu: List[int]  # DECODE: seq_len - 1
    req_to_token_pool: Any = None
    token_to_kv_pool: Any = None
    attn_backend: Any = None
    capture_all_logits: bool = False
    input_logprob_positions: Optional[torch.Tensor] = None
    input_logprob_token_ids: Optional[torch.Tensor] = None
    attn_metadata: Any = field(default=None, repr=False)  # set by attn_backend.init_forward_metadata
    lora_paths: Optional[List[Optional[str]]] = None
    lora_info: Any = None  # radixserve.lora LoRABatchInfo, set by ModelRunner.forward (--enable-lora)
    spec_tree: Optional["SpecTree"] = None
    capture_hidden_states: bool = False
    spec_hidden_states: Optional[torch.Tensor] = None
    pp_proxy_tensors: Any = None  # --pp-size, a stage after the first: models.llama.PPProxyTensors
    multimodal_inputs: Optional[List[Any]] = None  # see ModelWorkerBatch
    mamba_state_slots: Optional[torch.Tensor] = None  # (ModelWorkerBatch's)
    linear_traces: Optional[Dict[int, Any]] = None  # (ModelWorkerBatch's)
    swa_locs: Optional[SWAForwardLocs] = None  # (ModelWorkerBatch's, on the device)
    return_hidden_states: bool = False  # (ModelWorkerBatch's)
    input_token_ids_logprob_ids: Optional[torch.Tensor] = None
    input_top_logprobs_k: int = 0  # (ModelWorkerBatch's)
    input_embeds_rows: Optional[torch.Tensor] = None
    input_embeds: Optional[torch.Tensor] = None

    @classmethod
    def init_new(cls, batch: ModelWorkerBatch, model_runner: Any) -> "ForwardBatch":
        device = model_runner.device
        bs = batch.batch_size
        if batch.forward_mode.is_decode():
            extend_lens = [1] * bs
            prefix_lens = [s - 1 for s in batch.seq_lens_cpu]
            positions = batch.seq_lens.to(device) - 1
        else:
            extend_lens = list(batch.extend_seq_lens)
            prefix_lens = list(batch.extend_prefix_lens)
            positions = _extend_positions(prefix_lens, extend_lens, device) if batch.spec_tree is None \
                else batch.spec_tree.positions(prefix_lens).to(device)  # a tree token sits at L + its depth
        fb = cls(
            forward_mode=batch.forward_mode,
            batch_size=bs,
            input_ids=batch.input_ids.to(device),
            positions=positions,
            req_pool_indices=batch.req_pool_indices.to(device),
            seq_lens=batch.seq_lens.to(device),
            seq_lens_cpu=batch.seq_lens_cpu,
            out_cache_loc=batch.out_cache_loc.to(device),
            extend_seq_lens_cpu=extend_lens,
            extend_prefix_lens_cpu=prefix_lens,
            req_to_token_pool=model_runner.req_to_token_pool,
            token_to_kv_pool=model_runner.token_to_kv_pool,
            attn_backend=model_runner.attn_backend,
            capture_all_logits=batch.capture_all_logits,
            input_logprob_positions=batch.input_logprob_positions,
            input_logprob_token_ids=batch.input_logprob_token_ids,
            lora_paths=batch.lora_paths,
            spec_tree=batch.spec_tree,
            capture_hidden_states=batch.capture_hidden_states,
            spec_hidden_states=None if batch.spec_hidden_states is None else batch.spec_hidden_states.to(device),
            pp_proxy_tensors=batch.pp_proxy_tensors,
            multimodal_inputs=batch.multimodal_inputs,
            mamba_state_slots=batch.mamba_state_slots,
            linear_traces=batch.linear_traces,
            swa_locs=None if batch.swa_locs is None else batch.swa_locs.to(device),
            return_hidden_states=batch.return_hidden_states,
            input_token_ids_logprob_ids=batch.input_token_ids_logprob_ids,
            input_top_logprobs_k=batch.input_top_logprobs_k,
            input_embeds_rows=None if batch.input_embeds_rows is None else batch.input_embeds_rows.to(device),
            input_embeds=None if batch.input_embeds is None else batch.input_embeds.to(device),
        )
        # A batch a CUDA graph will replay needs none of the eager metadata.
        graph_runner = getattr(model_runner, "cuda_graph_runner", None)
        if graph_runner is None or not graph_runner.can_run(fb):
            model_runner.attn_backend.init_forward_metadata(fb)
        return fb


def _extend_positions(prefix_lens: List[int], extend_lens: List[int], device) -> torch.Tensor:
    """positions = prefix_len + 0..extend_len-1 per request, built with two vectorized ops."""
    lens = torch.tensor(extend_lens, dtype=torch.int64)
    starts = torch.tensor(prefix_lens, dtype=torch.int64)
    total = int(lens.sum())
    # offset of each token inside its request = global index - start of its request
    req_start = torch.cumsum(lens, 0) - lens
    offs = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(req_start, lens)
    return (offs + torch.repeat_interleave(starts, lens)).to(device)
