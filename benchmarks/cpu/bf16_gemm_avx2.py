"""The CPU's bf16 mode on an AVX2 + FMA machine (no AVX512_BF16): our bf16 GEMM
(cpu_kernels.bf16_linear: float32 x, the weight packed in bf16 and widened to float32 in
registers, float32 out) against what such a machine runs without it, at SmolLM2-135M's and
Qwen2.5-1.5B's MLP shapes, decode (M = 1, 16) and prefill (M = 128, 512):

  ours        cpu_kernels.bf16_linear(x float32, packed bf16 weight) -> float32
  f32         F.linear(x float32, w float32): the float32 model this machine serves today
  bf16        F.linear(x bf16, w bf16) -> bf16 (torch / oneDNN; emulated without AVX512_BF16)
  widen+f32   F.linear(x float32, w_bf16.float()): a bf16 weight widened per call, then sgemm
              (a candidate for prefill, where float32 sgemm may beat our tile)

Rates: decode rows (M <= 64) give GB/s, the weight's bytes in the method's dtype per call
(float32: 4 bytes per weight, the rest 2) over the best time; prefill rows give GFLOP/s (2MNK over
the best time). The ratios compare times (>1: ours is faster). Each method cycles
through copies of its weight that together exceed --cold-mib (default 96 MiB, 3x this machine's
L3), so decode reads its weights from memory as a model's forward does; the methods take turns
within each round (best of --reps). `read` is torch's x.sum() over a 512 MiB float32 tensor: the
memory read bandwidth the decode rows are bound by.

    OMP_NUM_THREADS=2 python benchmarks/cpu/bf16_gemm_avx2.py --out benchmarks/cpu/bf16_gemm_avx2.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_gemm import bench, copies  # noqa: E402  (the same timing rounds and cold weight copies)

from radixserve.layers import cpu_kernels  # noqa: E402
from radixserve.layers.gemm_select import cpu_model  # noqa: E402

# (label, K, N): SmolLM2-135M's up/down (hidden 576, intermediate 1536), Qwen2.5-1.5B's (1536, 8960)
SHAPES = [("smollm2.up", 576, 1536), ("smollm2.down", 1536, 576),
          ("qwen2.5-1.5b.up", 1536, 8960), ("qwen2.5-1.5b.down", 8960, 1536)]


def cpu_flags() -> List[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split()
    return [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16") if f in line]


def read_bandwidth(reps: int = 5) -> float:
    """GB/s of torch's multithreaded sum over 512 MiB of float32 (a memory read stream)."""
    t = torch.ones(128 << 20)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        t.sum()
        best = min(best, time.perf_counter() - t0)
    return t.numel() * 4 / best / 1e9


def methods(ops, x: torch.Tensor, w: torch.Tensor, m: int, cold: int, prefill: bool) -> Dict[str, Callable[[int], object]]:
    n = w.shape[0]
    wb = copies(w.to(torch.bfloat16), cold)
    wf = copies(w, cold)
    packed = [ops.pack_bf16_weight(t) for t in wb]
    xb = x.to(torch.bfloat16)
    fns = {
        "ours": lambda i: ops.bf16_linear(x, packed[i % len(packed)], n),
        "f32": lambda i: F.linear(x, wf[i % len(wf)]),
        "bf16": lambda i: F.linear(xb, wb[i % len(wb)]),
    }
    if prefill:
        fns["widen+f32"] = lambda i: F.linear(x, wb[i % len(wb)].float())
    return fns


