"""The DraftBudget replayed without the model: what a policy would give on spec_ngram.py's workloads.

Under greedy decoding the tokens a request commits do not depend on the drafts, so one run of
the target (speculation off) fixes every request's output. This script replays the NGRAM
worker's steps on those outputs: the same NgramCache and DraftBudget calls as ngram_worker.py,
each request advancing by the drafts it got that match its output, plus one; every step costs
what the measured forward costs (spec_ngram_cost.py's table: ms by batch size and drafts). The
replay's tokens/s against the plain decode steps of the same requests is the policy's speed-up
on the decode steps, free of the machine's load; the step-by-step truth is spec_ngram.py's.

    python benchmarks/cpu/spec_ngram_replay.py --dump /tmp/spec_outputs.json        # once: run the target
    python benchmarks/cpu/spec_ngram_replay.py --outputs /tmp/spec_outputs.json \\
        --cost benchmarks/cpu/spec_ngram_cost.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Dict, List, Sequence

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))

from radixserve.speculative import draft_budget as db  # noqa: E402
from radixserve.speculative.ngram_cache import NgramCache  # noqa: E402

MAX_NEW = 128


def dump(path: str) -> None:
    """Each workload's prompts and greedy outputs (speculation off), 128 new tokens."""
    from real_model import AGREEMENT_QUESTIONS, chat_prompt_ids, smollm2_gguf
    from spec_ngram import repetitive_questions

    from radixserve.engine import Engine

    engine = Engine(model_path=str(smollm2_gguf()), dtype="bfloat16", max_total_tokens=32768, log_level="warning")
    out = {}
    for name, qs in {"repetitive": repetitive_questions(), "random": AGREEMENT_QUESTIONS[:16]}.items():
        prompts = [chat_prompt_ids(engine.tokenizer, q) for q in qs]
        res = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0}, progress=False)
        out[name] = [{"prompt": p, "output": r["output_ids"]} for p, r in zip(prompts, res)]
    Path(path).write_text(json.dumps(out))
    engine.shutdown()


class TableCost:
    """Measured ms per step by (batch size, drafts): spec_ngram_cost.py's rows (every request
    with k drafts), linear in the drafts at a batch size and in the batch size between rows."""

    def __init__(self, rows: List[Dict[str, Any]]):
        by: Dict[int, Dict[int, float]] = {}
        for r in rows:
            by.setdefault(r["batch_size"], {})[r["drafts_per_req"] * r["batch_size"]] = r["ms_per_step"]
        self.sizes = sorted(by)
        self.decode_ms = {b: by[b][0] for b in self.sizes}
        # verify(b, K) = verify0[b] + slope[b] * K: a least-squares line through the rows with drafts
        self.verify0, self.slope = {}, {}
        for b in self.sizes:
            pts = [(k, ms) for k, ms in by[b].items() if k > 0]
            n, sx, sy = len(pts), sum(k for k, _ in pts), sum(ms for _, ms in pts)
            sxx, sxy = sum(k * k for k, _ in pts), sum(k * ms for k, ms in pts)
            slope = (n * sxy - sx * sy) / (n * sxx - sx * sx) if n > 1 else 0.0
            self.slope[b], self.verify0[b] = slope, (sy - slope * sx) / n

    def _interp(self, table: Dict[int, float], bs: int) -> float:
        lo = max([b for b in self.sizes if b <= bs], default=self.sizes[0])
        hi = min([b for b in self.sizes if b >= bs], default=self.sizes[-1])
        if lo == hi:
            return table[lo]
        return table[lo] + (table[hi] - table[lo]) * (bs - lo) / (hi - lo)

    def step_ms(self, bs: int, drafts: int) -> float:
        if drafts == 0:
            return self._interp(self.decode_ms, bs)
        return self._interp(self.verify0, bs) + self._interp(self.slope, bs) * drafts


def matched_prefix(drafts: Sequence[int], truth: Sequence[int]) -> int:
    m = 0
    while m < min(len(drafts), len(truth)) and drafts[m] == truth[m]:
        m += 1
    return m


