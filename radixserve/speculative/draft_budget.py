"""DraftBudget: how many of its drafts each request of a decode batch verifies this step.

A draft pays when the tokens it is expected to add are worth more than the time its extra
token adds to the verify forward. Two pieces:

1. Acceptance, per request. Each step the worker hands over every request's full draft chain
   (what the n-gram cache proposes), verified or not. The next step shows the tokens the
   target actually committed, so every chain is scored, drafted or only "shadowed": m drafts
   matched the committed tokens in order, out of m + 1 trials (m if the whole chain matched).
   For a draft that does not depend on the target this is the acceptance statistic itself:
   greedy acceptance is "the draft equals the target's token", and rejection sampling accepts
   d with probability p(d), the chance that sampling draws d. A request whose drafts keep
   failing thus stops drafting, and starts again when its text begins to repeat. The rate is
   a decayed count (recent steps weigh most) with a prior from all requests' recent rate.

2. Cost, per batch (StepCost, in ms). A decode step of B requests costs fixed + per_request * B
   (the weights are streamed once whatever B is); a verify forward of the same batch costs
   verify_fixed + verify_per_request * B more (the extend path) and per_draft for each draft
   token. With rate p the j-th draft of a chain is accepted with probability p^j. Drafts are
   added best first while each raises the expected tokens per ms of the step:

       add a draft with chance g  iff  g / per_draft > (tokens expected so far) / (ms so far)

   and the step falls back to the plain decode forward when drafting does not beat it. At one
   request the weights dominate the step, so a draft token costs ~4% of it and drafts with
   small chances pay; at 16 the forward is compute-bound and the verify's own overhead grows
   with the batch, so only drafts likely to be accepted pay: the drafts per request shrink
   with batch size, down to none on text that does not repeat.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

# The acceptance estimate.
DECAY = 0.8  # per step: a request's last ~5 steps weigh most
PRIOR_TRIALS = 2.0  # a new request starts as this many trials at the pooled rate
POOL_DECAY = 0.98  # the pooled rate over all requests remembers ~50 steps
INITIAL_RATE = 0.5  # the pooled rate before anything was observed


@dataclass
class AcceptanceRate:
    """A decayed count of drafts matched out of drafts tried."""

    matched: float = 0.0
    trials: float = 0.0

    def observe(self, matched: int, trials: int, decay: float) -> None:
        self.matched = self.matched * decay + matched
        self.trials = self.trials * decay + trials

    def rate(self, prior: float, prior_trials: float) -> float:
        return (self.matched + prior * prior_trials) / (self.trials + prior_trials)


def score_chain(chain: Sequence[int], committed: Sequence[int]) -> Tuple[int, int]:
    """(drafts matched, trials) of a chain against the tokens committed after it: the matched
    prefix, and one failed trial unless the chain or the committed tokens ran out first."""
    n = min(len(chain), len(committed))
    m = 0
    while m < n and chain[m] == committed[m]:
        m += 1
    return m, m + (1 if m < n else 0)


@dataclass(frozen=True)
class StepCost:
    """A forward's time by its shape, in ms: measured on SmolLM2-135M-Instruct bf16, 2 CPU cores,
    ~200-token contexts (benchmarks/cpu/spec_ngram_cost.py; benchmarks/NOTES.md, issue 27).
    Only the ratios matter to the allotment."""

    fixed: float = 13.3  # a decode step's part that does not grow with the batch (the weights)
    per_request: float = 1.25  # each request of a decode step (its token, attention, sampling)
    verify_fixed: float = 0.8  # a verify forward over the decode step of the same batch ...
    verify_per_request: float = 0.7  # ... and per request (the extend path, per-position work)
    per_draft: float = 0.56  # each draft token in the verify forward

    def decode(self, bs: int) -> float:
        return self.fixed + self.per_request * bs

    def verify(self, bs: int, drafts: int) -> float:
        return self.decode(bs) + self.verify_fixed + self.verify_per_request * bs + self.per_draft * drafts


def allot(rates: Sequence[float], chain_lens: Sequence[int], cost: StepCost = StepCost()) -> List[int]:
    """Drafts per request: the j-th draft of request i (j <= chain_lens[i]) is expected to add
    rates[i] ** j tokens; drafts go in best first while they raise the expected tokens per ms
    (module docstring). All zeros when the plain decode step is expected to do better."""
    bs = len(rates)
    tokens, ms = float(bs), cost.verify(bs, 0)
    counts = [0] * bs
    # (chance, request, position): a chain's later drafts never come before its earlier ones.
    candidates = sorted(((rates[i] ** j, i, j) for i in range(bs) for j in range(1, chain_lens[i] + 1)),
                        key=lambda c: (-c[0], c[2]))
    for gain, i, j in candidates:
        # (tokens + gain) / (ms + per_draft) > tokens / ms
        if gain * ms <= tokens * cost.per_draft:
            break  # the rest have smaller chances still
        if j == counts[i] + 1:
            counts[i] = j
            tokens, ms = tokens + gain, ms + cost.per_draft
    if tokens * cost.decode(bs) <= bs * ms:  # not better than the plain decode step
        return [0] * bs
    return counts


class DraftBudget:
    """Per-request acceptance rates (by rid) and the per-step allotment of drafts."""

    def __init__(self, cost: Optional[StepCost] = StepCost()):
        self.cost = cost  # None: no cut, every chain is verified whole
        self.pool = AcceptanceRate()
        self._rates: Dict[str, AcceptanceRate] = {}
        self._chains: Dict[str, Tuple[List[int], int]] = {}  # rid -> (last chain, tokens before it)

    @classmethod
    def every_draft(cls) -> "DraftBudget":
        """No cut: every request verifies its whole chain (tests of the verify path)."""
        return cls(cost=None)

    def reset(self) -> None:
        self.pool = AcceptanceRate()
        self._rates.clear()
        self._chains.clear()

    def pooled_rate(self) -> float:
        return self.pool.rate(INITIAL_RATE, PRIOR_TRIALS)

    def rate(self, rid: str) -> float:
        est = self._rates.get(rid)
        prior = self.pooled_rate()
        return est.rate(prior, PRIOR_TRIALS) if est is not None else prior

    def step(self, rids: Sequence[str], tokens: Sequence[Sequence[int]], chains: Sequence[List[int]]) -> List[List[int]]:
        """One decode step: score each request's previous chain against what it committed since,
        remember the new chains (requests not in this batch are forgotten), and return the
        drafts to verify: a prefix of each chain."""
        step_matched = step_trials = 0
        for rid, toks in zip(rids, tokens):
            prev = self._chains.get(rid)
            if prev is not None and prev[0]:
                matched, trials = score_chain(prev[0], toks[prev[1]:])
                self._rates.setdefault(rid, AcceptanceRate()).observe(matched, trials, DECAY)
                step_matched, step_trials = step_matched + matched, step_trials + trials
        if step_trials:
            self.pool.observe(step_matched, step_trials, POOL_DECAY)
        self._chains = {rid: (chain, len(toks)) for rid, toks, chain in zip(rids, tokens, chains)}
        self._rates = {rid: self._rates[rid] for rid in rids if rid in self._rates}
        if self.cost is None:
            return [list(c) for c in chains]
        counts = allot([self.rate(rid) for rid in rids], [len(c) for c in chains], self.cost)
        return [chain[:k] for chain, k in zip(chains, counts)]
