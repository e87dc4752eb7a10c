"""How the Scheduler runs a batch, chosen once at start (issue 40): instead of branching every step
on embedding / speculative / overlap, `select_batch_runner` picks one of

    embedding          --is-embedding: a prefill forward, pooled; nothing sampled
    speculative        drafts + one verify forward (speculative/), in the overlap loop on the
                       forward thread (managers/spec_overlap.py)
    overlap            launched on the forward thread; batch.output_ids become future placeholders
    plain              forward and sample now

and wraps a generation runner with the grammar mask when structured output is on (GrammarMaskRunner:
in the overlap loop a decode batch's mask is filled while its forward runs, once the tokens of the
batch before it are accepted). A runner takes the ScheduleBatch and its ModelWorkerBatch; it returns
the result (the normal loop) or None (the overlap loop: the result is processed later)."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

from radixserve.constrained.base_grammar_backend import DeferredTokenBitmask
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
    # Speculative steps verify drafts against the mask at once: there the loop waits (seed: overlap
    # is off only for speculative v2 with a grammar; Scheduler.is_disable_overlap_for_batch).
    return GrammarMaskRunner(run, grammar_backend, overlap_worker if spec_worker is None else None)


class GrammarMaskRunner:
    """A generation runner with the grammar mask filled first. In the overlap loop a decode (or
    mixed) batch N+1 with grammar rows is launched while N's tokens are not yet accepted by the
    matchers: it gets a DeferredTokenBitmask, which the Scheduler fills (`on_result_processed`)
    right after it processed N, while N+1's model forward runs; only N+1's sampler waits for it."""

    def __init__(self, run: BatchRunner, grammar_backend: Any, overlap_worker: Optional[TpModelWorkerClient]):
        self.run, self.backend, self.overlap_worker = run, grammar_backend, overlap_worker
        # (the batch's requests in row order, its mask, results still to process before it is filled)
        self.deferred: List[Tuple[List[Any], DeferredTokenBitmask, int]] = []

    def __call__(self, batch: ScheduleBatch, worker_batch: ModelWorkerBatch) -> Optional[GenerationBatchResult]:
        unprocessed = len(self.overlap_worker.result_queue) if self.overlap_worker is not None else 0
        if unprocessed and (batch.forward_mode.is_decode() or batch.forward_mode.is_mixed()) \
                and any(r.grammar is not None for r in batch.reqs):
            mask = DeferredTokenBitmask()
            self.deferred.append((list(batch.reqs), mask, unprocessed))
            worker_batch.token_bitmask = mask
        else:  # the matchers have seen every earlier token: fill it now, on this thread
            worker_batch.token_bitmask = self.backend.fill_token_bitmask(batch.reqs, GrammarQueue.fail_request)
        return self.run(batch, worker_batch)

    def on_result_processed(self) -> None:
        """A launched batch's result was processed (its tokens accepted): fill the deferred masks
        that waited for no other result."""
        waiting = []
        for reqs, mask, unprocessed in self.deferred:
            if unprocessed > 1:
                waiting.append((reqs, mask, unprocessed - 1))
                continue
            try:
                mask.set(self.backend.fill_token_bitmask(reqs, GrammarQueue.fail_request))
            except BaseException as e:  # the sampler must not wait forever for it
                mask.fail(e)
                raise
        self.deferred = waiting

    def fail_deferred(self, error: BaseException) -> None:
        """Processing a result failed (the scheduler goes down): release the waiting samplers."""
        for _, mask, _ in self.deferred:
            mask.fail(error)
        self.deferred = []


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
