"""Gemma 3 (issue 42) against transformers on the same random weights, float32: logits at every
position of a ragged prefill, an extend after a cached prefix and decode steps, past the local
layers' window; the Engine's greedy tokens and logprobs. Two configs: transformers 5's layer_types
with its per-layer-type rope_parameters and a rope scaling on the global layers, and the Hub's
older form (sliding_window_pattern, rope_local_base_freq)."""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_utils import KVDriver, hf_logits, load_hf, make_runner

from radixserve import Engine
from radixserve.hf_transformers_utils import LoadError
from radixserve.models.model_config import ModelConfig

TOL = 1e-4
WINDOW = 8
BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, sliding_window=WINDOW,
            query_pre_attn_scalar=24, rms_norm_eps=1e-6)
CONFIGS = {
    # layers 0, 2 local; 1, 3 global with a linear rope scaling (as Gemma 3 4B+)
    "layer_types": dict(layer_types=["sliding_attention", "full_attention"] * 2,
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    # the Hub's configs: every 3rd layer global (layer 2), local base 100 (far from the global 1e6)
    "pattern": dict(sliding_window_pattern=3, rope_theta=1e6, rope_local_base_freq=100.0),
}
PROMPTS = [list(range(7, 7 + 19)), [450, 2, 2, 61, 88, 130, 7, 9, 10, 11, 500, 42, 1, 77]]


def make_gemma3_dir(out_dir: str, seed: int = 0, **overrides) -> str:
    cfg = transformers.Gemma3TextConfig(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[-1] ** -0.5 * (p.shape[-1] ** 0.5 * 0.5 if "embed" in name else 1.5))
            else:  # the norms' weights, around 0 (their scale is 1 + weight)
                p.normal_(0, 0.2)
    model.config.architectures = ["Gemma3ForCausalLM"]
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module", params=list(CONFIGS))
def gemma3_dir(request, tmp_path_factory):
    return make_gemma3_dir(str(tmp_path_factory.mktemp(f"gemma3_{request.param}")), **CONFIGS[request.param])


def test_config_reads_the_local_and_global_layers(gemma3_dir):
    config = ModelConfig.from_pretrained(gemma3_dir)
    hf = transformers.AutoConfig.from_pretrained(gemma3_dir)
    assert config.window_layers == [t == "sliding_attention" for t in hf.layer_types] and any(config.window_layers)
    assert not all(config.window_layers) and config.sliding_window == WINDOW
    assert config.rope_theta == 1e6


def _driver_logits(runner) -> list:
    """A ragged prefill (row 0 past the window), an extend after row 0's 19 cached tokens, decode steps."""
    drv = KVDriver(runner, scatter_seed=1)
    out = [drv.extend([0, 1], [0, 0], PROMPTS).all_logits]
    out.append(drv.extend([0], [19], [[13, 14, 15, 16, 17]]).all_logits)
    lens = [24, 14]
    for t in range(4):
        out.append(drv.decode([0, 1], lens, [20 + t, 30 + t]).next_token_logits)
        lens = [n + 1 for n in lens]
    return out


def _reference(hf) -> list:
    a = PROMPTS[0] + [13, 14, 15, 16, 17] + [20, 21, 22, 23]
    b = PROMPTS[1] + [30, 31, 32, 33]
    la, lb = hf_logits(hf, a), hf_logits(hf, b)
    out = [torch.cat([la[:19], lb[:14]]), la[19:24]]
    for t in range(4):
        out.append(torch.stack([la[24 + t], lb[14 + t]]))
    return out


def test_logits_match_transformers(gemma3_dir):
    ours, ref = _driver_logits(make_runner(gemma3_dir)), _reference(load_hf(gemma3_dir))
    assert ref[0].std() > 1.0  # well-separated logits
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a.shape == b.shape, i
        assert (a - b).abs().max().item() <= TOL, f"step {i}: {(a - b).abs().max().item():.2e}"


def test_the_premise_the_window_and_the_local_rope_matter(gemma3_dir):
    """Without the window, or with the global RoPE base on the local layers, transformers' own
    logits past the window differ: the test above would see a mistake in either."""
    hf = load_hf(gemma3_dir)
    ids = PROMPTS[0] + PROMPTS[1]
    want = hf_logits(hf, ids)[-1]
    no_window = load_hf(gemma3_dir)
    no_window.config.sliding_window = 10_000
    for layer in no_window.model.layers:
        layer.self_attn.sliding_window = None if layer.self_attn.sliding_window is None else 10_000
    assert (hf_logits(no_window, ids)[-1] - want).abs().max() > 1e-2
    one_rope = load_hf(gemma3_dir)
    rope = one_rope.model.rotary_emb
    rope.sliding_attention_inv_freq.copy_(rope.full_attention_inv_freq)
    assert (hf_logits(one_rope, ids)[-1] - want).abs().max() > 1e-2


def test_the_engine_serves_it(gemma3_dir):
    hf = load_hf(gemma3_dir)
    engine = Engine(gemma3_dir, dtype="float32", skip_tokenizer_init=True, chunked_prefill_size=8)
    try:
        outs = engine.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": 6, "temperature": 0},
                               return_logprob=True, progress=False)
    finally:
        engine.shutdown()
    for prompt, out in zip(PROMPTS, outs):
        ids = out["output_ids"]
        ref = hf_logits(hf, prompt + ids)[len(prompt) - 1 : -1]
        assert ids == ref.argmax(-1).tolist()
        lp = torch.tensor([v for v, _, _ in out["meta_info"]["output_token_logprobs"]])
        assert (lp - torch.log_softmax(ref, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)).abs().max() <= TOL


@pytest.mark.parametrize("key", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_soft_capping_is_refused_in_one_line(tmp_path, key):
    model_dir = make_gemma3_dir(str(tmp_path / key), **CONFIGS["pattern"], **{key: 30.0})
    with pytest.raises(LoadError, match=f"{key}=30.0 is not supported"):
        make_runner(model_dir)
