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
    overlap_worker = SimpleNamespace(launch=calls("overlap", "futures"), launch_spec=calls("spec_overlap", "spec futures"),
                                     result_queue=[]) if overlap else None
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


def _grammar_decode_batch():
    from radixserve.model_executor.forward_batch import ForwardMode
    req = SimpleNamespace(grammar="matcher")
    return SimpleNamespace(reqs=[req], output_ids=None, forward_mode=ForwardMode.DECODE)


def test_overlap_defers_the_grammar_mask_until_the_result_in_flight_is_processed():
    """Overlap loop, a decode batch with a grammar row launched while two results are unprocessed:
    it is launched at once with a deferred mask, filled only after both results are processed."""
    import pytest
    from radixserve.constrained.base_grammar_backend import DeferredTokenBitmask
    from radixserve.managers.batch_runner import GrammarMaskRunner

    calls = Calls()
    worker, emb, _, overlap_worker, backend = _parts(calls, overlap=True, grammar=True)
    overlap_worker.result_queue = ["N-1", "N"]
    runner = select_batch_runner(worker, emb, None, overlap_worker, backend)
    assert isinstance(runner, GrammarMaskRunner)
    worker_batch = SimpleNamespace(token_bitmask=None)
    runner(_grammar_decode_batch(), worker_batch)
    mask = worker_batch.token_bitmask
    assert [n for n, _ in calls] == ["overlap"] and isinstance(mask, DeferredTokenBitmask)
    runner.on_result_processed()
    assert [n for n, _ in calls] == ["overlap"] and not mask._ready.is_set()
    runner.on_result_processed()
    assert [n for n, _ in calls] == ["overlap", "mask"] and mask.mask == "bitmask" and not runner.deferred

    # a failure while processing releases the sampler with an error instead of a hang
    worker_batch = SimpleNamespace(token_bitmask=None)
    runner(_grammar_decode_batch(), worker_batch)
    runner.fail_deferred(ValueError("boom"))
    with pytest.raises(RuntimeError, match="never filled"):
        worker_batch.token_bitmask.apply_(torch.zeros(1, 4), 4)

    # nothing in flight (or speculation): filled now, before the launch
    overlap_worker.result_queue = []
    worker_batch = SimpleNamespace(token_bitmask=None)
    runner(_grammar_decode_batch(), worker_batch)
    assert worker_batch.token_bitmask == "bitmask"
    overlap_worker.result_queue = ["N"]
    spec = select_batch_runner(worker, emb, SimpleNamespace(), overlap_worker, backend)
    worker_batch = SimpleNamespace(token_bitmask=None)
    spec(_grammar_decode_batch(), worker_batch)
    assert worker_batch.token_bitmask == "bitmask"
