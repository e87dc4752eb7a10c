"""SchedulePolicy (the order of the waiting queue) and PrefillAdder (who fits in the next
prefill), as seed 001 §5-6 and §9.4 describe them."""

from __future__ import annotations

import random
from collections import defaultdict
from enum import Enum, auto
from typing import Callable, Dict, List, Optional

import torch

from radixserve.managers.schedule_batch import Req, ScheduleBatch
from radixserve.mem_cache.kv_ledger import KVLedger
from radixserve.mem_cache.radix_cache import RadixCache, TreeNode
from radixserve.server_args import ServerArgs

# In-batch prefix caching (SGLang): a request whose cached prefix is short but which shares a
# long prefix with a request already chosen this round waits one round, so it hits the cache.
IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD = 32
IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD = 32
# Sorting by prefix match costs a tree walk per request: past this queue length LPM is FCFS.
LPM_MAX_QUEUE_LEN = 128


class CacheAwarePolicy(Enum):
    LPM = "lpm"
    DFS_WEIGHT = "dfs-weight"


class CacheAgnosticPolicy(Enum):
    FCFS = "fcfs"
    LOF = "lof"
    RANDOM = "random"


class SchedulePolicy:
    def __init__(
        self,
        policy: str,
        tree_cache,
        enable_priority_scheduling: bool = False,
        schedule_low_priority_values_first: bool = False,
        seed: int = 0,
    ):
        self.policy = CacheAwarePolicy(policy) if policy in ("lpm", "dfs-weight") else CacheAgnosticPolicy(policy)
        if tree_cache.disable and isinstance(self.policy, CacheAwarePolicy):
            self.policy = CacheAgnosticPolicy.FCFS  # no tree, nothing to be aware of
        self.tree_cache = tree_cache
        self.enable_priority_scheduling = enable_priority_scheduling
        self.low_first = schedule_low_priority_values_first
        self.rng = random.Random(seed)
        # A scratch tree of the prompts chosen so far in this round (in-batch prefix caching).
        self.waiting_queue_radix_tree = RadixCache(None, None, page_size=1)
        # --enable-lora: most distinct adapters in one batch (PrefillAdder.lora_fits); None: off.
        # Set by whoever makes the Scheduler (configure_lora_admission), not by the Scheduler.
        self.max_loras_per_batch: Optional[int] = None

    def priority_key(self, req: Req) -> int:
        """Smaller sorts first."""
        p = req.priority or 0
        return p if self.low_first else -p

    def calc_priority(self, waiting_queue: List[Req]) -> bool:
        """Sort waiting_queue in place. Returns whether prefixes were matched (cache-aware)."""
        policy = self.policy
        if policy == CacheAwarePolicy.LPM and len(waiting_queue) > LPM_MAX_QUEUE_LEN:
            policy = CacheAgnosticPolicy.FCFS
        if isinstance(policy, CacheAwarePolicy):
            deprioritized = self._compute_prefix_matches(waiting_queue)
            if policy == CacheAwarePolicy.LPM:
                self._sort_by_longest_prefix(waiting_queue, deprioritized)
            else:
                self._sort_by_dfs_weight(waiting_queue)
            return True
        if policy == CacheAgnosticPolicy.FCFS:
            if self.enable_priority_scheduling:
                waiting_queue.sort(key=lambda r: (self.priority_key(r), r.arrival_time))
        elif policy == CacheAgnosticPolicy.LOF:
            waiting_queue.sort(key=lambda r: (self._prio(r), -(r.sampling_params.max_new_tokens or 0)))
        elif policy == CacheAgnosticPolicy.RANDOM:
            self.rng.shuffle(waiting_queue)
            if self.enable_priority_scheduling:
                waiting_queue.sort(key=self._prio)
        return False

    def _prio(self, req: Req) -> int:
        return self.priority_key(req) if self.enable_priority_scheduling else 0

    def _compute_prefix_matches(self, waiting_queue: List[Req]) -> set:
        deprioritized = set()
        self.waiting_queue_radix_tree.reset()
        for r in waiting_queue:
            ids = r.origin_input_ids + r.output_ids
            # Both trees key prefixes by adapter: one under another adapter is no hit for r.
            match = self.tree_cache.match_prefix(ids[: max(len(ids) - 1, 0)], r.lora_path)
            r.prefix_indices, r.last_node = match.device_indices, match.last_device_node
            if len(r.prefix_indices) <= IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD:
                in_batch = self.waiting_queue_radix_tree.match_prefix(ids, r.lora_path).device_indices
                if len(in_batch) >= IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD:
                    deprioritized.add(r.rid)
                else:
                    zeros = torch.zeros(len(ids), dtype=torch.int64)
                    self.waiting_queue_radix_tree.insert(ids, zeros, extra_key=r.lora_path)
        return deprioritized

    def _sort_by_longest_prefix(self, waiting_queue: List[Req], deprioritized: set) -> None:
        def key(r: Req):
            prefix = float("inf") if r.rid in deprioritized else -len(r.prefix_indices)
            return (self._prio(r), prefix)

        waiting_queue.sort(key=key)  # stable: ties keep arrival order

    def _sort_by_dfs_weight(self, waiting_queue: List[Req]) -> None:
        """Walk the tree depth-first, heaviest subtree (most waiting requests) first, emitting a
        node's requests after its subtree's (SGLang's order): requests sharing the deepest
        prefixes run together, and requests that match nothing (at the root) go last."""
        node_to_reqs: Dict[TreeNode, List[Req]] = defaultdict(list)
        for r in waiting_queue:
            node_to_reqs[r.last_node].append(r)
        weight: Dict[TreeNode, int] = defaultdict(int)
        for node, reqs in node_to_reqs.items():
            n = node
            while n is not None:
                weight[n] += len(reqs)
                n = n.parent
        out: List[Req] = []
        stack = [(self.tree_cache.root_node, False)]  # iterative post-order
        while stack:
            node, children_done = stack.pop()
            if children_done:
                out.extend(node_to_reqs.get(node, []))
                continue
            stack.append((node, True))
            kids = [c for c in node.children.values() if weight.get(c, 0) > 0]
            kids.sort(key=lambda c: weight[c])  # lightest pushed first: heaviest visited first
            stack.extend((c, False) for c in kids)
        waiting_queue[:] = out


