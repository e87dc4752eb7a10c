"""Sampler + SamplingBatchInfo: each parameter changes the distribution as defined.

Empirical distributions come from one row of hand-made logits repeated many times in a
single batch, so one forward gives thousands of independent draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Set

import pytest
import torch

from radixserve.constrained.base_grammar_backend import TokenBitmask, allocate_token_bitmask
from radixserve.layers.sampler import Sampler, SamplerOutput, filter_probs
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo
from radixserve.sampling_params import TOP_K_ALL, SamplingParams

V = 16
EOS = 15


@dataclass
class FakeReq:
    sampling_params: SamplingParams
    origin_input_ids: List[int] = field(default_factory=list)
    output_ids: List[int] = field(default_factory=list)
    eos_token_ids: Set[int] = field(default_factory=lambda: {EOS})


def req(**kw) -> FakeReq:
    extra = {k: kw.pop(k) for k in ("origin_input_ids", "output_ids", "eos_token_ids") if k in kw}
    sp = SamplingParams(**kw)
    sp.verify(V)
    sp.normalize()
    return FakeReq(sampling_params=sp, **extra)


def info_for(reqs, vocab=V) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_reqs(reqs, vocab_size=vocab)


def base_logits() -> torch.Tensor:
    # Distinct, well separated values: token 0 is the most likely, 15 the least.
    return torch.linspace(2.0, -2.0, V)


def empirical(tokens: torch.Tensor, vocab=V) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / tokens.numel()


def sample_many(logits_row: torch.Tensor, n: int, **kw) -> torch.Tensor:
    info = info_for([req(**kw) for _ in range(n)])
    return Sampler()(logits_row.expand(n, -1).clone(), info).next_token_ids


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ------------------------------------------------------------------ distributions
def test_plain_sampling_matches_softmax():
    logits = base_logits()
    freq = empirical(sample_many(logits, 20000))
    assert (freq - torch.softmax(logits, -1)).abs().max() < 0.02


def test_temperature_sharpens_and_flattens():
    logits = base_logits()
    entropies = []
    for temp in (0.3, 0.7, 1.0, 2.0, 5.0):
        freq = empirical(sample_many(logits, 8000, temperature=temp))
        expected = torch.softmax(logits / temp, -1)
        assert (freq - expected).abs().max() < 0.03, temp
        p = freq[freq > 0]
        entropies.append(float(-(p * p.log()).sum()))
    assert entropies == sorted(entropies), entropies
    assert entropies[-1] - entropies[0] > 1.0


def test_temperature_zero_is_greedy():
    logits = torch.randn(200, V)
    info = info_for([req(temperature=0.0) for _ in range(200)])
    assert info.is_all_greedy
    out = Sampler()(logits.clone(), info).next_token_ids
    assert torch.equal(out, logits.argmax(-1))


@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_only_k_largest(k):
    logits = torch.randn(V)
    toks = sample_many(logits, 6000, top_k=k, temperature=1.5)
    allowed = set(torch.topk(logits, k).indices.tolist())
    assert set(toks.unique().tolist()) == allowed
    if k > 1:  # inside the kept set, proportional to the renormalized probs
        probs = torch.softmax(logits / 1.5, -1)
        mask = torch.zeros(V, dtype=torch.bool)
        mask[list(allowed)] = True
        expected = torch.where(mask, probs, 0) / probs[mask].sum()
        assert (empirical(toks) - expected).abs().max() < 0.03


def test_top_p_smallest_set_reaching_p():
    probs = torch.tensor([0.30, 0.05, 0.25, 0.15, 0.10, 0.05, 0.04, 0.03, 0.02, 0.01])
    logits = probs.log()
    # Sorted: 0.30 (0), 0.25 (2), 0.15 (3) -> cumulative 0.70 reaches 0.65 at token 3.
    toks = sample_many(logits, 6000, top_p=0.65)
    assert set(toks.unique().tolist()) == {0, 2, 3}
    expected = torch.zeros(10)
    expected[[0, 2, 3]] = torch.tensor([0.30, 0.25, 0.15]) / 0.70
    assert (empirical(toks, 10) - expected).abs().max() < 0.03
    # Just above the boundary the next token joins; just below it the last one leaves.
    assert set(sample_many(logits, 3000, top_p=0.71).unique().tolist()) == {0, 2, 3, 4}
    assert set(sample_many(logits, 3000, top_p=0.54).unique().tolist()) == {0, 2}


def test_top_p_filter_matches_definition_on_random_rows():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 30, generator=g) * 2
    top_ps = torch.rand(64, generator=g) * 0.9 + 0.05
    reqs = [req(top_p=float(p)) for p in top_ps]
    info = info_for(reqs, vocab=30)
    probs = torch.softmax(logits, -1)
    kept = filter_probs(probs, info) > 0
    for i in range(64):
        order = probs[i].argsort(descending=True)
        cum = probs[i][order].cumsum(0)
        n_keep = int((cum < info.top_ps[i]).sum()) + 1  # smallest prefix with cum >= p
        expected = torch.zeros(30, dtype=torch.bool)
        expected[order[:n_keep]] = True
        assert torch.equal(kept[i], expected), i


def _mixed_filter_rows(vocab: int):
    """Rows that filter (top-k, top-k + top-p) beside rows that don't (plain, greedy, min-p)."""
    params = [dict(top_k=3), dict(top_k=7, top_p=0.5), dict(), dict(temperature=0.0),
              dict(min_p=0.2), dict(top_k=2, top_p=0.9, min_p=0.1)]
    return [req(**p) for p in params for _ in range(4)]


