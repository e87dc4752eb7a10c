"""The Llama family: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm) share this code;
models/qwen2.py and models/qwen3.py only set the flags that differ.

Inside a layer the submodules are called through `.forward(...)`: nn.Module.__call__ costs ~2.5 us
a call (hook bookkeeping, unused here), and a decode step makes ~360 of them, ~1 ms of a ~10 ms
step of a small model on the CPU.

Pipeline parallelism (--pp-size): a stage builds only its decoder layers [start, end) (the
others are PPMissingLayer placeholders, so layer numbers and checkpoint names stay), the
embedding on the first stage, the final norm and the LM head on the last. A stage other than
the first takes the previous stage's hidden states and residual from forward_batch.pp_proxy_tensors;
a stage other than the last returns them (a PPProxyTensors) instead of logits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional, Tuple, Union

import torch
from torch import nn

from radixserve.distributed.parallel_state import get_pp_group, get_tp_group, stage_layers
from radixserve.layers.activation import SiluAndMul
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from radixserve.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from radixserve.layers.radix_attention import RadixAttention
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding, embed_with_input_embeds
from radixserve.models.model_config import ModelConfig
from radixserve.models.weight_utils import NamedWeight, call_weight_loader, load_named_weights


@dataclass
class PPProxyTensors:
    """What one pipeline stage hands the next (SGLang's name): the residual stream, split as
    the decoder layers carry it (the last layer's output and the running residual)."""

    hidden_states: torch.Tensor
    residual: Optional[torch.Tensor]


class PPMissingLayer(nn.Module):
    """A placeholder for what another pipeline stage holds (SGLang's name): no parameters."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("PPMissingLayer called: this part of the model lives on another pipeline stage")


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


def make_rope(config: ModelConfig) -> RotaryEmbedding:
    return RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling,
                           config.partial_rotary_factor)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, qkv_bias: bool, qk_norm: bool,
                 rotary_emb: Optional[RotaryEmbedding] = None, sliding_window: Optional[int] = None):
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
        # The model's one table, shared by its layers (its cos/sin are max_position x head_dim floats:
        # 32 MB at 32k positions, 0.9 GB as 28 per-layer copies on Qwen2.5-1.5B).
        self.rotary_emb = rotary_emb if rotary_emb is not None else make_rope(config)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = RadixAttention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id,
                                   sliding_window_size=sliding_window)
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
    def __init__(self, config: ModelConfig, layer_id: int, qkv_bias: bool, qk_norm: bool,
                 rotary_emb: Optional[RotaryEmbedding] = None, sliding_window: Optional[int] = None,
                 mlp: Optional[nn.Module] = None):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, qkv_bias, qk_norm, rotary_emb, sliding_window)
        # a dense MLP, or the model's own (a mixture of experts: models/qwen3_moe.py)
        self.mlp = mlp if mlp is not None else LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
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
    def __init__(self, config: ModelConfig, qkv_bias: bool, qk_norm: bool,
                 make_mlp: Optional[Callable[[ModelConfig, int], Optional[nn.Module]]] = None):
        super().__init__()
        pp = get_pp_group()
        self.is_first_stage, self.is_last_stage = pp.is_first_rank, pp.is_last_rank
        self.start_layer, self.end_layer = stage_layers(config.num_hidden_layers)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size)
                             if self.is_first_stage else PPMissingLayer())
        # A stage's KV pool holds its layers only: attention layer i reads the pool's layer i - start.
        rope = make_rope(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i - self.start_layer, qkv_bias, qk_norm, rope, config.layer_sliding_window(i),
                              make_mlp(config, i) if make_mlp is not None else None)
            if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last_stage else PPMissingLayer()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch) -> Union[torch.Tensor, PPProxyTensors]:
        proxy = getattr(forward_batch, "pp_proxy_tensors", None)
        if self.is_first_stage:
            hidden_states, residual = embed_with_input_embeds(self.embed_tokens, input_ids, forward_batch), None
        else:
            hidden_states, residual = proxy.hidden_states, proxy.residual
        for i in range(self.start_layer, self.end_layer):
            hidden_states, residual = self.layers[i].forward(positions, hidden_states, residual, forward_batch)
        if not self.is_last_stage:
            return PPProxyTensors(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    supports_input_embeds = True  # LlamaModel.forward takes a request's input_embeds (SGLang's field)
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
        self.model = LlamaModel(config, self.qkv_bias or config.attention_bias, self.qk_norm, self.make_mlp)
        if not self.model.is_last_stage:
            self.lm_head = PPMissingLayer()
        elif config.tie_word_embeddings and self.model.is_first_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            self.lm_head.weight = self.model.embed_tokens.weight
        else:  # untied, or tied with the embedding on another stage: a copy of it loaded here
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def make_mlp(self, config: ModelConfig, layer_id: int) -> Optional[nn.Module]:
        """Decoder layer layer_id's MLP; None: the dense LlamaMLP."""
        return None

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch, get_embedding: bool = False
    ) -> Union[LogitsProcessorOutput, torch.Tensor]:
        hidden_states = self.model(input_ids, positions, forward_batch)
        if isinstance(hidden_states, PPProxyTensors):  # not the last pipeline stage
            return hidden_states
        if get_embedding:  # --is-embedding: the final hidden states, for the ModelRunner's Pooler
            return hidden_states
        return self.logits_processor(hidden_states, self.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[NamedWeight], require_all: bool = True,
                     not_required: Tuple[str, ...] = ()) -> None:
        """weights: (checkpoint tensor name, tensor, file it came from). Raises LoadError.
        require_all=False: a weight update of some of the tensors. not_required: parameters a
        subclass loads itself (prefixes)."""
        weights = self.stage_weights(weights)
        if self.model.is_first_stage or not self.config.tie_word_embeddings:
            return load_named_weights(self, weights, self.stacked_params_mapping, require_all, not_required)
        # PP, tied embeddings, a later stage: the embedding's tensor is this stage's LM head.
        load_named_weights(self, self._tied_head_into_lm_head(weights), self.stacked_params_mapping,
                           require_all, not_required=("lm_head.", *not_required))

    def stage_weights(self, weights: Iterable[NamedWeight]) -> Iterator[NamedWeight]:
        """The checkpoint's tensors this pipeline stage holds, named as a *ForCausalLM checkpoint names them."""
        num_layers, tied = self.config.num_hidden_layers, self.config.tie_word_embeddings
        return (w for w in map(_with_model_prefix, weights) if is_stage_weight(w[0], num_layers, tied))

    def _tied_head_into_lm_head(self, weights: Iterator[NamedWeight]) -> Iterator[NamedWeight]:
        for name, tensor, fn in weights:
            if name == "model.embed_tokens.weight":
                call_weight_loader(self.lm_head, self.lm_head.weight, tensor)
            else:
                yield name, tensor, fn


class MistralForCausalLM(LlamaForCausalLM):
    pass


def is_stage_weight(name: str, num_layers: int, tied: bool = False) -> bool:
    """Whether checkpoint tensor `name` belongs to this process's pipeline stage (all do
    without PP); the loaders skip the others before reading or dequantizing them."""
    pp = get_pp_group()
    if pp.size == 1:
        return True
    if not name.startswith(("model.", "lm_head.")):
        name = f"model.{name}"  # a bare-model checkpoint (see _with_model_prefix)
    if name.startswith("model.layers."):
        start, end = stage_layers(num_layers)
        return start <= int(name.split(".")[2]) < end
    if name.startswith("model.embed_tokens."):
        return pp.is_first_rank or (tied and pp.is_last_rank)  # the last stage's tied LM head reads it too
    if name.startswith(("model.norm.", "lm_head.")):
        return pp.is_last_rank
    return True


def _with_model_prefix(weight: NamedWeight) -> NamedWeight:
    """A checkpoint saved from the bare model (AutoModel: Qwen3-Embedding is one) names its
    tensors without the "model." prefix of the *ForCausalLM checkpoints."""
    name, tensor, fn = weight
    bare = name.startswith(("embed_tokens.", "layers.", "norm."))
    return (f"model.{name}", tensor, fn) if bare else weight
