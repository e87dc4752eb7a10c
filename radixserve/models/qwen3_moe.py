"""Qwen3-MoE: Qwen3 (q/k RMSNorm) whose decoder layers' MLP is a mixture of experts (layers/moe.py),
except the config's mlp_only_layers and, with decoder_sparse_step > 1, the layers between sparse
ones, which keep a dense MLP of intermediate_size.

Checkpoints name each expert's projections apart (mlp.experts.{e}.gate_proj / up_proj /
down_proj); the loader puts them into the stacked w13 / w2 parameters, and mlp.gate is the router."""

from __future__ import annotations

import re
from typing import Iterable, Iterator, Optional

from torch import nn

from radixserve.layers.moe import FusedMoE, SparseMoeBlock
from radixserve.models.llama import LlamaForCausalLM
from radixserve.models.model_config import LoadError, ModelConfig
from radixserve.models.weight_utils import NamedWeight, call_weight_loader

EXPERT_WEIGHT = re.compile(r"^((?:model\.)?layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")  # (an MTP draft's: layers.)
SHARD_OF = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def num_experts(cfg: dict) -> int:
    """The hub's configs say num_experts; transformers 5 saves it as num_local_experts."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def is_sparse_layer(cfg: dict, layer_id: int) -> bool:
    """transformers' rule for which decoder layers are mixtures of experts."""
    step = cfg.get("decoder_sparse_step", 1)
    return layer_id not in (cfg.get("mlp_only_layers") or []) and num_experts(cfg) > 0 and (layer_id + 1) % step == 0


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    qk_norm = True

    def make_mlp(self, config: ModelConfig, layer_id: int) -> Optional[nn.Module]:
        cfg = config.hf_config
        if not is_sparse_layer(cfg, layer_id):
            return None
        if config.hidden_act != "silu":
            raise LoadError(f"{config.model_path}: unsupported hidden_act {config.hidden_act!r} for the experts (only silu)")
        return SparseMoeBlock(config.hidden_size, num_experts(cfg), cfg["num_experts_per_tok"],
                              cfg["moe_intermediate_size"], bool(cfg.get("norm_topk_prob", False)))

    def load_weights(self, weights: Iterable[NamedWeight], require_all: bool = True) -> None:
        expert_params = {name: p for name, p in self.named_parameters() if name.endswith((".w13_weight", ".w2_weight"))}
        loaded = set()
        super().load_weights(load_expert_weights(self, self.stage_weights(weights), loaded), require_all,
                             not_required=tuple(expert_params))
        if require_all:
            check_experts_loaded(self, loaded)


def check_experts_loaded(model: nn.Module, loaded: set) -> None:
    """Raise LoadError naming the first expert projection load_expert_weights did not see."""
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            for e in range(module.num_experts):
                for shard in ("w1", "w3", "w2"):
                    if (name, e, shard) not in loaded:
                        raise LoadError(f"{model.config.model_path}: no tensor for expert {e} ({shard}) of {name}")


def load_expert_weights(model: nn.Module, weights: Iterable[NamedWeight], loaded: set) -> Iterator[NamedWeight]:
    """Load the experts' tensors into their stacked parameters (noting (module, expert, shard) in
    `loaded`); pass the others on."""
    for name, tensor, fn in weights:
        if name.endswith((".w13_weight", ".w2_weight")):
            raise LoadError(f"{fn}: tensor {name!r}: the experts are loaded from each expert's gate_proj / up_proj / "
                            f"down_proj tensors (mlp.experts.<e>.<proj>.weight), not the stacked parameters")
        m = EXPERT_WEIGHT.match(name)
        if m is None:
            yield name, tensor, fn
            continue
        prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
        shard = SHARD_OF[proj]
        try:
            module = model.get_submodule(prefix)
        except AttributeError:
            module = None
        if not isinstance(module, FusedMoE) or not 0 <= expert < module.num_experts:
            raise LoadError(f"{fn}: unexpected tensor {name!r} for {type(model).__name__} (no such expert)")
        param = module.w2_weight if shard == "w2" else module.w13_weight
        try:
            call_weight_loader(module, param, tensor, (expert, shard))
        except (ValueError, IndexError, RuntimeError, TypeError) as e:
            raise LoadError(f"{fn}: tensor {name!r}: {e}") from None
        loaded.add((prefix, expert, shard))