def test_filter_bound_tracks_rows_through_merge_and_filter():
    v = 30
    info = info_for([req(top_k=5), req()], vocab=v)
    assert info.filter_bound == 5
    info.merge_batch(info_for([req(top_k=9, top_p=0.5)], vocab=v))
    assert info.filter_bound == 9
    info.merge_batch(info_for([req(top_p=0.5)], vocab=v))  # top-p with no top-k: all of V
    assert info.filter_bound == v
    info.filter_batch([0, 1, 2])
    assert info.filter_bound == 9
    info.filter_batch([1])
    assert info.filter_bound == 0


def test_top_k_rows_filter_without_a_full_sort(monkeypatch):
    """With every filtering row's bound small, top-k/top-p take torch.topk, not a sort of
    the vocabulary, and keep exactly the tokens the full sort keeps."""
    vocab = 64
    reqs = _mixed_filter_rows(vocab)
    for r in reqs:
        r.sampling_params.verify(vocab)
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(len(reqs), vocab, generator=g) * 2, -1)
    info = info_for(reqs, vocab=vocab)
    assert info.filter_bound == 7

    expected = filter_probs(probs, info)  # bound < TOPK_CANDIDATES_MAX: the topk path...
    monkeypatch.setattr("radixserve.layers.sampler.TOPK_CANDIDATES_MAX", 0)
    full_sort = filter_probs(probs, info)  # ...and the full sort, as the reference
    assert torch.equal(expected, full_sort)
    monkeypatch.undo()

    def no_sort(*a, **k):
        raise AssertionError("full sort called")

    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    assert torch.equal(filter_probs(probs, info), full_sort)
    unfiltered = [i for i, r in enumerate(reqs) if r.sampling_params.top_k in (-1, None, TOP_K_ALL)
                  and r.sampling_params.top_p == 1.0 and r.sampling_params.min_p == 0.0]
    assert unfiltered and torch.equal(full_sort[unfiltered], probs[unfiltered])


def test_min_p_drops_tokens_below_fraction_of_max():
    logits = base_logits()
    probs = torch.softmax(logits, -1)
    min_p = 0.3
    toks = sample_many(logits, 8000, min_p=min_p)
    allowed = set(torch.nonzero(probs >= min_p * probs.max()).view(-1).tolist())
    assert 1 < len(allowed) < V
    assert set(toks.unique().tolist()) == allowed


