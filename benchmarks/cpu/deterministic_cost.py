"""The cost of --enable-deterministic-inference (issue 56) on the CPU: offline throughput
(`radixserve bench offline`'s run_ours: random prompts, ignore_eos, greedy) with the flag and
without, at 1 and 16 requests running at once (--max-running-requests), in the bf16 mode.

The flag changes only which kernels a forward takes (layers/batch_invariant.py: the AVX2 GEMM's
one-chain tiles, the decode attention's fixed 256-key splits, one-token extends on the extend
kernel, no shared-prefix decode pass), all read from the process's mode at each call; so one
Engine per concurrency serves both, the mode switched between rounds (round-robin, best of
--rounds), and the ratio of the two is measured in the same process under the same noise.

    OMP_NUM_THREADS=2 python benchmarks/cpu/deterministic_cost.py --out benchmarks/cpu/deterministic_cost.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
from pathlib import Path
from typing import Any, Dict, List

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def workload(n: int, vocab: int, seed: int, in_lens=(64, 320), out_lens=(24, 64)):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*in_lens))] for _ in range(n)]
    return prompts, [rng.randint(*out_lens) for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None, help="an HF directory (default: SmolLM2-135M from the test cache)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    from radixserve.bench.offline import run_ours
    from radixserve.engine import Engine
    from radixserve.layers import batch_invariant, gemm_select

    if args.model_path is None:
        from real_model import smollm2_gguf, smollm2_hf_dir

        args.model_path = str(smollm2_hf_dir(smollm2_gguf()))
    results: Dict[str, Any] = {"cpu": gemm_select.cpu_model(), "threads": torch.get_num_threads(),
                               "model": args.model_path, "dtype": "bfloat16", "torch": torch.__version__,
                               "machine": platform.machine(), "rows": []}
    print(f"CPU: {results['cpu']}, {results['threads']} threads; model {args.model_path} in bf16")
    for conc in args.concurrency:
        n = max(2, conc)  # one wave at the concurrency (the machine is shared: kept short)
        prompts, lens = workload(n, 8000, seed=conc)
        engine = Engine(args.model_path, dtype="bfloat16", max_running_requests=conc, max_total_tokens=65536)
        best: Dict[bool, float] = {}
        best_cpu: Dict[bool, float] = {}  # output tokens per CPU second of this process: less moved by other load
        for r in range(args.rounds):
            for on in (False, True):  # round-robin: the same noise for both
                batch_invariant.enable_batch_invariant_mode(on)
                s = run_ours(engine, prompts, lens, label=f"det={on}")
                best[on] = max(best.get(on, 0.0), s["output_tok_s"])
                best_cpu[on] = max(best_cpu.get(on, 0.0), s["output_tok_per_cpu_s"])
                print(f"  concurrency {conc} round {r} deterministic={on}: {s['output_tok_s']:.1f} out tok/s, "
                      f"{s['output_tok_per_cpu_s']:.1f} per CPU s, load {s['loadavg_after']}")
        engine.shutdown()
        batch_invariant.enable_batch_invariant_mode(False)
        row = {"concurrency": conc, "num_prompts": n, "out_tok_per_s_off": best[False], "out_tok_per_s_on": best[True],
               "ratio_on_over_off": best[True] / best[False],
               "out_tok_per_cpu_s_off": best_cpu[False], "out_tok_per_cpu_s_on": best_cpu[True],
               "cpu_ratio_on_over_off": best_cpu[True] / best_cpu[False]}
        results["rows"].append(row)
        print(f"concurrency {conc}: off {best[False]:.1f}, on {best[True]:.1f} out tok/s: ratio {row['ratio_on_over_off']:.3f}; "
              f"per CPU second ratio {row['cpu_ratio_on_over_off']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
