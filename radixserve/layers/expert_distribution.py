"""SGLang's expert distribution recorder, the input of EPLB (seed 000's ExpertDistributionReq:
/start_expert_distribution_record, /stop_expert_distribution_record,
/dump_expert_distribution_record).

While recording, every MoE layer of the model adds the (token, expert) pairs its router sent to
each expert in a forward pass (global expert ids, before --ep-size maps them to a rank's own), so
`logical_count[layer, expert]` is the load EPLB would balance. The dump is SGLang's file format
(a torch.save'd dict with `logical_count`, written under $SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR,
else the temp dir) and is returned in the reply too. Recording costs nothing while it is off: the
layers hold no recorder then. Every TP rank routes the same tokens the same way, so rank 0's
counts are the server's.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
from torch import nn


def default_recorder_dir() -> str:
    return os.environ.get("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR") or tempfile.gettempdir()


@dataclass
class ExpertDistributionRecorder:
    layers: List[nn.Module]  # the model's FusedMoE layers, in order (moe_layer_index = position)
    num_experts: int
    counts: Optional[torch.Tensor] = None  # int64 [len(layers), num_experts] while recording
    forward_passes: int = 0
    started_at: float = field(default=0.0)

    @classmethod
    def for_model(cls, model: nn.Module, moe_type: type) -> Optional["ExpertDistributionRecorder"]:
        """The recorder of a model with MoE layers (instances of moe_type), or None."""
        layers = [m for m in model.modules() if isinstance(m, moe_type)]
        if not layers:
            return None
        for i, layer in enumerate(layers):
            layer.moe_layer_index = i
        return cls(layers, max(layer.num_experts for layer in layers))

    @property
    def recording(self) -> bool:
        return self.counts is not None

    def start(self) -> None:
        """Start (or restart from zero) recording."""
        self.counts = torch.zeros(len(self.layers), self.num_experts, dtype=torch.int64)
        self.forward_passes, self.started_at = 0, time.time()
        for layer in self.layers:
            layer.expert_recorder = self

    def stop(self) -> None:
        for layer in self.layers:
            layer.expert_recorder = None

    def record(self, layer_index: int, topk_ids: torch.Tensor) -> None:
        if self.counts is None:
            return
        if layer_index == 0:
            self.forward_passes += 1
        hits = torch.bincount(topk_ids.flatten().to(torch.int64), minlength=self.num_experts)
        self.counts[layer_index] += hits.to(self.counts.device)

    def dump(self, out_dir: Optional[str] = None) -> Dict[str, Any]:
        """The counts so far (recording goes on, as SGLang's dump): written to a file, and returned."""
        if self.counts is None:
            raise ValueError("No expert distribution recorded: call /start_expert_distribution_record first.")
        record = {"logical_count": self.counts.clone(), "num_forward_passes": self.forward_passes,
                  "recorded_seconds": time.time() - self.started_at}
        directory = out_dir or default_recorder_dir()
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"expert_distribution_recorder_{time.time():.6f}.pt")
        torch.save(record, path)
        return {"path": path, "logical_count": record["logical_count"].tolist(),
                "num_forward_passes": self.forward_passes}


def merge_expert_records(records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """--dp-size: the replicas' dumps as one: their counts and forward passes added (each replica
    routes its own requests), the paths of every replica's file."""
    counts = [[sum(col) for col in zip(*rows)] for rows in zip(*(r["logical_count"] for r in records))]
    return {"path": records[0]["path"], "paths": [r["path"] for r in records], "logical_count": counts,
            "num_forward_passes": sum(r["num_forward_passes"] for r in records)}
