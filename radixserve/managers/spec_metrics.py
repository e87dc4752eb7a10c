"""Speculative decoding's Prometheus metrics (SGLang's names; served twice, as `sglang:` with a
model_name label and as the older unlabelled `radixserve:`), read from the scheduler's state at
each scrape (TokenizerMetrics.set_scheduler_state):

    spec_verify_calls_total            verify steps, summed over requests (SGLang's counter;
                                       generation tokens / this = the mean accept length)
    spec_num_correct_drafts_total      drafts the target accepted
    spec_num_proposed_drafts_total     drafts verified
    spec_accept_length                 tokens per request per verify step, over the scheduler's
                                       last decode-log window (SGLang's gauge; before the first
                                       log line, the mean since start)
    spec_accept_rate                   accepted / proposed drafts over the same window
    spec_accept_length_histogram       tokens each request committed per verify step (1 = no
                                       draft accepted, or none proposed)

The scheduler keeps the totals (SchedulerStats), so a collector that reports them as they are is
all that is needed here: no counting twice in two processes.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional

PREFIX = "radixserve:"


class SpecMetricsCollector:
    """A prometheus_client collector of the last scheduler state's spec_* numbers; the
    histogram's buckets are 1 .. num_draft_tokens committed tokens."""

    def __init__(self, num_draft_tokens: int, prefix: str = PREFIX, labels: Optional[Dict[str, str]] = None):
        self.bounds = list(range(1, num_draft_tokens + 1))
        self.state: Dict[str, Any] = {}
        self.prefix, self.labels = prefix, dict(labels or {})

    def _family(self, family: Any, name: str, doc: str, value: float) -> Any:
        metric = family(self.prefix + name, doc, labels=list(self.labels))
        metric.add_metric(list(self.labels.values()), value)
        return metric

    def update(self, state: Dict[str, Any]) -> None:
        self.state = state

    def describe(self) -> List[Any]:
        return []  # metrics are made at collect time (prometheus_client then skips its dry run)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        st = self.state
        verify = st.get("spec_verify_ct", 0)
        yield self._family(CounterMetricFamily, "spec_verify_calls", "Verify steps of speculative decoding, summed over requests.",
                           verify)
        yield self._family(CounterMetricFamily, "spec_num_correct_drafts", "Draft tokens the target accepted.",
                           st.get("spec_num_correct_drafts", 0))
        yield self._family(CounterMetricFamily, "spec_num_proposed_drafts", "Draft tokens verified.",
                           st.get("spec_num_proposed_drafts", 0))
        length = st.get("spec_accept_length") or st.get("avg_spec_accept_length", 0.0)
        yield self._family(GaugeMetricFamily, "spec_accept_length", "The average acceptance length of speculative decoding "
                           "(tokens per request per verify step).", length)
        rate = st.get("spec_accept_rate")
        if rate is None or not st.get("spec_accept_length"):
            proposed = st.get("spec_num_proposed_drafts", 0)
            rate = st.get("spec_num_correct_drafts", 0) / proposed if proposed else 0.0
        yield self._family(GaugeMetricFamily, "spec_accept_rate", "The average acceptance rate of speculative decoding "
                           "(accepted / proposed draft tokens).", rate)
        yield self._histogram(HistogramMetricFamily, st.get("spec_accept_length_counts") or [], st.get("spec_num_accept_tokens", 0))

    def _histogram(self, family: Any, counts: List[int], total: float) -> Any:
        """counts[i]: request-steps that committed i + 1 tokens, as cumulative buckets."""
        buckets, seen = [], 0
        for b in self.bounds:
            seen += counts[b - 1] if b - 1 < len(counts) else 0
            buckets.append((f"{float(b)}", seen))
        buckets.append(("+Inf", sum(counts)))
        metric = family(self.prefix + "spec_accept_length_histogram", "Tokens each request committed per verify step.",
                        labels=list(self.labels))
        metric.add_metric(list(self.labels.values()), buckets, total)
        return metric
