"""Gemma 3 (text): Gemma3ForCausalLM, as transformers' modeling_gemma3.py computes it:

  - every RMSNorm is zero-centered (scale 1 + weight): the input, post-attention, pre- and
    post-feed-forward norms of each layer, the q/k norms of each head, and the final norm;
  - the embedding is scaled by sqrt(hidden_size), that scale rounded to the table's dtype;
  - the MLP is GeGLU (gelu, tanh approximation, on the gate);
  - attention scores are scaled by query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5);
  - layer_types (older configs: every sliding_window_pattern-th layer is global) says which
    layers are local (sliding window, RoPE base rope_local_base_freq, no scaling) and which
    global (full attention, rope_theta and rope_scaling).

The windowed layers use RadixAttention.sliding_window_size (ModelConfig.window_layers).
Refused at start, one line each: attention or final logit soft-capping (Gemma 2's; Gemma 3 has
none), --pp-size > 1."""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple

import torch
from torch import nn

from radixserve.distributed.parallel_state import get_pp_group
from radixserve.layers.activation import GeluAndMul
from radixserve.layers.layernorm import GemmaRMSNorm
from radixserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from radixserve.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from radixserve.layers.radix_attention import RadixAttention
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from radixserve.models.llama import LlamaForCausalLM
from radixserve.models.model_config import LoadError, ModelConfig
from radixserve.models.weight_utils import NamedWeight, load_named_weights

GELU_APPROXIMATION = {"gelu_pytorch_tanh": "tanh", "gelu_tanh": "tanh", "gelu": "none"}


def hidden_activation(cfg: Dict[str, Any]) -> str:
    """transformers' Gemma 3 reads hidden_activation (older Gemma configs said hidden_act)."""
    return cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"


def local_rope_theta(cfg: Dict[str, Any]) -> float:
    """The local (sliding) layers' RoPE base: transformers 5 saves it in rope_parameters'
    sliding_attention entry; the Hub's configs say rope_local_base_freq."""
    nested = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
    return float(nested.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))


def check_gemma3_config(config: ModelConfig) -> None:
    """What this implementation does not compute: refused at start with one line."""
    cfg, where = config.hf_config, config.model_path or config.architecture
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise LoadError(f"{where}: {key}={cfg[key]} is not supported (Gemma 3 has none)")
    if hidden_activation(cfg) not in GELU_APPROXIMATION:
        raise LoadError(f"{where}: unsupported hidden_activation {hidden_activation(cfg)!r} "
                        f"(only {', '.join(GELU_APPROXIMATION)})")
    if cfg.get("use_bidirectional_attention"):
        raise LoadError(f"{where}: use_bidirectional_attention is not supported (a causal language model only)")
    if get_pp_group().size > 1:
        raise LoadError(f"{where}: --pp-size > 1 is not supported for {config.architecture} yet")


class Gemma3MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.act_fn = GeluAndMul(GELU_APPROXIMATION[activation])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.act_fn.forward(self.gate_up_proj.forward(x)))


class Gemma3Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding, sliding_window: Optional[int]):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=config.attention_bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary_emb  # the local or the global table, shared with the layers of its kind
        scaling = float(config.hf_config.get("query_pre_attn_scalar", self.head_dim)) ** -0.5
        self.attn = RadixAttention(self.num_heads, self.head_dim, scaling, self.num_kv_heads, layer_id,
                                   sliding_window_size=sliding_window)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch) -> torch.Tensor:
        q, k, v = self.qkv_proj.forward(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm.forward(q.reshape(-1, self.num_heads, self.head_dim))
        k = self.k_norm.forward(k.reshape(-1, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb.forward(positions, q, k)
        return self.o_proj.forward(self.attn.forward(q, k, v, forward_batch))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer_id, rotary_emb, config.layer_sliding_window(layer_id))
        self.mlp = Gemma3MLP(h, config.intermediate_size, hidden_activation(config.hf_config))
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: Optional[torch.Tensor],
                forward_batch) -> Tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it): the residual add is done by the
        next norm (pre-feed-forward, or the next layer's input norm), as transformers adds it."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm.forward(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm.forward(hidden_states, residual)
        hidden_states = self.post_attention_layernorm.forward(self.self_attn.forward(positions, hidden_states, forward_batch))
        hidden_states, residual = self.pre_feedforward_layernorm.forward(hidden_states, residual)
        return self.post_feedforward_layernorm.forward(self.mlp.forward(hidden_states)), residual


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        # Two tables: the global layers' (rope_theta, rope_scaling), the local layers' (their own base).
        global_rope = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                      config.rope_scaling)
        local_rope = RotaryEmbedding(config.head_dim, config.max_position_embeddings, local_rope_theta(config.hf_config))
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, local_rope if config.layer_sliding_window(i) is not None else global_rope)
            for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        # transformers rounds the scale to the table's dtype first (25.25 in bf16 for hidden 640)
        hidden_states = hidden_states * torch.tensor(self.embed_scale, dtype=self.embed_tokens.weight.dtype,
                                                     device=hidden_states.device).to(hidden_states.dtype)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer.forward(positions, hidden_states, residual, forward_batch)
        hidden_states, _ = self.norm.forward(hidden_states, residual)
        return hidden_states


class Gemma3ForCausalLM(nn.Module):
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping  # the same fused q|k|v and gate|up

    def __init__(self, config: ModelConfig):
        super().__init__()
        check_gemma3_config(config)
        self.config = config
        self.model = Gemma3Model(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:  # Gemma 3's are: the LM head is the (unscaled) embedding table
            self.lm_head.weight = self.model.embed_tokens.weight
        self.logits_processor = LogitsProcessor(config.vocab_size)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch,
                get_embedding: bool = False) -> LogitsProcessorOutput | torch.Tensor:
        hidden_states = self.model(input_ids, positions, forward_batch)
        if get_embedding:  # --is-embedding: the final hidden states, for the ModelRunner's Pooler
            return hidden_states
        return self.logits_processor(hidden_states, self.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[NamedWeight], require_all: bool = True) -> None:
        # the multimodal checkpoints' language model is under language_model.model.*; this is the text one
        load_named_weights(self, weights, self.stacked_params_mapping, require_all)
