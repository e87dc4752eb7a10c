"""The multi-token-prediction (MTP) layer of Qwen3-Next and Qwen3.5 (SGLang's Qwen3NextForCausalLMMTP):
the draft of --speculative-algorithm NEXTN (EAGLE's worker, speculative/eagle_worker.py), loaded
from the target's own checkpoint (its mtp.* tensors, which transformers drops on load).

Draft position p takes the target's final (normed) hidden state h_p and the NEXT token x_{p+1}:

    x = fc([pre_fc_norm_embedding(embed(x_{p+1})) ; pre_fc_norm_hidden(h_p)])    fc: 2H -> H, no bias
    g = norm(layers(x))               the target's decoder layer, full attention (KV in its own pool)
    logits = lm_head(g)               predicts x_{p+2}; g is the feature of the next draft step

embed_tokens and lm_head are the target's (set_embed_and_head). The config is the target's with
mtp_num_hidden_layers full-attention layers (mtp_config); its layers' MLPs are the target
family's (experts for Qwen3-Next and Qwen3.5-MoE, dense for Qwen3.5)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Iterable, Type

import torch
from torch import nn

from radixserve.layers.layernorm import GemmaRMSNorm
from radixserve.layers.linear import LinearBase
from radixserve.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from radixserve.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from radixserve.models.llama import make_rope
from radixserve.models.model_config import LoadError, ModelConfig
from radixserve.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from radixserve.models.qwen3_moe import check_experts_loaded, load_expert_weights
from radixserve.models.qwen3_next import FULL, Qwen3NextDecoderLayer, Qwen3NextForCausalLM
from radixserve.models.weight_utils import NamedWeight, load_named_weights


class Qwen3NextForCausalLMMTP(nn.Module):
    target_class: Type[Qwen3NextForCausalLM] = Qwen3NextForCausalLM  # whose MLPs the MTP layers have
    stacked_params_mapping = Qwen3NextForCausalLM.stacked_params_mapping

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        h, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h)  # replaced by the target's
        self.fc = LinearBase(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = GemmaRMSNorm(h, eps)
        self.pre_fc_norm_hidden = GemmaRMSNorm(h, eps)
        rope = make_rope(config)
        make_mlp: Callable[[ModelConfig, int], nn.Module] = lambda c, i: self.target_class.make_mlp(self, c, i)  # noqa: E731
        self.layers = nn.ModuleList(Qwen3NextDecoderLayer(config, FULL, i, rope, make_mlp(config, i))
                                    for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(h, eps)
        self.lm_head = ParallelLMHead(config.vocab_size, h)  # replaced by the target's
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def set_embed_and_head(self, embed: nn.Module, head: nn.Module) -> None:
        """The target's embedding and LM head modules (shared, not copied)."""
        self.embed_tokens = embed
        self.lm_head = head

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch) -> LogitsProcessorOutput:
        embeds = self.pre_fc_norm_embedding.forward(self.embed_tokens(input_ids))
        hidden = self.pre_fc_norm_hidden.forward(forward_batch.spec_hidden_states.to(embeds.dtype))
        x, residual = self.fc.forward(torch.cat([embeds, hidden], dim=-1)), None
        for layer in self.layers:
            x, residual = layer.forward(positions, x, residual, forward_batch, None)  # full attention: no states
        g, _ = self.norm.forward(x, residual)
        out = self.logits_processor(g, self.lm_head, forward_batch)
        out.hidden_states = g  # the next draft step's feature
        return out

    def load_weights(self, weights: Iterable[NamedWeight], require_all: bool = True) -> None:
        """The checkpoint's mtp.* tensors, named without the prefix; the rest is the target's."""
        mtp = ((name[len("mtp."):], tensor, fn) for name, tensor, fn in weights if name.startswith("mtp."))
        expert_params = tuple(name for name, _ in self.named_parameters() if name.endswith((".w13_weight", ".w2_weight")))
        loaded: set = set()
        load_named_weights(self, load_expert_weights(self, mtp, loaded), self.stacked_params_mapping, require_all,
                           not_required=("embed_tokens.", "lm_head.") + expert_params)
        if require_all:
            check_experts_loaded(self, loaded)


class Qwen3_5ForCausalLMMTP(Qwen3NextForCausalLMMTP):
    target_class = Qwen3_5ForCausalLM


class Qwen3_5MoeForCausalLMMTP(Qwen3NextForCausalLMMTP):
    target_class = Qwen3_5MoeForCausalLM


# The target's architecture -> its MTP draft's (SGLang maps them the same way for a draft model).
MTP_ARCHITECTURES: Dict[str, str] = {
    "Qwen3NextForCausalLM": "Qwen3NextForCausalLMMTP",
    "Qwen3_5ForCausalLM": "Qwen3_5ForCausalLMMTP",
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLMMTP",
    "Qwen3_5MoeForCausalLM": "Qwen3_5MoeForCausalLMMTP",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLMMTP",
}


def num_mtp_layers(hf_config: dict) -> int:
    """The checkpoint's MTP layers (Qwen3-Next's and Qwen3.5's config.json: mtp_num_hidden_layers)."""
    return int(hf_config.get("mtp_num_hidden_layers") or hf_config.get("num_nextn_predict_layers") or 0)


def mtp_config(target: ModelConfig) -> ModelConfig:
    """The draft's config: the target's, with its MTP layers (all full attention) as the layers.
    LoadError (one line) for a model without MTP layers."""
    where = target.model_path or target.architecture
    if target.architecture not in MTP_ARCHITECTURES:
        raise LoadError(f"{where}: {target.architecture} has no multi-token-prediction layers; --speculative-algorithm "
                        f"NEXTN takes one of {', '.join(MTP_ARCHITECTURES)}")
    n = num_mtp_layers(target.hf_config)
    if n < 1:
        raise LoadError(f"{where}: config.json has no mtp_num_hidden_layers (the checkpoint holds no MTP layer for "
                        "--speculative-algorithm NEXTN)")
    arch = MTP_ARCHITECTURES[target.architecture]
    hf = {**target.hf_config, "architectures": [arch], "num_hidden_layers": n, "layer_types": [FULL] * n}
    return dataclasses.replace(target, architecture=arch, num_hidden_layers=n, sliding_window=None, window_layers=[],
                               hf_config=hf)
