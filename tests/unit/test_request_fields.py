"""Issue 43 item 4, through the offline Engine (the served runtime's front end and scheduler):
token_ids_logprob against the full-vocabulary logprobs, custom_logit_processor from the registry
(and its refusals), --allow-auto-truncate, data_parallel_rank's range."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from radixserve.engine import Engine
from radixserve.managers.request_frontend import hidden_states_refusal, input_embeds_refusal

CONTEXT = 64


@pytest.fixture(scope="module")
def engine():
    e = Engine(max_total_tokens=2048, context_length=CONTEXT, enable_custom_logit_processor=True,
               allow_auto_truncate=True, test_check_memory=True)
    yield e
    e.shutdown()


def _prompt(seed: int, n: int = 10):
    return [(seed * 97 + i * 31) % 8000 + 3 for i in range(n)]


def greedy(n: int = 6, **kw):
    return {"max_new_tokens": n, "temperature": 0, **kw}


def test_token_ids_logprob_are_the_full_vocabulary_logprobs_of_those_ids(engine):
    asked = [[5, 7, 100, 8191], [42], None]  # per prompt of a batch: two ask, one does not
    outs = engine.generate(input_ids=[_prompt(1), _prompt(2), _prompt(3)], sampling_params=greedy(4),
                           return_logprob=True, top_logprobs_num=engine.vocab_size, token_ids_logprob=None)
    got = engine.generate(input_ids=[_prompt(1), _prompt(2), _prompt(3)], sampling_params=greedy(4),
                          return_logprob=True, token_ids_logprob=asked)
    for ids, full, out in zip(asked, outs, got):
        assert out["output_ids"] == full["output_ids"]
        if ids is None:
            assert "output_token_ids_logprobs" not in out["meta_info"]
            continue
        rows = out["meta_info"]["output_token_ids_logprobs"]
        assert len(rows) == len(out["output_ids"]) == 4
        for row, top in zip(rows, full["meta_info"]["output_top_logprobs"]):
            by_id = {t: v for v, t, _ in top}
            assert [t for _, t, _ in row] == ids
            assert [v for v, _, _ in row] == pytest.approx([by_id[t] for t in ids], abs=1e-5)


@pytest.mark.parametrize("kw, message", [
    (dict(return_logprob=False, token_ids_logprob=[5]), "needs return_logprob"),
    (dict(return_logprob=True, token_ids_logprob=[8192]), r"in \[0, 8192\)"),
    (dict(return_logprob=True, token_ids_logprob=[]), "non-empty list"),
])
def test_token_ids_logprob_refusals(engine, kw, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(input_ids=_prompt(1), sampling_params=greedy(2), **kw)


def test_custom_logit_processors_act_on_their_rows_only(engine):
    prompts = [_prompt(4), _prompt(5), _prompt(6)]
    base = engine.generate(input_ids=prompts, sampling_params=greedy())
    banned = base[1]["output_ids"][:1]
    # one batch: row 0 forced, row 1 with a ban, row 2 untouched
    outs = [
        engine.submit(input_ids=prompts[0], sampling_params=greedy(custom_params={"token_id": 42}),
                      custom_logit_processor="force_token"),
        engine.submit(input_ids=prompts[1], sampling_params=greedy(custom_params={"token_ids": banned}),
                      custom_logit_processor="disallowed_tokens"),
        engine.submit(input_ids=prompts[2], sampling_params=greedy()),
    ]
    engine.wait_until_idle()
    forced, no_first, plain = [engine.frontend.make_output(s[0]) for s in outs]
    assert forced["output_ids"] == [42] * 6
    assert banned[0] not in no_first["output_ids"]
    assert no_first["output_ids"][0] != base[1]["output_ids"][0]
    assert plain["output_ids"] == base[2]["output_ids"]


@pytest.mark.parametrize("kw, message", [
    (dict(custom_logit_processor="nope"), "registered processor"),
    (dict(custom_logit_processor="force_token", sampling_params=greedy(custom_params={"token_id": -1})), r"in \[0, 8192\)"),
    (dict(custom_logit_processor="disallowed_tokens", sampling_params=greedy(custom_params={"token_ids": "5"})), "list of token ids"),
])
def test_custom_logit_processor_refusals(engine, kw, message):
    kw.setdefault("sampling_params", greedy())
    with pytest.raises(ValueError, match=message):
        engine.generate(input_ids=_prompt(1), **kw)


def test_custom_logit_processor_needs_the_flag(engine):
    engine.frontend.enable_custom_logit_processor = False
    try:
        with pytest.raises(ValueError, match="--enable-custom-logit-processor"):
            engine.generate(input_ids=_prompt(1), sampling_params=greedy(custom_params={"token_id": 1}),
                            custom_logit_processor="force_token")
    finally:
        engine.frontend.enable_custom_logit_processor = True


def test_allow_auto_truncate_cuts_a_too_long_input(engine):
    long_ids = _prompt(7, 3 * CONTEXT)
    out = engine.generate(input_ids=long_ids, sampling_params=greedy(8))
    assert out["meta_info"]["prompt_tokens"] == CONTEXT - 2  # room for the one token a prefill samples
    assert out["output_ids"] == engine.generate(input_ids=long_ids[: CONTEXT - 2], sampling_params=greedy(8))["output_ids"]
    # an input that fits but whose max_new_tokens does not: max_new_tokens clipped to the room
    fits = engine.generate(input_ids=_prompt(8, CONTEXT - 10), sampling_params=greedy(100, ignore_eos=True))
    assert fits["meta_info"]["completion_tokens"] == 9
    engine.frontend.allow_auto_truncate = False
    try:
        with pytest.raises(ValueError, match="longer than the model's context length"):
            engine.generate(input_ids=long_ids, sampling_params=greedy(8))
        with pytest.raises(ValueError, match="exceeds the model's maximum context length"):
            engine.generate(input_ids=_prompt(8, CONTEXT - 10), sampling_params=greedy(100))
    finally:
        engine.frontend.allow_auto_truncate = True


def test_data_parallel_rank_out_of_range_is_refused(engine):
    state = engine.submit(input_ids=_prompt(1), sampling_params=greedy(2), data_parallel_rank=0)[0]
    engine.wait_until_idle()
    assert state.finished and len(state.output_ids) == 2
    for bad in (1, -1, True):
        with pytest.raises(ValueError, match=r"data_parallel_rank must be an integer in \[0, 1\)"):
            engine.submit(input_ids=_prompt(1), sampling_params=greedy(2), data_parallel_rank=bad)


@pytest.mark.parametrize("overlap", [False, True])
def test_token_ids_logprob_in_both_loops_with_chunked_mixed_batches(overlap):
    """The overlap loop and mixed chunked prefills (decode rows beside a prefill chunk) keep
    each row's asked ids with its own row."""
    e = Engine(max_total_tokens=2048, disable_overlap_schedule=not overlap, enable_mixed_chunk=True, chunked_prefill_size=16)
    try:
        ids = [[(k * 131 + i * 17) % 8000 + 3 for i in range(30 + 5 * k)] for k in range(3)]
        asked = [[9, 99], None, [1234]]
        full = e.generate(input_ids=ids, sampling_params=greedy(5), return_logprob=True, top_logprobs_num=e.vocab_size)
        got = e.generate(input_ids=ids, sampling_params=greedy(5), return_logprob=True, token_ids_logprob=asked)
        for f, g, ask in zip(full, got, asked):
            if ask is None:
                continue
            rows = g["meta_info"]["output_token_ids_logprobs"]
            assert len(rows) == 5
            for row, top in zip(rows, f["meta_info"]["output_top_logprobs"]):
                by_id = {t: v for v, t, _ in top}
                # float32 noise between the two runs' batches (logprobs near -20: ~1e-5)
                assert [v for v, _, _ in row] == pytest.approx([by_id[t] for t in ask], abs=1e-4)
    finally:
        e.shutdown()


