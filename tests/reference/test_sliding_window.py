"""A config with a sliding window is never served as if it had none (issue 42, its first step).

Windowed attention is not implemented yet, so such a model is served up to its window, where
the window holds every key and the answers are transformers' own; longer inputs are refused and
a --context-length beyond the window is refused at start with one line."""

from __future__ import annotations

import pytest
import torch

from hf_utils import hf_logits, load_hf, make_hf_model_dir

from radixserve import Engine
from radixserve.hf_transformers_utils import LoadError
from radixserve.models.model_config import ModelConfig

WINDOW = 16
TOL = 1e-4


@pytest.fixture(scope="module")
def windowed_mistral(tmp_path_factory):
    return make_hf_model_dir("mistral", str(tmp_path_factory.mktemp("mistral_swa")), seed=7, sliding_window=WINDOW)


def _config(**cfg) -> ModelConfig:
    base = dict(architectures=["Qwen2ForCausalLM"], vocab_size=8, hidden_size=8, intermediate_size=8,
                num_hidden_layers=4, num_attention_heads=2, max_position_embeddings=1024)
    return ModelConfig.from_dict({**base, **cfg})


def test_the_window_is_read_as_transformers_reads_it():
    assert _config(sliding_window=WINDOW, architectures=["MistralForCausalLM"]).sliding_window == WINDOW
    assert _config(sliding_window=None).sliding_window is None
    # Qwen2/Qwen3 keep sliding_window in the config but use it only with use_sliding_window,
    # for the layers from max_window_layers on (transformers' layer_types).
    assert _config(sliding_window=WINDOW, use_sliding_window=False).sliding_window is None
    assert _config(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=4).sliding_window is None
    assert _config(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=2).sliding_window == WINDOW
    assert _config(sliding_window=WINDOW, layer_types=["full_attention"] * 4).sliding_window is None
    assert _config(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2).sliding_window == WINDOW


def test_a_windowed_model_is_served_up_to_its_window_exactly(windowed_mistral):
    hf = load_hf(windowed_mistral)
    config = ModelConfig.from_pretrained(windowed_mistral)
    assert config.sliding_window == WINDOW and config.context_len == WINDOW
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (WINDOW - 5,), generator=g).tolist()
    long_prompt = torch.randint(0, config.vocab_size, (WINDOW + 8,), generator=g).tolist()
    # The premise: past the window, transformers' windowed model answers differently from the
    # same weights attending to every key, so serving it "as if it had none" would be wrong.
    hf_full = load_hf(windowed_mistral)
    hf_full.config.sliding_window = None
    assert (hf_logits(hf, long_prompt)[-1] - hf_logits(hf_full, long_prompt)[-1]).abs().max() > 1e-2

    engine = Engine(windowed_mistral, dtype="float32", skip_tokenizer_init=True, disable_overlap_schedule=True)
    try:
        out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 4, "temperature": 0},
                              return_logprob=True, progress=False)
        ids = out["output_ids"]
        ref = hf_logits(hf, prompt + ids)
        want = ref[len(prompt) - 1 : -1].argmax(-1).tolist()
        assert ids == want
        lp = [v for v, _, _ in out["meta_info"]["output_token_logprobs"]]
        ref_lp = torch.log_softmax(ref[len(prompt) - 1 : -1], -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
        assert max(abs(a - b) for a, b in zip(lp, ref_lp.tolist())) <= TOL
        with pytest.raises(ValueError, match=f"longer than the model's context length \\({WINDOW} tokens\\)"):
            engine.generate(input_ids=long_prompt, sampling_params={"max_new_tokens": 1}, progress=False)
    finally:
        engine.shutdown()


def test_a_context_length_beyond_the_window_is_refused_at_start(windowed_mistral):
    with pytest.raises(LoadError, match=f"sliding window of {WINDOW} tokens"):
        Engine(windowed_mistral, dtype="float32", skip_tokenizer_init=True, context_length=4 * WINDOW)
