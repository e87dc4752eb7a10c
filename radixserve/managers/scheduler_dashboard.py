"""What the /dashboard page shows of one scheduler (issue 59): its last batches, and on request a
typed snapshot of its queues, its KV pool by owner and its radix tree.

    scheduler loop (rank 0)                     GetInternalStateReq(with_dashboard=True)
    -----------------------                     -----------------------------------------
    SchedulerDashboard.on_step(batch, step_s)   SchedulerDashboard.snapshot() -> DashboardSnapshot
      -> RecentBatches (a ring of BatchRecord)    (the reply's internal_state["dashboard"])

It reads the loop's queue and batch, the KV ledger, the prefix cache and the counters, and changes
nothing. The snapshot is built only when the page asks (about once a second), so a server nobody
watches pays for a ring append per batch and nothing else. The tree walk (nodes, the shared
prefixes) runs on the scheduler's thread, a few microseconds per node: it is bounded
(MAX_NODES_WALKED) and reused for TREE_SUMMARY_INTERVAL_S, so open pages cost a busy scheduler at
most one bounded pause every few seconds.

KV pool by owner (the ledger's invariant: every slot is in exactly one place):

    | private: held by running requests only | protected: in the tree, locked by running requests |
    | evictable: in the tree, unlocked (cached) | free: in the allocator |
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Tuple

if TYPE_CHECKING:
    from radixserve.managers.loop_state import LoopState
    from radixserve.managers.scheduler_stats import SchedulerStats
    from radixserve.mem_cache.base_prefix_cache import BasePrefixCache
    from radixserve.mem_cache.kv_ledger import KVLedger

RECENT_BATCHES = 64  # how many batches the page's batch strip shows
MAX_NODES_WALKED = 20_000  # a bound on one tree walk (~0.1 s on a loaded 2-core machine)
TREE_SUMMARY_INTERVAL_S = 3.0  # how long a tree walk's result is shown before the next walk
NUM_SHARED_PREFIXES = 5
# token ids sent per shared prefix, its first ones and (when longer) its last ones: the main
# process decodes them for the page's preview, where the end tells apart prefixes that begin alike
PREFIX_HEAD_TOKENS = 32
PREFIX_TAIL_TOKENS = 16


@dataclass(frozen=True)
class BatchRecord:
    """One forward: its kind, size and how long the loop's step took (wall time of run_step; in the
    overlap loop that is about one forward, since the step waits for the previous one's result)."""

    kind: str  # "prefill" | "decode" | "mixed"
    num_reqs: int
    num_tokens: int  # tokens fed to the model: new prompt tokens (+ one per decoding request)
    step_ms: float
    at: float  # time.time() when it ran (the page's time axis is wall-clock)


class RecentBatches:
    def __init__(self, maxlen: int = RECENT_BATCHES):
        self.records: Deque[BatchRecord] = deque(maxlen=maxlen)

    def add(self, record: BatchRecord) -> None:
        self.records.append(record)

    def to_list(self) -> List[Dict[str, Any]]:
        return [asdict(r) for r in self.records]


def batch_record(batch: Any, step_s: float, now: float) -> Optional[BatchRecord]:
    """The record of one ScheduleBatch (None: nothing ran, or an idle batch)."""
    mode = getattr(batch, "forward_mode", None)
    if batch is None or mode is None or not batch.reqs:
        return None
    if mode.is_decode():
        return BatchRecord("decode", len(batch.reqs), len(batch.reqs), step_s * 1e3, now)
    new_tokens = sum(batch.extend_lens or ())
    if mode.is_mixed():
        decoding = len(batch.decoding_reqs or ())
        return BatchRecord("mixed", len(batch.reqs), new_tokens + decoding, step_s * 1e3, now)
    return BatchRecord("prefill", len(batch.reqs), new_tokens, step_s * 1e3, now)


@dataclass(frozen=True)
class SharedPrefix:
    """A prefix the radix tree holds for at least two sequences (a branch point with no shared
    node below it: the longest prefix these sequences share)."""

    num_tokens: int
    num_sequences: int  # leaves under it: the cached sequences that start with it
    hit_count: int  # inserts that ran through its last node (the tree's LFU count)
    in_use: bool  # locked by a running request
    head_ids: List[int]  # its first PREFIX_HEAD_TOKENS token ids
    tail_ids: List[int]  # its last PREFIX_TAIL_TOKENS ones, after the head (empty: the head is all of it)
    namespace: Optional[str] = None  # the LoRA adapter it was cached under (None: the base model)


@dataclass(frozen=True)
class TreeSummary:
    num_nodes: int
    num_leaves: int
    cached_tokens: int  # slots the tree holds (evictable + protected)
    max_depth: int  # the longest cached sequence, in tokens
    shared_prefixes: List[SharedPrefix]
    truncated: bool = False  # the walk stopped at MAX_NODES_WALKED


@dataclass(frozen=True)
class KVByOwner:
    total: int
    free: int
    evictable: int
    protected: int
    private: int