def replay(reqs: List[Dict[str, Any]], concurrency: int, budget: db.DraftBudget, cost: TableCost,
           max_drafts: int = 3) -> Dict[str, float]:
    """The requests `concurrency` at a time (each group prefilled together, then decoded until
    all finish), one n-gram cache throughout. Decode steps only: ms with NGRAM and without."""
    cache = NgramCache(1, 12, 200_000)
    spec_ms = off_ms = 0.0
    steps = drafts_total = accepted_total = 0
    tokens_total = 0
    for g in range(0, len(reqs), concurrency):
        group = reqs[g : g + concurrency]
        # the prefill commits the first output token; decode steps commit the rest
        pos = {i: 1 for i in range(len(group))}
        inserted: Dict[int, int] = {}
        lens = [len(r["output"]) for r in group]
        # speculation off: one token per step per request
        for t in range(1, max(lens)):
            off_ms += cost.step_ms(sum(1 for n in lens if n > t), 0)
        while any(pos[i] < lens[i] for i in pos):
            live = [i for i in pos if pos[i] < lens[i]]
            chains, toks_all = [], []
            for i in live:
                toks = group[i]["prompt"] + group[i]["output"][: pos[i]]
                cache.insert(toks, inserted.get(i, 0))
                inserted[i] = len(toks)
                room = min(max_drafts, MAX_NEW - pos[i] - 1)
                chains.append(cache.draft(toks, room) if room > 0 else [])
                toks_all.append(toks)
            inserted = {i: inserted[i] for i in live}
            given = budget.step([f"{g}-{i}" for i in live], toks_all, chains)
            k = sum(len(d) for d in given)
            spec_ms += cost.step_ms(len(live), k)
            steps += 1
            drafts_total += k
            for i, d in zip(live, given):
                a = matched_prefix(d, group[i]["output"][pos[i] :])
                accepted_total += a
                pos[i] = min(lens[i], pos[i] + a + 1)
        tokens_total += sum(n - 1 for n in lens)  # (the budget's pooled rate carries over, as in the engine)
    return {"tokens": tokens_total, "off_ms": off_ms, "spec_ms": spec_ms, "speedup": off_ms / spec_ms,
            "steps": steps, "drafts": drafts_total, "accepted": accepted_total}


def step_cost_from(args: argparse.Namespace) -> db.StepCost:
    kw = {f.name: getattr(args, f.name) for f in fields(db.StepCost) if getattr(args, f.name, None) is not None}
    return db.StepCost(**kw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dump", default=None, help="run the target and write the outputs here, then stop")
    parser.add_argument("--outputs", default="/tmp/spec_outputs.json")
    parser.add_argument("--cost", default=str(REPO / "benchmarks" / "cpu" / "spec_ngram_cost.json"))
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--out", default=None)
    parser.add_argument("--baseline-budget", default=None,
                        help="also replay this budget: 'fixed,per_request,verify_fixed,verify_per_request,per_draft,min_gain'")
    for f in fields(db.StepCost):
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=float, default=None)
    for const in ("DECAY", "PRIOR_TRIALS", "POOL_DECAY", "INITIAL_RATE", "MIN_GAIN"):  # the module's constants
        parser.add_argument(f"--{const.lower().replace('_', '-')}", dest=const, type=float, default=None)
    args = parser.parse_args()
    for const in ("DECAY", "PRIOR_TRIALS", "POOL_DECAY", "INITIAL_RATE", "MIN_GAIN"):
        if getattr(args, const) is not None:
            setattr(db, const, getattr(args, const))
    if args.dump:
        dump(args.dump)
        return
    outputs = json.loads(Path(args.outputs).read_text())
    cost = TableCost(json.loads(Path(args.cost).read_text())["rows"])
    policies = {"budget": (step_cost_from(args), db.MIN_GAIN)}
    if args.baseline_budget:
        *consts, min_gain = [float(v) for v in args.baseline_budget.split(",")]
        policies["baseline"] = (db.StepCost(*consts), min_gain)
    rows = []
    for name, (step_cost, min_gain) in policies.items():
        print(f"{name}: {step_cost}, min_gain {min_gain}")
        for wname, reqs in outputs.items():
            for conc in [int(c) for c in args.concurrency.split(",")]:
                r = replay(reqs, conc, db.DraftBudget(step_cost, min_gain), cost)
                rows.append({"policy": name, "workload": wname, "concurrency": conc, **r})
                print(f"{wname:>10} c={conc:<3} x{r['speedup']:.3f}  steps {r['steps']}  drafts {r['drafts']}  "
                      f"accepted {r['accepted']}  ({r['tokens']} tokens, off {r['off_ms']:.0f} ms, NGRAM {r['spec_ms']:.0f} ms)")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": " ".join(sys.argv), "cost_table": args.cost,
            "policies": {n: {"cost": asdict(c), "min_gain": g} for n, (c, g) in policies.items()},
            "acceptance": {c: getattr(db, c) for c in ("DECAY", "PRIOR_TRIALS", "POOL_DECAY", "INITIAL_RATE")},
            "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
