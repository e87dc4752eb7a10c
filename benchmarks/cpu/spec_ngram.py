"""NGRAM speculative decoding on SmolLM2-135M-Instruct (the CPU's bf16 mode), offline Engine:
output tokens/s with and without --speculative-algorithm NGRAM, greedy, on

  repetitive  "repeat this text", code editing, extraction: the answer copies its prompt
  random      short open questions (answers that copy little)

at 1 concurrent request (the prompts one after another) and 16 (all at once), with the accepted
length (tokens per verify step, SGLang's spec_accept_length) and whether the outputs equal
speculation off. The n-gram cache and the prefix cache are cleared before each measurement; the two
engines take turns (chunk by chunk, the order flipping each round) so that other load on the
machine falls on both alike. With --rounds R each workload and concurrency is measured R times;
a row gives the ratio of the summed tokens/s and each round's ratio, and the load average.

    python benchmarks/cpu/spec_ngram.py --out benchmarks/cpu/spec_ngram.json

--interleave: the engines take turns step by step instead of chunk by chunk (each with the
same requests in flight), for a machine busy with other work. --baseline-budget runs a second
NGRAM engine with other DraftBudget constants in the same rounds (a before/after of the budget
under the same load). --step-log PATH writes every decode step as a JSON line: the engine, its
batch size and wall ms (one Engine.step), and for NGRAM the DraftBudget's plan (drafts per
request, rates, StepCost's predicted ms, what each chain matched) and the drafts accepted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from real_model import AGREEMENT_QUESTIONS, chat_prompt_ids, smollm2_gguf  # noqa: E402

from radixserve.engine import Engine  # noqa: E402
from radixserve.speculative.draft_budget import DraftBudget, StepCost  # noqa: E402

PARAGRAPHS = [
    "The city library opens at nine in the morning and closes at six in the evening. Members may borrow up to "
    "five books at a time for three weeks. Late returns cost ten cents per day, and lost books must be replaced.",
    "Our team meets every Monday to plan the week. On Wednesday we review progress, and on Friday we write a short "
    "report that lists what was finished, what was blocked, and what will be done next.",
    "To make a simple tomato soup, cook one chopped onion in butter, add two cans of tomatoes and a cup of stock, "
    "simmer for twenty minutes, then blend until smooth and season with salt and pepper.",
    "The museum has three floors. The first floor shows ancient history, the second floor shows modern art, and the "
    "third floor has a cafe with a view of the river and the old bridge.",
]
CODE = [
    "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n",
    "def greet(name):\n    message = 'Hello, ' + name\n    print(message)\n    return message\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def add(self):\n        self.count += 1\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'is even')\n    else:\n        print(i, 'is odd')\n",
]


def repetitive_questions() -> List[str]:
    qs = [f"Repeat the following text exactly, word for word:\n\n{p}" for p in PARAGRAPHS]
    qs += [f"Rename the function arguments to longer names and return the whole code:\n\n{c}" for c in CODE]
    qs += [f"Copy every sentence of this text that mentions a number:\n\n{p}" for p in PARAGRAPHS]
    qs += [f"Rewrite this code with a comment above each line:\n\n{c}" for c in CODE]
    return qs


def clear(engine: Engine) -> None:
    engine.scheduler.run_step()  # the finished requests leave the running batch, so the flush can run
    assert engine.flush_cache(), "the prefix cache was not flushed"
    if engine.scheduler.spec_worker is not None:
        engine.scheduler.spec_worker.clear_cache_pool()


class StepLog:
    """Each decode step of the engines (--step-log): Engine.step wrapped, one record per step."""

    def __init__(self) -> None:
        self.records: List[Dict[str, Any]] = []
        self.tag: Dict[str, Any] = {}

    def wrap(self, name: str, engine: Engine) -> None:
        inner, sched = engine.step, engine.scheduler

        def step() -> None:
            stats = sched.stats
            before = (stats.spec_num_proposed_drafts, stats.spec_num_correct_drafts)
            t0 = time.perf_counter()
            inner()
            ms = (time.perf_counter() - t0) * 1000
            batch = sched.last_batch
            if batch is None or batch.forward_mode is None or not batch.forward_mode.is_decode():
                return
            rec = {**self.tag, "engine": name, "bs": len(batch.reqs), "ms": ms,
                   "drafts": stats.spec_num_proposed_drafts - before[0], "accepted": stats.spec_num_correct_drafts - before[1]}
            budget = getattr(sched.spec_worker, "budget", None)
            if budget is not None and budget.last_plan is not None:
                rec["plan"] = budget.last_plan  # the next step fills in what matched: read at the end
            self.records.append(rec)

        engine.step = step

    def lines(self) -> str:
        out = []
        for rec in self.records:
            rec = dict(rec)
            plan = rec.pop("plan", None)
            if plan is not None:
                rec.update({k: v for k, v in asdict(plan).items() if k not in ("accepted", "ms")})
            out.append(json.dumps(rec) + "\n")
        return "".join(out)


def measure(engines: Dict[str, Engine], order: List[str], prompts: List[List[int]], concurrency: int,
            max_new: int) -> Dict[str, Any]:
    """Each engine runs the prompts `concurrency` at a time; the engines take turns chunk by
    chunk (in `order`), so that load from elsewhere on the machine falls on both alike."""
    sp = {"max_new_tokens": max_new, "temperature": 0}
    for engine in engines.values():
        clear(engine)
    seconds = {name: 0.0 for name in engines}
    outs: Dict[str, List[Dict[str, Any]]] = {name: [] for name in engines}
    for i in range(0, len(prompts), concurrency):
        chunk = prompts[i : i + concurrency]
        for name in order:
            t0 = time.perf_counter()
            outs[name] += engines[name].generate(input_ids=chunk, sampling_params=[sp] * len(chunk), progress=False)
            seconds[name] += time.perf_counter() - t0
    return summarize(engines, outs, seconds)


def summarize(engines: Dict[str, Engine], outs: Dict[str, List[Dict[str, Any]]], seconds: Dict[str, float]) -> Dict[str, Any]:
    res = {}
    for name in engines:
        tokens = sum(o["meta_info"]["completion_tokens"] for o in outs[name])
        metas = [o["meta_info"] for o in outs[name] if "spec_verify_ct" in o["meta_info"]]
        res[name] = {
            "output_tokens": tokens, "seconds": seconds[name], "tokens_per_s": tokens / seconds[name],
            "spec_accept_length": (sum(m["completion_tokens"] for m in metas) / sum(m["spec_verify_ct"] for m in metas)) if metas else None,
            "outputs": [o["output_ids"] for o in outs[name]],
        }
    return res


def measure_interleaved(engines: Dict[str, Engine], order: List[str], prompts: List[List[int]], concurrency: int,
                        max_new: int) -> Dict[str, Any]:
    """As measure, but the engines take turns step by step (Engine.step, the first engine of a
    turn rotating), each with the same `concurrency` prompts in flight: a burst of load from
    elsewhere falls on a few steps of each alike. Each engine's time is its own steps' time."""
    sp = {"max_new_tokens": max_new, "temperature": 0}
    for engine in engines.values():
        clear(engine)
    seconds = {name: 0.0 for name in engines}
    outs: Dict[str, List[Dict[str, Any]]] = {name: [] for name in engines}
    turn = 0
    for i in range(0, len(prompts), concurrency):
        chunk = prompts[i : i + concurrency]
        states = {name: engines[name].submit(input_ids=chunk, sampling_params=[sp] * len(chunk)) for name in order}
        live = list(order)
        while live:
            k = turn % len(live)
            for name in live[k:] + live[:k]:
                t0 = time.perf_counter()
                engines[name].step()
                seconds[name] += time.perf_counter() - t0
            turn += 1
            live = [name for name in live if not all(s.finished for s in states[name])]
        for name in order:
            outs[name] += [engines[name].frontend.make_output(s) for s in states[name]]
    return summarize(engines, outs, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="--speculative-num-draft-tokens (default: the flag's)")
    parser.add_argument("--bfs-breadth", type=int, default=1, help="--speculative-ngram-max-bfs-breadth (1: a chain)")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--workloads", default="repetitive,random")
    parser.add_argument("--rounds", type=int, default=1, help="measurements per workload and concurrency (order flips)")
    parser.add_argument("--interleave", action="store_true", help="the engines take turns step by step (a busy machine)")
    parser.add_argument("--step-log", default=None, help="write every decode step here (JSON lines)")
    parser.add_argument("--baseline-budget", default=None,
                        help="a second NGRAM engine ('ngram_base') whose DraftBudget uses this StepCost and min_gain: "
                             "'fixed,per_request,verify_fixed,verify_per_request,per_draft,min_gain' (a before/after "
                             "of the budget in the same run)")
    args = parser.parse_args()

    path = smollm2_gguf()
    base = dict(model_path=str(path), dtype=args.dtype, max_total_tokens=32768)
    spec = dict(speculative_algorithm="NGRAM", speculative_ngram_max_bfs_breadth=args.bfs_breadth)
    if args.num_draft_tokens is not None:
        spec["speculative_num_draft_tokens"] = args.num_draft_tokens
    engines = {"off": Engine(**base), "ngram": Engine(**base, **spec)}
    if args.baseline_budget:
        *consts, min_gain = [float(v) for v in args.baseline_budget.split(",")]
        engines["ngram_base"] = Engine(**base, **spec)
        engines["ngram_base"].scheduler.spec_worker.budget = DraftBudget(StepCost(*consts), min_gain=min_gain)
    spec_names = [n for n in engines if n != "off"]
    tok = engines["off"].tokenizer
    all_workloads = {
        "repetitive": [chat_prompt_ids(tok, q) for q in repetitive_questions()],
        "random": [chat_prompt_ids(tok, q) for q in AGREEMENT_QUESTIONS[:16]],
    }
    workloads = {w: all_workloads[w] for w in args.workloads.split(",")}
    for engine in engines.values():  # warm up (first-call allocations), not measured
        engine.generate(input_ids=all_workloads["random"][:2], sampling_params={"max_new_tokens": 8, "temperature": 0})
    log = StepLog() if args.step_log else None
    if log is not None:
        for name, engine in engines.items():
            log.wrap(name, engine)
    rows = []
    for wname, prompts in workloads.items():
        for conc in [int(c) for c in args.concurrency.split(",")]:
            rounds = []
            for r in range(args.rounds):
                order = list(engines) if r % 2 == 0 else list(reversed(engines))
                if log is not None:
                    log.tag = {"workload": wname, "concurrency": conc, "round": r}
                load0 = os.getloadavg()[0]
                res = (measure_interleaved if args.interleave else measure)(engines, order, prompts, conc, args.max_new_tokens)
                res["load"] = [load0, os.getloadavg()[0]]
                rounds.append(res)
                print(f"{wname:>10} c={conc:<3} round {r + 1}: off {res['off']['tokens_per_s']:7.1f} tok/s, "
                      + ", ".join(f"{n} {res[n]['tokens_per_s']:7.1f} x{res[n]['tokens_per_s'] / res['off']['tokens_per_s']:.2f}"
                                  for n in spec_names)
                      + f"  load {res['load'][0]:.2f}-{res['load'][1]:.2f}", flush=True)
            tps = {n: sum(x[n]["output_tokens"] for x in rounds) / sum(x[n]["seconds"] for x in rounds) for n in engines}
            row = {"workload": wname, "concurrency": conc, "num_prompts": len(prompts), "rounds": args.rounds,
                   "off_tokens_per_s": tps["off"], "off_output_tokens": rounds[0]["off"]["output_tokens"],
                   "load_avg_1min": [x["load"] for x in rounds]}
            for n in spec_names:
                per_round = [x[n]["tokens_per_s"] / x["off"]["tokens_per_s"] for x in rounds]
                same = sum(a == b for x in rounds for a, b in zip(x["off"]["outputs"], x[n]["outputs"]))
                accept = [x[n]["spec_accept_length"] for x in rounds if x[n]["spec_accept_length"]]
                key = "" if n == "ngram" else "base_"
                row.update({
                    f"{n}_tokens_per_s": tps[n], f"{key}speedup": tps[n] / tps["off"], f"{key}speedup_per_round": per_round,
                    f"{key}speedup_median": statistics.median(per_round),
                    f"{key}spec_accept_length": statistics.mean(accept) if accept else None,
                    f"{key}outputs_equal": f"{same}/{len(prompts) * args.rounds}",
                })
                print(f"{wname:>10} c={conc:<3} {n}: x{tps[n] / tps['off']:.2f} (rounds {', '.join(f'{v:.2f}' for v in per_round)})"
                      f"  accept_length {row[f'{key}spec_accept_length'] or 0:.2f}  equal {row[f'{key}outputs_equal']}", flush=True)
            rows.append(row)
    result = {
        "model": path.name, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
        "speculative_num_draft_tokens": engines["ngram"].server_args.speculative_num_draft_tokens,
        "speculative_ngram_max_bfs_breadth": args.bfs_breadth,
        "budget": {"cost": asdict(engines["ngram"].scheduler.spec_worker.budget.cost),
                   "min_gain": engines["ngram"].scheduler.spec_worker.budget.min_gain},
        "baseline_budget": args.baseline_budget, "interleave": args.interleave,
        "command": " ".join(sys.argv), "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if log is not None:
        Path(args.step_log).write_text(log.lines())
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
