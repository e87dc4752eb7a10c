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
from radixserve.lora.lora import LoRAAdapter, LoRAShard
from radixserve.lora.lora_config import ALL_TARGET_MODULES, CONFIG_FILE, LoRAConfig, LoRAError
from radixserve.lora.mem_pool import LoRAMemoryPool
from radixserve.server_args import parse_lora_paths

logger = logging.getLogger(__name__)

_LINEAR = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(qkv_proj|o_proj|gate_up_proj|down_proj)$")


# (layer, fused name) -> (the linear module, its parts: (PEFT module name, offset in this rank's fused output, size))
LoRALinears = Dict[Tuple[int, str], Tuple[nn.Module, List[Tuple[str, int, int]]]]


def model_lora_parts(model: nn.Module) -> Tuple[LoRALinears, Dict[str, Tuple[int, int]], Dict[str, LoRAShard]]:
    """The model's linear layers LoRA can target (LoRALinears); per PEFT module name, the whole
    projection's (in, out), which an adapter file must match; and the slice of A and B this TP
    rank keeps, cut as the base layer cuts its weight (linear.py): q/k/v by heads (a kv head
    replicated on several ranks goes to each of them), gate/up each split evenly, o/down (row
    parallel) along their input."""
    found: LoRALinears = {}
    dims: Dict[str, Tuple[int, int]] = {}
    shards: Dict[str, LoRAShard] = {}
    for name, module in model.named_modules():
        m = _LINEAR.search(name)
        if m is None:
            continue
        layer, kind = int(m.group(1)), m.group(2)
        rank, tp = getattr(module, "tp_rank", 0), getattr(module, "tp_size", 1)
        # (PEFT name, this rank's out size, the whole out size, where this rank's rows start)
        if kind == "qkv_proj":
            replicas = getattr(module, "kv_replicas", 1)
            q, kv = module.num_heads * module.head_dim, module.num_kv_heads * module.head_dim
            kv_part = (kv, kv * tp // replicas, rank // replicas * kv)
            outs = [("q_proj", q, q * tp, rank * q), ("k_proj", *kv_part), ("v_proj", *kv_part)]
        elif kind == "gate_up_proj":
            outs = [(part, full // tp, full, rank * (full // tp))
                    for part, full in zip(("gate_proj", "up_proj"), module.output_sizes)]
        else:
            outs = [(kind, module.out_features, module.out_features, 0)]
        row_parallel = kind in ("o_proj", "down_proj")
        in_local = module.in_features  # this rank's input: all of it, but 1/tp of a row-parallel layer's
        in_full, in_start = (in_local * tp, rank * in_local) if row_parallel else (in_local, 0)
        parts, offset = [], 0
        for peft_name, size, full, out_start in outs:
            parts.append((peft_name, offset, size))
            dims[peft_name] = (in_full, full)
            shards[peft_name] = LoRAShard(in_start, in_local, out_start, size)
            offset += size
        found[(layer, kind)] = (module, parts)
    return found, dims, shards


class LoRAManager:
    def __init__(self, model: nn.Module, lora_paths: Dict[str, str], max_loras_per_batch: int,
                 max_lora_rank: Optional[int], target_modules: Optional[List[str]], max_loaded_loras: Optional[int],
                 dtype: torch.dtype, device: str):
        self.max_loaded_loras = max_loaded_loras
        self.adapters: Dict[str, LoRAAdapter] = {}
        self.linears, self.module_dims, self.shards = model_lora_parts(model)
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
        # The slots hold this TP rank's slices (LoRAShard): the layers' deltas then line up with
        # their sharded outputs (and a row-parallel layer's with its partial sums).
        local_dims = {t: (self.shards[t].in_size, self.shards[t].out_size) for t in targets}
        self.pool = LoRAMemoryPool(max_loras_per_batch, max_lora_rank, local_dims, self.num_layers, dtype, device)
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
        self.adapters[name] = LoRAAdapter.load(name, config, self.module_dims, self.num_layers, self.shards)
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
