"""Embeddings through the same Scheduler (--is-embedding; SGLang's handle_embedding_request,
handle_batch_embedding_request, forward_batch_embedding, BatchEmbeddingOutput).

An embedding request is a Req that only prefills:

    TokenizedEmbeddingReqInput -> EmbeddingReq (max_new_tokens 0) -> waiting_queue
      -> prefill batches as any request (radix cache, PrefillAdder budgets, chunked prefill)
      -> run_batch: TpModelWorker.forward_batch_embedding -> EmbeddingBatchResult (pooled parts)
      -> EmbeddingOutputProcessor: merge the part; at the last chunk finish the embedding,
         hand the KV to the tree (a later request sharing the prefix hits the cache)
      -> BatchEmbeddingOutput (straight to the TokenizerManager: nothing to detokenize)

No request decodes, so the running batch stays empty and the normal loop runs (ServerArgs turns
the overlap loop off: a result must be processed before the next schedule).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch

from radixserve.layers.pooler import PoolingConfig
from radixserve.managers.embedding_frontend import NOT_A_GENERATION_SERVER, NOT_AN_EMBEDDING_SERVER
from radixserve.managers.output_processor import SchedulerOutputProcessor
from radixserve.managers.schedule_batch import FINISH_ABORT, Req, ScheduleBatch
from radixserve.model_executor.worker_protocol import EmbeddingWorker
from radixserve.model_executor.forward_batch import ModelWorkerBatch
from radixserve.protocol import BatchEmbeddingOutput, BatchTokenizedEmbeddingReqInput, TokenizedEmbeddingReqInput
from radixserve.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)


@dataclass
class EmbeddingBatchResult:
    embeddings: torch.Tensor  # [bs, hidden] float32: each request's part (layers/pooler.py)


class EmbeddingReq(Req):
    """A request that prefills its prompt and ends with the pooled hidden states."""

    def __init__(self, recv: TokenizedEmbeddingReqInput, pooling: PoolingConfig, vocab_size: int):
        super().__init__(recv.rid, recv.input_text, recv.input_ids, SamplingParams(max_new_tokens=0),
                         priority=recv.priority, vocab_size=vocab_size)
        self.pooling = pooling
        self.pooled: Optional[torch.Tensor] = None  # the parts of the forwards so far, merged
        self.embedding: Optional[List[float]] = None

    # No decode follows the prefill: admission reserves nothing beyond the prompt.
    def clipped_max_new_tokens(self) -> int:
        return 0

    def clipped_remaining_new_tokens(self) -> int:
        return 0

    def init_next_round_input(self, tree_cache: Any = None) -> None:
        super().init_next_round_input(tree_cache)
        if tree_cache is not None and self.pooling.needs_every_token and len(self.prefix_indices) > 0:
            # CLS / mean pooling need the hidden state of every prompt token, which the cache
            # does not keep: compute the whole prompt (its KV still goes into the tree).
            match = tree_cache.match_prefix([])
            self.prefix_indices, self.last_node = match.device_indices, match.last_device_node
            self.extend_input_len = len(self.fill_ids)

    def add_pooled_part(self, part: torch.Tensor) -> None:
        self.pooled = self.pooling.merge(self.pooled, part)

    def finish_embedding(self) -> None:
        self.embedding = self.pooling.finish(self.pooled, len(self.origin_input_ids)).tolist()


class SchedulerEmbedding:
    """The Scheduler's embedding handlers (its TypeBasedDispatcher calls them) and its run_batch
    hook. Narrow seam: it checks a request with the scheduler's `validate` (the same input and
    queue limits as generate requests), queues it with `enqueue`, refuses it with `finish`."""

    def __init__(
        self,
        server_args: ServerArgs,
        tp_worker: EmbeddingWorker,
        validate: Callable[[Req], Optional[Tuple[str, int]]],
        enqueue: Callable[[Req], None],
        finish: Callable[[Req, Any], None],
    ):
        self.enabled = server_args.is_embedding
        self.tp_worker = tp_worker
        self.pooling: PoolingConfig = tp_worker.pooling_config() if self.enabled else PoolingConfig()
        self.vocab_size = tp_worker.model_config.vocab_size
        self.validate, self.enqueue, self.finish = validate, enqueue, finish

    def dispatch_entries(self) -> List[Tuple[type, Callable[[Any], Any]]]:
        return [(TokenizedEmbeddingReqInput, self.handle_embedding_request),
                (BatchTokenizedEmbeddingReqInput, self.handle_batch_embedding_request)]

    def handle_batch_embedding_request(self, recv: BatchTokenizedEmbeddingReqInput) -> None:
        for r in recv.batch:
            self.handle_embedding_request(r)

    def handle_embedding_request(self, recv: TokenizedEmbeddingReqInput) -> None:
        req = EmbeddingReq(recv, self.pooling, self.vocab_size)
        if not self.enabled:  # the front end refuses these already; the scheduler is also driven directly
            self.finish(req, FINISH_ABORT(NOT_AN_EMBEDDING_SERVER, status_code=400, err_type="BadRequestError"))
            return
        try:
            error = self.validate(req)
            if error is None:
                self.enqueue(req)
                return
            message, status = error
            reason = FINISH_ABORT(message, status_code=status, err_type="BadRequestError" if status == 400 else "ServiceUnavailable")
        except Exception as e:  # a bug one request's input reached: end that request, serve the rest
            logger.exception("Failed to admit embedding request %s; it is aborted", req.rid)
            reason = FINISH_ABORT(f"Internal error while admitting the request: {type(e).__name__}: {e}",
                                  status_code=500, err_type="InternalServerError")
        self.finish(req, reason)

    def run_batch(self, worker_batch: ModelWorkerBatch) -> EmbeddingBatchResult:
        """Scheduler.run_batch's hook: a prefill forward, pooled; nothing sampled."""
        return EmbeddingBatchResult(self.tp_worker.forward_batch_embedding(worker_batch))


