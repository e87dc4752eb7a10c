"""Speculative decoding's plain data: the algorithm names (SGLang's SpeculativeAlgorithm) and what
one verify step takes in and gives out.

A verify step of a decode batch, request i (L = tokens with KV before the step, t = its last
sampled token, d_1..d_k its drafts; k may be 0):

    input_ids:   | t   d_1   ...  d_k |        an EXTEND of 1 + k tokens after a prefix of L
    positions:     L   L+1   ...  L+k
    logits at:     L predicts d_1 (or the token after t), L+j predicts the token after d_j

The target accepts a prefix d_1..d_a and adds its own token at position L+a: a + 1 tokens are
committed, the KV of t, d_1..d_a stays (L + 1 + a tokens), the k - a rejected slots are freed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional


class SpeculativeAlgorithm(Enum):
    NONE = "NONE"
    NGRAM = "NGRAM"
    STANDALONE = "STANDALONE"
    EAGLE = "EAGLE"

    @classmethod
    def from_string(cls, name: Optional[str]) -> "SpeculativeAlgorithm":
        return cls.NONE if name is None else cls[name.upper()]

    def is_none(self) -> bool:
        return self == SpeculativeAlgorithm.NONE

    def is_ngram(self) -> bool:
        return self == SpeculativeAlgorithm.NGRAM

    def is_standalone(self) -> bool:
        return self == SpeculativeAlgorithm.STANDALONE


@dataclass
class ChainVerifyInput:
    """The drafts of one decode batch (a chain per request, no tree), from any drafter (NGRAM's
    n-gram cache, STANDALONE's draft model)."""

    draft_token_ids: List[List[int]]  # per request, its k_i >= 0 drafts

    def __post_init__(self) -> None:
        assert all(isinstance(d, list) for d in self.draft_token_ids)

    @property
    def num_drafts(self) -> List[int]:
        return [len(d) for d in self.draft_token_ids]

    @property
    def extend_lens(self) -> List[int]:
        """Tokens each request feeds the verify forward: its last token and its drafts."""
        return [1 + len(d) for d in self.draft_token_ids]

    @property
    def starts(self) -> List[int]:
        return layout_starts(self.extend_lens)


def layout_starts(extend_lens: List[int]) -> List[int]:
    """Index of each request's first position in the flat [sum(extend_lens)] verify layout."""
    out, offset = [], 0
    for n in extend_lens:
        out.append(offset)
        offset += n
    return out


@dataclass
class ChainVerifyOutput:
    """What the target made of the drafts: per request, a_i accepted drafts and the a_i + 1
    tokens to commit (the accepted drafts, then the target's own token)."""

    accept_lens: List[int]  # a_i: drafts accepted (SGLang's accept_length, the bonus not counted)
    token_ids: List[List[int]]  # a_i + 1 tokens per request
    logprobs: Optional[List[List[float]]] = None  # of each committed token (return_logprob)
    top_logprobs_val: Optional[List[List[List[float]]]] = None
    top_logprobs_idx: Optional[List[List[List[int]]]] = None
    num_drafts: List[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert all(len(t) == a + 1 for t, a in zip(self.token_ids, self.accept_lens)), (self.token_ids, self.accept_lens)


# NGRAM's names for the chain types (its worker and tests use them).
NgramVerifyInput = ChainVerifyInput
NgramVerifyOutput = ChainVerifyOutput
