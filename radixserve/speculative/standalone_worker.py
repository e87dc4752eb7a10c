"""STANDALONEWorker: speculative decoding with a smaller draft model of the target's vocabulary.

The draft model has KV buffers of its own (its layers, heads, head_dim) indexed by the target's
slots: one req_to_token_pool and one allocator for both, so a slot the target writes, the draft
writes too, and the radix cache, chunked prefill and retraction need to know nothing of it:

    extend / mixed batch:  the target's forward, then the draft's over the same out_cache_loc
    decode batch, request i (L = tokens with KV before the step, t its last sampled token):
        draft chain:  t at L -> d_1,  d_1 at L+1 -> d_2,  ...,  d_{k-1} at L+k-1 -> d_k
                      (k = --speculative-num-steps greedy forwards, each writing the draft's KV
                      at the slot the verify uses for that token)
        verify:       one target forward of t, d_1..d_k and acceptance (verify_step.py, as NGRAM)
        catch-up:     a request that accepted all k drafts keeps d_k, whose draft KV the chain
                      did not write: one more draft forward of d_k at L+k writes it

Drafts are the draft model's argmax: a deterministic draft makes verify.py's rejection rule
exact in distribution. Requests that cannot draft (verify_step.can_draft) still get the draft
KV of t (the chain's first forward) and verify no drafts.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, List, Optional

import torch

from radixserve.model_executor.forward_batch import ForwardBatch, ForwardMode, ModelWorkerBatch
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.model_executor.tp_worker import GenerationBatchResult
from radixserve.model_executor.worker_protocol import TargetWorker
from radixserve.models.model_config import ModelConfig
from radixserve.speculative.spec_info import ChainVerifyInput
from radixserve.speculative.verify_step import alloc_draft_slots, can_draft, draft_room, run_verify_step

logger = logging.getLogger(__name__)


def load_draft_runner(server_args: Any, target_worker: TargetWorker,
                      config: Optional[ModelConfig] = None) -> ModelRunner:
    """The draft model on the target's device, with KV buffers for every slot of the target's
    pool. ValueError (one line) when its vocabulary or context differs from the target's.
    config: the draft's (default: its path's config.json)."""
    path = server_args.speculative_draft_model_path
    config = config or ModelConfig.from_pretrained(path)
    target = target_worker.model_config
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"--speculative-draft-model-path {path}: vocabulary of {config.vocab_size} tokens, "
                         f"the target's has {target.vocab_size} (the draft needs the target's tokenizer)")
    if config.context_len < target_worker.context_len:
        raise ValueError(f"--speculative-draft-model-path {path}: context of {config.context_len} tokens is below "
                         f"the target's {target_worker.context_len}; lower --context-length")
    # The draft is an ordinary model of its own path (no adapters, no speculation of its own),
    # in the target's dtype (an EAGLE head takes the target's embeddings and hidden states).
    # Its decode steps run eagerly: the target's memory budget reserves no graph pool for it.
    dtype = str(target_worker.dtype).removeprefix("torch.")
    args = server_args.replace(model_path=path, speculative_algorithm=None, enable_lora=False, lora_paths=None,
                               disable_cuda_graph=True, dtype=dtype,
                               quantization=draft_quantization(server_args.quantization, config))
    return ModelRunner(config, args, shared_slots=target_worker.get_memory_pool())


def draft_quantization(quantization: str, draft: ModelConfig) -> str:
    """The target's --quantization where it applies to the draft's format, else auto: a GGUF
    target's `gguf` would refuse an HF-directory draft, and `w8a8_int8` a GGUF draft."""
    if (quantization == "gguf" and not draft.gguf_file) or (quantization == "w8a8_int8" and draft.gguf_file):
        return "auto"
    return quantization


