"""NGRAMWorker: speculative decoding with drafts from an n-gram cache (no draft model).

For a decode batch that ScheduleBatch.prepare_for_decode has prepared (one slot for each
request's last token, at position L = seq_len - 1):

    1. drafts: up to k = --speculative-num-draft-tokens - 1 tokens per request from the NgramCache
       (the request's own prompt and output, and every other request's);
    2. one target forward (TARGET_VERIFY): an EXTEND of 1 + k_i tokens per request over its paged KV
       (the ordinary causal mask: a chain needs no tree mask), logits at every position;
    3. acceptance (verify.py), then the KV of rejected drafts is freed at once and the batch's
       seq_lens are the committed lengths (2 and 3: verify_step.py, shared with STANDALONE).

A batch where no request got a draft runs the plain decode forward. The scheduler then commits
accept_lens[i] + 1 tokens per request (SchedulerOutputProcessor), checking the stop conditions
after each one. Requests whose next token depends on state the drafts would change (a grammar,
penalties, min_new_tokens not reached yet) get no drafts: their step is an ordinary decode.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List

from radixserve.layers.attention.spec_tree import SpecTree
from radixserve.model_executor.forward_batch import ModelWorkerBatch
from radixserve.model_executor.tp_worker import GenerationBatchResult
from radixserve.model_executor.worker_protocol import TargetWorker
from radixserve.speculative.draft_budget import DraftBudget
from radixserve.speculative.ngram_cache import NgramCache
from radixserve.speculative.spec_info import NgramVerifyInput
from radixserve.speculative.tree import TreeDrafts
from radixserve.speculative.verify_step import can_draft, draft_room, result_of, run_tree_verify_step, run_verify_step

logger = logging.getLogger(__name__)


class NGRAMWorker:
    def __init__(self, server_args: Any, target_worker: TargetWorker):
        self.target_worker = target_worker
        # SGLang's meaning: tokens per request in the verify forward, the verified token included.
        self.max_drafts = server_args.speculative_num_draft_tokens - 1
        self.verify_width = 1 + self.max_drafts  # slots a verify writes per request (the overlap loop's view)
        self.ngram_cache = NgramCache(
            server_args.speculative_ngram_min_match_window_size,
            server_args.speculative_ngram_max_match_window_size,
            server_args.speculative_ngram_capacity,
        )
        self._inserted: Dict[str, int] = {}  # rid -> how many of its tokens the cache has seen
        self.budget = DraftBudget()  # which drafts are worth verifying, per request and step
        self.breadth = server_args.speculative_ngram_max_bfs_breadth  # 1: a chain; more: a token tree

    def clear_cache_pool(self) -> None:
        self.ngram_cache.reset()
        self._inserted.clear()
        self.budget.reset()

    # ---- the interface the scheduler calls ------------------------------------------------
    def forward_batch(self, batch: Any, worker_batch: ModelWorkerBatch) -> GenerationBatchResult:
        """Run `batch` (the scheduler's run_batch): decode batches with drafts, others as usual
        (NGRAM keeps no state of its own in the KV pools)."""
        if batch.forward_mode.is_decode():
            return self.forward_batch_speculative_generation(batch, worker_batch)
        result = self.target_worker.forward_batch_generation(worker_batch)
        batch.output_ids = result.next_token_ids
        return result

    def forward_batch_speculative_generation(self, batch: Any, worker_batch: ModelWorkerBatch) -> GenerationBatchResult:
        """Run one decode step of `batch` (a prepared DECODE ScheduleBatch; `worker_batch` is its
        ModelWorkerBatch, grammar mask included) with drafts. Sets batch.output_ids to each
        request's last committed token."""
        chains = self._draft(batch)
        if self.breadth > 1 and any(chains):  # SGLang's token tree: as many nodes as the chain's drafts
            trees = self._trees(batch, chains)
            out, _, _ = run_tree_verify_step(self.target_worker, batch, worker_batch, trees)
            return result_of(out, trees.num_drafts)
        return run_verify_step(self.target_worker, batch, worker_batch, NgramVerifyInput(chains))

    # ---- drafting ----------------------------------------------------------------------------
    def _draft(self, batch: Any) -> List[List[int]]:
        """Each request's chain from the n-gram cache, then the DraftBudget's cut: the drafts
        expected to pay for their verify tokens at this batch size (draft_budget.py)."""
        chains, seen, all_tokens = [], {}, []
        for req in batch.reqs:
            tokens = req.origin_input_ids + req.output_ids
            self.ngram_cache.insert(tokens, self._inserted.get(req.rid, 0))
            seen[req.rid] = len(tokens)
            all_tokens.append(tokens)
            room = min(self.max_drafts, draft_room(req))
            chains.append(self.ngram_cache.draft(tokens, room) if room > 0 and can_draft(req) else [])
        self._inserted = seen  # requests no longer decoding are forgotten
        return self.budget.step([req.rid for req in batch.reqs], all_tokens, chains)

    def _trees(self, batch: Any, chains: List[List[int]]) -> TreeDrafts:
        """--speculative-ngram-max-bfs-breadth > 1: each request's tree of len(chain) nodes (the
        DraftBudget's count), breadth first from its tokens."""
        tokens, parents = [], []
        for req, chain in zip(batch.reqs, chains):
            toks, par = self.ngram_cache.draft_tree(req.origin_input_ids + req.output_ids, len(chain), self.breadth) \
                if chain else ([], [-1])
            tokens.append(toks)
            parents.append(par)
        return TreeDrafts(tokens, SpecTree(parents))
