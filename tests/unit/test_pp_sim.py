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


def test_abort_reaches_every_micro_batch(llama8b):
    """An abort of everything while PP's micro-batch slots each hold requests (the LoopState points
    at one slot at a time; Scheduler.abort_request walks them all): every request ends with an
    abort long before its 256 tokens, and the pools are idle again."""
    from radixserve.protocol import AbortReq, BatchTokenIDOutput, TokenizedGenerateReqInput
    from radixserve.sampling_params import SamplingParams
    from radixserve.sim.worker import make_sim_scheduler

    inbox, outbox = [], []
    sched, _ = make_sim_scheduler(ServerArgs(**SMALL, pp_size=2, pp_max_micro_batch_size=8), llama8b, get_device("h100"),
                                  recv_fn=lambda: [inbox.pop(0)] if inbox else [], send_fn=outbox.append)
    for i, row in enumerate(_rows(16)):
        sp = SamplingParams(max_new_tokens=row.output_len, temperature=0.0, ignore_eos=True)
        sp.normalize(None)
        inbox.append(TokenizedGenerateReqInput(str(i), None, list(row.input_ids), sp, stream=True))
    for _ in range(40):  # everything admitted and decoding, spread over the slots
        sched.process_input_requests(sched.recv_requests())
        sched.run_step()
    held = [len(slot.running_batch.reqs) for slot in sched.batch_slots()]
    assert sum(1 for n in held if n) > 1, held  # more than one slot holds requests
    inbox.append(AbortReq(abort_all=True))
    finished = {}
    for _ in range(40):
        sched.process_input_requests(sched.recv_requests())
        sched.run_step()
        for out in (o for o in outbox if isinstance(o, BatchTokenIDOutput)):
            finished.update({rid: r for rid, r in zip(out.rids, out.finished_reasons) if r is not None})
        outbox.clear()
        if not sched.has_work():
            break
    assert len(finished) == 16 and all(r["type"] == "abort" for r in finished.values()), finished
    sched.check_memory()
