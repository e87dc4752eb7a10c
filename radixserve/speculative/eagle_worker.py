"""EAGLEWorker: speculative decoding with an EAGLE draft head (models/llama_eagle.py) drafting a
token tree (EAGLE-2: --speculative-eagle-topk branches per node, --speculative-num-steps levels,
the --speculative-num-draft-tokens - 1 likeliest nodes verified) in one target forward.

The head's KV lives in buffers of its own indexed by the target's slots (as STANDALONE's draft).
Draft position p holds (the target's hidden state h_p, the token x_{p+1}) and predicts x_{p+2}.
What a request carries between steps (SGLang's EagleDraftInput, `DraftState` here): the top-k
tokens and log-probabilities the head gave for the token after next, and the head's hidden g.

    extend batch:  the target's forward (hidden states kept), then the head's extend over the
                   same slots with the tokens shifted by one -> each request's DraftState
    decode batch, request i (t its last token at position L, its state from the step before):
        tree:     level 1 = the state's top-k; each further level forwards the newest top-k
                  nodes through the head (position L + depth - 1, feature = the parent's g, KV in
                  scratch slots, attention over the prefix and the node's own path: TokenPaths)
                  and keeps the top-k children by cumulative log-probability
        verify:   the likeliest nodes (ancestors first) as a tree, one TARGET_VERIFY forward
                  under the tree mask, acceptance (tree.py), the accepted branch's KV moved to
                  its positions, the chain's commit (verify_step.py); scratch slots freed
        extend:   the head over the committed tokens at L .. L + a with the target's hidden
                  states there (its KV of the accepted branch recomputed from the target's
                  features) -> the next DraftState

Drafts are the head's top-k (not sampled): deterministic drafts keep tree.py's acceptance exact
in distribution.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from radixserve.layers.attention.spec_tree import SpecTree, TokenPaths
from radixserve.model_executor.forward_batch import ForwardBatch, ForwardMode, ModelWorkerBatch
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.model_executor.tp_worker import GenerationBatchResult
from radixserve.model_executor.worker_protocol import TargetWorker
from radixserve.models.model_config import ModelConfig
from radixserve.models.qwen3_next_mtp import MTP_ARCHITECTURES, mtp_config
from radixserve.speculative.overlap_view import slots_of
from radixserve.speculative.standalone_worker import load_draft_runner
from radixserve.speculative.tree import TreeDrafts
from radixserve.speculative.verify_step import can_draft, draft_room, result_of, run_tree_verify_step

logger = logging.getLogger(__name__)


@dataclass
class DraftState:
    topk_ids: torch.Tensor  # [topk] the head's likeliest tokens after the request's last token
    topk_logp: torch.Tensor  # [topk] their log-probabilities
    hidden: torch.Tensor  # [hidden] the head's g there: the feature of level 1's forwards


@dataclass
class _Node:
    token: int
    parent: int  # index in the request's node list; -1: the root (the last committed token)
    score: float  # cumulative log-probability
    depth: int
    path: List[int] = dataclasses.field(default_factory=list)  # scratch slots of its forward path
    feature: Optional[torch.Tensor] = None  # the g its children are drafted from (once forwarded)


class EAGLEWorker:
    def __init__(self, server_args: Any, target_worker: TargetWorker, draft_runner: Optional[ModelRunner] = None):
        self.target_worker = target_worker
        self.topk = server_args.speculative_eagle_topk
        self.num_steps = server_args.speculative_num_steps
        self.num_verify = server_args.speculative_num_draft_tokens - 1  # drafts verified per request
        self.draft_runner = draft_runner or load_draft_runner(server_args, target_worker, draft_config(server_args))
        check_head(self.draft_runner.model_config, target_worker.model_config, server_args.speculative_draft_model_path)
        self.draft_runner.model.set_embed_and_head(*target_worker.embed_and_head())
        # Slots a step takes past the decode token: the verified drafts and the tree's scratch.
        self.max_drafts = self.num_verify + (self.num_steps - 1) * self.topk
        self.verify_width = 1 + self.num_verify  # the rest of max_drafts is the tree's scratch
        self.states: Dict[str, DraftState] = {}

    def clear_cache_pool(self) -> None:
        self.states.clear()

    # ---- the interface the scheduler calls ------------------------------------------------
    def forward_batch(self, batch: Any, worker_batch: ModelWorkerBatch) -> GenerationBatchResult:
        if batch.forward_mode.is_decode():
            return self.forward_batch_speculative_generation(batch, worker_batch)
        result = self.target_worker.forward_batch_generation(dataclasses.replace(worker_batch, capture_hidden_states=True))
        batch.output_ids = result.next_token_ids
        self._extend_after_prefill(batch, worker_batch, result)
        return result

    def forward_batch_speculative_generation(self, batch: Any, worker_batch: ModelWorkerBatch) -> GenerationBatchResult:
        self._forget_finished(batch.reqs)
        budgets = [min(self.num_verify, draft_room(r)) if can_draft(r) and r.rid in self.states else 0
                   for r in batch.reqs]
        drafts, scratch = self._draft_tree(batch, budgets)
        prefix_lens = [s - 1 for s in batch.seq_lens_cpu]  # L
        out, paths, hidden = run_tree_verify_step(self.target_worker, batch, worker_batch, drafts, capture_hidden=True)
        if scratch is not None:
            batch.ledger.free_slots(scratch)
        features = [[s] + [s + j for j in path] for s, path in zip(drafts.starts, paths)]
        self._extend_after_verify(batch, prefix_lens, out.token_ids, hidden, features)
        return result_of(out, drafts.num_drafts)

    # ---- the head's forwards -------------------------------------------------------------------
    @torch.inference_mode()
    def _head(self, wb: ModelWorkerBatch) -> Tuple[torch.Tensor, torch.Tensor]:
        """(logits at each row's last token, the head's g at every token)."""
        runner = self.draft_runner
        out = runner.forward(ForwardBatch.init_new(dataclasses.replace(wb, capture_hidden_states=True), runner))
        return out.next_token_logits, out.hidden_states

    def _save_states(self, reqs: List[Any], logits: torch.Tensor, last_hidden: torch.Tensor) -> None:
        logp = torch.log_softmax(logits.float(), dim=-1)
        top_v, top_i = torch.topk(logp, self.topk, dim=-1)
        for i, req in enumerate(reqs):
            self.states[req.rid] = DraftState(top_i[i], top_v[i], last_hidden[i])

    def _extend_after_prefill(self, batch: Any, wb: ModelWorkerBatch, result: GenerationBatchResult) -> None:
        """The head over the prefill's slots: position p gets (h_p, x_{p+1}); the token after a
        chunk is the prompt's next one, after the whole prompt the token just sampled."""
        ids, sampled = wb.input_ids.tolist(), result.next_token_ids.tolist()
        tokens, start = [], 0
        for i, req in enumerate(batch.reqs):
            p, n = wb.extend_prefix_lens[i], wb.extend_seq_lens[i]
            full = req.origin_input_ids + req.output_ids
            tokens += ids[start + 1 : start + n] + [full[p + n] if p + n < len(full) else sampled[i]]
            start += n
        head_wb = ModelWorkerBatch(
            forward_mode=ForwardMode.EXTEND, input_ids=torch.tensor(tokens, dtype=torch.int64),
            req_pool_indices=wb.req_pool_indices, seq_lens=wb.seq_lens, out_cache_loc=wb.out_cache_loc,
            seq_lens_cpu=wb.seq_lens_cpu, extend_seq_lens=wb.extend_seq_lens, extend_prefix_lens=wb.extend_prefix_lens,
            spec_hidden_states=result.logits_output.hidden_states,
        )
        logits, g = self._head(head_wb)
        last = torch.cumsum(torch.tensor(wb.extend_seq_lens), 0) - 1
        self._save_states(batch.reqs, logits, g[last])

    def _extend_after_verify(self, batch: Any, prefix_lens: List[int], token_ids: List[List[int]],
                             hidden: torch.Tensor, features: List[List[int]]) -> None:
        """The head over positions L .. L + a: the committed tokens with the target's hidden
        states of the tokens before them (the root and the accepted branch)."""
        lens = [len(t) for t in token_ids]
        locs = [slots_of(batch, i, p, p + n) for i, (p, n) in enumerate(zip(prefix_lens, lens))]
        seq_lens = [p + n for p, n in zip(prefix_lens, lens)]
        head_wb = ModelWorkerBatch(
            forward_mode=ForwardMode.EXTEND,
            input_ids=torch.tensor([t for toks in token_ids for t in toks], dtype=torch.int64),
            req_pool_indices=batch.req_pool_indices, seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=torch.cat(locs), seq_lens_cpu=seq_lens, extend_seq_lens=lens, extend_prefix_lens=prefix_lens,
            spec_hidden_states=hidden[torch.tensor([j for f in features for j in f], dtype=torch.int64)],
        )
        logits, g = self._head(head_wb)
        last = torch.cumsum(torch.tensor(lens), 0) - 1
        self._save_states(batch.reqs, logits, g[last])

    # ---- the draft tree ---------------------------------------------------------------------------
    def _draft_tree(self, batch: Any, budgets: List[int]) -> Tuple[TreeDrafts, Optional[torch.Tensor]]:
        """Each drafting request's tree of its budget's likeliest nodes; the scratch slots the
        head's tree forwards wrote (the caller frees them after the verify)."""
        active = [i for i, b in enumerate(budgets) if b > 0]
        nodes: Dict[int, List[_Node]] = {}
        for i in active:
            st = self.states[batch.reqs[i].rid]
            nodes[i] = [_Node(int(t), -1, float(v), 1) for t, v in zip(st.topk_ids.tolist(), st.topk_logp.tolist())]
        frontier = [(i, n) for i in active for n in range(len(nodes[i]))]
        scratch = self._alloc_scratch(batch, len(active) * self.topk * (self.num_steps - 1)) if active and self.num_steps > 1 else None
        used = 0
        for _ in range(self.num_steps - 1 if active else 0):
            slots = scratch[used : used + len(frontier)].tolist()
            used += len(frontier)
            children = self._expand(batch, nodes, frontier, slots)
            frontier = [(i, n) for i in active for n in children[i]]
        tokens, parents = [], []
        for i, b in enumerate(budgets):
            chosen = _choose(nodes.get(i, []), b)
            index = {n: k + 1 for k, n in enumerate(chosen)}  # layout: root at 0
            tokens.append([nodes[i][n].token for n in chosen])
            parents.append([-1] + [0 if nodes[i][n].parent < 0 else index[nodes[i][n].parent] for n in chosen])
        return TreeDrafts(tokens, SpecTree(parents)), scratch

    def _alloc_scratch(self, batch: Any, n: int) -> torch.Tensor:
        ps = batch.ledger.page_size  # (check_decode_mem made room for the draft tree)
        return batch.ledger.alloc_slots(-(-n // ps) * ps).to(torch.int64)

    def _expand(self, batch: Any, nodes: Dict[int, List[_Node]], frontier: List[Tuple[int, int]],
                slots: List[int]) -> Dict[int, List[int]]:
        """One head forward of the frontier nodes; adds their top-k children to `nodes` and
        returns, per request, the top-k new children (the next frontier)."""
        L = [s - 1 for s in batch.seq_lens_cpu]
        feats, tokens, paths, prefix = [], [], [], []
        for (i, n), slot in zip(frontier, slots):
            node = nodes[i][n]
            parent = nodes[i][node.parent] if node.parent >= 0 else None
            node.path = (parent.path if parent else []) + [slot]
            feats.append(parent.feature if parent else self.states[batch.reqs[i].rid].hidden)
            tokens.append(node.token)
            paths.append(node.path)
            prefix.append(L[i] + node.depth - 1)
        rows = torch.tensor([i for i, _ in frontier], dtype=torch.int64)
        wb = ModelWorkerBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, input_ids=torch.tensor(tokens, dtype=torch.int64),
            req_pool_indices=batch.req_pool_indices[rows], seq_lens=torch.tensor([p + 1 for p in prefix], dtype=torch.int64),
            out_cache_loc=torch.tensor(slots, dtype=torch.int64), seq_lens_cpu=[p + 1 for p in prefix],
            extend_seq_lens=[1] * len(frontier), extend_prefix_lens=prefix, spec_tree=TokenPaths(paths),
            spec_hidden_states=torch.stack(feats),
        )
        logits, g = self._head(wb)
        top_v, top_i = torch.topk(torch.log_softmax(logits.float(), dim=-1), self.topk, dim=-1)
        new: Dict[int, List[int]] = {}
        for f, (i, n) in enumerate(frontier):
            node = nodes[i][n]
            node.feature = g[f]
            for t, v in zip(top_i[f].tolist(), top_v[f].tolist()):
                new.setdefault(i, []).append(len(nodes[i]))
                nodes[i].append(_Node(t, n, node.score + v, node.depth + 1))
        return {i: sorted(kids, key=lambda n: -nodes[i][n].score)[: self.topk] for i, kids in new.items()}

    def _forget_finished(self, reqs: List[Any]) -> None:
        """States of requests that are no longer decoding (finished, aborted, retracted)."""
        live = {r.rid for r in reqs}
        for rid in [rid for rid in self.states if rid not in live]:
            del self.states[rid]


def draft_config(server_args: Any) -> ModelConfig:
    """The draft's config: an EAGLE head's, or (NEXTN: a Qwen3-Next / Qwen3.5 checkpoint) its MTP
    layers' (models/qwen3_next_mtp.py)."""
    config = ModelConfig.from_pretrained(server_args.speculative_draft_model_path)
    return mtp_config(config) if config.architecture in MTP_ARCHITECTURES else config


def check_head(head: Any, target: Any, path: str) -> None:
    """ValueError (one line) unless `path` holds an EAGLE head (or MTP layers) of the target's width."""
    if head.architecture != "LlamaForCausalLMEagle" and head.architecture not in MTP_ARCHITECTURES.values():
        raise ValueError(f"--speculative-draft-model-path {path}: architecture {head.architecture!r} is not an EAGLE "
                         "head (LlamaForCausalLMEagle) nor a checkpoint with MTP layers (NEXTN: Qwen3-Next, Qwen3.5); a smaller "
                         "full model is --speculative-algorithm STANDALONE")
    if head.hidden_size != target.hidden_size:
        raise ValueError(f"--speculative-draft-model-path {path}: hidden size {head.hidden_size}, the target's is "
                         f"{target.hidden_size} (the head reads the target's hidden states)")


def _choose(nodes: List[_Node], budget: int) -> List[int]:
    """Up to `budget` nodes by cumulative log-probability, a node only after its parent (so the
    choice is a tree), in an order where parents come first."""
    chosen, taken = [], set()
    for n in sorted(range(len(nodes)), key=lambda n: (-nodes[n].score, nodes[n].depth)):
        if len(chosen) == budget:
            break
        if nodes[n].parent < 0 or nodes[n].parent in taken:
            chosen.append(n)
            taken.add(n)
    return sorted(chosen, key=lambda n: (nodes[n].depth, n))