class AddReqResult(Enum):
    CONTINUE = auto()  # more requests may fit
    NO_TOKEN = auto()  # the KV pool budget is exhausted
    OTHER = auto()  # the input / chunk budget is exhausted


# new_token_ratio schedule (seed 001 §9.3; SGLang's defaults)
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600


class NewTokenRatio:
    """The share of a running request's remaining max_new_tokens that admission reserves
    (seed 001 §9.3): it decays while decoding goes well, jumps up after a retraction, and
    goes back to its start when the server is idle."""

    def __init__(self, schedule_conservativeness: float = 1.0):
        self.init = min(INIT_NEW_TOKEN_RATIO * schedule_conservativeness, 1.0)
        self.min = min(self.init * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.decay = (self.init - self.min) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.value = self.init

    def step(self) -> None:
        self.value = max(self.value - self.decay, self.min)

    def reset(self) -> None:
        self.value = self.init


class PrefillAdder:
    """Admits requests into a prefill batch under three budgets (seed 001 §9.4, seed 004):

    rem_total_tokens  = free + evictable KV - reserve for running requests' future decode
                        (remaining max_new_tokens x new_token_ratio) - what was admitted
    rem_input_tokens  = --max-prefill-tokens minus admitted extend tokens
    rem_chunk_tokens  = --chunked-prefill-size minus admitted extend tokens; the last
                        request that does not fit whole is truncated into a chunk

    With the SWA pool (mem_cache/swa_kv_ledger.py) a fourth, SGLang's budget from
    `_get_swa_token_info`: rem_swa_tokens = free + evictable swa slots - what running requests'
    windows may still grow by (remaining tokens x new_token_ratio, at most a window each) - what
    was admitted (its extend tokens, all in the pool while they are computed, and the window its
    decode will hold). A request holds about a window there, not its length, so the full pool's
    totals would be wrong both ways.
    """

    def __init__(
        self,
        page_size: int,
        ledger: KVLedger,
        running_batch: Optional[ScheduleBatch],
        new_token_ratio: float,
        rem_input_tokens: int,
        rem_chunk_tokens: Optional[int],
        mixed_with_decode_tokens: int = 0,
        priority_scheduling_preemption_threshold: int = 10,
        policy: Optional[SchedulePolicy] = None,
    ):
        self.page_size = page_size
        self.ledger = ledger
        self.tree_cache = ledger.tree_cache  # (read: prefix matching)
        self.running_batch = running_batch
        self.new_token_ratio = new_token_ratio
        self.rem_input_tokens = rem_input_tokens - mixed_with_decode_tokens
        self.rem_chunk_tokens = None if rem_chunk_tokens is None else rem_chunk_tokens - mixed_with_decode_tokens
        self.rem_total_token_offset = mixed_with_decode_tokens
        self.cur_rem_token_offset = mixed_with_decode_tokens
        self.preemption_threshold = priority_scheduling_preemption_threshold
        self.policy = policy
        self.can_run_list: List[Req] = []
        self.preempt_list: List[Req] = []
        self.new_chunked_req: Optional[Req] = None
        self.log_hit_tokens = 0
        self.log_input_tokens = 0
        self.swa_window = ledger.sliding_window_size  # None: no SWA pool
        self.rem_swa_token_offset: float = mixed_with_decode_tokens
        if running_batch is not None:
            self.rem_total_token_offset += sum(self._running_offset(r) for r in running_batch.reqs)
            if self.swa_window is not None:
                self.rem_swa_token_offset += sum(min(self._running_offset(r), self.swa_window) for r in running_batch.reqs)

    def _running_offset(self, req: Req) -> float:
        return req.clipped_remaining_new_tokens() * self.new_token_ratio

    @property
    def rem_swa_tokens(self) -> Optional[float]:
        """The SWA pool's budget left this round (None without one)."""
        room = self.ledger.swa_room()
        return None if room is None else room - self.rem_swa_token_offset

    def _swa_short(self, need: int) -> bool:
        rem = self.rem_swa_tokens
        return rem is not None and need >= rem

    @property
    def rem_total_tokens(self) -> float:
        avail = self.ledger.budget()
        return avail - self.rem_total_token_offset

    @property
    def cur_rem_tokens(self) -> float:
        avail = self.ledger.budget()
        return avail - self.cur_rem_token_offset

    def ceil_paged_tokens(self, tokens: int) -> int:
        return -(-tokens // self.page_size) * self.page_size

    def budget_state(self) -> AddReqResult:
        if self.rem_total_tokens <= 0 or self.cur_rem_tokens <= 0 or self._swa_short(0):
            return AddReqResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddReqResult.OTHER
        return AddReqResult.CONTINUE

    def _update_prefill_budget(self, prefix_len: int, extend_input_len: int, max_new_tokens: int) -> None:
        extend_input_len = self.ceil_paged_tokens(extend_input_len)
        self.rem_total_token_offset += extend_input_len + max_new_tokens
        self.cur_rem_token_offset += extend_input_len
        if self.swa_window is not None:
            self.rem_swa_token_offset += extend_input_len + min(max_new_tokens, self.swa_window)
        self.rem_input_tokens -= extend_input_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend_input_len
        self.log_hit_tokens += prefix_len
        self.log_input_tokens += extend_input_len

    def _max_new(self, req: Req) -> int:
        """The decode room admission reserves: never more than the pool has beside the request's
        tokens, or a request whose prompt + max_new_tokens exceed the whole pool would wait
        forever; it runs, and if it truly outgrows the pool it is aborted (retract_decode)."""
        return min(req.clipped_max_new_tokens(), max(self.ledger.total_size() - len(req.fill_ids) - self.page_size, 0))

    def _chunk_budget(self) -> Optional[int]:
        """rem_chunk_tokens, and with the SWA pool no more than it has room for after what this
        round admitted (its windowed layers' slots: mem_cache/swa_kv_ledger.py)."""
        swa_room = self.ledger.swa_room()
        if swa_room is None or self.rem_chunk_tokens is None:
            return self.rem_chunk_tokens
        room = (swa_room - self.cur_rem_token_offset) // self.page_size * self.page_size
        return min(self.rem_chunk_tokens, room)

    def add_chunked_req(self, req: Req) -> Optional[Req]:
        """Continue the request whose prefill is being chunked. Returns it if still unfinished."""
        chunk = self._chunk_budget()
        if chunk is not None and chunk <= 0:
            # The SWA pool is full this round (decodes hold it): wait, as computed so far, for
            # them to move on, finish or be retracted; alone, it always has room (model_runner).
            if self.running_batch is None or self.running_batch.is_empty():
                raise RuntimeError(f"the SWA pool has no room for the chunked request alone: {self.ledger.mem_report()}")
            req.fill_ids, req.extend_input_len = req.fill_ids[: len(req.prefix_indices)], 0
            return req
        truncated = chunk is not None and req.extend_input_len > chunk
        if truncated:
            req.extend_input_len = chunk // self.page_size * self.page_size
            req.fill_ids = req.fill_ids[: len(req.prefix_indices) + req.extend_input_len]
        self.can_run_list.append(req)
        self._update_prefill_budget(0, req.extend_input_len, 0 if truncated else self._max_new(req))
        return req if truncated else None

    def _lock_node(self, last_node):
        # Locked, the matched prefix is not evictable: rem_total_tokens sees the true budget.
        return self.ledger.locked(last_node)

    def add_one_req(self, req: Req, has_chunked_req: bool = False) -> AddReqResult:
        total_tokens = req.extend_input_len + self._max_new(req)
        # HiCache (as SGLang): host hits take device slots (total_tokens) but are loaded back,
        # not computed, so they do not count as input.
        input_tokens = self.ceil_paged_tokens(req.extend_input_len - req.host_hit_length)
        prefix_len = len(req.prefix_indices)
        if total_tokens >= self.rem_total_tokens:
            return AddReqResult.NO_TOKEN
        if input_tokens >= self.rem_input_tokens and self.can_run_list:
            return AddReqResult.OTHER
        with self._lock_node(req.last_node):
            if total_tokens >= self.rem_total_tokens:
                return AddReqResult.NO_TOKEN
            if req.host_hit_length > 0:
                if not self._load_back(req):
                    return AddReqResult.NO_TOKEN
                prefix_len, input_tokens = len(req.prefix_indices), self.ceil_paged_tokens(req.extend_input_len)
            chunk = self._chunk_budget()
            if chunk is None or input_tokens <= chunk:
                if self.swa_window is not None and self._swa_short(input_tokens + min(self._max_new(req), self.swa_window)):
                    return AddReqResult.NO_TOKEN  # its extend and window do not fit the SWA pool's budget
                self.can_run_list.append(req)
                self.ledger.lock(req.last_node)
                self._update_prefill_budget(prefix_len, input_tokens, self._max_new(req))
            else:
                trunc_len = chunk // self.page_size * self.page_size
                if trunc_len <= 0:
                    return AddReqResult.OTHER
                if self._swa_short(trunc_len):
                    return AddReqResult.NO_TOKEN
                req.extend_input_len = trunc_len
                req.fill_ids = req.fill_ids[: len(req.prefix_indices) + trunc_len]
                self.can_run_list.append(req)
                self.new_chunked_req = req
                self.ledger.lock(req.last_node)
                self._update_prefill_budget(prefix_len, trunc_len, 0)
        return self.budget_state()

    def _load_back(self, req: Req) -> bool:
        """HiCache: load the request's host hit into fresh device slots; they extend its cached
        prefix (counted as tier host in prepare_for_extend). False: the device has no room."""
        new_indices, last_node = self.ledger.load_back(req.last_host_node, req.host_hit_length)
        if len(new_indices) < req.host_hit_length:
            return False
        req.prefix_indices = torch.cat([req.prefix_indices, new_indices])
        req.last_node, req.extend_input_len = last_node, len(req.fill_ids) - len(req.prefix_indices)
        req.loaded_host_tokens, req.loaded_storage_tokens = len(new_indices), self.tree_cache.loaded_storage_tokens
        req.host_hit_length = 0  # loaded: a retry of add_one_req must not load it again
        return True

    # ---- priority preemption (seed 001 §13) -------------------------------------------------
    def add_waiting_reqs(self, waiting_queue: List[Req], num_allocatable: Callable[[int], int],
                         try_preemption: bool, has_chunked_req: bool) -> None:
        """Admit requests from the (sorted) waiting queue, in order, until a budget or the
        request slots run out (seed 001 §8). With priority scheduling, a request that does not
        fit may preempt running requests of a worse priority."""
        running_batch = self.running_batch
        for req in waiting_queue:
            slots_full = len(self.can_run_list) >= num_allocatable(running_batch.batch_size())
            if slots_full or running_batch.batch_is_full:
                req.init_next_round_input(self.ledger)
                if not (try_preemption and self.preempt_to_schedule(req, need_slot=slots_full)):
                    running_batch.batch_is_full = True
                    return
                running_batch.batch_is_full = False
            if not self.lora_fits(req):
                # SGLang's skip: it waits for a slot while requests behind it that fit (base, or
                # an adapter already in the batch) go ahead; a busy adapter may keep it waiting
                continue
            req.init_next_round_input(self.ledger)
            res = self.add_one_req(req, has_chunked_req=has_chunked_req)
            if res == AddReqResult.NO_TOKEN and try_preemption and req not in self.can_run_list:
                if self.preempt_to_schedule(req, need_slot=False):
                    res = self.add_one_req(req, has_chunked_req=has_chunked_req)
            if res != AddReqResult.CONTINUE:
                if res == AddReqResult.NO_TOKEN:
                    running_batch.batch_is_full = True
                return

    def lora_fits(self, req: Req) -> bool:
        """SGLang's can_run_lora_batch: the adapters of the running batch, of what this round
        admitted and of `req` fit the LoRA pool's --max-loras-per-batch slots (base: no slot)."""
        limit = getattr(self.policy, "max_loras_per_batch", None)
        if limit is None or req.lora_path is None:
            return True
        running = self.running_batch.reqs if self.running_batch is not None else []
        in_use = {r.lora_path for r in running} | {r.lora_path for r in self.can_run_list}
        in_use.discard(None)
        return req.lora_path in in_use or len(in_use) < limit

    def preempt_to_schedule(self, req: Req, need_slot: bool) -> bool:
        """Retract running requests whose priority is worse than `req`'s by more than the
        threshold, lowest priority (then latest arrival) first, until `req` fits.
        need_slot: the running batch is at max_running_requests, so one request must go."""
        if self.running_batch is None or self.policy is None:
            return False
        key = self.policy.priority_key
        candidates = [
            r for r in self.running_batch.reqs
            if key(r) - key(req) > self.preemption_threshold and r not in self.preempt_list
        ]
        candidates.sort(key=lambda r: (-key(r), -r.arrival_time))
        need = req.extend_input_len + self._max_new(req) - self.rem_total_tokens
        chosen, freed = [], 0.0
        for r in candidates:
            if freed >= need and (chosen or not need_slot):
                break
            chosen.append(r)
            freed += r.seqlen() + self._running_offset(r)
        if not chosen or freed < need:
            return False
        for r in chosen:
            self.rem_total_token_offset -= self._running_offset(r)
            self.running_batch.release_req(r)
        keep = [i for i, r in enumerate(self.running_batch.reqs) if r not in chosen]
        self.running_batch.filter_batch(keep_indices=keep)
        self.preempt_list.extend(chosen)
        return True


def configure_lora_admission(policy: SchedulePolicy, server_args: ServerArgs) -> None:
    """--enable-lora: the Scheduler's PrefillAdder (through its policy) admits only what fits the LoRA slots."""
    if server_args.enable_lora:
        policy.max_loras_per_batch = server_args.max_loras_per_batch
