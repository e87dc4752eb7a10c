"""The parts the Scheduler is built from (issue 40), built in one place and passed in: the model
worker, the prefix cache and the KV ledger over the worker's pools, the grammar backend, the
speculative worker and HiCache's storage tier. The Scheduler builds only its loop's own machinery
(queues, policy, output processor, the overlap loop's forward thread) and the helpers that
need it. A caller (the simulator, a test) can build the parts itself, with a worker of its own.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Optional

from radixserve.constrained.base_grammar_backend import BaseGrammarBackend
from radixserve.constrained.factory import create_grammar_backend
from radixserve.hf_transformers_utils import get_tokenizer, resolve_model_path
from radixserve.managers.scheduler_hicache import SchedulerHiCache
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache
from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.mem_cache.hiradix_cache import HiRadixCache
from radixserve.mem_cache.kv_ledger import KVLedger
from radixserve.mem_cache.mamba_radix_cache import MambaRadixCache, has_state_pool
from radixserve.mem_cache.radix_cache import RadixCache
from radixserve.mem_cache.swa_kv_ledger import SWAKVLedger
from radixserve.mem_cache.swa_radix_cache import SWARadixCache
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.model_executor.worker_protocol import ModelWorker
from radixserve.models.model_config import ModelConfig
from radixserve.server_args import ServerArgs
from radixserve.speculative.factory import create_speculative_worker

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SchedulerParts:
    tokenizer: Any  # None: --skip-tokenizer-init
    tp_worker: ModelWorker
    swa_pool: bool  # --enable-hybrid-swa-memory on a windowed model: an SWA tree and ledger
    tree_cache: BasePrefixCache
    ledger: KVLedger  # the one owner of KV: rows, slots and tree locks
    grammar_backend: Optional[BaseGrammarBackend]  # None: no structured output
    spec_worker: Optional[Any]  # --speculative-algorithm; None: off
    hicache: SchedulerHiCache  # HiCache's storage tier, /clear_hicache_storage_backend


# Builds the model worker in place of TpModelWorker: the top layer (launch, Engine) passes one for
# --null-worker, so the managers never import the simulator's workers.
WorkerFactory = Callable[[ServerArgs, ModelConfig], ModelWorker]


def build_scheduler_parts(args: ServerArgs, tp_rank: int = 0, tp_size: int = 1,
                          tp_worker: Optional[ModelWorker] = None,
                          make_worker: Optional[WorkerFactory] = None) -> SchedulerParts:
    """The parts, in the order the Scheduler built them (tp_worker None: make_worker's, or load
    the model)."""
    tokenizer = get_tokenizer(args)
    if tp_worker is None and make_worker is not None:  # e.g. --null-worker (sim/null_worker.py)
        tp_worker = make_worker(args, ModelConfig.from_pretrained(resolve_model_path(args)))
    if tp_worker is None:
        tp_worker = TpModelWorker(args, ModelConfig.from_pretrained(resolve_model_path(args)), tp_rank, tp_size)
    req_to_token_pool, allocator = tp_worker.get_memory_pool()
    swa_pool = hasattr(allocator, "free_swa")
    tree_cache = make_tree_cache(args, tp_worker, swa_pool)
    sliding_window = tp_worker.model_config.sliding_window
    ledger = KVLedger(req_to_token_pool, allocator, tree_cache, kv_pool=tp_worker.get_kv_pool()) if not swa_pool else \
        SWAKVLedger(req_to_token_pool, allocator, tree_cache, tp_worker.get_kv_pool(), sliding_window)
    spec_worker = create_speculative_worker(args, tp_worker)
    config = tp_worker.model_config
    grammar_backend = create_grammar_backend(args, tokenizer, config.vocab_size, config.eos_token_ids)
    hicache = SchedulerHiCache(args, tree_cache, tp_rank, tp_size)
    return SchedulerParts(tokenizer, tp_worker, swa_pool, tree_cache, ledger, grammar_backend, spec_worker, hicache)


def make_tree_cache(args: ServerArgs, tp_worker: ModelWorker, swa_pool: bool) -> BasePrefixCache:
    """The prefix cache over the worker's pools: chunk (no radix), HiCache, hybrid, SWA or radix."""
    req_to_token_pool, allocator = tp_worker.get_memory_pool()
    if args.disable_radix_cache:
        return ChunkCache(req_to_token_pool, allocator)
    if args.enable_hierarchical_cache:  # HiCache: a host tier under the device pool
        return HiRadixCache.from_server_args(req_to_token_pool, allocator, tp_worker.get_kv_pool(), args)
    if has_state_pool(req_to_token_pool):  # a hybrid model: prefix hits only where a state snapshot is
        if args.speculative_algorithm and args.overlap_schedule_enabled(tp_worker.device):
            # The step launched before a finish is seen feeds the request's last token and drafts
            # and advances its states past the committed KV; a next turn's hit then restored
            # states ahead of their key (tests/reference/test_qwen3_next_mtp.py).
            logger.info("hybrid linear-attention model with speculative decoding in the overlap loop: prefix cache off "
                        "(--disable-overlap-schedule serves it with the hybrid radix cache)")
            return ChunkCache(req_to_token_pool, allocator)
        return MambaRadixCache(req_to_token_pool, allocator, args.page_size, args.radix_eviction_policy)
    if swa_pool:
        return SWARadixCache(req_to_token_pool, allocator, tp_worker.model_config.sliding_window,
                             eviction_policy=args.radix_eviction_policy)
    return RadixCache(req_to_token_pool, allocator, page_size=args.page_size, eviction_policy=args.radix_eviction_policy)
