"""Input logprobs (`logprob_start_len`) equal transformers' log_softmax of the prompt's logits,
also when part of the prompt is cached and when the prompt is prefilled in chunks."""

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
                              return_logprob=True, logprob_start_len=start)
        pairs = out["meta_info"]["input_token_logprobs"]  # [logprob, token id, text] triples
        assert [t for _, t, _ in pairs] == IDS[start:]
        if start == 0:
            assert pairs[0][0] is None  # the first token has no context
            pairs, start = pairs[1:], 1
        expected = [reference[j - 1, IDS[j]].item() for j in range(start, len(IDS))]
        assert max(abs(v - e) for (v, _, _), e in zip(pairs, expected)) <= 1e-4
    without = engine.generate(input_ids=IDS, sampling_params={"max_new_tokens": 2}, return_logprob=True)
    assert without["meta_info"]["input_token_logprobs"] == []  # present (as in SGLang), empty
    engine.scheduler.check_memory()
