"""The table of benchmarks/cpu_vs_peers.sh: reads the JSON lines `radixserve bench serving`
appended (tags "ENGINE/WORKLOAD", the last line of a tag wins), prints a markdown table and
writes it to a file.

    python benchmarks/cpu/report.py benchmarks/cpu_vs_llamacpp.jsonl --md benchmarks/cpu_vs_llamacpp.md

Ratios are ENGINE / baseline for the same workload (baseline: --baseline, else the first engine
whose name starts with "llamacpp"): output tok/s (higher is better for ENGINE when > 1) and
mean ITL (lower is better for ENGINE when < 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Optional, Tuple

WORKLOAD_ORDER = ("serving", "one-user", "chat")


def load(path: str) -> Dict[Tuple[str, str], Dict[str, Any]]:
    """(engine, workload) -> the last record with that tag."""
    out: Dict[Tuple[str, str], Dict[str, Any]] = {}
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            tag = rec.get("tag") or ""
            if "/" not in tag:
                continue
            engine, workload = tag.split("/", 1)
            out[(engine, workload)] = rec
    return out


def _order(items: List[str], first: Tuple[str, ...]) -> List[str]:
    return sorted(items, key=lambda x: (first.index(x) if x in first else len(first), x))


def _fmt(x: Optional[float], nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def workload_key(rec: Dict[str, Any]) -> Tuple[Any, ...]:
    """What must match for two runs to be compared."""
    a = rec.get("args", {})
    keys = ("dataset_name", "seed", "random_input_len", "random_output_len", "random_range_ratio", "num_prompts",
            "max_concurrency", "num_users", "num_turns", "system_prompt_len", "turn_input_len")
    return tuple(a.get(k, rec.get(k)) for k in keys)


def workload_desc(rec: Dict[str, Any]) -> str:
    a = rec.get("args", {})
    if rec.get("dataset_name") == "multi-turn":
        return (f"{rec.get('num_users')} users x {rec.get('num_turns')} turns, system {rec.get('system_prompt_len')}, "
                f"user msg {rec.get('turn_input_len')}, answer {rec.get('output_len')}, "
                f"concurrency {rec.get('max_concurrency') or 'all users'}")
    return (f"{rec.get('num_prompts')} requests, in {a.get('random_input_len')}, out {a.get('random_output_len')}, "
            f"concurrency {rec.get('max_concurrency') or 'unbounded'}")


def build_report(records: Dict[Tuple[str, str], Dict[str, Any]], baseline: Optional[str] = None) -> str:
    engines = sorted({e for e, _ in records}, key=lambda e: (not e.startswith("llamacpp"), e))
    if baseline is None:
        baseline = next((e for e in engines if e.startswith("llamacpp")), None)
    workloads = _order(list({w for _, w in records}), WORKLOAD_ORDER)
    mismatch = False
    lines = ["| engine | workload | done/failed | output tok/s | mean TTFT ms | median TTFT ms | mean ITL ms | "
             "median ITL ms | cache hit | tok/s ratio | ITL ratio |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for w in workloads:
        base = records.get((baseline, w)) if baseline else None
        for e in engines:
            r = records.get((e, w))
            if r is None:
                continue
            hit = r.get("cache_hit_rate", r.get("usage_cache_hit_rate"))
            if base is not None and e != baseline and workload_key(r) != workload_key(base):
                tput = itl = "differs*"
                mismatch = True
            elif base is not None and e != baseline:
                tput = _fmt(_ratio(r["output_throughput"], base["output_throughput"]), 2)
                itl = _fmt(_ratio(r["mean_itl_ms"], base["mean_itl_ms"]), 2)
            else:
                tput = itl = "-"
            lines.append(f"| {e} | {w} | {r['completed']}/{r['failed']} | {_fmt(r['output_throughput'])} | "
                         f"{_fmt(r['mean_ttft_ms'])} | {_fmt(r['median_ttft_ms'])} | {_fmt(r['mean_itl_ms'], 2)} | "
                         f"{_fmt(r['median_itl_ms'], 2)} | {_fmt(hit, 3)} | {tput} | {itl} |")
    out = ["## CPU: radixserve vs llama.cpp", "",
           f"Ratios: engine / {baseline or '(no llama.cpp baseline)'} on the same workload "
           "(tok/s ratio > 1 and ITL ratio < 1 favour the engine). Cache hit: cached prompt tokens / prompt "
           "tokens (the server's /metrics where it has them, else the responses' usage).", ""]
    out += lines
    if mismatch:
        out += ["", "\\* not the same workload parameters as the baseline's run (rerun both with the same settings)."]
    out += ["", "Workloads:", ""]
    for w in workloads:
        rec = next(records[(e, w)] for e in engines if (e, w) in records)
        out.append(f"- **{w}**: {workload_desc(rec)}")
    chat = [(e, records[(e, "chat")]) for e in engines if (e, "chat") in records and records[(e, "chat")].get("per_turn")]
    if chat:
        out += ["", "Chat, per turn (mean prompt tokens, cached prompt tokens, mean TTFT ms, mean ITL ms):", "",
                "| engine | turn | prompt len | cached | mean TTFT ms | mean ITL ms |", "|---|---:|---:|---:|---:|---:|"]
        for e, r in chat:
            for t in r["per_turn"]:
                out.append(f"| {e} | {t['turn'] + 1} | {t['mean_prompt_len']:.0f} | {t['cached_tokens']} | "
                           f"{t['mean_ttft_ms']:.1f} | {t['mean_itl_ms']:.2f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jsonl")
    p.add_argument("--md", default=None, help="also write the table here")
    p.add_argument("--baseline", default=None, help="engine the ratios divide by (default: the first llamacpp*)")
    p.add_argument("--notes", default="", help="text put under the table (the setup)")
    args = p.parse_args(argv)
    records = load(args.jsonl)
    if not records:
        print(f"{args.jsonl}: no records with ENGINE/WORKLOAD tags", file=sys.stderr)
        return 1
    text = build_report(records, args.baseline)
    if args.notes:
        text += "\n" + args.notes.rstrip() + "\n"
    print(text, end="")
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
        print(f"wrote {args.md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
