"""The Llama family: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm) share this code;
models/qwen2.py and models/qwen3.py only set the flags that differ.

Inside a layer the submodules are called through `.forward(...)`: nn.Module.__call__ costs ~2.5 us
a call (hook bookkeeping, unused here), and a decode step makes ~360 of them, ~1 ms of a ~10 ms
step of a small model on the CPU."""

from __future__ import annotations

from typing import Iterable, Optional, Tuple, Union

import torch
from torch import nn

from radixserve.distributed.parallel_state import get_tp_group
from radixserve.layers.activation import SiluAndMul
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from radixserve.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from radixserve.layers.radix_attention import RadixAttention
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from radixserve.models.model_config import ModelConfig
from radixserve.models.weight_utils import NamedWeight, load_named_weights


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu"):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r} (only silu)")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.act_fn.forward(self.gate_up_proj.forward(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        tp_size = get_tp_group().size
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads, bias=qkv_bias
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.o_bias
        )
        self.rotary_emb = RotaryEmbedding(
            self.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            config.partial_rotary_factor,
        )
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = RadixAttention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id)
        assert tp_size == 1 or config.num_attention_heads % tp_size == 0

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch) -> torch.Tensor:
        qkv = self.qkv_proj.forward(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        q, k = self.rotary_emb.forward(positions, q, k)
        out = self.attn.forward(q, k, v, forward_batch)
        return self.o_proj.forward(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, qkv_bias, qk_norm)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: Optional[torch.Tensor], forward_batch
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm.forward(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm.forward(hidden_states, residual)
        hidden_states = self.self_attn.forward(positions, hidden_states, forward_batch)
        hidden_states, residual = self.post_attention_layernorm.forward(hidden_states, residual)
        return self.mlp.forward(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, qkv_bias, qk_norm) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer.forward(positions, hidden_states, residual, forward_batch)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False
    # checkpoint name -> (our fused parameter, shard id)
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.qkv_bias or config.attention_bias, self.qk_norm)
        if config.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch, get_embedding: bool = False
    ) -> Union[LogitsProcessorOutput, torch.Tensor]:
        hidden_states = self.model(input_ids, positions, forward_batch)
        if get_embedding:  # --is-embedding: the final hidden states, for the ModelRunner's Pooler
            return hidden_states
        return self.logits_processor(hidden_states, self.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[NamedWeight], require_all: bool = True) -> None:
        """weights: (checkpoint tensor name, tensor, file it came from). Raises LoadError.
        require_all=False: a weight update of some of the tensors."""
        load_named_weights(self, (_with_model_prefix(w) for w in weights), self.stacked_params_mapping, require_all)


class MistralForCausalLM(LlamaForCausalLM):
    pass


def _with_model_prefix(weight: NamedWeight) -> NamedWeight:
    """A checkpoint saved from the bare model (AutoModel: Qwen3-Embedding is one) names its
    tensors without the "model." prefix of the *ForCausalLM checkpoints."""
    name, tensor, fn = weight
    bare = name.startswith(("embed_tokens.", "layers.", "norm."))
    return (f"model.{name}", tensor, fn) if bare else weight
