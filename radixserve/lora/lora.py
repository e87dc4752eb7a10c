"""LoRAAdapter: one PEFT adapter's A and B matrices, read from adapter_model.safetensors and kept
in host memory (the pool copies them into a slot when a batch needs the adapter)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch

from radixserve.lora.lora_config import WEIGHTS_FILE, LoRAConfig, LoRAError

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT; ".default" in some saves)
_PEFT_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")

# (layer, PEFT module name) -> tensor
LoRAWeights = Dict[Tuple[int, str], torch.Tensor]


@dataclass(frozen=True)
class LoRAShard:
    """This tensor-parallel rank's slice of one module's A [r, in] and B [out, r], cut where the
    base layer cuts its weight (SGLang's slice_lora_a_weights / slice_lora_b_weights):
      column-parallel (q/k/v, gate/up; output rows split): A whole, B's rows of this rank's outputs;
      row-parallel (o, down; input columns split): A's columns of this rank's inputs, B whole, so
      the rank's delta is a partial sum that the layer's all-reduce completes with its own.
    At tp 1 both ranges are the whole matrix."""

    in_start: int
    in_size: int
    out_start: int
    out_size: int

    def cut(self, a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        a = a[:, self.in_start:self.in_start + self.in_size]
        b = b[self.out_start:self.out_start + self.out_size]
        return a.contiguous(), b.contiguous()


@dataclass
class LoRAAdapter:
    name: str
    config: LoRAConfig
    # (layer, module) -> (A [r, in], B [out, r]), float32 on the CPU; this TP rank's slice of them
    weights: Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def scaling(self) -> float:
        return self.config.scaling

    @classmethod
    def load(cls, name: str, config: LoRAConfig, module_dims: Dict[str, Tuple[int, int]], num_layers: int,
             shards: Optional[Dict[str, LoRAShard]] = None) -> "LoRAAdapter":
        """module_dims: PEFT module name -> (in_features, out_features) of the model's (whole,
        unsharded) projection, which the file must match; shards: what this TP rank keeps of each
        module (None: all of it)."""
        fn = os.path.join(config.path, WEIGHTS_FILE)
        if not os.path.isfile(fn):
            raise LoRAError(f"{fn}: no such file (the adapter's weights)")
        from safetensors.torch import load_file

        try:
            tensors = load_file(fn, device="cpu")
        except Exception as e:  # a truncated or foreign file
            raise LoRAError(f"{fn}: cannot read ({type(e).__name__}: {e})") from None
        a_mats: LoRAWeights = {}
        b_mats: LoRAWeights = {}
        for tname, t in tensors.items():
            m = _PEFT_NAME.search(tname)
            if m is None:
                continue  # e.g. a saved lm_head / embedding delta: not supported, ignored
            layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
            if module not in module_dims:
                raise LoRAError(f"{fn}: {tname}: target module {module!r} is not in the model")
            if module not in config.target_modules:
                raise LoRAError(f"{fn}: {tname}: module {module!r} is not in target_modules of adapter_config.json")
            if layer >= num_layers:
                raise LoRAError(f"{fn}: {tname}: layer {layer} but the model has {num_layers} layers")
            (a_mats if ab == "A" else b_mats)[(layer, module)] = t.to(torch.float32)
        adapter = cls(name, config)
        r = config.r
        for key in sorted(set(a_mats) | set(b_mats)):
            layer, module = key
            where = f"{fn}: layers.{layer}.{module}"
            if key not in a_mats or key not in b_mats:
                raise LoRAError(f"{where}: has lora_{'A' if key not in a_mats else 'B'} missing")
            a, b = a_mats[key], b_mats[key]
            in_f, out_f = module_dims[module]
            if tuple(a.shape) != (r, in_f) or tuple(b.shape) != (out_f, r):
                raise LoRAError(f"{where}: shapes do not match: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}; "
                                f"expected ({r}, {in_f}) and ({out_f}, {r}) for r={r}")
            adapter.weights[key] = shards[module].cut(a, b) if shards is not None else (a.contiguous(), b.contiguous())
        if not adapter.weights:
            raise LoRAError(f"{fn}: no LoRA tensors (expected PEFT names like "
                            f"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight)")
        return adapter