def test_top_k_top_p_min_p_combined_mixed_rows():
    logits = base_logits()
    params = [dict(top_k=4), dict(top_p=0.3), dict(min_p=0.5), dict()]
    n = 3000
    reqs = [req(**p) for p in params for _ in range(n)]
    out = Sampler()(logits.expand(len(reqs), -1).clone(), info_for(reqs)).next_token_ids
    probs = torch.softmax(logits, -1)
    sets = [set(out[i * n:(i + 1) * n].unique().tolist()) for i in range(len(params))]
    assert sets[0] == {0, 1, 2, 3}
    cum = probs.cumsum(0)
    assert sets[1] == set(range(int((cum < 0.3).sum()) + 1))
    assert sets[2] == set(torch.nonzero(probs >= 0.5 * probs[0]).view(-1).tolist())
    assert len(sets[3]) >= 12  # unfiltered row still spreads over the vocabulary


# ------------------------------------------------------------ penalties and bias
def test_frequency_and_presence_penalties_formula():
    outputs = [[3, 3, 3, 5], [5, 7], [], [3]]
    params = [dict(frequency_penalty=0.5), dict(presence_penalty=1.5),
              dict(frequency_penalty=0.7, presence_penalty=-0.4), dict()]
    reqs = [req(output_ids=o, **p) for o, p in zip(outputs, params)]
    info = info_for(reqs)
    assert info.output_token_counts is not None
    assert info.output_lens.tolist() == [4, 2, 0, 1]
    logits = torch.randn(4, V)

    def expected(lg, outs):
        lg = lg.clone()
        for i, (o, p) in enumerate(zip(outs, params)):
            for tok in set(o):
                c = o.count(tok)
                lg[i, tok] -= p.get("frequency_penalty", 0.0) * c + p.get("presence_penalty", 0.0)
        return lg

    got = info.apply_logits_bias(logits.clone())
    assert torch.allclose(got, expected(logits, outputs), atol=1e-6)
    # After a step, the new tokens count too.
    info.cumulate_output_tokens(torch.tensor([3, 9, 9, 0]))
    outputs = [o + [t] for o, t in zip(outputs, [3, 9, 9, 0])]
    assert info.output_lens.tolist() == [5, 3, 1, 2]
    got = info.apply_logits_bias(logits.clone())
    assert torch.allclose(got, expected(logits, outputs), atol=1e-6)


def test_repetition_penalty_on_prompt_and_output_tokens():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, -0.5] + [0.0] * (V - 6)] * 2)
    reqs = [req(repetition_penalty=2.0, origin_input_ids=[0, 1], output_ids=[2, 3]),
            req(origin_input_ids=[0, 1], output_ids=[2])]
    info = info_for(reqs)
    got = info.apply_logits_bias(logits.clone())
    assert got[0, :6].tolist() == [1.0, -4.0, 0.5, -2.0, 0.5, -0.5]
    assert torch.equal(got[1], logits[1])  # penalty 1: untouched
    info.cumulate_output_tokens(torch.tensor([5, 4]))
    got = info.apply_logits_bias(logits.clone())
    assert got[0, :6].tolist() == [1.0, -4.0, 0.5, -2.0, 0.5, -1.0]
    # Penalty < 1 encourages repetition: positive logits grow.
    info2 = info_for([req(repetition_penalty=0.5, origin_input_ids=[0])])
    assert info2.apply_logits_bias(logits[:1].clone())[0, 0] == 4.0


def test_penalty_lowers_sampling_of_repeated_token():
    logits = torch.zeros(V)
    n = 4000
    reqs = [req(presence_penalty=2.0, output_ids=[0, 1, 2, 3]) for _ in range(n)]
    toks = Sampler()(logits.expand(n, -1).clone(), info_for(reqs)).next_token_ids
    freq = empirical(toks)
    w = torch.ones(V)
    w[:4] = math.exp(-2.0)
    assert (freq - w / w.sum()).abs().max() < 0.02


