"""What a verify forward costs against a decode step, on SmolLM2-135M-Instruct (the CPU's bf16
mode), offline Engine: a static batch of B requests decodes with exactly k drafts per request
per step (random tokens, so they are almost never accepted: every step commits one token), and
k = 0 is the plain decode step. The median ms per step, over the timed steps, give the cost model that
radixserve/speculative/draft_budget.py is built on: step(B, N) ~ fixed + per_token * N, where
N = B * (1 + k) tokens go through the forward.

    python benchmarks/cpu/spec_ngram_cost.py --out benchmarks/cpu/spec_ngram_cost.json

The draft counts take turns step by step within one batch (and the batch sizes round by round),
so load from elsewhere falls on all alike; a row is the median step over all rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from real_model import smollm2_gguf  # noqa: E402

from radixserve.engine import Engine  # noqa: E402
from radixserve.managers import scheduler as sched_mod  # noqa: E402
from radixserve.speculative.verify_step import draft_room  # noqa: E402

DECODE_MS: List[float] = []


def _timed_step(run_step: Any) -> Any:
    def wrapper(self: Any) -> Any:
        t0 = time.perf_counter()
        batch = run_step(self)
        if batch is not None and batch.forward_mode is not None and batch.forward_mode.is_decode():
            DECODE_MS.append((time.perf_counter() - t0) * 1000)
        return batch

    return wrapper


def force_drafts(worker: Any, ks: List[int], vocab: int, used: List[int]) -> None:
    """Every request gets k random drafts per step (within its room), k cycling through `ks`
    step by step; each step's k is appended to `used`."""
    rng = random.Random(len(ks))
    turn = [0]

    def draft(batch: Any) -> List[List[int]]:
        k = ks[turn[0] % len(ks)]
        turn[0] += 1
        used.append(k)
        return [[rng.randrange(10, vocab - 10) for _ in range(min(k, draft_room(req)))] for req in batch.reqs]

    worker._draft = draft


def measure(engine: Engine, bs: int, ks: List[int], input_len: int, steps: int) -> Dict[int, List[float]]:
    """One static batch of `bs` random prompts; the draft counts `ks` take turns step by step
    (so load from elsewhere falls on all alike), `steps` timed steps each. ms per step by k."""
    rng = random.Random(bs)
    vocab = engine.vocab_size
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(input_len)] for _ in range(bs)]
    used: List[int] = []
    force_drafts(engine.scheduler.spec_worker, ks, vocab, used)
    DECODE_MS.clear()
    skip = 2 * len(ks)  # the first steps pay for first-call allocations
    timed = steps * len(ks)
    # max(ks) steps more: near its end a request has no room for all its drafts (not timed)
    engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": skip + timed + max(ks) + 2, "temperature": 0,
                                                        "ignore_eos": True}, progress=False)
    engine.scheduler.run_step()  # the finished requests leave the running batch, so the flush can run
    assert engine.flush_cache()
    by_k: Dict[int, List[float]] = {k: [] for k in ks}
    for k, ms in list(zip(used, DECODE_MS))[skip : skip + timed]:
        by_k[k].append(ms)
    return by_k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16")
    parser.add_argument("--drafts", default="0,1,2,3")
    parser.add_argument("--input-len", type=int, default=200)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per draft count and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    sched_mod.Scheduler.run_step = _timed_step(sched_mod.Scheduler.run_step)
    engine = Engine(model_path=str(smollm2_gguf()), dtype=args.dtype, max_total_tokens=32768, log_level="warning",
                    speculative_algorithm="NGRAM", speculative_num_draft_tokens=1 + max(int(k) for k in args.drafts.split(",")))
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    drafts = [int(k) for k in args.drafts.split(",")]
    ms: Dict[str, List[float]] = {}
    loads = []
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for bs in sizes:
            for k, vals in measure(engine, bs, drafts, args.input_len, args.steps).items():
                ms.setdefault(f"{bs},{k}", []).extend(vals)
            print(f"  batch {bs}: " + ", ".join(f"k={k} {statistics.median(ms[f'{bs},{k}']):.2f}" for k in drafts)
                  + f" ms/step (median so far), load {os.getloadavg()[0]:.2f}", flush=True)
        print(f"round {r + 1} done", flush=True)
    loads.append(os.getloadavg()[0])
    rows = []
    print("| batch | drafts/req | tokens in forward | ms/step (median) | 20th percentile | x decode step |")
    for bs in sizes:
        base = statistics.median(ms[f"{bs},0"])
        for k in drafts:
            vals = sorted(ms[f"{bs},{k}"])
            med, low = statistics.median(vals), vals[len(vals) // 5]
            rows.append({"batch_size": bs, "drafts_per_req": k, "tokens": bs * (1 + k), "ms_per_step": med,
                         "ms_p20": low, "steps": len(vals), "vs_decode": med / base})
            print(f"| {bs} | {k} | {bs * (1 + k)} | {med:.2f} | {low:.2f} | {med / base:.2f} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"model": smollm2_gguf().name, "dtype": args.dtype, "input_len": args.input_len,
                                              "command": " ".join(sys.argv), "load_avg_1min": loads, "rows": rows},
                                             indent=1) + "\n")
    engine.shutdown()


if __name__ == "__main__":
    main()
