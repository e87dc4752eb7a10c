"""Drafts as token trees: verification and the KV of the accepted branch.

A request's tree (layers/attention/spec_tree.py's SpecTree) has its last committed token t as
token 0 and n - 1 drafts, each a child of an earlier token; siblings carry different tokens. The
verify forward gives the target's logits at every token (p_j: the distribution of the token that
follows j's path). Acceptance walks down from token 0:

    x = the target's token at the current node (argmax p_j, or a draw from p_j when sampling)
    if a child of the node carries x: accept it, go there;  else: commit x and stop

The committed tokens are the accepted drafts and the last x. Drafts that do not depend on the
target (n-grams, a greedy draft model) make this exact in distribution: every committed token is
a draw from the target given the tokens before it, whether or not a child matched. A chain is the
tree with one child per node.

KV: the verify forward gave token j the slot of position L + j (its place in the layout), but
the accepted branch must sit at positions L + 1 .. L + a: `accepted_kv_moves` lists the copies
(a branch token at layout index j >= its depth d moves to index d; increasing d never overwrites
a source still to be read). The rest is the chain's commit: slots past L + a are freed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from radixserve.constrained.base_grammar_backend import TokenBitmask
from radixserve.layers.attention.spec_tree import SpecTree
from radixserve.layers.sampler import filter_probs
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo
from radixserve.speculative.spec_info import ChainVerifyOutput, layout_starts
from radixserve.speculative.verify import PositionLayout, add_logprobs, draw_residual, processed_logits


@dataclass
class TreeDrafts:
    """The drafts of one decode batch as trees: request i feeds its last token and tokens[i]."""

    tokens: List[List[int]]  # per request, its n_i - 1 drafts in layout order
    tree: SpecTree  # parents of the n_i tokens (token 0: the last committed token)

    def __post_init__(self) -> None:
        assert [len(t) + 1 for t in self.tokens] == self.tree.lens, (self.tokens, self.tree.parents)

    @classmethod
    def chains(cls, drafts: List[List[int]]) -> "TreeDrafts":
        return cls([list(d) for d in drafts], SpecTree.chains([len(d) + 1 for d in drafts]))

    @property
    def num_drafts(self) -> List[int]:
        return [len(t) for t in self.tokens]

    @property
    def extend_lens(self) -> List[int]:
        return self.tree.lens

    @property
    def starts(self) -> List[int]:
        return layout_starts(self.extend_lens)

    def children(self, i: int) -> List[dict]:
        """Per token of request i: {draft token: child index}."""
        par = self.tree.parents[i]
        kids: List[dict] = [{} for _ in par]
        for j in range(1, len(par)):
            kids[par[j]][self.tokens[i][j - 1]] = j
        return kids


@torch.inference_mode()  # as verify_chain: the penalties update the logits in place
def verify_tree(
    logits: torch.Tensor,
    info: SamplingBatchInfo,
    drafts: TreeDrafts,
    token_bitmask: Optional[TokenBitmask] = None,
    return_logprob: bool = False,
    top_logprobs_nums: Optional[List[int]] = None,
) -> Tuple[ChainVerifyOutput, List[List[int]]]:
    """logits [sum(n_i), V] at every tree token; info: the batch's [bs] rows. Returns the
    committed tokens and, per request, the layout indices of its accepted branch."""
    depth = [d for i in range(len(drafts.tokens)) for d in drafts.tree.depths(i)]
    req_of_pos = [i for i, n in enumerate(drafts.extend_lens) for _ in range(n)]
    ex, logits = processed_logits(logits, info, PositionLayout(req_of_pos, depth, [-1] * len(depth)), token_bitmask, drafts)
    target = _target_tokens(logits, ex).tolist()

    out_tokens, accept_lens, paths, judged_at = [], [], [], []
    for i, start in enumerate(drafts.starts):
        kids, node, path = drafts.children(i), 0, []
        while target[start + node] in kids[node]:
            node = kids[node][target[start + node]]
            path.append(node)
        paths.append(path)
        accept_lens.append(len(path))
        out_tokens.append([drafts.tokens[i][j - 1] for j in path] + [target[start + node]])
        judged_at.append([start] + [start + j for j in path])  # where each committed token was decided
    out = ChainVerifyOutput(accept_lens, out_tokens, num_drafts=drafts.num_drafts)
    if return_logprob:
        add_logprobs(out, logits, judged_at, top_logprobs_nums)
    return out, paths


def _target_tokens(logits: torch.Tensor, ex: SamplingBatchInfo) -> torch.Tensor:
    """The target's token at every position: argmax for greedy rows, else one draw from the
    processed distribution (temperature, top-k/p, min-p) with the Sampler's per-step seeds."""
    argmax = torch.argmax(logits, dim=-1)
    if ex.is_all_greedy:
        return argmax
    probs = filter_probs(torch.softmax(logits / ex.temperatures, dim=-1), ex)
    greedy_row = ~(probs.sum(dim=-1) > 0) | (ex.top_ks <= 1)
    pos = torch.arange(logits.shape[0], device=logits.device)
    drawn = draw_residual(probs, torch.full_like(argmax, -1), ex, pos)
    return torch.where(greedy_row, argmax, drawn)


def accepted_kv_moves(drafts: TreeDrafts, paths: List[List[int]], out_cache_loc: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(targets, sources) slot pairs that bring each accepted branch to positions L + 1 .. L + a
    (out_cache_loc: the verify tokens' slots in layout order). Empty for chains."""
    tgt, src = [], []
    for start, path in zip(drafts.starts, paths):
        for d, j in enumerate(path, start=1):
            if j != d:
                tgt.append(start + d)
                src.append(start + j)
    loc = out_cache_loc.to(torch.int64)
    idx = lambda xs: torch.tensor(xs, dtype=torch.int64, device=loc.device)  # noqa: E731
    return loc[idx(tgt)], loc[idx(src)]