class STANDALONEWorker:
    def __init__(self, server_args: Any, target_worker: TargetWorker, draft_runner: Optional[ModelRunner] = None):
        self.target_worker = target_worker
        self.draft_runner = draft_runner or load_draft_runner(server_args, target_worker)
        self.max_drafts = server_args.speculative_num_steps
        self.verify_width = 1 + self.max_drafts  # slots a verify writes per request (the overlap loop's view)

    def clear_cache_pool(self) -> None:
        """Nothing to forget: the draft's KV lives in the target's slots (flushed with them)."""

    # ---- the interface the scheduler calls ------------------------------------------------
    def forward_batch(self, batch: Any, worker_batch: ModelWorkerBatch) -> GenerationBatchResult:
        if batch.forward_mode.is_decode():
            return self.forward_batch_speculative_generation(batch, worker_batch)
        result = self.target_worker.forward_batch_generation(worker_batch)
        self._draft_forward(dataclasses.replace(
            worker_batch, return_logprob=False, top_logprobs_nums=None, capture_all_logits=False,
            token_bitmask=None, input_logprob_positions=None, input_logprob_token_ids=None, lora_paths=None,
        ))
        batch.output_ids = result.next_token_ids
        return result

    def forward_batch_speculative_generation(self, batch: Any, worker_batch: ModelWorkerBatch) -> GenerationBatchResult:
        """One decode step of a prepared DECODE `batch`: the draft chain, the target's verify,
        the draft KV of fully accepted chains. Sets batch.output_ids to the last committed tokens."""
        budgets = [min(self.max_drafts, draft_room(r)) if can_draft(r) else 0 for r in batch.reqs]
        draft_locs = alloc_draft_slots(batch, budgets) if any(budgets) else None
        drafts = self._draft_chain(batch, budgets, draft_locs)
        spec = ChainVerifyInput(drafts)
        result = run_verify_step(self.target_worker, batch, worker_batch, spec, draft_locs)
        if result.accept_lens is not None:
            self._catch_up(batch, spec, result.accept_lens, draft_locs)
        return result

    # ---- the draft model ----------------------------------------------------------------------
    @torch.inference_mode()
    def _draft_forward(self, worker_batch: ModelWorkerBatch) -> torch.Tensor:
        """The draft model's forward of `worker_batch` (its KV written at out_cache_loc); the
        logits of each request's last token."""
        runner = self.draft_runner
        return runner.forward(ForwardBatch.init_new(worker_batch, runner)).next_token_logits

    def _decode(self, batch: Any, rows: List[int], tokens: List[int], positions: List[int], slots: List[int]) -> List[int]:
        """A draft DECODE forward of tokens[j] at positions[j] (slot slots[j]) of request rows[j];
        returns each one's argmax (the next draft)."""
        idx = torch.tensor(rows, dtype=torch.int64)
        seq_lens = [p + 1 for p in positions]
        wb = ModelWorkerBatch(
            forward_mode=ForwardMode.DECODE,
            input_ids=torch.tensor(tokens, dtype=torch.int64),
            req_pool_indices=batch.req_pool_indices[idx],
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=torch.tensor(slots, dtype=torch.int64),
            seq_lens_cpu=seq_lens,
        )
        return torch.argmax(self._draft_forward(wb), dim=-1).tolist()

    def _draft_chain(self, batch: Any, budgets: List[int], draft_locs: Optional[List[torch.Tensor]]) -> List[List[int]]:
        """k greedy draft forwards: t at L for every request (its draft KV), then d_j at L+j for
        the requests whose budget goes past j. Returns each request's budgets[i] drafts."""
        n = len(batch.reqs)
        positions = [s - 1 for s in batch.seq_lens_cpu]  # L
        rows = list(range(n))
        nxt = self._decode(batch, rows, batch.input_ids.tolist(), positions, batch.out_cache_loc.tolist())
        drafts: List[List[int]] = [[] for _ in range(n)]
        for j in range(1, max(budgets, default=0) + 1):
            for i, tok in zip(rows, nxt):
                if budgets[i] >= j:
                    drafts[i].append(tok)
            rows = [i for i in range(n) if budgets[i] > j]  # d_j leads to d_{j+1}
            if not rows:
                break
            nxt = self._decode(batch, rows, [drafts[i][j - 1] for i in rows], [positions[i] + j for i in rows],
                               [int(draft_locs[i][j - 1]) for i in rows])
        return drafts

    def _catch_up(self, batch: Any, spec: ChainVerifyInput, accept_lens: List[int],
                  draft_locs: List[torch.Tensor]) -> None:
        """Requests that accepted every draft keep d_k at L+k: write its draft KV (the chain
        stopped at d_{k-1}). commit() has set seq_lens to L+1+k for them."""
        rows = [i for i, (k, a) in enumerate(zip(spec.num_drafts, accept_lens)) if k > 0 and a == k]
        if not rows:
            return
        tokens = [spec.draft_token_ids[i][-1] for i in rows]
        positions = [batch.seq_lens_cpu[i] - 1 for i in rows]  # L + k
        self._decode(batch, rows, tokens, positions, [int(draft_locs[i][-1]) for i in rows])