def test_min_new_tokens_suppresses_eos_until_reached():
    logits = torch.full((1, V), -5.0)
    logits[0, EOS] = 10.0  # EOS overwhelmingly likely
    logits[0, 4] = 2.0  # stop_token_ids entry, next most likely
    r = req(min_new_tokens=3, stop_token_ids=[4])
    info = info_for([r])
    sampler = Sampler()
    toks = [int(sampler(logits.clone(), info).next_token_ids[0]) for _ in range(5)]
    assert all(t not in (EOS, 4) for t in toks[:3]), toks
    assert toks[3] == EOS and toks[4] == EOS
    # A retracted request that already produced 2 tokens has 1 left to suppress.
    info = info_for([req(min_new_tokens=3, output_ids=[1, 2])])
    toks = [int(sampler(logits.clone(), info).next_token_ids[0]) for _ in range(2)]
    assert toks[0] != EOS and toks[1] == EOS
    # Rows without min_new_tokens in the same batch are unaffected.
    info = info_for([req(min_new_tokens=2, temperature=0), req(temperature=0)])
    assert sampler(logits.expand(2, -1).clone(), info).next_token_ids.tolist()[1] == EOS


def test_logit_bias_shifts_exactly():
    logits = torch.randn(3, V)
    reqs = [req(logit_bias={"2": 5.0, "7": -3.5}), req(), req(logit_bias={"0": -100.0})]
    info = info_for(reqs)
    got = info.apply_logits_bias(logits.clone())
    expected = logits.clone()
    expected[0, 2] += 5.0
    expected[0, 7] -= 3.5
    expected[2, 0] -= 100.0
    assert torch.allclose(got, expected)
    # A large bias makes the token certain, a large negative one forbids it.
    toks = sample_many(base_logits(), 500, logit_bias={"9": 100.0})
    assert (toks == 9).all()
    toks = sample_many(base_logits(), 2000, logit_bias={"0": -100.0})
    assert (toks != 0).all()


# ---------------------------------------------------------- greedy, seeds, logprobs
def test_greedy_rows_are_argmax_in_mixed_batch():
    n = 300
    logits = torch.randn(n, V)
    logits[::3, 5] = logits[::3].max(-1).values  # exact ties too
    params = [dict(temperature=0.0), dict(top_k=5, temperature=1.3), dict(top_p=0.9, min_p=0.1)]
    reqs = [req(**params[i % 3]) for i in range(n)]
    info = info_for(reqs)
    assert not info.is_all_greedy
    out = Sampler()(logits.clone(), info).next_token_ids
    greedy = torch.arange(n) % 3 == 0
    assert torch.equal(out[greedy], logits[greedy].argmax(-1))
    assert not torch.equal(out[~greedy], logits[~greedy].argmax(-1))  # others do sample


def _seeded_run(seed, steps=8, companions=()):
    torch.manual_seed(1234 + len(companions))  # different global RNG state per run
    reqs = [req(sampling_seed=seed, temperature=1.0)] + [req(**c) for c in companions]
    info = info_for(reqs)
    logits = torch.zeros(len(reqs), V)  # flat: maximal randomness
    sampler = Sampler()
    return [int(sampler(logits.clone(), info).next_token_ids[0]) for _ in range(steps)]


def test_seeded_request_is_reproducible():
    a = _seeded_run(42)
    b = _seeded_run(42)
    assert a == b
    assert _seeded_run(43) != a
    # The draw does not depend on what else is in the batch (or the sort path it needs).
    assert _seeded_run(42, companions=[dict(top_k=3), dict(top_p=0.5), dict()]) == a
    # Distinct steps draw distinct noise: not the same token every step.
    assert len(set(a)) > 1


def test_seeded_rows_follow_their_distribution():
    # Many distinct seeds at the same step: the draws are spread like the probs.
    n = 4000
    logits = base_logits()
    reqs = [req(sampling_seed=s) for s in range(n)]
    toks = Sampler()(logits.expand(n, -1).clone(), info_for(reqs)).next_token_ids
    assert (empirical(toks) - torch.softmax(logits, -1)).abs().max() < 0.03


