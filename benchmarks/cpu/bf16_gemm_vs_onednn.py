"""The engine's bf16 GEMM (cpu_kernels.bf16_linear: float32 x, packed bf16 weight, sums in
float32) against torch's own oneDNN bf16 linear, at the shapes of a served model's decode and
prefill steps (issue 38, "The bf16 GEMM too").

Columns (ms, best of the rounds; the methods take turns in each round, and each call gets the
next of several copies of its weight, together more than twice the L3, so the weights come from
memory as in a forward pass):

  rs-bf16     cpu_kernels.bf16_linear(x float32, packed bf16 W): the engine's bf16 mode today
  onednn-bf16 F.linear(x.to(bf16), W bf16).float(): what vLLM's CPU backend runs (x rounded to bf16
              first: a coarser operand than ours, where the bf16 mode keeps float32 activations)
  fp32        F.linear in float32 on the same weight, for scale

and rs/onednn (> 1: oneDNN is faster at this shape). Shapes: SmolLM2-135M (hidden 576: qkv 960,
o 576, gate/up 2x1536, down, the LM head 49152) and Qwen2.5-1.5B (hidden 1536), with M rows of x
for decode (1, 16) and prefill (256, 1024, 2048: the CPU's max_prefill_tokens is 2048).

    OMP_NUM_THREADS=2 python benchmarks/cpu/bf16_gemm_vs_onednn.py --out benchmarks/cpu/bf16_gemm_vs_onednn.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_gemm import bench, copies  # noqa: E402

from radixserve.layers import cpu_kernels  # noqa: E402

SHAPES = {  # model: [(layer, K, N)]
    "smollm2-135m": [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576),
                     ("lm_head", 576, 49152)],
    "qwen2.5-1.5b": [("qkv", 1536, 2048), ("o", 1536, 1536), ("gate_up", 1536, 17920), ("down", 8960, 1536)],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(SHAPES), help="comma-separated: " + ",".join(SHAPES))
    ap.add_argument("--ms", default="1,16,256,1024,2048")
    ap.add_argument("--reps", type=int, default=0, help="rounds per case (default: 20 for M<=16, 5 for more)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    ops = cpu_kernels.get()
    assert ops is not None and ops.has_bf16_gemm(), "cpu_kernels.bf16_linear is not built (needs AVX512_BF16)"
    ms = [int(v) for v in args.ms.split(",")]
    load0 = os.getloadavg()[0]
    print(f"threads {torch.get_num_threads()}, load average {load0:.2f}; best of the rounds, ms")
    header = f"{'model':13} {'layer':8} {'K':>5} {'N':>6} {'M':>5} | {'rs-bf16':>8} {'onednn':>8} {'fp32':>8} | rs/onednn"
    print(header)
    print("-" * len(header))
    rows = []
    for model in args.models.split(","):
        for layer, k, n in SHAPES[model]:
            w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * 7 + k)) * k ** -0.5
            wb = copies(w.to(torch.bfloat16))
            wp = [ops.pack_bf16_weight(t) for t in wb]
            wf = copies(w, budget=2 * w.numel() * 4)
            for m in ms:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                fns = {
                    "rs_bf16": lambda i: ops.bf16_linear(x, wp[i % len(wp)], n),
                    "onednn_bf16": lambda i: F.linear(x.to(torch.bfloat16), wb[i % len(wb)]).float(),
                    "fp32": lambda i: F.linear(x, wf[i % len(wf)]),
                }
                t = bench(fns, args.reps or (20 if m <= 16 else 5))
                best = {name: v["best_ms"] for name, v in t.items()}
                ratio = best["rs_bf16"] / best["onednn_bf16"]
                rows.append({"model": model, "layer": layer, "K": k, "N": n, "M": m, "ms": t,
                             "rs_over_onednn_best": ratio})
                print(f"{model:13} {layer:8} {k:>5} {n:>6} {m:>5} | {best['rs_bf16']:8.3f} {best['onednn_bf16']:8.3f} "
                      f"{best['fp32']:8.3f} | {ratio:6.2f}", flush=True)
            del wb, wp, wf
    load1 = os.getloadavg()[0]
    print(f"load average {load1:.2f} at the end")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "what": "cpu_kernels.bf16_linear (float32 x, packed bf16 W) vs F.linear on bf16 (oneDNN) and fp32; "
                    "weights cycled through > 2x L3; best/median ms of the rounds",
            "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__, "load_average_start_end": [load0, load1], "rows": rows,
        }, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
