"""LoRAManager: the registry of loaded adapters, the slot pool, and the per-forward batch info.

The ModelRunner makes one (--enable-lora) after loading the model; it attaches a LoRALinearDelta
to every targeted linear layer and, before each forward, `prepare_lora_batch` gives every token
its adapter's slot (requests choose an adapter by name with `lora_path`; None = the base model)."""

from __future__ import annotations

import logging
import re
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from radixserve.lora.layers import LoRABatchInfo, LoRABatchState, LoRALinearDelta
from radixserve.lora.lora import LoRAAdapter
from radixserve.lora.lora_config import ALL_TARGET_MODULES, CONFIG_FILE, LoRAConfig, LoRAError
from radixserve.lora.mem_pool import LoRAMemoryPool
from radixserve.server_args import parse_lora_paths

logger = logging.getLogger(__name__)

_LINEAR = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(qkv_proj|o_proj|gate_up_proj|down_proj)$")


def model_lora_parts(model: nn.Module) -> Tuple[Dict[Tuple[int, str], Tuple[nn.Module, List[Tuple[str, int, int]]]], Dict[str, Tuple[int, int]]]:
    """The model's linear layers LoRA can target: (layer, fused name) -> (module, parts), where a
    part is (PEFT module name, offset in the fused output, size); and PEFT name -> (in, out)."""
    found: Dict[Tuple[int, str], Tuple[nn.Module, List[Tuple[str, int, int]]]] = {}
    dims: Dict[str, Tuple[int, int]] = {}
    for name, module in model.named_modules():
        m = _LINEAR.search(name)
        if m is None:
            continue
        layer, kind = int(m.group(1)), m.group(2)
        if kind == "qkv_proj":
            q, kv = module.num_heads * module.head_dim, module.num_kv_heads * module.head_dim
            sizes = [("q_proj", q), ("k_proj", kv), ("v_proj", kv)]
        elif kind == "gate_up_proj":
            sizes = [("gate_proj", module.output_sizes[0]), ("up_proj", module.output_sizes[1])]
        else:
            sizes = [(kind, module.out_features)]
        parts, offset = [], 0
        for peft_name, size in sizes:
            parts.append((peft_name, offset, size))
            dims[peft_name] = (module.in_features, size)
            offset += size
        found[(layer, kind)] = (module, parts)
    return found, dims


class LoRAManager:
    def __init__(self, model: nn.Module, lora_paths: Dict[str, str], max_loras_per_batch: int,
                 max_lora_rank: Optional[int], target_modules: Optional[List[str]], max_loaded_loras: Optional[int],
                 dtype: torch.dtype, device: str):
        self.max_loaded_loras = max_loaded_loras
        self.adapters: Dict[str, LoRAAdapter] = {}
        self.linears, self.module_dims = model_lora_parts(model)
        self.num_layers = 1 + max((layer for layer, _ in self.linears), default=-1)
        configs = {name: LoRAConfig.from_dir(path, max_lora_rank) for name, path in lora_paths.items()}
        if target_modules:
            targets = list(ALL_TARGET_MODULES) if "all" in target_modules else list(target_modules)
        else:
            targets = sorted({t for c in configs.values() for t in c.target_modules}, key=ALL_TARGET_MODULES.index)
        missing = [t for t in targets if t not in self.module_dims]
        if missing:
            raise LoRAError(f"--lora-target-modules: {missing[0]!r} is not a module of the model")
        self.target_modules = targets
        if max_lora_rank is None:
            max_lora_rank = max((c.r for c in configs.values()), default=0)
        if not targets or max_lora_rank < 1:
            raise LoRAError("--enable-lora without --lora-paths needs --max-lora-rank and --lora-target-modules")
        self.max_lora_rank = max_lora_rank
        self.pool = LoRAMemoryPool(max_loras_per_batch, max_lora_rank, {t: self.module_dims[t] for t in targets},
                                   self.num_layers, dtype, device)
        self.state = LoRABatchState()
        for (layer, _), (module, parts) in self.linears.items():
            if any(p[0] in targets for p in parts):
                module.lora = LoRALinearDelta(layer, parts, self.pool, self.state)
        for name, config in configs.items():
            self._register(name, config)

    @classmethod
    def from_server_args(cls, model: nn.Module, args: Any, dtype: torch.dtype, device: str) -> "LoRAManager":
        return cls(model, parse_lora_paths(args.lora_paths), args.max_loras_per_batch, args.max_lora_rank,
                   args.lora_target_modules, args.max_loaded_loras, dtype, device)

    # ---- registry -------------------------------------------------------------------------
    def _register(self, name: str, config: LoRAConfig) -> None:
        fn = f"{config.path}/{CONFIG_FILE}"
        if config.r > self.max_lora_rank:
            raise LoRAError(f"{fn}: rank r={config.r} is above --max-lora-rank {self.max_lora_rank}")
        outside = [t for t in config.target_modules if t not in self.target_modules]
        if outside:
            raise LoRAError(f"{fn}: target module {outside[0]!r} is not in --lora-target-modules ({', '.join(self.target_modules)})")
        if self.max_loaded_loras is not None and len(self.adapters) >= self.max_loaded_loras:
            raise LoRAError(f"adapter {name!r}: --max-loaded-loras {self.max_loaded_loras} adapters are loaded already")
        self.adapters[name] = LoRAAdapter.load(name, config, self.module_dims, self.num_layers)
        logger.info("LoRA adapter %r loaded from %s (r=%d, %s)", name, config.path, config.r, ", ".join(config.target_modules))

    def load_lora_adapter(self, name: str, path: str) -> None:
        if name in self.adapters:
            raise LoRAError(f"adapter {name!r} is already loaded")
        self._register(name, LoRAConfig.from_dir(path, self.max_lora_rank))

    def unload_lora_adapter(self, name: str) -> None:
        """The caller makes sure no running request uses it."""
        if name not in self.adapters:
            raise LoRAError(f"adapter {name!r} is not loaded")
        self.pool.evict(name)
        del self.adapters[name]

    def loaded_adapters(self) -> Dict[str, str]:
        return {name: a.config.path for name, a in self.adapters.items()}

    # ---- per forward ----------------------------------------------------------------------
    def prepare_lora_batch(self, forward_batch: Any) -> Optional[LoRABatchInfo]:
        """Slots for the batch's adapters and the token segments of each; None (no delta at
        all) when every request runs on the base model."""
        paths: Optional[List[Optional[str]]] = forward_batch.lora_paths
        info = None
        if paths and any(p is not None for p in paths):
            names = list(dict.fromkeys(p for p in paths if p is not None))
            slots = self.pool.prepare(self.adapters[n] for n in names)
            info = self._segments(paths, forward_batch.extend_seq_lens_cpu, slots)
        self.state.info = forward_batch.lora_info = info
        return info

    def _segments(self, paths: List[Optional[str]], lens: Iterable[int], slots: Dict[str, int]) -> LoRABatchInfo:
        info = LoRABatchInfo()
        token_slots: List[int] = []
        start = 0
        for path, n in zip(paths, lens):
            slot = -1 if path is None else slots[path]
            token_slots.extend([slot] * n)
            if slot >= 0:
                last = info.segments[-1] if info.segments else None
                if last is not None and last[1] == start and last[2] == slot:
                    info.segments[-1] = (last[0], start + n, slot, last[3])
                else:
                    info.segments.append((start, start + n, slot, self.pool.scalings[slot]))
            start += n
        info.token_slots = torch.tensor(token_slots, dtype=torch.int64)
        return info
