"""An EAGLE draft head (EAGLE-1/2's checkpoint layout, SGLang's LlamaForCausalLMEagle): one
Llama decoder layer on top of the target model's hidden states.

Draft position p takes the target's final hidden state h_p and the NEXT token x_{p+1}:

    x = fc([embed(x_{p+1}) ; h_p])       fc: 2H -> H (with bias)
    g = layer_0(x) + residual            layer 0 without its input RMSNorm (EAGLE's choice)
    logits = lm_head(g)                  predicts x_{p+2}

embed_tokens and lm_head are the target's (set_embed_and_head); a checkpoint holds fc.* and
layers.* (with or without the "model." prefix). The feature of a deeper draft step is the draft's
own g of its parent (speculative/eagle_worker.py). forward_batch.spec_hidden_states carries the
features, one per token; the output's hidden_states carries g.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from radixserve.layers.linear import LinearBase
from radixserve.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from radixserve.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from radixserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from radixserve.models.model_config import ModelConfig
from radixserve.models.weight_utils import NamedWeight, load_named_weights


class _Identity(nn.Module):
    """Layer 0's input norm in EAGLE: none (layer 0 is called without a residual)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class EagleModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.fc = LinearBase(2 * config.hidden_size, config.hidden_size, bias=True)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, config.attention_bias, False) for i in range(config.num_hidden_layers)
        )
        self.layers[0].input_layernorm = _Identity()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        x = self.fc.forward(torch.cat([embeds, forward_batch.spec_hidden_states.to(embeds.dtype)], dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer.forward(positions, x, residual, forward_batch)
        return x + residual


class LlamaForCausalLMEagle(nn.Module):
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = EagleModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def set_embed_and_head(self, embed: nn.Module, head: nn.Module) -> None:
        """The target's embedding and LM head modules (shared, not copied)."""
        self.model.embed_tokens = embed
        self.lm_head = head

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch) -> LogitsProcessorOutput:
        g = self.model(input_ids, positions, forward_batch)
        out = self.logits_processor(g, self.lm_head, forward_batch)
        out.hidden_states = g  # the next draft step's features
        return out

    def load_weights(self, weights: Iterable[NamedWeight], require_all: bool = True) -> None:
        """fc and the layers; embed_tokens / lm_head come from the target (skipped if present)."""
        kept = []
        for name, tensor, fn in weights:
            name = name[len("model."):] if name.startswith("model.") else name
            if name.startswith(("embed_tokens.", "lm_head.")):
                continue
            kept.append((f"model.{name}", tensor, fn))
        load_named_weights(self, kept, self.stacked_params_mapping, require_all,
                           not_required=("model.embed_tokens.", "lm_head."))
