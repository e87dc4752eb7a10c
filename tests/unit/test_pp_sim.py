"""`radixserve simulate --pp-size N` (sim/pipeline.py): the real SchedulerPP on the virtual
clock. Micro-batches in flight fill the pipeline's bubble: with one micro-batch each stage
waits for the others (busy ~1/N), with N of them the stages overlap."""

from __future__ import annotations

import pytest

from radixserve.bench.datasets import DatasetRow
from radixserve.server_args import ServerArgs
from radixserve.sim.cost_model import get_device
from radixserve.sim.models import load_model_config
from radixserve.sim.simulator import simulate

SMALL = dict(context_length=4096, max_running_requests=128, chunked_prefill_size=8192)  # one prefill takes all


@pytest.fixture(scope="module")
def llama8b():
    return load_model_config("llama-3-8b")


def _rows(n: int = 32):
    """Decode-heavy, all at once: a steady batch the pipeline can split."""
    return [DatasetRow(None, list(range(10 + i, 138 + i)), 128, 256) for i in range(n)]


def _stages(cfg, **server):
    res = simulate(ServerArgs(**{**SMALL, **server}), cfg, get_device("h100"), _rows())
    assert res.metrics["completed"] == 32
    return res.metrics["pp_stages"], res


def test_micro_batches_fill_the_bubble(llama8b):
    one, _ = _stages(llama8b, pp_size=2, pp_max_micro_batch_size=32)  # everything in one micro-batch
    two, _ = _stages(llama8b, pp_size=2, pp_max_micro_batch_size=16)  # two micro-batches in flight
    # one micro-batch: a stage waits while the other computes (the bubble is about half)
    assert all(0.35 < s["bubble"] < 0.6 for s in one), one
    # two micro-batches: each stage computes one while the other stage computes the other
    assert all(s["bubble"] < 0.2 for s in two), two
    assert all(abs(s["busy_share"] + s["bubble"] - 1) < 1e-9 for s in one + two)


def test_partition_sets_each_stages_share(llama8b):
    stages, _ = _stages(llama8b, pp_size=2, pp_partition="24,8", pp_max_micro_batch_size=16)
    assert [s["layers_share"] for s in stages] == [0.75, 0.25]
    # the big stage is the bottleneck: busy most of the time; the small one waits for it
    assert stages[0]["busy_share"] > 0.8 and stages[1]["busy_share"] < stages[0]["busy_share"] / 2


def test_pp1_reports_no_stages(llama8b):
    res = simulate(ServerArgs(**SMALL), llama8b, get_device("h100"), _rows())
    assert "pp_stages" not in res.metrics and res.metrics["completed"] == 32
