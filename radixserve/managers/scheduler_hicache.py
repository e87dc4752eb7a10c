"""The Scheduler's side of HiCache's storage tier (--hicache-storage-backend): it builds the
backend, the controller's threads and the tier the HiRadixCache calls (mem_cache/storage/), and
answers SGLang's POST /clear_hicache_storage_backend. The Scheduler only adds its dispatch entry.

    --hicache-storage-backend file|mooncake
    --hicache-storage-backend-extra-config '{"path": ..., "prefetch_threshold": 256, ...}'
    --hicache-storage-prefetch-policy best_effort|wait_complete|timeout

Per request prefetch (seed 003 §24, SGLang's prefetch in the waiting queue): the prefetch of what
the tree lacks of a request's prompt starts when the request is queued (`on_enqueue`); with
wait_complete or timeout only that request stays in the waiting queue until its prefetch may be
taken (`admissible`), while the requests behind it are admitted and served.

The pages' namespace names the model (its resolved path; with dummy weights, their seed too),
the KV dtype and the TP rank, so servers of other models sharing a directory or a Mooncake
master never read each other's pages.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from radixserve.hf_transformers_utils import resolve_model_path
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache
from radixserve.mem_cache.storage import (
    HiCacheStorageController, PrefetchOperation, PrefetchTimeout, create_storage_backend, storage_namespace,
)
from radixserve.mem_cache.storage.tier import DEFAULT_PREFETCH_THRESHOLD, HiCacheStorageTier
from radixserve.protocol import ClearHiCacheReqInput, ClearHiCacheReqOutput
from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)

NOT_ENABLED = ("HiCache storage is not enabled: start the server with --enable-hierarchical-cache "
               "--hicache-storage-backend file|mooncake")
IDLE_PREFETCH_WAIT_S = 0.005  # as the grammar queue's idle wait: new requests are seen this late at most
# extra_config keys for the controller and the tier (SGLang's); the rest go to the backend
TIER_KEYS = ("prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "prefetch_timeout_max")


class SchedulerHiCache:
    def __init__(self, args: ServerArgs, tree_cache: BasePrefixCache, tp_rank: int, tp_size: int):
        self.controller: Optional[HiCacheStorageController] = None
        self.tier: Optional[HiCacheStorageTier] = None
        self.tree_cache = tree_cache
        # rid -> the prefetch a queued request waits for (blocking policies only)
        self.prefetching: Dict[str, PrefetchOperation] = {}
        if args.hicache_storage_backend is not None and hasattr(tree_cache, "set_storage"):
            self.controller, self.tier = build_storage_tier(args, tree_cache, tp_rank, tp_size)
            tree_cache.set_storage(self.tier)

    def on_enqueue(self, req: Any) -> None:
        """A request joined the waiting queue: its prefetch starts now (any policy); with a
        blocking policy it is held until the prefetch may be taken."""
        if self.tier is None:
            return
        ids = req.origin_input_ids + req.output_ids
        op = self.tree_cache.prefetch_from_storage(ids[:len(ids) - 1], req.lora_path)  # what admission matches
        if op is not None and self.controller.prefetch_policy != "best_effort" and not self.controller.can_take(op):
            self.prefetching[req.rid] = op

    def admissible(self, waiting_queue: List[Any]) -> List[Any]:
        """The waiting requests admission may consider: all but those whose prefetch is still
        running under wait_complete / timeout (they stay queued; the others go ahead)."""
        if not self.prefetching:
            return waiting_queue
        queued = {r.rid for r in waiting_queue}
        for rid in [rid for rid, op in self.prefetching.items() if rid not in queued or self.controller.can_take(op)]:
            op = self.prefetching.pop(rid)  # done, timed out, or the request left (aborted)
            if not op.done and rid in queued:
                logger.info("HiCache storage: request %s goes on after its prefetch's bound with %d of %d pages",
                            rid, op.pages_ready(), len(op.keys))
        return [r for r in waiting_queue if r.rid not in self.prefetching]

    def wait_idle(self) -> None:
        """Nothing ran this step: an otherwise idle scheduler blocks briefly on a held request's
        prefetch instead of spinning (a spinning loop holds the GIL the prefetch threads need)."""
        if self.prefetching:
            next(iter(self.prefetching.values())).wait(IDLE_PREFETCH_WAIT_S)

    def dispatch_entries(self) -> List[Tuple[type, Callable[[Any], Any]]]:
        return [(ClearHiCacheReqInput, self.clear_hicache_storage)]

    def clear_hicache_storage(self, recv: ClearHiCacheReqInput) -> ClearHiCacheReqOutput:
        if self.controller is None or self.tier is None:
            return ClearHiCacheReqOutput(False, NOT_ENABLED, recv.query_id)
        self.tier.clear()
        if not self.controller.clear():
            return ClearHiCacheReqOutput(False, "Clearing the HiCache storage backend failed (see the server log)", recv.query_id)
        logger.info("HiCache storage backend cleared")
        return ClearHiCacheReqOutput(True, "Hierarchical cache storage backend cleared.", recv.query_id)


def model_id(args: Any) -> str:
    path = resolve_model_path(args)
    ident = os.path.realpath(path) if os.path.exists(path) else path
    return f"{ident}-dummy{args.seed}" if args.load_format == "dummy" else ident


def build_storage_tier(args: Any, tree_cache: Any, tp_rank: int, tp_size: int) -> Tuple[HiCacheStorageController, HiCacheStorageTier]:
    extra: Dict[str, Any] = dict(args.hicache_storage_backend_extra_config or {})
    tier_conf = {k: extra.pop(k) for k in TIER_KEYS if k in extra}
    pool = tree_cache.host_pool
    page_shape = (2, pool.layer_num, pool.page_size, pool.device_pool.head_num, pool.device_pool.head_dim)
    namespace = storage_namespace(model_id(args), pool.dtype, tp_rank, tp_size)
    backend = create_storage_backend(args.hicache_storage_backend, extra, page_shape, pool.dtype, namespace)
    defaults = PrefetchTimeout()
    timeout = PrefetchTimeout(
        float(tier_conf.get("prefetch_timeout_base", defaults.base)),
        float(tier_conf.get("prefetch_timeout_per_ki_token", defaults.per_ki_token)),
        float(tier_conf.get("prefetch_timeout_max", defaults.max)),
    )
    controller = HiCacheStorageController(backend, args.hicache_storage_prefetch_policy, pool.page_size, timeout)
    tier = HiCacheStorageTier(controller, pool.page_size, int(tier_conf.get("prefetch_threshold", DEFAULT_PREFETCH_THRESHOLD)))
    logger.info("HiCache storage tier: %s, namespace %s, prefetch policy %s", args.hicache_storage_backend, namespace,
                args.hicache_storage_prefetch_policy)
    return controller, tier