def test_logprobs_and_top_logprobs():
    logits = torch.randn(4, V)
    reqs = [req(temperature=0.7, top_k=3), req(temperature=0.0), req(top_p=0.5), req()]
    info = info_for(reqs)
    out = Sampler()(logits.clone(), info, return_logprob=True, top_logprobs_nums=[3, 0, 5, 1])
    assert isinstance(out, SamplerOutput)
    ref = torch.log_softmax(logits, -1)  # before temperature and filtering
    assert torch.allclose(out.next_token_logprobs, ref.gather(1, out.next_token_ids[:, None]).view(-1))
    assert [len(v) for v in out.top_logprobs_val] == [3, 0, 5, 1]
    for i, k in enumerate([3, 0, 5, 1]):
        vals = out.top_logprobs_val[i]
        assert vals == sorted(vals, reverse=True)
        if k:
            tv, ti = torch.topk(ref[i], k)
            assert torch.allclose(torch.tensor(vals), tv)
            assert out.top_logprobs_idx[i] == ti.tolist()
    # Without return_logprob nothing is computed.
    plain = Sampler()(logits.clone(), info_for(reqs))
    assert plain.next_token_logprobs is None and plain.top_logprobs_val is None


def test_logprobs_include_penalties():
    logits = torch.randn(1, V)
    info = info_for([req(temperature=0.0, logit_bias={"3": 2.0})])
    out = Sampler()(logits.clone(), info, return_logprob=True)
    biased = logits.clone()
    biased[0, 3] += 2.0
    ref = torch.log_softmax(biased, -1)
    assert torch.allclose(out.next_token_logprobs, ref[0, biased.argmax(-1)])


# ------------------------------------------------------------------ batch upkeep
def test_from_reqs_flags_and_shapes():
    info = info_for([req(), req(temperature=0.0)])
    assert info.top_ks.tolist() == [TOP_K_ALL, 1]
    assert info.temperatures.shape == (2, 1)
    assert not info.is_all_greedy and not info.need_top_k_sampling and not info.need_top_p_sampling
    assert info_for([req(top_k=5)]).need_top_k_sampling
    assert info.output_token_counts is None and info.seen_token_mask is None
    assert info.stop_token_mask is None and info.logit_bias is None
    empty = info_for([])
    assert len(empty) == 0 and empty.is_all_greedy


def test_repetition_penalty_skips_an_input_embeds_prompts_placeholder_ids():
    """An input_embeds prompt's ids are placeholders (0): no prompt token counts as seen."""
    sp = req(repetition_penalty=1.5).sampling_params
    plain = FakeReq(sampling_params=sp, origin_input_ids=[0, 0, 4], output_ids=[7])
    embeds = FakeReq(sampling_params=sp, origin_input_ids=[0, 0, 0], output_ids=[7])
    embeds.input_embeds = torch.zeros(3, 8)
    info = info_for([plain, embeds])
    assert info.seen_token_mask[0].nonzero().view(-1).tolist() == [0, 4, 7]
    assert info.seen_token_mask[1].nonzero().view(-1).tolist() == [7]


