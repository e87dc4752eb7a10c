"""SGLang's EPLBManager: re-place a model's experts from their recorded load.

It is given the model's MoE layers (anything with a placement and set_expert_location, in the
recorder's order), the number of expert-parallel ranks, where the recorded load is read, and the
TP group's broadcast; it never sees the model runner. Every rank of the TP group calls it at the
same step boundary (the weights' move is a collective): the load is rank 0's, broadcast, so every
rank computes the same placement.

    --enable-eplb                     rebalance every --eplb-rebalance-num-iterations forward passes
    /eplb_rebalance, Engine.eplb_rebalance()   rebalance now, from the load recorded so far
    --init-expert-location FILE       place once at start from a dump's logical_count
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Protocol, Sequence

import torch

from radixserve.eplb.eplb_algorithms import LayerPlacement, Placement, rank_loads, rebalance_experts

logger = logging.getLogger(__name__)


class ExpertLayer(Protocol):
    """What EPLB needs of an MoE layer (layers/moe.py's FusedMoE)."""

    num_experts: int
    num_physical_experts: int
    placement: LayerPlacement

    def set_expert_location(self, placement: LayerPlacement) -> None: ...


@dataclass(frozen=True)
class BalanceStats:
    """Per-rank load under a placement: max / mean over the ranks, averaged over the layers
    (1.0 is perfectly balanced; the step waits for the slowest rank)."""

    max_over_mean: float
    worst_layer: float

    @classmethod
    def of(cls, load: torch.Tensor, placement: Placement, num_ranks: int) -> "BalanceStats":
        per_rank = rank_loads(load, placement, num_ranks)
        ratio = per_rank.max(-1).values / per_rank.mean(-1).clamp(min=1e-9)
        ratio = torch.where(per_rank.sum(-1) > 0, ratio, torch.ones_like(ratio))  # an idle layer is balanced
        return cls(float(ratio.mean()), float(ratio.max()))


def load_logical_count(path: str) -> torch.Tensor:
    """[layers, experts] from a /dump_expert_distribution_record file (.pt, or its JSON reply)."""
    if path.endswith(".json"):
        with open(path) as f:
            record = json.load(f)
    else:
        record = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(record, dict) or "logical_count" not in record:
        raise ValueError(f"{path}: not an expert distribution dump (no logical_count)")
    return torch.as_tensor(record["logical_count"], dtype=torch.int64)


class EPLBManager:
    def __init__(self, layers: Sequence[ExpertLayer], num_ranks: int, logical_count: Callable[[], Optional[torch.Tensor]],
                 broadcast: Callable[[torch.Tensor], torch.Tensor], rebalance_num_iterations: Optional[int] = None):
        self.layers = list(layers)
        self.num_ranks = num_ranks
        self.logical_count = logical_count  # the recorder's counts so far (None: not recording)
        self.broadcast = broadcast
        self.rebalance_num_iterations = rebalance_num_iterations  # None: only on request
        self.forward_passes = 0
        self.num_rebalances = 0

    def placement(self) -> Placement:
        """The layers' current placement, stacked (layers with the widest copy list set the width)."""
        width = max(layer.placement.logical_to_all_physical_map.shape[1] for layer in self.layers)
        log2phy = [torch.nn.functional.pad(layer.placement.logical_to_all_physical_map.cpu(),
                                           (0, width - layer.placement.logical_to_all_physical_map.shape[1]), value=-1)
                   for layer in self.layers]
        return Placement(torch.stack([layer.placement.physical_to_logical_map.cpu() for layer in self.layers]),
                         torch.stack(log2phy), torch.stack([layer.placement.logical_count.cpu() for layer in self.layers]))

    def on_forward_pass_end(self) -> None:
        """A step boundary (every TP rank counts the same passes)."""
        self.forward_passes += 1
        if self.rebalance_num_iterations and self.forward_passes % self.rebalance_num_iterations == 0:
            load = self.logical_count()
            if load is None or int(load.sum()) == 0:
                return  # nothing routed since the record (re)started: keep the placement
            stats = self.rebalance(load)
            logger.info("EPLB rebalance %d after %d forward passes: %s", self.num_rebalances, self.forward_passes, stats)

    def rebalance(self, load: Optional[torch.Tensor] = None) -> Dict[str, float]:
        """Re-place every layer's experts for `load` ([layers, experts]; default: the recorded
        counts); returns the balance before and after, on that load."""
        if load is None:
            load = self.logical_count()
            if load is None:
                raise ValueError("No expert load recorded: call /start_expert_distribution_record (or start with --enable-eplb) first.")
        self._check_shape(load)
        if int(load.sum()) == 0:
            raise ValueError("No tokens were routed since the expert distribution record started: nothing to balance yet.")
        load = self.broadcast(load.to(torch.int64).cpu().clone())
        before = self.placement()
        after = rebalance_experts(load, self.layers[0].num_physical_experts, self.num_ranks)
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                layer.set_expert_location(after.layer(i))
        self.num_rebalances += 1
        b, a = BalanceStats.of(load, before, self.num_ranks), BalanceStats.of(load, after, self.num_ranks)
        return {"max_over_mean_before": b.max_over_mean, "max_over_mean_after": a.max_over_mean,
                "worst_layer_before": b.worst_layer, "worst_layer_after": a.worst_layer,
                "num_rebalances": self.num_rebalances, "forward_passes": self.forward_passes}

    def _check_shape(self, load: torch.Tensor) -> None:
        want = (len(self.layers), self.layers[0].num_experts)
        if tuple(load.shape) != want:
            raise ValueError(f"the expert load is {tuple(load.shape)}, this model's MoE layers need {want} "
                             f"([MoE layers, experts])")
        if any(layer.num_experts != want[1] or layer.num_physical_experts != self.layers[0].num_physical_experts
               for layer in self.layers):
            raise ValueError("EPLB needs every MoE layer to have the same number of experts")
