"""The served runtime's Prometheus metrics (GET /metrics), kept in the main process.

Names, labels and histogram buckets are SGLang's exporter's (sglang/srt/metrics/collector.py:
TokenizerMetricsCollector and SchedulerMetricsCollector): an `sglang:` prefix and a `model_name`
label, so SGLang's Grafana dashboard and alert rules work on a radixserve server unchanged.

The older unlabelled `radixserve:` names (with their own buckets) are still served beside them,
deprecated, so scrapes and dashboards made for earlier versions keep working.

    per request (TokenizerMetrics.on_update)      the scheduler's state at each scrape
    ----------------------------------------      ----------------------------------------
    prompt/generation/cached_tokens_total         num_running_reqs, num_queue_reqs,
    num_requests_total, num_aborted_requests_     num_grammar_queue_reqs, num_used_tokens,
    total, num_so_requests_total                  token_usage, gen_throughput, cache_hit_rate,
    time_to_first_token_seconds                   max_total_num_tokens, new_token_ratio,
    inter_token_latency_seconds                   num_retracted_requests_total,
    e2e_request_latency_seconds, queue_time_seconds  num_grammar_{total,cache_hit,aborted,timeout}_total,
    num_retractions                               grammar_compilation_time_seconds
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

from radixserve.managers.spec_metrics import SpecMetricsCollector

SGLANG_PREFIX = "sglang:"
LEGACY_PREFIX = "radixserve:"

# SGLang's default buckets (collector.py)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
INTER_TOKEN_LATENCY_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
                               0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0)
E2E_REQUEST_LATENCY_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600,
                               1200, 1800, 2400)
QUEUE_TIME_BUCKETS = (0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300,
                      400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000)
NUM_RETRACTIONS_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 15, 20, 25, 30, 40, 50, 75, 100)
GRAMMAR_COMPILATION_TIME_BUCKETS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 90, 120, 240)

# The buckets the radixserve: histograms always had (unchanged for their existing scrapes)
_LEGACY_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160)
_LEGACY_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5)
_LEGACY_E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320)

# Scheduler gauges: (SGLang's name, the internal_state key, help); None: computed below.
_SCHEDULER_GAUGES: Tuple[Tuple[str, Optional[str], str], ...] = (
    ("num_running_reqs", "num_running_reqs", "The number of running requests."),
    ("num_queue_reqs", "num_waiting_reqs", "The number of requests in the waiting queue."),
    ("num_grammar_queue_reqs", "num_grammar_queue_reqs", "The number of requests in the grammar waiting queue."),
    ("num_used_tokens", None, "The number of used tokens (KV slots held by requests)."),
    ("token_usage", "token_usage", "The token usage."),
    ("gen_throughput", "gen_throughput", "The generation throughput (token/s)."),
    ("cache_hit_rate", "cache_hit_rate", "The prefix cache hit rate."),
    ("max_total_num_tokens", "max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."),
    ("new_token_ratio", "new_token_ratio", "The new token ratio."),
)
# Scheduler counters: (SGLang's name without _total, the internal_state key, help)
_SCHEDULER_COUNTERS: Tuple[Tuple[str, str, str], ...] = (
    ("num_retracted_requests", "num_retracted_reqs", "Total number of retracted requests."),
    ("num_grammar_total", "num_grammar_total", "Number of the total grammar requests."),
    ("num_grammar_cache_hit", "num_grammar_cache_hit", "Number of grammar cache hits."),
    ("num_grammar_aborted", "num_grammar_aborted", "Number of grammar aborted requests."),
    ("num_grammar_timeout", "num_grammar_timeout", "Number of grammar timeouts."),
)
# The five the radixserve: names had
_LEGACY_GAUGES = ("num_running_reqs", "num_queue_reqs", "token_usage", "cache_hit_rate", "gen_throughput")


def _num_used_tokens(st: Dict[str, Any]) -> float:
    total = st.get("max_total_num_tokens") or 0
    return max(total - st.get("available_tokens", total) - st.get("evictable_tokens", 0), 0)


class SchedulerStateCollector:
    """The scheduler's gauges and counters from its last internal state (read at each scrape,
    so nothing is counted twice in two processes)."""

    def __init__(self, labels: Dict[str, str]):
        self.labels = labels
        self.state: Dict[str, Any] = {}

    def describe(self) -> List[Any]:
        return []  # made at collect time

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st, names, values = self.state, list(self.labels), list(self.labels.values())
        for name, key, doc in _SCHEDULER_GAUGES:
            value = float(_num_used_tokens(st) if key is None else st.get(key) or 0)
            family = GaugeMetricFamily(SGLANG_PREFIX + name, doc, labels=names)
            family.add_metric(values, value)
            yield family
            if name in _LEGACY_GAUGES:
                yield GaugeMetricFamily(LEGACY_PREFIX + name, doc, value=value)
        for name, key, doc in _SCHEDULER_COUNTERS:
            counter = CounterMetricFamily(SGLANG_PREFIX + name, doc, labels=names)
            counter.add_metric(values, float(st.get(key, 0)))
            yield counter
        yield self._grammar_compilation_time(names, values)

    def _grammar_compilation_time(self, names: List[str], values: List[str]) -> Any:
        from prometheus_client.core import HistogramMetricFamily

        counts = self.state.get("grammar_compilation_time_counts") or [0] * (len(GRAMMAR_COMPILATION_TIME_BUCKETS) + 1)
        buckets, seen = [], 0
        for bound, n in zip(GRAMMAR_COMPILATION_TIME_BUCKETS, counts):
            seen += n
            buckets.append((str(float(bound)), seen))
        buckets.append(("+Inf", sum(counts)))
        family = HistogramMetricFamily(SGLANG_PREFIX + "grammar_compilation_time_seconds",
                                       "Histogram of grammar compilation time in seconds.", labels=names)
        family.add_metric(values, buckets, self.state.get("grammar_compilation_time_sum", 0.0))
        return family


class _Twin:
    """One metric under SGLang's name (a labelled child) and, where it existed, the old name."""

    def __init__(self, new: Any, old: Any = None):
        self.new, self.old = new, old

    def inc(self, amount: float = 1) -> None:
        self.new.inc(amount)
        if self.old is not None:
            self.old.inc(amount)

    def observe(self, value: float) -> None:
        self.new.observe(value)
        if self.old is not None:
            self.old.observe(value)


