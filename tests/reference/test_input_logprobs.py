"""Input logprobs (`logprob_start_len`) equal transformers' log_softmax of the prompt's logits,
also when part of the prompt is cached and when the prompt is prefilled in chunks, in SGLang's
convention: one entry per token from the start, the first None whatever the start (its
scheduler returns `[None] + logprobs[:-1]`), and input_top_logprobs alongside."""

from __future__ import annotations

import pytest
import torch
import transformers

from radixserve.engine import Engine
from radixserve.tiny_model import get_tiny_model_path

IDS = list(range(100, 180))


@pytest.fixture(scope="module")
def reference():
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(get_tiny_model_path()), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([IDS])).logits[0].float(), -1)


@pytest.mark.parametrize("kw", [{"disable_overlap_schedule": False}, {"chunked_prefill_size": 16}, {"chunked_prefill_size": 16, "disable_overlap_schedule": True}])
def test_input_logprobs_match_hf(kw, reference):
    engine = Engine(max_total_tokens=4096, **kw)
    engine.generate(input_ids=IDS[:50], sampling_params={"max_new_tokens": 1})  # a cached prefix
    for start in (0, 5, 60, 79):
        out = engine.generate(input_ids=IDS, sampling_params={"max_new_tokens": 2, "temperature": 0},
                              return_logprob=True, logprob_start_len=start, top_logprobs_num=3)
        pairs = out["meta_info"]["input_token_logprobs"]  # [logprob, token id, text] triples
        tops = out["meta_info"]["input_top_logprobs"]
        assert [t for _, t, _ in pairs] == IDS[start:] and len(tops) == len(pairs)
        # SGLang's convention (until this issue radixserve gave a number there for start > 0,
        # and SGLang's frontend counted one token too many in select)
        assert pairs[0][0] is None and tops[0] is None
        expected = [reference[j - 1, IDS[j]].item() for j in range(start + 1, len(IDS))]
        assert max((abs(v - e) for (v, _, _), e in zip(pairs[1:], expected)), default=0.0) <= 1e-4
        for j, row in zip(range(start + 1, len(IDS)), tops[1:]):
            best = torch.topk(reference[j - 1], 3)
            assert [t for _, t, _ in row] == best.indices.tolist()
            assert max(abs(v - e) for (v, _, _), e in zip(row, best.values.tolist())) <= 1e-4
    # SGLang's default start (-1) with return_logprob is the last prompt token: one None entry
    without = engine.generate(input_ids=IDS, sampling_params={"max_new_tokens": 2}, return_logprob=True)
    assert without["meta_info"]["input_token_logprobs"] == [[None, IDS[-1], None]]
    # max_new_tokens 0 (SGLang's prefill-only request): the prompt's logprobs, no token
    only = engine.generate(input_ids=IDS, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    assert only["output_ids"] == [] and only["meta_info"]["output_token_logprobs"] == []
    assert only["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert only["meta_info"]["completion_tokens"] == 0
    assert len(only["meta_info"]["input_token_logprobs"]) == len(IDS)
    engine.scheduler.check_memory()