def test_merge_and_filter_keep_rows_aligned():
    greedy = info_for([req(temperature=0.0), req(temperature=0.0)])
    topk = info_for([req(top_k=2, temperature=2.0)])
    pen = info_for([req(frequency_penalty=1.0, output_ids=[0, 0], min_new_tokens=5,
                        logit_bias={"1": -50.0}, repetition_penalty=1.5, origin_input_ids=[2])])
    greedy.merge_batch(topk)
    greedy.merge_batch(pen)
    info = greedy
    assert len(info) == 4 and info.sampling_seeds == [None] * 4
    assert info.top_ks.tolist() == [1, 1, 2, TOP_K_ALL]
    assert info.output_token_counts[:3].sum() == 0 and info.output_token_counts[3, 0] == 2
    assert info.seen_token_mask[3].nonzero().view(-1).tolist() == [0, 2]
    assert info.stop_token_mask[3, EOS] and not info.stop_token_mask[:3].any()
    assert info.logit_bias[3, 1] == -50.0 and info.logit_bias[:3].abs().sum() == 0
    assert not info.is_all_greedy and info.need_top_k_sampling

    # Drop the first greedy row and move the penalty row to the front.
    info.filter_batch([3, 1, 2])
    assert info.top_ks.tolist() == [TOP_K_ALL, 1, 2]
    assert info.frequency_penalties.tolist() == [1.0, 0.0, 0.0]
    assert info.output_lens.tolist() == [2, 0, 0]
    assert info.output_token_counts[0, 0] == 2 and info.logit_bias[0, 1] == -50.0
    n = 2000
    logits = base_logits().expand(3, -1).clone()
    for _ in range(3):  # min_new_tokens: EOS at top must stay suppressed for row 0
        logits[:, EOS] = 50.0
        out = Sampler()(logits.clone(), info).next_token_ids
        assert out[0] != EOS and out[1] == EOS and out[2] == EOS
    assert info.output_lens.tolist() == [5, 3, 3]

    # Row behaviour per its own params, with many copies of the top_k row.
    big = info_for([req(temperature=0.0)])
    big.merge_batch(info_for([req(top_k=2, temperature=2.0) for _ in range(n)]))
    big.filter_batch(torch.arange(n + 1).flip(0))  # tensor indices, reversed
    assert big.top_ks[-1] == 1 and big.top_ks[0] == 2
    out = Sampler()(base_logits().expand(n + 1, -1).clone(), big).next_token_ids
    assert out[-1] == 0 and set(out[:-1].unique().tolist()) == {0, 1}

    # Filtering away the only penalty row drops the dense tensors.
    info.filter_batch([1, 2])
    assert info.output_token_counts is None and info.seen_token_mask is None
    assert info.stop_token_mask is None and info.logit_bias is None
    assert not info.is_all_greedy and info.need_top_k_sampling


def test_merge_into_batch_without_counts_then_penalize():
    a = info_for([req()])
    b = info_for([req(presence_penalty=1.0)])
    a.merge_batch(b)
    a.cumulate_output_tokens(torch.tensor([3, 3]))
    got = a.apply_logits_bias(torch.zeros(2, V))
    assert got[0].abs().sum() == 0
    assert got[1, 3] == -1.0 and got[1].abs().sum() == 1.0


def test_nan_and_inf_rows_do_not_crash():
    logits = torch.randn(5, V)
    logits[0] = float("-inf")
    logits[1, 3] = float("nan")
    logits[2, 7] = float("inf")
    logits[3] = float("nan")
    reqs = [req(), req(top_p=0.9), req(top_k=4), req(min_p=0.1), req(temperature=0.0)]
    out = Sampler()(logits.clone(), info_for(reqs), return_logprob=True, top_logprobs_nums=[2] * 5)
    ids = out.next_token_ids
    assert ids.shape == (5,) and ((ids >= 0) & (ids < V)).all()
    assert ids[1] != 3 and ids[2] == 7
    # All-greedy path with NaN too.
    g = Sampler()(logits.clone(), info_for([req(temperature=0.0)] * 5)).next_token_ids
    assert g[1] != 3 and g[2] == 7


def grammar_mask_banning(*tokens: int) -> TokenBitmask:
    """One row's grammar mask, as the grammar backend makes it: every token allowed but `tokens`."""
    bitmask = allocate_token_bitmask(1, V)
    for t in tokens:
        bitmask[0, t // 32] &= ~(1 << (t % 32))
    return TokenBitmask(bitmask, [0])


def test_vocab_wider_than_info_and_grammar_mask():
    # Padded logits (model vocab rounded up): only the first V columns are touched, by the
    # bias and by the grammar's bans.
    info = info_for([req(logit_bias={"1": 1.0})])
    wide = info.apply_logits_bias(torch.zeros(1, V + 4))
    got = grammar_mask_banning(0).apply_(wide, V)
    assert got[0, 0] == float("-inf") and got[0, 1] == 1.0 and (got[0, V:] == 0).all()


def test_grammar_mask_is_applied_after_the_bias():
    # A logit_bias cannot lift a token the grammar bans: the sampler applies the mask last.
    info = info_for([req(temperature=0.0, logit_bias={"0": 100.0})])
    out = Sampler()(base_logits()[None].clone(), info, token_bitmask=grammar_mask_banning(0))
    assert out.next_token_ids.item() == 1  # token 0 banned; 1 is the next most likely
