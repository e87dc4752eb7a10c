"""Issue 27, the NGRAM draft budget (radixserve/speculative/draft_budget.py): drafting must beat the
plain decode step by MIN_GAIN, the per-step plan is kept and logged (RADIXSERVE_DRAFT_BUDGET_LOG)
with what its drafts matched. The rest of the budget's tests are in test_speculative_ngram.py."""

from __future__ import annotations

import json
import random
from typing import List

from radixserve.speculative import draft_budget
from radixserve.speculative.draft_budget import DraftBudget, StepCost, plan, score_chain

WRONG = 99999  # a draft token the texts never have


def decode_steps(budget: DraftBudget, texts: List[List[int]], good: List[bool], steps: int) -> List[List[int]]:
    """Requests decode `texts` (greedy: the committed tokens are the text) with 3-token chains,
    right (good[i]) or always wrong; a step accepts the matching prefix of the drafts given, plus
    one token. Returns the drafts given per step."""
    pos, given = [8] * len(texts), []
    for _ in range(steps):
        chains = [t[p : p + 3] if ok else [WRONG] * 3 for t, p, ok in zip(texts, pos, good)]
        drafts = budget.step([f"r{i}" for i in range(len(texts))], [t[:p] for t, p in zip(texts, pos)], chains)
        given.append([len(d) for d in drafts])
        for i, d in enumerate(drafts):
            pos[i] += score_chain(d, texts[i][pos[i]:])[0] + 1
    return given


def test_drafting_must_beat_the_decode_step_by_min_gain():
    """A batch whose drafts are expected to beat the plain decode step by less than min_gain
    decodes plainly; with the gain above it, it drafts. The plan's ms and tokens are the model's."""
    cost = StepCost(fixed=10.0, per_request=1.0, verify_fixed=0.0, verify_per_request=0.0, per_draft=1.0)
    # one request, rate 0.2: a draft adds 0.2 tokens for 1 ms on an 11 ms step: 1.2 / 12 = 0.1 tok/ms
    # against 1 / 11 = 0.0909: drafting is 10% better, the second draft (0.04 tokens) is not worth its ms
    counts, tokens, ms = plan([0.2], [3], cost, min_gain=0.05)
    assert counts == [1] and abs(tokens - 1.2) < 1e-9 and abs(ms - 12.0) < 1e-9
    counts, tokens, ms = plan([0.2], [3], cost, min_gain=0.15)
    assert counts == [0] and tokens == 1.0 and ms == cost.decode(1)
    # the module's MIN_GAIN is the default
    assert plan([0.2], [3], cost)[0] == plan([0.2], [3], cost, min_gain=draft_budget.MIN_GAIN)[0]


def test_min_gain_keeps_drafts_that_pay_clearly():
    """Text that repeats keeps every draft at one request and at 16 (the gain is far above
    MIN_GAIN), and text whose drafts fail drafts nothing at 16."""
    text = [7, 8, 9, 10, 11] * 40
    assert all(k == 3 for step in decode_steps(DraftBudget(), [text], [True], 10) for k in step)
    assert all(k == 3 for step in decode_steps(DraftBudget(), [text] * 16, [True] * 16, 10)[3:] for k in step)
    rng = random.Random(0)
    texts = [[rng.randrange(100, 1000) for _ in range(300)] for _ in range(16)]
    assert all(k == 0 for step in decode_steps(DraftBudget(), texts, [False] * 16, 10)[2:] for k in step)


def test_the_step_log_records_each_plan_and_what_its_drafts_matched(tmp_path, monkeypatch):
    """RADIXSERVE_DRAFT_BUDGET_LOG: one JSON line per step, written when the next step has scored
    it: the batch, the drafts given, the rates, StepCost's ms, and per request the drafts of its
    chain that matched (accepted: those of them verified)."""
    path = tmp_path / "budget.jsonl"
    monkeypatch.setenv(draft_budget.LOG_ENV, str(path))
    rng = random.Random(1)
    texts = [[7, 8, 9, 10, 11] * 40, [rng.randrange(100, 1000) for _ in range(300)]]
    budget = DraftBudget(StepCost(fixed=13.0, per_request=1.0, verify_fixed=0.0, verify_per_request=0.0, per_draft=0.1))
    given = decode_steps(budget, texts, [True, False], steps=6)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 5  # the last step is not scored yet
    for rec, drafts in zip(lines, given):
        assert rec["batch_size"] == 2 and rec["drafts"] == drafts and rec["chain_lens"] == [3, 3]
        assert rec["matched"] == [3, 0]  # the right chain matched whole, the wrong one not at all
        assert rec["accepted"] == drafts[0]  # only the first request's verified drafts were accepted
        assert rec["predicted_ms"] > 0 and rec["ms"] >= 0 and len(rec["rates"]) == 2
    assert budget.last_plan is not None and budget.last_plan.matched is None  # step 6: not scored


def test_no_log_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(draft_budget.LOG_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    decode_steps(DraftBudget(), [[7, 8, 9] * 30], [True], steps=3)
    assert list(tmp_path.iterdir()) == []
