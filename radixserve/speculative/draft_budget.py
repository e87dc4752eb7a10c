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

   and the step falls back to the plain decode forward unless drafting beats it by MIN_GAIN
   (the cost model's own error is ~5-10% of a step). At one request the weights dominate the
   step, so a draft token costs ~7% of it and drafts with small chances pay; from a few
   requests on the forward is compute-bound (a draft token costs about what a request's decode
   token does) and the verify's own overhead grows with the batch, so only drafts likely to be
   accepted pay: the drafts per request shrink with batch size, down to none on text that
   does not repeat.

A per-step log (LOG_ENV) records each step's plan, StepCost's prediction, the drafts accepted
and the wall time, to check the model against a workload.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Tuple

# The acceptance estimate.
DECAY = 0.8  # per step: a request's last ~5 steps weigh most
PRIOR_TRIALS = 2.0  # a new request starts as this many trials at the pooled rate
POOL_DECAY = 0.98  # the pooled rate over all requests remembers ~50 steps
INITIAL_RATE = 0.5  # the pooled rate before anything was observed

# Drafting must beat the plain decode step's tokens per ms by this fraction: below it the gain
# is within the cost model's error (benchmarks/NOTES.md, issue 27: random text at 16 concurrent).
MIN_GAIN = 0.05

# A per-step log (debugging the cost model): a file path; each decode step's StepPlan, with its
# drafts accepted and the wall time to the next step, is appended as a JSON line. Unset: no log.
LOG_ENV = "RADIXSERVE_DRAFT_BUDGET_LOG"


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
    ~100-250-token contexts, batch sizes 1-16 with 0-3 drafts per request (a least-squares fit of
    benchmarks/cpu/spec_ngram_cost.py's rows; benchmarks/NOTES.md, issue 27: random text at 16
    concurrent). Only the ratios matter to the allotment."""

    fixed: float = 10.4  # a decode step's part that does not grow with the batch (the weights)
    per_request: float = 1.41  # each request of a decode step (its token, attention, sampling)
    verify_fixed: float = 1.0  # a verify forward over the decode step of the same batch ...
    verify_per_request: float = 0.45  # ... and per request (the extend path, per-position work)
    # Each draft token in the verify forward: 0.5-0.8 ms at batch 1 and 16, 1.2-1.3 ms at 4-8
    # (the fit's 0.75 rounded up: the mid-size batches are where random text's drafts are marginal).
    per_draft: float = 0.9

    def decode(self, bs: int) -> float:
        return self.fixed + self.per_request * bs

    def verify(self, bs: int, drafts: int) -> float:
        return self.decode(bs) + self.verify_fixed + self.verify_per_request * bs + self.per_draft * drafts


@dataclass
class StepPlan:
    """One decode step as the budget planned it: the per-step log's record (LOG_ENV)."""

    batch_size: int
    drafts: List[int]  # verified per request
    chain_lens: List[int]  # proposed per request
    rates: List[float]
    expected_tokens: float  # committed, by the rates
    predicted_ms: float  # StepCost: the step as planned (the plain decode when no drafts)
    decode_ms: float  # StepCost: the plain decode step of the same batch
    # Known at the next step: per request, the drafts of its whole chain that matched what it
    # committed (None: not seen again, e.g. finished), and the verified drafts accepted in all.
    matched: Optional[List[Optional[int]]] = None
    accepted: Optional[int] = None
    ms: Optional[float] = None  # wall time to the next step's plan (one loop iteration)


def plan(rates: Sequence[float], chain_lens: Sequence[int], cost: StepCost = StepCost(),
         min_gain: Optional[float] = None) -> Tuple[List[int], float, float]:
    """(drafts per request, expected tokens, predicted ms): the j-th draft of request i
    (j <= chain_lens[i]) is expected to add rates[i] ** j tokens; drafts go in best first while
    they raise the expected tokens per ms (module docstring). All zeros (and the decode step's
    tokens and ms) when the plain decode step is not expected to do better by min_gain (default
    MIN_GAIN) or more."""
    min_gain = MIN_GAIN if min_gain is None else min_gain
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
    if tokens * cost.decode(bs) <= (1 + min_gain) * bs * ms:  # not clearly better than the plain decode step
        return [0] * bs, float(bs), cost.decode(bs)
    return counts, tokens, ms


def allot(rates: Sequence[float], chain_lens: Sequence[int], cost: StepCost = StepCost()) -> List[int]:
    """Drafts per request (plan's first part)."""
    return plan(rates, chain_lens, cost)[0]


class DraftBudget:
    """Per-request acceptance rates (by rid) and the per-step allotment of drafts. The last
    step's plan is kept (last_plan); with LOG_ENV set, each plan is appended to that file as a
    JSON line once the next step has scored it."""

    def __init__(self, cost: Optional[StepCost] = StepCost(), min_gain: Optional[float] = None):
        self.cost = cost  # None: no cut, every chain is verified whole
        self.min_gain = MIN_GAIN if min_gain is None else min_gain
        self.pool = AcceptanceRate()
        self._rates: Dict[str, AcceptanceRate] = {}
        # rid -> (last chain, tokens before it, drafts of it verified)
        self._chains: Dict[str, Tuple[List[int], int, int]] = {}
        self.last_plan: Optional[StepPlan] = None
        self._last_t = 0.0
        self._log_path = os.environ.get(LOG_ENV) or None

    @classmethod
    def every_draft(cls) -> "DraftBudget":
        """No cut: every request verifies its whole chain (tests of the verify path)."""
        return cls(cost=None)

    def reset(self) -> None:
        self.pool = AcceptanceRate()
        self._rates.clear()
        self._chains.clear()
        self.last_plan = None

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
        now = time.perf_counter()
        step_matched = step_trials = 0
        seen: Dict[str, int] = {}  # rid -> drafts of its last chain matched
        for rid, toks in zip(rids, tokens):
            prev = self._chains.get(rid)
            if prev is not None:
                matched, trials = score_chain(prev[0], toks[prev[1]:])
                seen[rid] = matched
                if trials:
                    self._rates.setdefault(rid, AcceptanceRate()).observe(matched, trials, DECAY)
                    step_matched, step_trials = step_matched + matched, step_trials + trials
        if step_trials:
            self.pool.observe(step_matched, step_trials, POOL_DECAY)
        if self.last_plan is not None:
            self._close_plan(self.last_plan, [seen.get(rid) for rid in self._chains], now)
        self._rates = {rid: self._rates[rid] for rid in rids if rid in self._rates}
        bs, lens = len(rids), [len(c) for c in chains]
        rates = [self.rate(rid) for rid in rids]
        if self.cost is None:
            counts, exp_tokens, ms, decode_ms = lens, float("nan"), float("nan"), float("nan")
        else:
            counts, exp_tokens, ms = plan(rates, lens, self.cost, self.min_gain)
            decode_ms = self.cost.decode(bs)
        self._chains = {rid: (chain, len(toks), k) for rid, toks, chain, k in zip(rids, tokens, chains, counts)}
        self.last_plan = StepPlan(bs, list(counts), lens, rates, exp_tokens, ms, decode_ms)
        self._last_t = now
        return [chain[:k] for chain, k in zip(chains, counts)]

    def _close_plan(self, done: StepPlan, matched: List[Optional[int]], now: float) -> None:
        """The previous step's outcome (greedy or rejection sampling alike, a verified draft was
        accepted iff it matched the committed token), and its log line (LOG_ENV)."""
        done.matched, done.ms = matched, (now - self._last_t) * 1000
        done.accepted = sum(min(m, k) for m, k in zip(matched, done.drafts) if m is not None)
        if self._log_path:
            with open(self._log_path, "a") as f:
                f.write(json.dumps(asdict(done)) + "\n")
