"""How the benchmarks (`radixserve bench ...`) and the simulator (`radixserve simulate`) write
their results: tables, the serving report, its plot, and JSON files.

    markdown_table(header, rows)        a right-aligned Markdown table
    format_report(metrics, title, ...)  the text report of bench serving / simulate
    plot_results(outputs, metrics, ...) TTFT and ITL distributions, throughput over time (PNG)
    json_safe(x)                        inf / nan as strings, so the JSON is strict
    write_json(path, obj)               one JSON document (parent folders made)
    append_jsonl(path, record)          one JSON line appended (parent folders made)
    machine_info(), loadavg()           where a benchmark ran (timings depend on it)
"""

from __future__ import annotations

import json
import math
import os
import platform
from typing import Any, Dict, List, Sequence, Tuple

from radixserve.bench.metrics import RequestOutput


def ensure_parent_dir(path: str) -> None:
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)


def markdown_table(header: List[str], rows: List[List[str]]) -> str:
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) if rows else len(header[i]) for i in range(len(header))]

    def fmt(cells: List[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"

    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([fmt(header), sep] + [fmt(r) for r in rows])


def format_report(m: Dict[str, Any], title: str, header: Sequence[Tuple[str, Any]] = ()) -> str:
    w = 50
    lines = ["{s:{c}^{n}}".format(s=f" {title} ", n=w, c="=")]

    def row(name: str, value: Any) -> None:
        if isinstance(value, float):
            value = f"{value:.2f}"
        lines.append(f"{name + ':':<40} {value!s:<10}")

    for k, v in header:
        row(k, v)
    row("Successful requests", m["completed"])
    if m.get("failed"):
        row("Failed requests", m["failed"])
    row("Benchmark duration (s)", m["duration"])
    row("Total input tokens", m["total_input_tokens"])
    row("Total generated tokens", m["total_output_tokens"])
    row("Request throughput (req/s)", m["request_throughput"])
    row("Input token throughput (tok/s)", m["input_throughput"])
    row("Output token throughput (tok/s)", m["output_throughput"])
    row("Total token throughput (tok/s)", m["total_throughput"])
    row("Concurrency", m["concurrency"])
    if m.get("cache_hit_rate") is not None:
        row("Cache hit rate", f"{m['cache_hit_rate']:.4f}")
    for key, name in (("e2e_latency", "End-to-End Latency"), ("ttft", "Time to First Token"),
                      ("tpot", "Time per Output Token (excl. 1st token)"), ("itl", "Inter-Token Latency")):
        lines.append("{s:{c}^{n}}".format(s=name, n=w, c="-"))
        short = {"e2e_latency": "E2E Latency"}.get(key, key.upper())
        for stat in ("mean", "median", "p90", "p99"):
            row(f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {short} (ms)", m[f"{stat}_{key}_ms"])
    lines.append("=" * w)
    return "\n".join(lines)


def plot_results(outputs: Sequence[RequestOutput], m: Dict[str, Any], path: str, title: str) -> None:
    """TTFT and ITL distributions and output throughput over time, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [o for o in outputs if o.success]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    ttft = [o.ttft * 1e3 for o in ok]
    itl = [x * 1e3 for o in ok for x in o.itl]
    for ax, data, name, key in ((axes[0], ttft, "TTFT (ms)", "ttft"), (axes[1], itl, "ITL (ms)", "itl")):
        if data:
            ax.hist(data, bins=50, color="tab:blue", alpha=0.8)
            for stat, style in (("median", "--"), ("p99", ":")):
                ax.axvline(m[f"{stat}_{key}_ms"], color="k", linestyle=style, label=f"{stat} {m[f'{stat}_{key}_ms']:.1f}")
            ax.legend()
        ax.set_xlabel(name)
        ax.set_ylabel("count")
        ax.set_title(f"{name.split()[0]} distribution")
    chunks = sorted((t, n) for o in ok for t, n in o.chunks)
    ax = axes[2]
    if chunks:
        end = max(t for t, _ in chunks)
        width = max(end / 60, 1e-3)
        bins = [0.0] * (int(end / width) + 1)
        for t, n in chunks:
            bins[min(int(t / width), len(bins) - 1)] += n
        ax.step([i * width for i in range(len(bins))], [b / width for b in bins], where="post")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("output throughput over time")
    fig.suptitle(title)
    fig.tight_layout()
    ensure_parent_dir(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def json_safe(x: Any) -> Any:
    """inf / nan become strings, so the output is strict JSON (request_rate defaults to inf)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def write_json(path: str, obj: Dict[str, Any]) -> None:
    ensure_parent_dir(path)
    with open(path, "w") as f:
        json.dump(json_safe(obj), f, indent=2)
        f.write("\n")


def append_jsonl(path: str, record: Dict[str, Any]) -> None:
    ensure_parent_dir(path)
    with open(path, "a") as f:
        f.write(json.dumps(json_safe(record)) + "\n")


def loadavg() -> List[float]:
    """1/5/15-minute load average: > ~1 on a 2-core machine means the timing was contended."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):  # not on every platform
        return []


def machine_info() -> Dict[str, Any]:
    """What a benchmark report records about where it ran (timings depend on all of it)."""
    import torch

    return {
        "torch_num_threads": torch.get_num_threads(),
        "loadavg_after": loadavg(),
        "torch_version": torch.__version__,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
    }
