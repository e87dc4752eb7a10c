"""The expert distribution recorder's parts that need no model (the model's counts are checked
against transformers in tests/reference/test_qwen3_moe.py): a layer records only between start
and stop, start begins again from zero, and with --dp-size the controller adds the replicas'
dumps (each replica routes its own requests) instead of answering with the first one's."""

from types import SimpleNamespace

import torch
from torch import nn

from radixserve.layers.expert_distribution import ExpertDistributionRecorder
from radixserve.managers.dp_controller import DataParallelController
from radixserve.protocol import ExpertDistributionReqOutput


class FakeMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts, self.expert_recorder, self.moe_layer_index = 4, None, -1

    def route(self, ids: torch.Tensor) -> None:
        if self.expert_recorder is not None:
            self.expert_recorder.record(self.moe_layer_index, ids)


def test_layers_record_between_start_and_stop_only(tmp_path):
    model = nn.Sequential(FakeMoE(), nn.Linear(2, 2), FakeMoE())
    rec = ExpertDistributionRecorder.for_model(model, FakeMoE)
    first, second = model[0], model[2]
    assert (first.moe_layer_index, second.moe_layer_index) == (0, 1)
    first.route(torch.tensor([[0, 1]]))  # before the start: not counted
    rec.start()
    first.route(torch.tensor([[0, 1], [1, 3]]))
    second.route(torch.tensor([[2, 2]]))
    rec.stop()
    first.route(torch.tensor([[3, 3]]))  # after the stop: not counted
    out = rec.dump(str(tmp_path))
    assert out["logical_count"] == [[1, 2, 0, 1], [0, 0, 2, 0]] and out["num_forward_passes"] == 1
    assert torch.equal(torch.load(out["path"])["logical_count"], torch.tensor(out["logical_count"]))
    rec.start()  # again from zero
    assert rec.dump(str(tmp_path))["logical_count"] == [[0] * 4, [0] * 4]
    assert ExpertDistributionRecorder.for_model(nn.Linear(2, 2), FakeMoE) is None


def test_dp_adds_the_replicas_dumps():
    replies = [ExpertDistributionReqOutput(True, "a", {"path": "/r0.pt", "logical_count": [[1, 2], [3, 4]],
                                                       "num_forward_passes": 2}, "q"),
               ExpertDistributionReqOutput(True, "b", {"path": "/r1.pt", "logical_count": [[10, 0], [0, 5]],
                                                       "num_forward_passes": 3}, "q")]
    ctl = SimpleNamespace(dp_size=2, budget=SimpleNamespace(num_dispatched=[1, 1]))
    merged = DataParallelController.merge(ctl, replies)
    assert merged.record["logical_count"] == [[11, 2], [3, 9]]
    assert merged.record["num_forward_passes"] == 5 and merged.record["paths"] == ["/r0.pt", "/r1.pt"]
