"""NGRAM speculative decoding with tensor parallelism (issue 27): tp=2 gives the tp=1 greedy
outputs, in the normal and the overlap loop, and under sampling every rank commits what rank 0
accepted (speculative/verify_step.py: rank0_outcome) even when the ranks' random draws differ."""

from __future__ import annotations

import multiprocessing as mp
import random
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from radixserve.tiny_model import get_tiny_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from processes import free_port, run_processes  # noqa: E402

WAVES = 2  # the second wave repeats the first: its drafts come from the first's outputs


def _waves(temperature: float) -> List[list]:
    from radixserve.protocol import TokenizedGenerateReqInput
    from radixserve.sampling_params import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 8000) for _ in range(rng.randint(5, 30))] for _ in range(6)]
    waves = []
    for w in range(WAVES):
        reqs = []
        for i, ids in enumerate(prompts):
            sp = SamplingParams(max_new_tokens=16, temperature=temperature, top_k=3, ignore_eos=True)
            sp.normalize()
            reqs.append(TokenizedGenerateReqInput(f"w{w}-p{i}", None, ids, sp))
        waves.append(reqs)
    return waves


def _run(tp_rank: int, tp_size: int, addr: str, overlap: bool, temperature: float, out_path: str) -> None:
    """One rank's Scheduler over the two waves; saves rid -> committed tokens and accepted drafts."""
    from radixserve.managers.scheduler import Scheduler
    from radixserve.server_args import ServerArgs

    args = ServerArgs(model_path=get_tiny_model_path(), dtype="float32", max_total_tokens=4096, tp_size=tp_size,
                      dist_init_addr=addr, disable_overlap_schedule=not overlap, test_check_memory=True,
                      speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    waves = _waves(temperature)
    sched = Scheduler(args, recv_fn=lambda: waves.pop(0) if waves and not sched.has_work() else [],
                      send_fn=lambda obj: None, tp_rank=tp_rank, tp_size=tp_size)
    # The tokens this rank commits (only rank 0 sends outputs; every rank commits).
    outputs: Dict[str, List[int]] = {}
    add_token = sched.output_processor._add_token

    def record(req, token, result, i):
        outputs.setdefault(req.rid, []).append(token)
        add_token(req, token, result, i)

    sched.output_processor._add_token = record
    assert sched.enable_overlap == overlap
    torch.manual_seed(1000 + tp_rank)  # the ranks' own random draws differ
    received = 0  # (rank 0 receives, the others get its requests: count on every rank)
    for _ in range(10_000):
        reqs = sched.recv_requests()
        received += len(reqs)
        sched.process_input_requests(reqs)
        sched.run_step()
        if received == 6 * WAVES and not sched.has_work():
            break
    sched.check_memory()
    state = sched.internal_state()
    sched.shutdown()
    torch.save((outputs, state["spec_num_correct_drafts"]), f"{out_path}.{tp_rank}")


def _run_tp2(tmp_path, overlap: bool, temperature: float):
    ctx = mp.get_context("spawn")
    addr = f"127.0.0.1:{free_port()}"
    run_processes([ctx.Process(target=_run, args=(r, 2, addr, overlap, temperature, str(tmp_path / "tp2")))
                   for r in range(2)])
    return [torch.load(tmp_path / f"tp2.{r}") for r in range(2)]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal_loop", "overlap_loop"])
def test_tp2_ngram_equals_tp1(tmp_path, overlap):
    _run(0, 1, "", False, 0.0, str(tmp_path / "tp1"))
    ref, ref_correct = torch.load(tmp_path / "tp1.0")
    (got, correct), _ = _run_tp2(tmp_path, overlap, 0.0)
    assert set(got) == set(ref) and len(got) == 6 * WAVES
    for rid, ids in ref.items():
        assert got[rid] == ids, rid
    assert correct == ref_correct > 0  # drafts were accepted, the same ones


def test_tp2_ranks_commit_rank0s_sampled_acceptance(tmp_path):
    (out0, correct0), (out1, correct1) = _run_tp2(tmp_path, False, 1.0)
    assert correct0 > 0
    assert out0 == out1 and correct0 == correct1