class TokenizerMetrics:
    """Prometheus metrics in a registry of their own (see the module's docstring)."""

    def __init__(self, spec_num_draft_tokens: Optional[int] = None, model_name: str = "radixserve") -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = r = CollectorRegistry()
        self.labels = labels = {"model_name": model_name}
        self.scheduler_state = SchedulerStateCollector(labels)
        r.register(self.scheduler_state)
        # --speculative-algorithm: the spec_* metrics, from the scheduler's totals, under both prefixes
        self.spec: List[SpecMetricsCollector] = []
        if spec_num_draft_tokens:
            self.spec = [SpecMetricsCollector(spec_num_draft_tokens),
                         SpecMetricsCollector(spec_num_draft_tokens, SGLANG_PREFIX, labels)]
            for collector in self.spec:
                r.register(collector)

        def counter(name: str, doc: str, legacy: bool = True) -> _Twin:
            new = Counter(SGLANG_PREFIX + name, doc, list(labels), registry=r).labels(**labels)
            return _Twin(new, Counter(LEGACY_PREFIX + name, doc, registry=r) if legacy else None)

        def histogram(name: str, doc: str, buckets: Tuple[float, ...], legacy: Optional[Tuple[float, ...]] = None) -> _Twin:
            new = Histogram(SGLANG_PREFIX + name, doc, list(labels), registry=r, buckets=buckets).labels(**labels)
            return _Twin(new, Histogram(LEGACY_PREFIX + name, doc, registry=r, buckets=legacy) if legacy else None)

        self.prompt_tokens_total = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens_total = counter("generation_tokens", "Number of generation tokens processed.")
        self.cached_tokens_total = counter("cached_tokens", "Number of cached prompt tokens.")
        self.num_requests_total = counter("num_requests", "Number of requests processed.")
        self.num_aborted_requests_total = counter("num_aborted_requests", "Number of requests aborted.")
        self.num_so_requests_total = counter("num_so_requests", "Number of structured output requests processed.",
                                             legacy=False)
        self.cached_tokens_by_tier_total = Counter(  # HiCache: where the cached tokens came from (ours only)
            LEGACY_PREFIX + "cached_tokens_by_tier", "Prompt tokens served from the prefix cache, by tier (device, host, storage).",
            ["tier"], registry=r)
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                             TIME_TO_FIRST_TOKEN_BUCKETS, _LEGACY_TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                             INTER_TOKEN_LATENCY_BUCKETS)
        self._legacy_inter_token_latency = Histogram(LEGACY_PREFIX + "inter_token_latency_seconds", "Time between output tokens.",
                                                     registry=r, buckets=_LEGACY_ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                                             E2E_REQUEST_LATENCY_BUCKETS, _LEGACY_E2E_BUCKETS)
        self.queue_time = histogram("queue_time_seconds", "Histogram of queueing time in seconds.", QUEUE_TIME_BUCKETS)
        self.num_retractions = histogram("num_retractions", "Histogram of retraction counts per request.",
                                         NUM_RETRACTIONS_BUCKETS)
        self.num_disconnect_aborts = 0

    def on_update(self, state: Any, num_new_tokens: int, now: float) -> None:
        """Latency histograms and finished-request counters from one request's news (a ReqState)."""
        if num_new_tokens:
            if state.first_token_time is None:
                state.first_token_time = now
                self.time_to_first_token.observe(now - state.created)
            elif state.last_time is not None:
                interval = now - state.last_time
                self._legacy_inter_token_latency.observe(interval / num_new_tokens)
                for _ in range(num_new_tokens):  # SGLang counts each token of the interval once
                    self.inter_token_latency.observe(interval / num_new_tokens)
            state.last_time = now
        if state.finished:
            self._on_finish(state, now)

    def _on_finish(self, state: Any, now: float) -> None:
        self.num_requests_total.inc()
        self.prompt_tokens_total.inc(len(state.input_ids))
        self.generation_tokens_total.inc(state.completion_tokens)
        self.cached_tokens_total.inc(state.cached_tokens)
        for tier, n in (state.cached_tokens_details or {}).items():
            self.cached_tokens_by_tier_total.labels(tier=tier).inc(n)
        self.e2e_request_latency.observe(now - state.created)
        self.num_retractions.observe(state.retraction_count)
        if state.queue_time is not None:
            self.queue_time.observe(state.queue_time)
        sp = state.sampling_params
        if any(x is not None for x in (sp.json_schema, sp.regex, sp.ebnf, sp.structural_tag)):
            self.num_so_requests_total.inc()
        if (state.finished_reason or {}).get("type") == "abort":
            self.num_aborted_requests_total.inc()

    def set_scheduler_state(self, st: Dict[str, Any]) -> None:
        self.scheduler_state.state = st
        for collector in self.spec:
            collector.update(st)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
