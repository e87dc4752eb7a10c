"""Qwen3-Next: a hybrid of GatedDeltaNet linear-attention layers (layers/gated_delta_net.py, their
state in the MambaPool) and full-attention layers (paged KV as every model), each followed by a
mixture of experts with a sigmoid-gated shared expert (or a dense MLP: mlp_only_layers,
decoder_sparse_step), as transformers' modeling_qwen3_next.py:

  - config.layer_types names each layer "linear_attention" or "full_attention" (older configs:
    every full_attention_interval-th layer is full attention);
  - every RMSNorm is zero-centered (scale 1 + weight), the q/k norms of full attention too;
  - full attention: q_proj gives each head's query and an output gate (interleaved per head),
    the output is attn * sigmoid(gate); rotary on the first partial_rotary_factor of head_dim.

The KV pool holds the full-attention layers only (RadixAttention's layer_id counts them); the
MambaPool holds the linear ones (GatedDeltaNet's layer_id counts those). Prefixes are shared
through the hybrid radix cache (mem_cache/mamba_radix_cache.py: hits where a state snapshot is
held); the MTP layers of the checkpoint (mtp.*) are a draft model of their own
(models/qwen3_next_mtp.py, --speculative-algorithm NEXTN), skipped here."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, List, Optional, Tuple, Type

import torch
from torch import nn

from radixserve.layers.gated_delta_net import GatedDeltaNet, LinearAttnMetadata
from radixserve.layers.layernorm import GemmaRMSNorm
from radixserve.layers.linear import QKVParallelLinear, RowParallelLinear
from radixserve.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from radixserve.layers.moe import SparseMoeBlock
from radixserve.layers.radix_attention import RadixAttention
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from radixserve.mem_cache.mamba_pool import MambaStateShape
from radixserve.models.llama import LlamaMLP, make_rope
from radixserve.models.model_config import LoadError, ModelConfig
from radixserve.models.qwen3_moe import check_experts_loaded, is_sparse_layer, load_expert_weights, num_experts
from radixserve.models.weight_utils import NamedWeight, load_named_weights
from radixserve.server_args import ServerArgs

LINEAR, FULL = "linear_attention", "full_attention"


def layer_types(cfg: dict) -> List[str]:
    """Each decoder layer's token mixer, by transformers' rule."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        interval = cfg.get("full_attention_interval", 4)
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
    if len(types) != n or any(t not in (LINEAR, FULL) for t in types):
        raise LoadError(f"layer_types {types!r}: expected {n} entries of {LINEAR!r} / {FULL!r}")
    return list(types)


def check_hybrid_server_args(args: ServerArgs, where: str) -> None:
    """What a hybrid (linear + full attention) model does not run with yet: one line each. Its
    prefix cache is the hybrid radix cache (mem_cache/mamba_radix_cache.py), in both loops."""
    refused = [
        (args.speculative_algorithm not in (None, "EAGLE"), f"--speculative-algorithm {args.speculative_algorithm}",
         "the linear layers' states roll back after a rejected draft in EAGLE / NEXTN's worker only"),
        (args.speculative_algorithm is not None and args.speculative_eagle_topk != 1, "--speculative-eagle-topk > 1",
         "a token tree's branches would each need a state of their own; 1 drafts a chain"),
        (args.disaggregation_mode != "null", "--disaggregation-mode", "the states are not transferred with the KV"),
        (args.enable_hierarchical_cache, "--enable-hierarchical-cache", "the host tier keeps no states"),
        (args.pp_size > 1, "--pp-size > 1", "the state pool is not split by stage"),
        (args.enable_lora or bool(args.lora_paths), "--enable-lora", "no adapters for the linear-attention layers"),
        (args.is_embedding, "--is-embedding", "not an embedding model"),
        (args.load_format == "dummy", "--load-format dummy", "its random weights are named as a Llama checkpoint's"),
    ]
    for on, what, why in refused:
        if on:
            raise LoadError(f"{where}: a hybrid linear-attention model does not run with {what} yet ({why})")


