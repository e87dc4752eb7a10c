"""Issue 40: the Scheduler runs a batch through a runner chosen once at start
(managers/batch_runner.py), not a ladder of per-step branches; the runners keep the old order:
embedding before anything else, the grammar mask before any generation forward."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from radixserve.managers.batch_runner import select_batch_runner


class Calls(list):
    def __call__(self, name, ret=None):
        def record(*args):
            self.append((name, args))
            return ret
        return record


def _parts(calls: Calls, embedding=False, spec=False, overlap=False, grammar=False):
    tokens = torch.tensor([7, 8])
    worker = SimpleNamespace(forward_batch_generation=calls("plain", SimpleNamespace(next_token_ids=tokens)))
    emb = SimpleNamespace(enabled=embedding, run_batch=calls("embedding", "pooled"))
    spec_worker = SimpleNamespace(forward_batch=calls("spec", "spec result")) if spec else None
    overlap_worker = SimpleNamespace(launch=calls("overlap", "futures"), launch_spec=calls("spec_overlap", "spec futures")) \
        if overlap else None
    grammar_backend = SimpleNamespace(fill_token_bitmask=calls("mask", "bitmask")) if grammar else None
    return worker, emb, spec_worker, overlap_worker, grammar_backend


def _run(**flags):
    calls = Calls()
    runner = select_batch_runner(*_parts(calls, **flags))
    batch, worker_batch = SimpleNamespace(reqs=["r"], output_ids=None), SimpleNamespace(token_bitmask=None)
    out = runner(batch, worker_batch)
    return [name for name, _ in calls], out, batch, worker_batch


def test_each_configuration_gets_its_runner():
    names, out, batch, _ = _run()
    assert names == ["plain"] and batch.output_ids.tolist() == [7, 8] and out.next_token_ids.tolist() == [7, 8]
    names, out, batch, _ = _run(overlap=True)
    assert names == ["overlap"] and out is None and batch.output_ids == "futures"
    names, out, batch, _ = _run(spec=True)
    assert names == ["spec"] and out == "spec result"
    names, out, batch, _ = _run(spec=True, overlap=True)
    assert names == ["spec_overlap"] and out is None and batch.output_ids == "spec futures"


def test_embedding_runs_alone_and_generation_gets_the_grammar_mask_first():
    names, out, _, worker_batch = _run(embedding=True, spec=True, overlap=True, grammar=True)
    assert names == ["embedding"] and out == "pooled" and worker_batch.token_bitmask is None
    for flags in ({}, {"overlap": True}, {"spec": True}, {"spec": True, "overlap": True}):
        names, _, _, worker_batch = _run(grammar=True, **flags)
        assert names[0] == "mask" and len(names) == 2 and worker_batch.token_bitmask == "bitmask", flags