def rel_err(fns: Dict[str, Callable[[int], object]], x: torch.Tensor, w: torch.Tensor) -> Dict[str, float]:
    """Relative L2 error of each method against float64 on the bf16-rounded weight (not timed;
    f32 multiplies the unrounded weight, so its figure is the weight's own rounding)."""
    ref = F.linear(x.double(), w.to(torch.bfloat16).double())
    return {k: float((f(0).double() - ref).norm() / ref.norm()) for k, f in fns.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="", help="comma-separated subset of: " + ",".join(s[0] for s in SHAPES))
    ap.add_argument("--ms", default="1,16,128,512", help="rows of x: decode (<= 64) and prefill sizes")
    ap.add_argument("--reps", type=int, default=0, help="rounds per case (default: 100 for M <= 16, 6 for more)")
    ap.add_argument("--cold-mib", type=int, default=96, help="MiB of weight copies cycled through per method")
    ap.add_argument("--out", default=str(REPO / "benchmarks/cpu/bf16_gemm_avx2.json"))
    args = ap.parse_args()

    ops = cpu_kernels.get()
    assert ops is not None and ops.has_bf16_gemm(), "the C++ bf16 GEMM is not built here (AVX512_BF16 or AVX2 + FMA)"
    only = set(args.shapes.split(",")) if args.shapes else None
    ms = [int(v) for v in args.ms.split(",")]
    load0 = os.getloadavg()[0]
    bw = read_bandwidth()
    print(f"{cpu_model()}; threads {torch.get_num_threads()}; flags {' '.join(cpu_flags())}; "
          f"has_avx512_bf16 {bool(ops.has_avx512_bf16())}; read bandwidth {bw:.1f} GB/s; load average {load0:.2f}")
    header = (f"{'shape':18} {'K':>5} {'N':>5} {'M':>4} | {'ours ms':>8} {'f32 ms':>8} {'bf16 ms':>8} {'wid+f32':>8} | "
              f"{'rate':>7} {'ours':>6} {'f32':>6} {'bf16':>6} | {'f32/ours':>8} {'bf16/ours':>9} {'w+f/ours':>8}")
    print(header)
    print("-" * len(header))
    rows = []
    for label, k, n in SHAPES:
        if only is not None and label not in only:
            continue
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(k * 31 + n)) * k**-0.5
        for m in ms:
            prefill = m > 64
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            fns = methods(ops, x, w, m, args.cold_mib << 20, prefill)
            err = rel_err(fns, x, w)
            t = bench(fns, args.reps or (100 if m <= 16 else 6))
            best = {name: v["best_ms"] for name, v in t.items()}
            gbs = {name: n * k * (4 if name == "f32" else 2) / (best[name] * 1e-3) / 1e9 for name in ("ours", "f32", "bf16")}
            gflops = {name: 2 * m * n * k / (best[name] * 1e-3) / 1e9 for name in best}
            rate, unit = (gflops, "GFLOP/s") if prefill else (gbs, "GB/s")
            ratio = {name: best[name] / best["ours"] for name in best if name != "ours"}
            rows.append({"shape": label, "K": k, "N": n, "M": m, "ms": t, "weight_gb_per_s": gbs, "gflop_per_s": gflops,
                         "time_over_ours": ratio, "rel_err_vs_fp64": err})
            wid = f"{best['widen+f32']:8.3f}" if "widen+f32" in best else f"{'-':>8}"
            wid_r = f"{ratio['widen+f32']:8.2f}" if "widen+f32" in ratio else f"{'-':>8}"
            print(f"{label:18} {k:>5} {n:>5} {m:>4} | {best['ours']:8.3f} {best['f32']:8.3f} {best['bf16']:8.3f} {wid} | "
                  f"{unit:>7} {rate['ours']:6.1f} {rate['f32']:6.1f} {rate['bf16']:6.1f} | {ratio['f32']:8.2f} {ratio['bf16']:9.2f} "
                  f"{wid_r}", flush=True)
    load1 = os.getloadavg()[0]
    out = {
        "label": "the CPU bf16 mode's GEMM on AVX2 + FMA (bf16_linear widening the packed bf16 weight) vs torch",
        "command": "python " + " ".join(sys.argv),
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "has_avx512_bf16": bool(ops.has_avx512_bf16()),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "read_bandwidth_gb_per_s": bw,
        "load_average_start_end": [load0, load1],
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"load average {load1:.2f} at the end; wrote {args.out}")


if __name__ == "__main__":
    main()
