"""DeepSeek's EPLB placement, global (no node hierarchy: one group of ranks), in plain torch.

Given the load of each logical expert of each MoE layer ([layers, experts] token counts), the
number of physical expert slots (experts + --ep-num-redundant-experts) and the number of ranks
holding them (--ep-size):

1. replicate_experts: the redundant slots go one at a time to the logical expert whose load per
   copy is highest now (so the hottest experts get copies, each copy taking an equal share);
2. balanced_packing: the physical copies, heaviest first, go to the least loaded rank that still
   has a free slot and, where possible, holds no copy of the same expert yet (two copies on one
   rank would share nothing out).

Off the hot path (run at a rebalance), so per-layer Python loops over experts are fine here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

CPU = torch.device("cpu")  # placements are host data, whatever device the model is built under


@dataclass(frozen=True)
class Placement:
    """One EPLB result, every tensor int64 and per MoE layer:

        physical_to_logical_map       [L, P]   the logical expert each physical slot holds;
                                                rank r holds slots [r * P/R, (r+1) * P/R)
        logical_to_all_physical_map   [L, E, C] each logical expert's physical slots, -1 padded
        logical_count                 [L, E]   how many copies each logical expert has (>= 1)
    """

    physical_to_logical_map: torch.Tensor
    logical_to_all_physical_map: torch.Tensor
    logical_count: torch.Tensor

    @property
    def num_layers(self) -> int:
        return self.physical_to_logical_map.shape[0]

    def layer(self, i: int) -> "LayerPlacement":
        return LayerPlacement(self.physical_to_logical_map[i], self.logical_to_all_physical_map[i], self.logical_count[i])


@dataclass(frozen=True)
class LayerPlacement:
    """One MoE layer's row of a Placement: [P], [E, C] and [E]."""

    physical_to_logical_map: torch.Tensor
    logical_to_all_physical_map: torch.Tensor
    logical_count: torch.Tensor

    def is_identity(self) -> bool:
        """Slot e holds expert e and nothing else: the router's ids are already physical."""
        p2l = self.physical_to_logical_map
        return len(p2l) == len(self.logical_count) and bool((p2l.cpu() == torch.arange(len(p2l), device=CPU)).all())


def replicate_experts(load: torch.Tensor, num_physical: int) -> torch.Tensor:
    """[L, E] loads -> [L, E] copies per logical expert (each >= 1, summing to num_physical)."""
    num_layers, num_logical = load.shape
    if num_physical < num_logical:
        raise ValueError(f"{num_physical} physical expert slots cannot hold {num_logical} experts")
    counts = torch.ones(num_layers, num_logical, dtype=torch.int64, device=CPU)
    rows = torch.arange(num_layers, device=CPU)
    for _ in range(num_physical - num_logical):  # vectorized over layers
        heaviest = (load / counts).argmax(dim=-1)
        counts[rows, heaviest] += 1
    return counts


def balanced_packing(item_load: List[float], item_expert: List[int], num_packs: int) -> List[int]:
    """Each item's pack: items heaviest first, each to the lightest pack with room, preferring a
    pack without an item of the same expert. Every pack gets exactly len(items) / num_packs."""
    per_pack = len(item_load) // num_packs
    pack_load = [0.0] * num_packs
    pack_size = [0] * num_packs
    pack_experts: List[set] = [set() for _ in range(num_packs)]
    out = [0] * len(item_load)
    for i in sorted(range(len(item_load)), key=lambda j: (-item_load[j], j)):
        open_packs = [p for p in range(num_packs) if pack_size[p] < per_pack]
        fresh = [p for p in open_packs if item_expert[i] not in pack_experts[p]]
        p = min(fresh or open_packs, key=lambda q: (pack_load[q], q))
        out[i] = p
        pack_load[p] += item_load[i]
        pack_size[p] += 1
        pack_experts[p].add(item_expert[i])
    return out


def rebalance_experts(load: torch.Tensor, num_physical: int, num_ranks: int) -> Placement:
    """SGLang's rebalance_experts (DeepSeek's global policy): the placement of num_physical expert
    slots over num_ranks ranks that balances the per-rank share of `load` ([L, E])."""
    if load.dim() != 2:
        raise ValueError(f"the expert load must be [layers, experts], got shape {tuple(load.shape)}")
    if num_physical % num_ranks:
        raise ValueError(f"{num_physical} physical expert slots do not split over {num_ranks} ranks")
    load = load.to(CPU, torch.float64).clamp(min=0)
    num_layers, num_logical = load.shape
    counts = replicate_experts(load, num_physical)
    per_rank = num_physical // num_ranks
    phy2log = torch.empty(num_layers, num_physical, dtype=torch.int64, device=CPU)
    for layer in range(num_layers):
        experts = torch.repeat_interleave(torch.arange(num_logical, device=CPU), counts[layer]).tolist()
        share = (load[layer] / counts[layer]).tolist()
        packs = balanced_packing([share[e] for e in experts], experts, num_ranks)
        filled = [0] * num_ranks
        for expert, rank in zip(experts, packs):
            phy2log[layer, rank * per_rank + filled[rank]] = expert
            filled[rank] += 1
    return placement_of(phy2log, num_logical)


def placement_of(phy2log: torch.Tensor, num_logical: int) -> Placement:
    """The inverse maps of a [L, P] physical-to-logical map."""
    num_layers, num_physical = phy2log.shape
    phy2log = phy2log.to(CPU)
    counts = torch.zeros(num_layers, num_logical, dtype=torch.int64, device=CPU)
    counts.scatter_add_(1, phy2log, torch.ones_like(phy2log))
    if (counts == 0).any():
        layer, expert = (counts == 0).nonzero()[0].tolist()
        raise ValueError(f"layer {layer}: logical expert {expert} has no physical copy")
    log2phy = torch.full((num_layers, num_logical, int(counts.max())), -1, dtype=torch.int64, device=CPU)
    for layer in range(num_layers):
        seen = [0] * num_logical
        for slot, expert in enumerate(phy2log[layer].tolist()):
            log2phy[layer, expert, seen[expert]] = slot
            seen[expert] += 1
    return Placement(phy2log, log2phy, counts)


def trivial_placement(num_layers: int, num_logical: int, num_physical: int) -> Placement:
    """SGLang's trivial expert location: slot p holds logical expert p % E (the redundant slots
    copy experts 0, 1, ...)."""
    return placement_of((torch.arange(num_physical, device=CPU) % num_logical).repeat(num_layers, 1), num_logical)


def rank_loads(load: torch.Tensor, placement: Placement, num_ranks: int) -> torch.Tensor:
    """[L, R] the load each rank serves under `placement`, a logical expert's load split equally
    over its copies (as the dispatch spreads its tokens)."""
    share = load.to(CPU, torch.float64) / placement.logical_count
    slot_load = share.gather(1, placement.physical_to_logical_map)
    return slot_load.view(load.shape[0], num_ranks, -1).sum(-1)