# ---- return_hidden_states / input_embeds: what is refused (their values: tests/reference/test_request_fields_vs_hf.py)
def test_input_embeds_need_the_radix_cache_off(engine):
    with pytest.raises(ValueError, match="--disable-radix-cache"):
        engine.generate(input_embeds=[[0.0] * 256] * 3, sampling_params=greedy(2))


@pytest.fixture(scope="module")
def no_radix():
    e = Engine(max_total_tokens=1024, context_length=CONTEXT, disable_radix_cache=True)
    yield e
    e.shutdown()


ROW = [0.5] * 256  # the tiny model's hidden size


@pytest.mark.parametrize("kw, message", [
    (dict(input_embeds=[[0.5] * 255] * 3), "rows of 255 numbers; this model's hidden size is 256"),
    (dict(input_embeds=[]), "non-empty list"),
    (dict(input_embeds=[[]]), "rows of 0 numbers; this model.s hidden size is 256"),
    (dict(input_embeds=[ROW, ROW[:10]]), "rows of 256 numbers each"),
    (dict(input_embeds=[ROW, ["a"] * 256]), "rows of 256 numbers each"),
    (dict(input_embeds=[ROW, [float("nan")] * 256]), "finite"),
    (dict(input_embeds=[ROW] * 3, input_ids=[1, 2, 3]), "Either text or input_ids"),
    (dict(input_embeds=[ROW] * 3, prompt="hi"), "Either text or input_ids"),
    (dict(input_embeds=[[ROW] * 3, [ROW[:7]]]), r"input_embeds\[1\] has rows of 7 numbers"),
    (dict(input_embeds=[ROW] * 3, return_logprob=True, logprob_start_len=0), "an input_embeds prompt has none"),
    (dict(input_embeds=[ROW] * CONTEXT), "context length"),
])
def test_input_embeds_refusals(no_radix, kw, message):
    with pytest.raises(ValueError, match=message):
        no_radix.generate(sampling_params=greedy(2), **kw)
    assert not no_radix.frontend.rid_to_state


