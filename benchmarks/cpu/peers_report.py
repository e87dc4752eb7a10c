"""The table of benchmarks/cpu_vs_peers.sh: radixserve against the best peer (llama.cpp, vLLM) on
each workload. Reads the JSON lines `radixserve bench serving` appended (tags "ENGINE/WORKLOAD",
the last line of a tag wins; report.py reads them the same way), prints markdown and writes it.

    python benchmarks/cpu/peers_report.py benchmarks/cpu_vs_peers.jsonl --md benchmarks/cpu_vs_peers.md

The best peer of a workload is the engine other than radixserve with the most output tokens/s
there; "vs best peer" is radixserve's tokens/s over that engine's (> 1 favours radixserve).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Optional, Tuple

from report import WORKLOAD_ORDER, _fmt, _order, _ratio, load, workload_desc, workload_key

Records = Dict[Tuple[str, str], Dict[str, Any]]
ENGINE_ORDER = ("llamacpp", "vllm", "radixserve")


def engine_rank(engine: str) -> Tuple[int, str]:
    """llama.cpp variants first, then vLLM's, then radixserve's (by tag prefix)."""
    for i, prefix in enumerate(ENGINE_ORDER):
        if engine.startswith(prefix):
            return i, engine
    return len(ENGINE_ORDER), engine


def best_peer(records: Records, workload: str, ours: str) -> Optional[str]:
    """The engine (not ours) with the most output tok/s on this workload, among the runs with
    ours's workload parameters; None when there is none."""
    mine = records.get((ours, workload))
    peers = [(r["output_throughput"], e) for (e, w), r in records.items()
             if w == workload and e != ours and not e.startswith("radixserve")
             and (mine is None or workload_key(r) == workload_key(mine))]
    return max(peers)[1] if peers else None


def summary(records: Records, engines: List[str], workloads: List[str], ours: str) -> List[str]:
    """Output tok/s (mean ITL ms) per engine and workload, and ours / the best peer."""
    head = "| workload | " + " | ".join(engines) + f" | best peer | {ours} vs best peer |"
    lines = [head, "|---|" + "---:|" * (len(engines) + 2)]
    for w in workloads:
        cells = []
        for e in engines:
            r = records.get((e, w))
            cells.append("-" if r is None else f"{_fmt(r['output_throughput'])} ({_fmt(r['mean_itl_ms'], 1)})")
        peer = best_peer(records, w, ours)
        mine, theirs = records.get((ours, w)), records.get((peer, w)) if peer else None
        ratio = _ratio(mine["output_throughput"], theirs["output_throughput"]) if mine and theirs else None
        lines.append(f"| {w} | " + " | ".join(cells) + f" | {peer or '-'} | {_fmt(ratio, 2)}{'x' if ratio else ''} |")
    return lines


def details(records: Records, engines: List[str], workloads: List[str]) -> List[str]:
    lines = ["| engine | workload | done/failed | output tok/s | mean TTFT ms | median TTFT ms | mean ITL ms | "
             "median ITL ms | cache hit |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for w in workloads:
        for e in engines:
            r = records.get((e, w))
            if r is None:
                continue
            hit = r.get("cache_hit_rate", r.get("usage_cache_hit_rate"))
            lines.append(f"| {e} | {w} | {r['completed']}/{r['failed']} | {_fmt(r['output_throughput'])} | "
                         f"{_fmt(r['mean_ttft_ms'])} | {_fmt(r['median_ttft_ms'])} | {_fmt(r['mean_itl_ms'], 2)} | "
                         f"{_fmt(r['median_itl_ms'], 2)} | {_fmt(hit, 3)} |")
    return lines


def per_turn(records: Records, engines: List[str]) -> List[str]:
    chat = [(e, records[(e, "chat")]) for e in engines if records.get((e, "chat"), {}).get("per_turn")]
    if not chat:
        return []
    lines = ["", "Chat, per turn (mean prompt tokens, cached prompt tokens, mean TTFT ms, mean ITL ms):", "",
             "| engine | turn | prompt len | cached | mean TTFT ms | mean ITL ms |", "|---|---:|---:|---:|---:|---:|"]
    for e, r in chat:
        for t in r["per_turn"]:
            lines.append(f"| {e} | {t['turn'] + 1} | {t['mean_prompt_len']:.0f} | {t['cached_tokens']} | "
                         f"{t['mean_ttft_ms']:.1f} | {t['mean_itl_ms']:.2f} |")
    return lines


def build_report(records: Records, ours: str = "radixserve") -> str:
    engines = sorted({e for e, _ in records}, key=engine_rank)
    workloads = _order(list({w for _, w in records}), WORKLOAD_ORDER)
    out = ["## CPU: radixserve vs llama.cpp and vLLM", "",
           f"Output tokens/s (mean ITL ms), one server at a time; the last column is {ours}'s tokens/s over "
           "the best peer's on that workload (> 1 favours radixserve).", ""]
    out += summary(records, engines, workloads, ours)
    out += ["", "Every metric (cache hit: cached prompt tokens / prompt tokens, from the server's /metrics where "
            "it has them, else the responses' usage):", ""]
    out += details(records, engines, workloads)
    out += ["", "Workloads:", ""]
    for w in workloads:
        rec = next(records[(e, w)] for e in engines if (e, w) in records)
        out.append(f"- **{w}**: {workload_desc(rec)}")
    out += per_turn(records, engines)
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jsonl")
    p.add_argument("--md", default=None, help="also write the table here")
    p.add_argument("--ours", default="radixserve", help="the engine compared with the best peer")
    p.add_argument("--notes", default="", help="text put under the table (the setup)")
    args = p.parse_args(argv)
    records = load(args.jsonl)
    if not records:
        print(f"{args.jsonl}: no records with ENGINE/WORKLOAD tags", file=sys.stderr)
        return 1
    text = build_report(records, args.ours)
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
