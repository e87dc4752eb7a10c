"""Issue 43 item 4 against transformers (float32), through the offline Engine: return_hidden_states
(HF's output_hidden_states[-1], the final norm's output), token_ids_logprob at prompt positions
(HF's log_softmax of the prompt's logits) and input_embeds (embed_tokens(ids) given as embeddings
gives the token path's tokens and logprobs), each also with chunked prefills and in both loops."""

from __future__ import annotations

from typing import List

import pytest
import torch
import transformers

from radixserve.engine import Engine
from radixserve.tiny_model import get_tiny_model_path

PROMPTS = [[(k * 131 + i * 17) % 8000 + 3 for i in range(21 + 9 * k)] for k in range(3)]
ASKED = [5, 77, 4000, 8191]


@pytest.fixture(scope="module")
def hf():
    return transformers.AutoModelForCausalLM.from_pretrained(str(get_tiny_model_path()), dtype=torch.float32).eval()


def greedy(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def hf_run(hf, ids: List[int]):
    with torch.no_grad():
        return hf(torch.tensor([ids]), output_hidden_states=True)


ENGINES = {  # the overlap loop (default), mixed chunked prefills in it, and the plain loop with chunks
    "overlap": dict(),
    "overlap-mixed-chunks": dict(chunked_prefill_size=16, enable_mixed_chunk=True),
    "no-overlap-chunks": dict(chunked_prefill_size=16, disable_overlap_schedule=True),
}


@pytest.fixture(scope="module", params=list(ENGINES))
def engine(request):
    e = Engine(max_total_tokens=4096, **ENGINES[request.param])
    yield e
    e.shutdown()


def test_hidden_states_are_hf_final_hidden_states(engine, hf):
    """meta_info.hidden_states: the prompt's entry (its last position) and one row per later
    output token, each the final-norm hidden state the next token was sampled from."""
    engine.generate(input_ids=PROMPTS[2][:12], sampling_params=greedy(1))  # a cached prefix for prompt 2
    outs = engine.generate(input_ids=PROMPTS, sampling_params=greedy(6), return_hidden_states=[True, False, True])
    assert "hidden_states" not in outs[1]["meta_info"]
    for ids, out in zip(PROMPTS, outs):
        if "hidden_states" not in out["meta_info"]:
            continue
        hs = out["meta_info"]["hidden_states"]
        assert len(hs) == out["meta_info"]["completion_tokens"] == 6
        assert len(hs[0]) == 1 and all(len(row) == 256 for row in [hs[0][0], *hs[1:]])
        ref = hf_run(hf, ids + out["output_ids"][:-1]).hidden_states[-1][0, len(ids) - 1:]
        got = torch.tensor([hs[0][0], *hs[1:]])
        assert (got - ref).abs().max().item() <= 1e-4


def test_hidden_states_streamed_equal_the_whole(engine):
    whole = engine.generate(input_ids=PROMPTS[0], sampling_params=greedy(5), return_hidden_states=True)
    last = list(engine.generate(input_ids=PROMPTS[0], sampling_params=greedy(5), return_hidden_states=True, stream=True))[-1]
    a, b = last["meta_info"]["hidden_states"], whole["meta_info"]["hidden_states"]
    assert len(a) == len(b) == 5
    assert (torch.tensor([a[0][0], *a[1:]]) - torch.tensor([b[0][0], *b[1:]])).abs().max().item() <= 1e-5


@pytest.mark.parametrize("start", [0, 4, 29])
def test_token_ids_logprob_at_prompt_positions_are_hf_logprobs(engine, hf, start):
    """SGLang's input_token_ids_logprobs: per prompt token from logprob_start_len, the asked ids'
    logprobs given the tokens before it (None for the first token, as input_token_logprobs)."""
    engine.generate(input_ids=PROMPTS[1][:10], sampling_params=greedy(1))  # a cached prefix
    outs = engine.generate(input_ids=PROMPTS, sampling_params=greedy(3), return_logprob=True,
                           logprob_start_len=start, token_ids_logprob=[ASKED, None, ASKED[:2]])
    assert "input_token_ids_logprobs" not in outs[1]["meta_info"]
    for ids, out, asked in ((PROMPTS[0], outs[0], ASKED), (PROMPTS[2], outs[2], ASKED[:2])):
        rows = out["meta_info"]["input_token_ids_logprobs"]
        assert len(rows) == len(out["meta_info"]["input_token_logprobs"]) == max(len(ids) - start, 0)
        ref = torch.log_softmax(hf_run(hf, ids).logits[0].float(), -1)
        if start < len(ids):  # SGLang's convention: the first token from the start has None
            assert rows[0] is None
        for j, row in zip(range(start, len(ids)), rows):
            if j == start:
                continue
            assert [t for _, t, _ in row] == asked
            assert max(abs(v - ref[j - 1, t].item()) for v, t, _ in row) <= 1e-4


@pytest.mark.parametrize("kw", [dict(), dict(chunked_prefill_size=8, disable_overlap_schedule=True),
                                dict(chunked_prefill_size=8, enable_mixed_chunk=True)])
def test_input_embeds_give_the_token_path(hf, kw):
    """embed_tokens(ids) sent as input_embeds (a batch beside a token prompt, chunked prefills)
    gives the very tokens and logprobs of the ids themselves."""
    e = Engine(max_total_tokens=4096, disable_radix_cache=True, **kw)
    try:
        table = hf.model.embed_tokens.weight
        embeds = [table[torch.tensor(ids)].tolist() for ids in PROMPTS[:2]]
        by_ids = e.generate(input_ids=PROMPTS, sampling_params=greedy(6), return_logprob=True, top_logprobs_num=3)
        by_embeds = e.generate(input_embeds=embeds, sampling_params=greedy(6), return_logprob=True, top_logprobs_num=3)
        beside = e.submit(input_ids=PROMPTS[2], sampling_params=greedy(6), return_logprob=True)  # one batch with them
        mixed = e.submit(input_embeds=embeds[0], sampling_params=greedy(6), return_logprob=True)
        e.wait_until_idle()
        for ref, out in zip([by_ids[0], by_ids[1], by_ids[0]], [*by_embeds, e.frontend.make_output(mixed[0])]):
            assert out["output_ids"] == ref["output_ids"]
            assert out["meta_info"]["prompt_tokens"] == ref["meta_info"]["prompt_tokens"]
            got = [v for v, _, _ in out["meta_info"]["output_token_logprobs"]]
            assert got == pytest.approx([v for v, _, _ in ref["meta_info"]["output_token_logprobs"]], abs=1e-4)  # batch noise
        assert e.frontend.make_output(beside[0])["output_ids"] == by_ids[2]["output_ids"]
        # the embeddings are what the model reads: other ones, other tokens
        other = e.generate(input_embeds=[[2 * x for x in row] for row in embeds[0]], sampling_params=greedy(6))
        assert other["output_ids"] != by_ids[0]["output_ids"]
        e.scheduler.check_memory()
    finally:
        e.shutdown()


def test_input_embeds_and_hidden_states_through_retractions(hf):
    """A retracted input_embeds request re-prefills its prompt from the embeddings and its
    output tokens from their ids; its hidden-state rows stay one per output token."""
    e = Engine(max_total_tokens=2048, disable_radix_cache=True, test_retract_interval=3, chunked_prefill_size=8)
    try:
        prompts = [[(k * 131 + i * 17) % 8000 + 3 for i in range(20)] for k in range(3)]
        by_ids = e.generate(input_ids=prompts, sampling_params=greedy(24))
        embeds = [hf.model.embed_tokens.weight[torch.tensor(p)].tolist() for p in prompts]
        by_embeds = e.generate(input_embeds=embeds, sampling_params=greedy(24), return_hidden_states=True)
        assert any(o["meta_info"].get("retraction_count") for o in by_embeds)  # the path under test ran
        for ids, ref, out in zip(prompts, by_ids, by_embeds):
            assert out["output_ids"] == ref["output_ids"]
            hs = out["meta_info"]["hidden_states"]
            want = hf_run(hf, ids + out["output_ids"][:-1]).hidden_states[-1][0, len(ids) - 1:]
            assert (torch.tensor([hs[0][0], *hs[1:]]) - want).abs().max().item() <= 1e-4
        e.scheduler.check_memory()
    finally:
        e.shutdown()
