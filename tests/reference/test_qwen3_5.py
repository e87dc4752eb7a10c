"""Qwen3.5 text models (dense and MoE) against transformers, float32: the Qwen3-Next tests
that compare logits and greedy tokens (test_qwen3_next.py), imported here and so run again with
this module's `next_dir` fixture (pytest resolves a test's fixtures in the module that collects
it): a ragged prefill and decode steps, a chunked prefill that splits a linear-attention
sequence, and the Engine's greedy tokens and logprobs."""

from __future__ import annotations

import pytest
import torch
import transformers

from test_qwen3_next import (  # noqa: F401  (collected here with this module's next_dir)
    CONFIG,
    LONG,
    SHORT,
    TOL,
    hf,
    make_next_dir,
    randomize_,
    test_chunked_prefill_continues_from_the_saved_state,
    test_ragged_prefill_and_decode_match_transformers,
    test_tensor_parallel_2_splits_the_heads,
    test_the_engine_greedy_matches_transformers,
)

from hf_utils import KVDriver, make_runner
from vl_model import IMAGE_PLACEHOLDER, data_url, hf_greedy, make_vl_model_dir, random_image

from radixserve.engine import Engine
from radixserve.layers.gated_delta_net import Qwen3_5GatedDeltaNet
from radixserve.layers.moe import SparseMoeBlock
from radixserve.models.llama import LlamaMLP

NOT_IN_QWEN3_5 = ("moe_intermediate_size", "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok",
                  "mlp_only_layers")
FAMILIES = {
    "qwen3_5": (transformers.Qwen3_5TextConfig, {k: v for k, v in CONFIG.items() if k not in NOT_IN_QWEN3_5}),
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, {k: v for k, v in CONFIG.items() if k not in ("intermediate_size", "mlp_only_layers")}),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def next_dir(request, tmp_path_factory):
    config_class, config = FAMILIES[request.param]
    return make_next_dir(str(tmp_path_factory.mktemp(request.param)), config_class=config_class, config=config)


def test_the_families_build_their_own_layers(next_dir):
    runner = make_runner(next_dir, max_running_requests=4)
    layers = runner.model.model.layers
    moe = runner.model_config.architecture == "Qwen3_5MoeForCausalLM"
    assert runner.model_config.architecture in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
    assert [isinstance(getattr(layer, "linear_attn", None), Qwen3_5GatedDeltaNet) for layer in layers] == [True, False, True, True]
    assert all(isinstance(layer.mlp, SparseMoeBlock if moe else LlamaMLP) for layer in layers)


VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=1)
VISION_LANGUAGE = {
    "qwen3_5": (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration),
    "qwen3_5_moe": (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration),
}


@pytest.mark.parametrize("family", list(VISION_LANGUAGE))
def test_a_vision_language_checkpoint_on_text_prompts(family, tmp_path):
    """The released Qwen3.5 checkpoints are vision-language models (text_config, the weights under
    model.language_model., a vision tower; served with it: models/qwen3_5_vl.py): on text prompts,
    the logits of the model that holds them, over a ragged prefill and a decode step."""
    config_class, model_class = VISION_LANGUAGE[family]
    torch.manual_seed(0)
    model = model_class(config_class(text_config=FAMILIES[family][1], vision_config=VISION)).float().eval()
    randomize_(model)
    model.save_pretrained(str(tmp_path))
    runner = make_runner(str(tmp_path), max_running_requests=4)
    assert runner.model_config.architecture == model_class.__name__ and runner.model_config.hidden_size == 64
    rows = runner.req_to_token_pool.alloc(2)
    drv = KVDriver(runner)
    prefill = drv.extend(rows, [0, 0], [LONG, SHORT]).all_logits
    decode = drv.decode(rows, [100, 30], [7, 9]).next_token_logits
    with torch.no_grad():
        la = model(torch.tensor([LONG + [7]])).logits[0]
        lb = model(torch.tensor([SHORT + [9]])).logits[0]
    assert (prefill - torch.cat([la[:100], lb[:30]])).abs().max() <= TOL
    assert (decode - torch.stack([la[100], lb[30]])).abs().max() <= TOL


def test_a_moe_vision_language_checkpoint_serves_images(tmp_path):
    """Qwen3.5-MoE with images (the dense one runs every test of test_qwen_vl.py): one image, two
    images, and a text-only request in one batch, greedy tokens and logprobs equal to transformers'."""
    path = make_vl_model_dir(str(tmp_path), family="qwen3_5_moe")
    model = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    ref = (model, transformers.AutoTokenizer.from_pretrained(path), transformers.AutoImageProcessor.from_pretrained(path))
    prompts = [f"look {IMAGE_PLACEHOLDER} and say", "only text here", f"{IMAGE_PLACEHOLDER} and {IMAGE_PLACEHOLDER} two"]
    images = [[random_image(1)], [], [random_image(2, (20, 44)), random_image(3, (48, 48))]]
    e = Engine(model_path=path, dtype="float32", device="cpu", max_total_tokens=4096)
    try:
        assert type(e.scheduler.tp_worker.model_runner.model).__name__ == "Qwen3_5MoeForConditionalGeneration"
        results = e.generate(prompts, {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
                             image_data=[[data_url(i) for i in im] or None for im in images], return_logprob=True)
    finally:
        e.shutdown()
    for prompt, im, result in zip(prompts, images, results):
        tokens, logprobs = hf_greedy(ref, prompt, im, 5)
        assert result["output_ids"] == tokens
        ours = [lp for lp, _, _ in result["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(ours, logprobs)) < 1e-3
