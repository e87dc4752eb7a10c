"""SchedulerStats: the Scheduler's counters, typed. Tests, /get_server_info, the metrics log,
the simulator and the benchmarks read them (through `Engine.stats()` offline)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Tuple


class CountsByLength(tuple):
    """Counts indexed by a length. A tuple, so a snapshot (Scheduler.get_stats) never changes
    afterwards; `after - before` subtracts index by index (bench/offline.py's stats_delta)."""

    def __sub__(self, other: Tuple[int, ...]) -> "CountsByLength":
        n = max(len(self), len(other))
        a, b = list(self) + [0] * (n - len(self)), list(other) + [0] * (n - len(other))
        return CountsByLength(x - y for x, y in zip(a, b))


@dataclass
class SchedulerStats:
    # batches run, by kind
    num_prefill_batches: int = 0
    num_decode_batches: int = 0
    num_mixed_batches: int = 0
    num_chunked_prefills: int = 0
    # memory pressure (seed 001 §9) and priority preemption
    num_retractions: int = 0
    num_retracted_reqs: int = 0
    num_preempted_reqs: int = 0
    # prompt tokens of admitted requests, and those served from the prefix cache
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # overlap loop: results processed, and those processed while the next forward ran
    results_processed: int = 0
    results_processed_while_busy: int = 0
    # ... and those processed after the next batch was launched (the overlap share's numerator)
    results_processed_overlapped: int = 0
    # seconds of the scheduling thread per phase (bench offline's breakdown)
    schedule_s: float = 0.0
    forward_s: float = 0.0  # normal loop: the forward ran inline on this thread
    process_s: float = 0.0
    wait_s: float = 0.0  # overlap loop: waiting for a result
    # seconds the forward thread ran (overlap loop; the "device" time)
    forward_thread_busy_s: float = 0.0
    # speculative decoding, summed over requests: verify steps, tokens they committed, drafts
    spec_verify_ct: int = 0
    spec_num_accept_tokens: int = 0
    spec_num_correct_drafts: int = 0
    spec_num_proposed_drafts: int = 0
    # the accept-length histogram: [i] = (request, verify step) pairs that committed i + 1 tokens
    spec_accept_length_counts: "CountsByLength" = field(default_factory=lambda: CountsByLength())

    def count_batch(self, forward_mode: Any) -> None:
        if forward_mode.is_decode():
            self.num_decode_batches += 1
        elif forward_mode.is_mixed():
            self.num_mixed_batches += 1
        else:
            self.num_prefill_batches += 1

    def count_prefill(self, reqs: List[Any], cached_tokens: int, chunked: bool) -> None:
        """A prefill batch was formed: count each prompt once (its first chunk, first time)."""
        self.num_chunked_prefills += chunked
        self.prompt_tokens += sum(len(r.origin_input_ids) for r in reqs if r.pending_chunks <= 1 and r.already_computed == 0)
        self.cached_tokens += cached_tokens

    def count_spec_accept_lens(self, accept_lens: List[int]) -> None:
        """One verify step: each request's accepted drafts (its committed tokens minus one)."""
        counts = list(self.spec_accept_length_counts)
        for a in accept_lens:
            counts.extend([0] * (a + 1 - len(counts)))
            counts[a] += 1
        self.spec_accept_length_counts = CountsByLength(counts)

    @property
    def num_batches(self) -> int:
        return self.num_prefill_batches + self.num_decode_batches + self.num_mixed_batches

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        out["spec_accept_length_counts"] = list(self.spec_accept_length_counts)
        if self.spec_verify_ct:  # SGLang's get_internal_state key: tokens per request per verify step
            out["avg_spec_accept_length"] = self.spec_num_accept_tokens / self.spec_verify_ct
        return out