def test_input_embeds_batch_and_n_samples(no_radix):
    """A batch of embeddings and n > 1 samples of one: each sample runs from the same embeddings."""
    outs = no_radix.generate(input_embeds=[[ROW] * 4, [[0.1 * (i % 7) for i in range(256)]] * 6],
                             sampling_params=greedy(3))
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [4, 6]
    samples = no_radix.generate(input_embeds=[ROW] * 4, sampling_params={**greedy(3), "n": 2})
    assert samples[0]["output_ids"] == samples[1]["output_ids"] == outs[0]["output_ids"]
    no_radix.scheduler.check_memory()


def test_hidden_states_are_refused_where_no_forward_keeps_them(engine):
    with pytest.raises(ValueError, match="return_hidden_states must be true or false"):
        engine.generate(input_ids=_prompt(1), sampling_params=greedy(2), return_hidden_states="yes")
    engine.frontend.hidden_states_refusal = hidden_states_refusal(_args(speculative_algorithm="EAGLE"))
    try:
        with pytest.raises(ValueError, match="return_hidden_states is not supported with --speculative-algorithm"):
            engine.generate(input_ids=_prompt(1), sampling_params=greedy(2), return_hidden_states=True)
        engine.generate(input_ids=_prompt(1), sampling_params=greedy(2))  # without it: served
    finally:
        engine.frontend.hidden_states_refusal = None
    assert hidden_states_refusal(_args(pp_size=2)) == "return_hidden_states is not supported with --pp-size > 1."
    assert "--disaggregation-mode" in hidden_states_refusal(_args(disaggregation_mode="decode"))
    assert hidden_states_refusal(_args()) is None


def test_input_embeds_refusal_by_server_and_model():
    assert input_embeds_refusal(_args(), "Qwen3ForCausalLM") is None
    assert "--disable-radix-cache" in input_embeds_refusal(_args(disable_radix_cache=False), "Qwen3ForCausalLM")
    assert "--speculative-algorithm" in input_embeds_refusal(_args(speculative_algorithm="NGRAM"), "LlamaForCausalLM")
    assert input_embeds_refusal(_args(), "Qwen2_5_VLForConditionalGeneration") == \
        "input_embeds is not supported for Qwen2_5_VLForConditionalGeneration models."


def _args(**kw):
    base = dict(speculative_algorithm=None, pp_size=1, disaggregation_mode="null", disable_radix_cache=True)
    return SimpleNamespace(**{**base, **kw})