@dataclass(frozen=True)
class DashboardSnapshot:
    queues: Dict[str, int]
    kv: KVByOwner
    tree: TreeSummary
    recent_batches: List[Dict[str, Any]]
    evicted_tokens: int
    retractions: int
    retracted_reqs: int
    at: float

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def summarize_tree(root: Any, max_nodes: int = MAX_NODES_WALKED, top: int = NUM_SHARED_PREFIXES) -> TreeSummary:
    """One walk of a radix tree (radix_cache.TreeNode: key, value, children, lock_ref, hit_count)."""
    if root is None:
        return TreeSummary(0, 0, 0, 0, [])
    # pre-order with depths; leaves counted bottom-up afterwards
    order: List[Tuple[Any, int, Optional[int]]] = []  # (node, depth in tokens, index of parent)
    stack: List[Tuple[Any, int, Optional[int]]] = [(root, 0, None)]
    truncated = False
    while stack:
        if len(order) >= max_nodes:
            truncated = True
            break
        node, depth, parent = stack.pop()
        here = len(order)
        order.append((node, depth, parent))
        for child in node.children.values():
            stack.append((child, depth + len(child.key), here))
    leaves = [0] * len(order)
    has_shared_child = [False] * len(order)
    cached = 0
    for i in range(len(order) - 1, -1, -1):  # children come after their parent in pre-order
        node, _, parent = order[i]
        cached += len(node.value) if i and node.value is not None else 0  # HiCache: None = host only
        if not node.children:
            leaves[i] = 1
        if parent is not None:
            leaves[parent] += leaves[i]
            if leaves[i] >= 2 and i:
                has_shared_child[parent] = True
    candidates = [i for i in range(1, len(order)) if leaves[i] >= 2 and not has_shared_child[i]]
    candidates.sort(key=lambda i: (-order[i][1], -leaves[i]))
    shared = [_shared_prefix(order, i, leaves[i]) for i in candidates[:top]]
    return TreeSummary(num_nodes=len(order) - 1, num_leaves=leaves[0] if order[0][0].children else 0,
                       cached_tokens=cached, max_depth=max((d for _, d, _ in order), default=0),
                       shared_prefixes=shared, truncated=truncated)


def _shared_prefix(order: List[Tuple[Any, int, Optional[int]]], i: int, num_sequences: int) -> SharedPrefix:
    node, depth, _ = order[i]
    path: List[Any] = []
    j: Optional[int] = i
    while j:  # up to (not including) the root
        path.append(order[j][0])
        j = order[j][2]
    head: List[int] = []
    for n in reversed(path):
        head.extend(int(t) for t in n.key[: PREFIX_HEAD_TOKENS - len(head)])
        if len(head) >= PREFIX_HEAD_TOKENS:
            break
    tail: List[int] = []
    for n in path:  # from the node up
        need = min(PREFIX_TAIL_TOKENS, depth - PREFIX_HEAD_TOKENS) - len(tail)
        if need <= 0:
            break
        tail = [int(t) for t in n.key[-need:]] + tail
    return SharedPrefix(num_tokens=depth, num_sequences=num_sequences, hit_count=int(getattr(node, "hit_count", 0)),
                        in_use=node.lock_ref > 0, head_ids=head, tail_ids=tail, namespace=getattr(node, "extra_key", None))


@dataclass(frozen=True)
class DashboardSources:
    """What the dashboard reads (it changes nothing)."""

    ledger: KVLedger
    tree_cache: BasePrefixCache
    stats: SchedulerStats
    loop: LoopState
    max_total_num_tokens: int


class SchedulerDashboard:
    def __init__(self, sources: DashboardSources, tree_interval_s: float = TREE_SUMMARY_INTERVAL_S):
        self.src = sources
        self.batches = RecentBatches()
        self.tree_interval_s = tree_interval_s
        self._tree: Optional[Tuple[float, TreeSummary]] = None  # (when walked, what it found)

    def on_step(self, batch: Any, step_s: float) -> None:
        record = batch_record(batch, step_s, time.time())
        if record is not None:
            self.batches.add(record)

    def kv_by_owner(self) -> KVByOwner:
        s = self.src
        total, free = s.max_total_num_tokens, s.ledger.available_size()
        evictable, protected = s.tree_cache.evictable_size(), s.tree_cache.protected_size()
        private = max(total - free - evictable - protected, 0)
        return KVByOwner(total=total, free=free, evictable=evictable, protected=protected, private=private)

    def decorate_state(self, out: Any) -> Any:
        """A GetInternalStateReqOutput the page asked for gets the snapshot; other replies pass."""
        if getattr(out, "with_dashboard", False):
            out.internal_state["dashboard"] = self.snapshot().to_dict()
        return out

    def _tree_summary(self, root: Any) -> TreeSummary:
        now = time.monotonic()
        if self._tree is None or now - self._tree[0] >= self.tree_interval_s:
            self._tree = (now, summarize_tree(root))
        return self._tree[1]

    def snapshot(self) -> DashboardSnapshot:
        s, loop = self.src, self.src.loop
        root = None if getattr(s.tree_cache, "disable", False) else getattr(s.tree_cache, "root_node", None)
        return DashboardSnapshot(
            queues={"waiting": len(loop.waiting_queue), "running": loop.running_batch.batch_size(),
                    "chunked": int(loop.chunked_req is not None)},
            kv=self.kv_by_owner(),
            tree=self._tree_summary(root),
            recent_batches=self.batches.to_list(),
            evicted_tokens=getattr(s.ledger, "num_evicted_tokens", 0),
            retractions=s.stats.num_retractions,
            retracted_reqs=s.stats.num_retracted_reqs,
            at=time.time(),
        )
