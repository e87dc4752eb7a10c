"""Qwen3.5 text models (transformers' Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM): Qwen3-Next's
hybrid of GatedDeltaNet and gated full attention (models/qwen3_next.py), with

  - the linear layers' projections apart and in order (in_proj_qkv, in_proj_z, in_proj_b,
    in_proj_a: Qwen3_5GatedDeltaNet) instead of Qwen3-Next's per-key-head interleaving;
  - Qwen3.5: a dense MLP in every layer; Qwen3.5-MoE: experts in every layer (always
    renormalized over the top k) with the sigmoid-gated shared expert;
  - multimodal rotary (mrope_section): for text the three position axes are the token's
    position, which makes it the ordinary (partial) rotary embedding.

The vision-language checkpoints (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration:
the released Qwen3.5 models) are served with their vision encoder: models/qwen3_5_vl.py."""

from __future__ import annotations

from torch import nn

from radixserve.layers.gated_delta_net import Qwen3_5GatedDeltaNet
from radixserve.models.llama import LlamaMLP
from radixserve.models.model_config import ModelConfig
from radixserve.models.qwen3_next import Qwen3NextForCausalLM, sparse_moe_block


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    gdn_class = Qwen3_5GatedDeltaNet

    def make_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act)


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    gdn_class = Qwen3_5GatedDeltaNet

    def make_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        return sparse_moe_block(config, renormalize=True)
