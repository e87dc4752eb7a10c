"""How the Scheduler runs a batch, chosen once at start (issue 40): instead of branching every step
on embedding / speculative / overlap, `select_batch_runner` picks one of

    embedding          --is-embedding: a prefill forward, pooled; nothing sampled
    speculative        drafts + one verify forward (speculative/), in the overlap loop on the
                       forward thread (managers/spec_overlap.py)
    overlap            launched on the forward thread; batch.output_ids become future placeholders
    plain              forward and sample now

and wraps a generation runner with the grammar mask when structured output is on. A runner takes
the ScheduleBatch and its ModelWorkerBatch; it returns the result (the normal loop) or None (the
overlap loop: the result is processed later)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from radixserve.managers.grammar import GrammarQueue
from radixserve.managers.overlap import TpModelWorkerClient
from radixserve.managers.schedule_batch import ScheduleBatch
from radixserve.model_executor.forward_batch import ModelWorkerBatch
from radixserve.model_executor.tp_worker import GenerationBatchResult
from radixserve.model_executor.worker_protocol import ModelWorker

BatchRunner = Callable[[ScheduleBatch, ModelWorkerBatch], Optional[Any]]


def select_batch_runner(worker: ModelWorker, embedding: Any, spec_worker: Optional[Any],
                        overlap_worker: Optional[TpModelWorkerClient], grammar_backend: Optional[Any]) -> BatchRunner:
    """`embedding`: the SchedulerEmbedding (its run_batch when enabled); `spec_worker`: None when
    speculative decoding is off; `overlap_worker`: None in the normal loop."""
    if embedding.enabled:
        return lambda batch, worker_batch: embedding.run_batch(worker_batch)
    run = _generation_runner(worker, spec_worker, overlap_worker)
    if grammar_backend is None:
        return run

    def with_grammar_mask(batch: ScheduleBatch, worker_batch: ModelWorkerBatch) -> Optional[GenerationBatchResult]:
        # This forward's grammar mask, filled now on this thread (the matchers have seen every
        # earlier token: see Scheduler.is_disable_overlap_for_batch).
        worker_batch.token_bitmask = grammar_backend.fill_token_bitmask(batch.reqs, GrammarQueue.fail_request)
        return run(batch, worker_batch)

    return with_grammar_mask


def _generation_runner(worker: ModelWorker, spec_worker: Optional[Any],
                       overlap_worker: Optional[TpModelWorkerClient]) -> BatchRunner:
    if spec_worker is not None and overlap_worker is not None:
        def speculative_overlap(batch: ScheduleBatch, worker_batch: ModelWorkerBatch) -> None:
            batch.output_ids = overlap_worker.launch_spec(spec_worker, batch, worker_batch)
        return speculative_overlap
    if spec_worker is not None:
        return spec_worker.forward_batch
    if overlap_worker is not None:
        def overlap(batch: ScheduleBatch, worker_batch: ModelWorkerBatch) -> None:
            batch.output_ids = overlap_worker.launch(batch, worker_batch)
        return overlap

    def plain(batch: ScheduleBatch, worker_batch: ModelWorkerBatch) -> GenerationBatchResult:
        result = worker.forward_batch_generation(worker_batch)
        batch.output_ids = result.next_token_ids
        return result
    return plain
