"""LoRAConfig: what a PEFT adapter directory's adapter_config.json says (rank, alpha, targets)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

# PEFT's module names of a Llama-family decoder layer -> (our fused module, part index in it).
LORA_TARGET_PARTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
ALL_TARGET_MODULES: Tuple[str, ...] = tuple(LORA_TARGET_PARTS)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class LoRAError(ValueError):
    """A bad adapter: one line naming the file (or the adapter) and what is wrong."""


@dataclass
class LoRAConfig:
    path: str
    r: int
    lora_alpha: float
    target_modules: List[str]
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        # PEFT: alpha / r, or alpha / sqrt(r) with use_rslora
        return self.lora_alpha / (self.r**0.5 if self.use_rslora else self.r)

    @classmethod
    def from_dir(cls, path: str, max_lora_rank: Optional[int] = None) -> "LoRAConfig":
        fn = os.path.join(path, CONFIG_FILE)
        if not os.path.isfile(fn):
            raise LoRAError(f"{fn}: no such file (a LoRA adapter is a PEFT directory with {CONFIG_FILE})")
        try:
            with open(fn) as f:
                raw = json.load(f)
            r, alpha, targets = int(raw["r"]), float(raw.get("lora_alpha", raw["r"])), raw["target_modules"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise LoRAError(f"{fn}: not a PEFT LoRA config ({type(e).__name__}: {e})") from None
        if isinstance(targets, str):
            targets = [targets]
        if r < 1:
            raise LoRAError(f"{fn}: rank r={r} must be >= 1")
        if max_lora_rank is not None and r > max_lora_rank:
            raise LoRAError(f"{fn}: rank r={r} is above --max-lora-rank {max_lora_rank}")
        unknown = [t for t in targets if t not in LORA_TARGET_PARTS]
        if unknown:
            raise LoRAError(f"{fn}: target module {unknown[0]!r} is not in the model (it has {', '.join(ALL_TARGET_MODULES)})")
        return cls(path, r, alpha, list(targets), bool(raw.get("use_rslora", False)))
