"""GrammarQueue: structured-output admission (seed 000, seed 001 §12). A request with a
json_schema / regex / ebnf constraint waits here while its grammar compiles on the backend's
thread pool, then joins the waiting queue; an invalid grammar, or one that takes longer than
--grammar-timeout, ends the request with a 400."""

from __future__ import annotations

import bisect
import time
from concurrent import futures
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional

from radixserve.constrained.base_grammar_backend import (
    BaseGrammarBackend,
    InvalidGrammarObject,
    grammar_key,
    grammar_unavailable_message,
    is_invalid_grammar,
)
from radixserve.distributed.parallel_state import broadcast_pyobj
from radixserve.managers.metrics import GRAMMAR_COMPILATION_TIME_BUCKETS
from radixserve.managers.schedule_batch import FINISH_ABORT, Req
from radixserve.server_args import ServerArgs

# How long an otherwise idle scheduler blocks on a compiling grammar per iteration.
IDLE_GRAMMAR_WAIT_S = 0.005


@dataclass
class GrammarStats:
    """SGLang's grammar metrics (sglang:num_grammar_*_total, grammar_compilation_time_seconds)."""

    num_grammar_total: int = 0  # requests with a grammar
    num_grammar_cache_hit: int = 0
    num_grammar_aborted: int = 0  # invalid grammars
    num_grammar_timeout: int = 0
    # compile times (queued -> compiled) per GRAMMAR_COMPILATION_TIME_BUCKETS bucket, the last: above all
    grammar_compilation_time_counts: List[int] = field(
        default_factory=lambda: [0] * (len(GRAMMAR_COMPILATION_TIME_BUCKETS) + 1))
    grammar_compilation_time_sum: float = 0.0

    def observe_compilation(self, seconds: float) -> None:
        self.grammar_compilation_time_counts[bisect.bisect_left(GRAMMAR_COMPILATION_TIME_BUCKETS, seconds)] += 1
        self.grammar_compilation_time_sum += seconds


class GrammarQueue:
    def __init__(
        self,
        server_args: ServerArgs,
        backend: Optional[BaseGrammarBackend],
        reject: Callable[[Req, str], None],  # ends a request with a 400 and this message
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        self.server_args = server_args
        self.backend = backend
        self.reject = reject
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.queue: List[Req] = []
        self.stats = GrammarStats()

    def internal_state(self) -> Dict[str, Any]:
        return {**asdict(self.stats), "grammar_compilation_time_counts": list(self.stats.grammar_compilation_time_counts)}

    def __len__(self) -> int:
        return len(self.queue)

    def __iter__(self):
        return iter(self.queue)

    def admit(self, req: Req) -> bool:
        """Attach the request's grammar. True: it can join the waiting queue now (no grammar,
        or a cached one). False: it waits here for its compile, or was rejected."""
        key = grammar_key(req.sampling_params)
        if key is None:
            return True
        if self.backend is None:
            self.reject(req, grammar_unavailable_message(self.server_args))
            return False
        value, cache_hit = self.backend.get_cached_or_future_value(key)
        self.stats.num_grammar_total += 1
        self.stats.num_grammar_cache_hit += cache_hit
        if not cache_hit:  # compiling: wait here
            req.grammar, req.grammar_key = value, key
            req.grammar_queued_at = time.monotonic()
            self.queue.append(req)
            return False
        if is_invalid_grammar(value):  # a cached invalid grammar fails fast
            self.stats.num_grammar_aborted += 1
            self.reject(req, value.message)
            return False
        req.grammar = value
        return True

    def pop_ready(self, scheduler_idle: bool) -> List[Req]:
        """The requests whose grammar compiled, in arrival order; rejects invalid and timed-out
        ones. With TP, rank 0 decides and the other ranks follow (they wait for their own
        compile). An idle scheduler waits a little for a compile instead of spinning."""
        if not self.queue or self.backend is None:
            return []
        if scheduler_idle:
            futures.wait([self.queue[0].grammar], timeout=IDLE_GRAMMAR_WAIT_S)
        timeout = self.server_args.grammar_timeout
        now = time.monotonic()
        decisions = [
            "ready" if req.grammar.done() else "timeout" if now - req.grammar_queued_at > timeout else "wait"
            for req in self.queue
        ]
        if self.tp_size > 1:
            decisions = broadcast_pyobj(decisions if self.tp_rank == 0 else None)
        ready: List[Req] = []
        still_waiting: List[Req] = []
        for req, decision in zip(self.queue, decisions):
            if decision == "wait":
                still_waiting.append(req)
            elif decision == "timeout":
                req.grammar.cancel()
                message = f"Grammar compilation timed out after {timeout:g} s (--grammar-timeout)."
                # Cache it as invalid: the same grammar fails fast instead of timing out again.
                self.backend.set_cache(req.grammar_key, InvalidGrammarObject(message))
                self.stats.num_grammar_timeout += 1
                self.reject(req, message)
            else:
                value = req.grammar.result()
                self.stats.observe_compilation(now - req.grammar_queued_at)
                if is_invalid_grammar(value):
                    self.stats.num_grammar_aborted += 1
                    self.reject(req, value.message)
                else:
                    req.grammar = value
                    ready.append(req)
        self.queue = still_waiting
        return ready

    def remove(self, match: Callable[[Req], bool]) -> List[Req]:
        """Take the matching requests out (abort); a compile still running is cancelled."""
        removed = [r for r in self.queue if match(r)]
        self.queue = [r for r in self.queue if not match(r)]
        for r in removed:
            if isinstance(r.grammar, futures.Future):
                r.grammar.cancel()
            r.grammar = None
        return removed

    def discard(self, req: Req) -> None:
        if req in self.queue:
            self.queue.remove(req)

    @staticmethod
    def fail_request(req: Req, error: Exception) -> None:
        """A request's grammar broke while filling its mask: that request ends (500) at its
        next token; the batch goes on."""
        req.to_finish = FINISH_ABORT(f"Internal error in the request's grammar: {type(error).__name__}: {error}",
                                     status_code=500, err_type="InternalServerError")

    def reset(self) -> None:
        """Flush: compiled grammars go too (SGLang does the same)."""
        if self.backend is not None:
            self.backend.reset()

    def shutdown(self) -> None:
        if self.backend is not None:
            self.backend.shutdown()
