"""The GGUF-blocks agreement figures of tests/reference/test_bf16_agreement.py per CPU GEMM path and
dtype, with the bootstrap standard error (over the 64 prompts) of the teacher-forced mean and p99.
Issue 54 (session 9: why the test holds the p99 at 1.25x llama.cpp's):

    python benchmarks/cpu/gguf_agreement_paths.py q8_0 bfloat16:int8 float32:int8 bfloat16:f32 bfloat16:onednn_bf16
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "reference")]
import test_bf16_agreement as t  # noqa: E402
from real_model import agreement_figures, smollm2_gguf, smollm2_q8_0_gguf  # noqa: E402

from radixserve import Engine  # noqa: E402
from radixserve.layers.gemm_select import cpu_model  # noqa: E402


def bootstrap_se(per_prompt, stat, rounds: int = 2000) -> float:
    rng = random.Random(0)
    vals = [stat([x for _ in per_prompt for x in per_prompt[rng.randrange(len(per_prompt))]]) for _ in range(rounds)]
    return statistics.pstdev(vals)


def p99(v):
    return sorted(v)[int(0.99 * (len(v) - 1))]  # real_model.agreement_figures' rank


def main() -> None:
    which, configs = sys.argv[1], sys.argv[2:]
    path, prompts, eos, answers, ref_lp, gaps, _ = t.build_reference(smollm2_q8_0_gguf() if which == "q8_0" else smollm2_gguf())
    rows = []
    for cfg in configs:
        dtype, gemm_path, *det = cfg.split(":")  # DTYPE:PATH[:det] (det: --enable-deterministic-inference)
        engine = Engine(str(path), dtype=dtype, max_total_tokens=16384, quantization="gguf", cpu_gemm_path=gemm_path,
                        enable_deterministic_inference=bool(det))
        forced = t.teacher_forced(engine, prompts, answers)
        fig = agreement_figures(answers, ref_lp, t.greedy(engine, prompts), forced, eos, ref_gaps=gaps)
        per = [[abs(a - b) for a, b in zip(r, f)] for r, f in zip(ref_lp, forced)]
        row = {"file": which, "dtype": dtype, "path": gemm_path, "deterministic": bool(det), "agree": fig["agree"],
               "mean": fig["tf_dlogprob_mean"], "p99": fig["tf_dlogprob_p99"], "max": fig["tf_dlogprob_max"],
               "mean_se": bootstrap_se(per, statistics.fmean), "p99_se": bootstrap_se(per, p99)}
        rows.append(row)
        print(f"{which} {dtype:9s} {gemm_path:12s}{' det' if det else ''} agree {row['agree']:2d}/64  mean {row['mean']:.4f} (se {row['mean_se']:.4f})"
              f"  p99 {row['p99']:.3f} (se {row['p99_se']:.3f})  max {row['max']:.3f}", flush=True)
        engine.shutdown()
    out = REPO / "benchmarks" / "cpu" / f"gguf_agreement_paths_{which}.json"
    old = json.loads(out.read_text())["rows"] if out.exists() else []
    out.write_text(json.dumps({"cpu": cpu_model(), "rows": old + rows}, indent=1))


if __name__ == "__main__":
    main()