class Qwen3NextAttention(nn.Module):
    """Full attention with an output gate; `layer_id` is its KV-pool layer. q_proj's rows are per
    head [q | gate]: fused with k and v as if q had twice the heads, so a tensor-parallel rank's
    slice holds whole [q | gate] pairs (and KV heads are replicated where the ranks outnumber them)."""

    def __init__(self, config: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.head_dim = d = config.head_dim
        bias = config.attention_bias
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, 2 * config.num_attention_heads,
                                          config.num_key_value_heads, bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads // 2, self.qkv_proj.num_kv_heads  # this rank's
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size, bias)
        self.q_norm = GemmaRMSNorm(d, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(d, config.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = RadixAttention(self.num_heads, d, d**-0.5, self.num_kv_heads, layer_id)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch) -> torch.Tensor:
        T, d = hidden_states.shape[0], self.head_dim
        qg, k, v = self.qkv_proj.forward(hidden_states).split([2 * self.num_heads * d, self.num_kv_heads * d,
                                                               self.num_kv_heads * d], dim=-1)
        q, gate = qg.reshape(T, self.num_heads, 2 * d).split([d, d], dim=-1)
        q = self.q_norm.forward(q.contiguous())
        k = self.k_norm.forward(k.reshape(T, self.num_kv_heads, d))
        v = v.contiguous()
        q, k = self.rotary_emb.forward(positions, q, k)
        out = self.attn.forward(q, k, v, forward_batch)
        return self.o_proj.forward(out * torch.sigmoid(gate.reshape(T, -1)))


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kind: str, mixer_id: int, rope: RotaryEmbedding, mlp: nn.Module,
                 gdn_class: Type[GatedDeltaNet] = GatedDeltaNet):
        super().__init__()
        cfg = config.hf_config
        self.is_linear = kind == LINEAR
        if self.is_linear:
            self.linear_attn = gdn_class(
                config.hidden_size, cfg["linear_num_key_heads"], cfg["linear_num_value_heads"],
                cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg.get("linear_conv_kernel_dim", 4),
                mixer_id, config.rms_norm_eps, config.hidden_act)
        else:
            self.self_attn = Qwen3NextAttention(config, mixer_id, rope)
        self.mlp = mlp
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: Optional[torch.Tensor],
                forward_batch, linear_meta: LinearAttnMetadata) -> Tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm.forward(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm.forward(hidden_states, residual)
        if self.is_linear:
            conv, temporal = forward_batch.req_to_token_pool.mamba_pool.layer_state(self.linear_attn.layer_id)
            hidden_states = self.linear_attn.forward(hidden_states, linear_meta, conv, temporal)
        else:
            hidden_states = self.self_attn.forward(positions, hidden_states, forward_batch)
        hidden_states, residual = self.post_attention_layernorm.forward(hidden_states, residual)
        return self.mlp.forward(hidden_states), residual


def sparse_moe_block(config: ModelConfig, renormalize: bool) -> SparseMoeBlock:
    """The experts of Qwen3-Next's (and Qwen3.5-MoE's) sparse layers, with their shared expert."""
    cfg = config.hf_config
    return SparseMoeBlock(config.hidden_size, num_experts(cfg), cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                          renormalize, int(cfg.get("shared_expert_intermediate_size") or 0))


class Qwen3NextModel(nn.Module):
    def __init__(self, config: ModelConfig, make_mlp: Callable[[ModelConfig, int], nn.Module],
                 gdn_class: Type[GatedDeltaNet]):
        super().__init__()
        self.layer_types = layer_types(config.hf_config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rope = make_rope(config)
        # Layer i's index among the layers of its kind: its KV-pool or its MambaPool layer.
        mixer_ids = [self.layer_types[:i].count(t) for i, t in enumerate(self.layer_types)]
        self.layers = nn.ModuleList(Qwen3NextDecoderLayer(config, t, mixer_ids[i], rope, make_mlp(config, i), gdn_class)
                                    for i, t in enumerate(self.layer_types))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch,
                input_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_embeds: the tokens' embeddings where the caller made them (Qwen3.5's image rows)."""
        # The state slots as the batch was scheduled (in the overlap loop a finished request's row
        # may be freed and handed on before this forward runs); the rows' map for a batch built
        # without the scheduler
        slots = forward_batch.mamba_state_slots
        if slots is None:
            slots = forward_batch.req_to_token_pool.mamba_indices(forward_batch.req_pool_indices)
        # A verify (a chain of drafts: trees are refused at start) reads the states and leaves them,
        # its layers' traces let the accepted tokens advance them (speculative/linear_state.py).
        traces = forward_batch.linear_traces if forward_batch.forward_mode.is_target_verify() else None
        if forward_batch.forward_mode.is_target_verify() and traces is None:
            raise RuntimeError("a hybrid model's verify forward needs linear_traces (its states advance by them)")
        meta = LinearAttnMetadata.build(slots, forward_batch.forward_mode.is_decode(), forward_batch.extend_seq_lens_cpu,
                                        forward_batch.extend_prefix_lens_cpu, traces)
        hidden_states = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer.forward(positions, hidden_states, residual, forward_batch, meta)
        hidden_states, _ = self.norm.forward(hidden_states, residual)
        return hidden_states


class Qwen3NextForCausalLM(nn.Module):
    gdn_class: Type[GatedDeltaNet] = GatedDeltaNet  # the linear layers' projections (Qwen3.5 has its own)
    loaded_elsewhere: Tuple[str, ...] = ()  # parameter prefixes a subclass loads itself (Qwen3.5's visual.)
    # checkpoint name -> (our fused parameter, shard id): the dense MLPs' and the shared experts'
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
        self.model = Qwen3NextModel(config, self.make_mlp, self.gdn_class)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def make_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        """Decoder layer layer_id's MLP: experts, or dense in mlp_only_layers (decoder_sparse_step)."""
        if not is_sparse_layer(config.hf_config, layer_id):
            return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        return sparse_moe_block(config, bool(config.hf_config.get("norm_topk_prob", True)))

    def mamba_state_shape(self) -> MambaStateShape:
        """One request's state in the linear layers (the MambaPool's slot)."""
        linear = [layer.linear_attn for layer in self.model.layers if layer.is_linear]
        gdn = linear[0]
        return MambaStateShape(num_layers=len(linear), conv_dim=gdn.conv_dim, conv_kernel=gdn.conv1d.kernel_size[0],
                               num_heads=gdn.num_v_heads, head_k_dim=gdn.head_k_dim, head_v_dim=gdn.head_v_dim)

    def num_kv_layers(self) -> int:
        """Layers whose KV the pool holds: the full-attention ones."""
        return self.model.layer_types.count(FULL)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch,
                get_embedding: bool = False) -> LogitsProcessorOutput:
        hidden_states = self.model(input_ids, positions, forward_batch)
        return self.logits_processor(hidden_states, self.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[NamedWeight], require_all: bool = True) -> None:
        expert_params = tuple(name for name, _ in self.named_parameters() if name.endswith((".w13_weight", ".w2_weight")))
        loaded: set = set()
        load_named_weights(self, load_expert_weights(self, self._without_mtp(weights), loaded),
                           self.stacked_params_mapping, require_all, not_required=expert_params + self.loaded_elsewhere)
        if require_all:
            check_experts_loaded(self, loaded)

    @staticmethod
    def _without_mtp(weights: Iterable[NamedWeight]) -> Iterator[NamedWeight]:
        """The checkpoint's multi-token-prediction head (mtp.*) is a draft model: not loaded."""
        return (w for w in weights if not w[0].startswith("mtp."))