class EmbeddingOutputProcessor(SchedulerOutputProcessor):
    """The output side of an embedding scheduler: merges each forward's pooled parts, finishes a
    request at its last chunk (its KV goes to the tree), reports BatchEmbeddingOutput."""

    def process_batch_result(self, batch: ScheduleBatch, result: EmbeddingBatchResult) -> None:
        with self.ledger.free_group():
            for i, req in enumerate(batch.reqs):
                if req.finished():
                    continue
                if isinstance(req, EmbeddingReq):
                    req.add_pooled_part(result.embeddings[i])
                elif req.to_finish is None:  # a generate request driven straight into this scheduler
                    req.to_finish = FINISH_ABORT(NOT_A_GENERATION_SERVER, status_code=400, err_type="BadRequestError")
                if req.pending_chunks > 0:
                    req.pending_chunks -= 1  # a middle chunk: the prompt goes on in the next forward
                    continue
                req.check_finished()  # max_new_tokens 0: FINISH_LENGTH, or the abort it was given
                if isinstance(req, EmbeddingReq) and not req.finished_reason.is_error:
                    req.finish_embedding()
                self.ledger.cache_finished_req(req)
        self.stream_output(batch.reqs)

    def stream_output(self, reqs: List[Req]) -> None:
        """Each request reports once, when it has finished (embeddings do not stream)."""
        out = BatchEmbeddingOutput([], [], [], [], [])
        for req in reqs:
            if not req.finished() or req.finished_sent:
                continue
            req.finished_sent = True
            out.rids.append(req.rid)
            out.finished_reasons.append(req.finished_reason.to_json())
            out.embeddings.append(getattr(req, "embedding", None))
            out.prompt_tokens.append(len(req.origin_input_ids))
            out.cached_tokens.append(req.cached_tokens)
        if out.rids:
            self.send_fn(out)
