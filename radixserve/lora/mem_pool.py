"""LoRAMemoryPool: `max_loras_per_batch` slots of A/B buffers per target module and layer. An
adapter lives in host memory (LoRAAdapter) and is copied into a slot when a batch needs it;
a slot is reused only for an adapter the batch being prepared does not use (least recently
used first). Ranks below --max-lora-rank are zero-padded, so one matmul serves every rank."""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch

from radixserve.lora.lora import LoRAAdapter


class LoRAMemoryPool:
    def __init__(self, max_loras_per_batch: int, max_lora_rank: int, module_dims: Dict[str, Tuple[int, int]],
                 num_layers: int, dtype: torch.dtype, device: str):
        """module_dims: the target modules (PEFT names) -> this TP rank's (in_features,
        out_features) of them: a slot holds the rank's slice of an adapter (lora.LoRAShard)."""
        self.num_slots = max_loras_per_batch
        self.max_rank = max_lora_rank
        self.dtype, self.device = dtype, device
        # module -> [layer, slot, rank, in] and [layer, slot, out, rank]
        self.a_buffers: Dict[str, torch.Tensor] = {}
        self.b_buffers: Dict[str, torch.Tensor] = {}
        for module, (in_f, out_f) in module_dims.items():
            self.a_buffers[module] = torch.zeros(num_layers, self.num_slots, max_lora_rank, in_f, dtype=dtype, device=device)
            self.b_buffers[module] = torch.zeros(num_layers, self.num_slots, out_f, max_lora_rank, dtype=dtype, device=device)
        self.slot_names: List[Optional[str]] = [None] * self.num_slots
        self.scalings: List[float] = [0.0] * self.num_slots
        self._last_used: List[int] = [0] * self.num_slots
        self._clock = 0
        self.num_swaps = 0  # adapters copied into a slot so far (tests, logs)

    def slot_of(self, name: str) -> Optional[int]:
        try:
            return self.slot_names.index(name)
        except ValueError:
            return None

    def prepare(self, adapters: Iterable[LoRAAdapter]) -> Dict[str, int]:
        """A slot for each adapter of a batch (loading the missing ones); name -> slot."""
        adapters = list(adapters)
        if len(adapters) > self.num_slots:
            raise RuntimeError(f"a batch uses {len(adapters)} LoRA adapters but --max-loras-per-batch is {self.num_slots}")
        self._clock += 1
        wanted = {a.name for a in adapters}
        slots: Dict[str, int] = {}
        for adapter in adapters:
            slot = self.slot_of(adapter.name)
            if slot is None:
                slot = self._free_slot(wanted)
                self._load(adapter, slot)
            self._last_used[slot] = self._clock
            slots[adapter.name] = slot
        return slots

    def _free_slot(self, wanted: set) -> int:
        empty = [i for i, n in enumerate(self.slot_names) if n is None]
        if empty:
            return empty[0]
        # never a slot this batch uses; the least recently used of the others
        victims = [i for i, n in enumerate(self.slot_names) if n not in wanted]
        return min(victims, key=lambda i: self._last_used[i])

    def _load(self, adapter: LoRAAdapter, slot: int) -> None:
        for module in self.a_buffers:
            self.a_buffers[module][:, slot].zero_()
            self.b_buffers[module][:, slot].zero_()
        r = adapter.config.r
        for (layer, module), (a, b) in adapter.weights.items():
            self.a_buffers[module][layer, slot, :r].copy_(a)
            self.b_buffers[module][layer, slot, :, :r].copy_(b)
        self.slot_names[slot] = adapter.name
        self.scalings[slot] = adapter.scaling
        self.num_swaps += 1

    def evict(self, name: str) -> None:
        """Forget an adapter's slot (unload): the next batch that needs the slot overwrites it."""
        slot = self.slot_of(name)
        if slot is not None:
            self.slot_names[slot] = None
