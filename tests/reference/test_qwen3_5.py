"""Qwen3.5 text models (dense and MoE) against transformers, float32: the Qwen3-Next tests
that compare logits and greedy tokens (test_qwen3_next.py), imported here and so run again with
this module's `next_dir` fixture (pytest resolves a test's fixtures in the module that collects
it): a ragged prefill and decode steps, a chunked prefill that splits a linear-attention
sequence, and the Engine's greedy tokens and logprobs."""

from __future__ import annotations

import pytest
import transformers

from test_qwen3_next import (  # noqa: F401  (collected here with this module's next_dir)
    CONFIG,
    hf,
    make_next_dir,
    test_chunked_prefill_continues_from_the_saved_state,
    test_ragged_prefill_and_decode_match_transformers,
    test_the_engine_greedy_matches_transformers,
)

from hf_utils import make_runner

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
