"""Per-request results and the serving metrics computed from them (SGLang bench_serving's):
shared by `radixserve bench serving` (wall times) and `radixserve simulate` (virtual times).

    RequestOutput        one request: success, lengths, TTFT, ITL, E2E latency, streamed chunks
    calculate_metrics    completed / failed, throughputs, TTFT / TPOT / ITL / E2E mean, std,
                         median, p90, p99 (ms)
    percentile           linear interpolation between the closest ranks (numpy's default)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

PERCENTILES = (50, 90, 99)


@dataclass
class RequestOutput:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0  # s
    latency: float = 0.0  # E2E, s
    itl: List[float] = field(default_factory=list)  # s
    start_time: float = 0.0  # send time, s from the benchmark start
    cached_tokens: int = 0
    error: str = ""
    # (time from the benchmark start, new output tokens) per streamed chunk: throughput over time
    chunks: List[Tuple[float, int]] = field(default_factory=list)
    generated_text: str = ""  # the answer (multi-turn feeds it into the next turn's prompt)
    user: Optional[int] = None  # multi-turn: which conversation and which turn (0-based)
    turn: Optional[int] = None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of `values`; 0.0 for none."""
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def latency_stats(prefix: str, values_s: Sequence[float]) -> Dict[str, float]:
    """mean / std / median / p90 / p99 of `values_s` (seconds) in ms, keyed `{stat}_{prefix}_ms`."""
    ms = [v * 1e3 for v in values_s]
    mean = sum(ms) / len(ms) if ms else 0.0
    out = {
        f"mean_{prefix}_ms": mean,
        f"std_{prefix}_ms": math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms)) if ms else 0.0,
    }
    for q in PERCENTILES:
        name = "median" if q == 50 else f"p{q}"
        out[f"{name}_{prefix}_ms"] = percentile(ms, q)
    return out


def calculate_metrics(outputs: Sequence[RequestOutput], duration: float) -> Dict[str, Any]:
    ok = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_len for o in ok)
    duration = max(duration, 1e-9)
    tpots = [(o.latency - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1]
    itls = [x for o in ok for x in o.itl]
    m: Dict[str, Any] = {
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "input_throughput": total_in / duration,
        "output_throughput": total_out / duration,
        "total_throughput": (total_in + total_out) / duration,
        "concurrency": sum(o.latency for o in ok) / duration,
        "cached_tokens": sum(o.cached_tokens for o in ok),
    }
    m.update(latency_stats("e2e_latency", [o.latency for o in ok]))
    m.update(latency_stats("ttft", [o.ttft for o in ok]))
    m.update(latency_stats("tpot", tpots))
    m.update(latency_stats("itl", itls))
    return m
