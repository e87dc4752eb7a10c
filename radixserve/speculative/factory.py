"""The speculative worker of --speculative-algorithm: one interface the scheduler calls.

    worker.forward_batch(batch, worker_batch) -> GenerationBatchResult
        runs one ScheduleBatch (its ModelWorkerBatch given): a decode batch drafts and verifies,
        and sets batch.output_ids to each request's last committed token; other batches run as
        usual (a worker with a draft model also fills the draft's KV there)
    worker.max_drafts           drafts per request per step (ScheduleBatch reserves their slots)
    worker.clear_cache_pool()   /flush_cache: forget what the worker keeps across requests
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from radixserve.model_executor.worker_protocol import TargetWorker
from radixserve.speculative.eagle_worker import EAGLEWorker
from radixserve.speculative.ngram_worker import NGRAMWorker
from radixserve.speculative.standalone_worker import STANDALONEWorker

logger = logging.getLogger(__name__)


def create_speculative_worker(server_args: Any, target_worker: TargetWorker) -> Optional[Any]:
    """The worker of --speculative-algorithm (None without it). ServerArgs refused the others;
    STANDALONE refuses a draft model whose vocabulary differs from the target's (ValueError)."""
    if server_args.speculative_algorithm is None:
        return None
    if server_args.speculative_algorithm == "EAGLE":
        logger.info("Speculative decoding: EAGLE, head %s, %d steps, topk %d, %d tokens verified per step",
                    server_args.speculative_draft_model_path, server_args.speculative_num_steps,
                    server_args.speculative_eagle_topk, server_args.speculative_num_draft_tokens)
        return EAGLEWorker(server_args, target_worker)
    if server_args.speculative_algorithm == "STANDALONE":
        logger.info("Speculative decoding: STANDALONE, draft model %s, %d draft tokens per step",
                    server_args.speculative_draft_model_path, server_args.speculative_num_steps)
        return STANDALONEWorker(server_args, target_worker)
    assert server_args.speculative_algorithm == "NGRAM", server_args.speculative_algorithm
    logger.info("Speculative decoding: NGRAM, %d draft tokens per step", server_args.speculative_num_draft_tokens - 1)
    return NGRAMWorker(server_args, target_worker)
