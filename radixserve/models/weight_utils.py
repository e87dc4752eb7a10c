"""Copying checkpoint tensors into a model: what each model's load_weights calls.

It lives beside the models (below model_executor, see the layering contract in
pyproject.toml); model_executor/model_loader.py finds the files and hands the tensors over."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Tuple

import torch
from torch import nn

from radixserve.layers.linear import WeightShapeError, default_weight_loader
from radixserve.models.model_config import LoadError

NamedWeight = Tuple[str, torch.Tensor, str]  # (checkpoint name, tensor, file)


def load_named_weights(model: nn.Module, weights: Iterable[NamedWeight], stacked_params_mapping,
                       require_all: bool = True, not_required: Tuple[str, ...] = ()) -> None:
    """Copy checkpoint tensors into the model, through each layer's TP-aware weight_loader.
    q/k/v and gate/up checkpoint tensors go into the fused parameters (stacked_params_mapping).
    require_all=False: a weight update of some tensors (the others keep their values).
    not_required: prefixes of parameters filled elsewhere (an EAGLE head's shared embedding)."""
    params: Dict[str, nn.Parameter] = dict(model.named_parameters())
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded = set()
    for name, tensor, fn in weights:
        if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
            continue
        target, shard_id = param_name_for(name, stacked_params_mapping)
        param = params.get(target)
        if param is None:
            raise LoadError(f"{fn}: unexpected tensor {name!r} for {type(model).__name__}")
        owner = model.get_submodule(target.rsplit(".", 1)[0])
        try:
            call_weight_loader(owner, param, tensor, shard_id)
        except (WeightShapeError, ValueError, RuntimeError) as e:
            raise LoadError(f"{fn}: tensor {name!r}: {e}") from None
        loaded.add((target, shard_id))
    missing = [key for key in _expected_loads(params, stacked_params_mapping)
               if key not in loaded and not key[0].startswith(not_required)]
    if missing and require_all:
        where = model.config.model_path or "checkpoint"
        name, shard = missing[0]
        what = name if shard is None else f"{name} (shard {shard})"
        raise LoadError(f"{where}: no tensor for parameter {what!r} ({len(missing)} missing)")


def param_name_for(name: str, stacked_params_mapping) -> Tuple[str, object]:
    """(the model's parameter, shard id) a checkpoint tensor is loaded into: q_proj -> (qkv_proj, "q")."""
    for param_name, weight_name, sid in stacked_params_mapping:
        if weight_name in name:
            return name.replace(weight_name, param_name), sid
    return name, None


def _expected_loads(params: Dict[str, nn.Parameter], mapping) -> List[Tuple[str, object]]:
    """(parameter, shard id) pairs a complete checkpoint fills; fused ones need every shard."""
    out = []
    for name in params:
        shards = [sid for fused, _, sid in mapping if f"{fused}." in name]
        out += [(name, sid) for sid in shards] if shards else [(name, None)]
    return out


def call_weight_loader(owner: Any, param: torch.Tensor, tensor: torch.Tensor, shard_id: Any = None) -> None:
    """Copy a checkpoint tensor into `param` the way its layer loads it (its TP slice, its
    shard of a merged projection), or whole where the layer has no weight_loader."""
    loader = getattr(owner, "weight_loader", None)
    if loader is None:
        default_weight_loader(param, tensor)
    elif shard_id is None:
        loader(param, tensor)
    else:
        loader(param, tensor, shard_id)
