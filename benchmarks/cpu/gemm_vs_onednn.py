"""Our bf16 GEMM (cpu_kernels.bf16_linear: float32 x, the weight packed in bf16, float32 out; what
the CPU's bf16 mode serves with) against torch's own oneDNN bf16 linear, at the linear layers'
prefill and decode shapes of SmolLM2-135M and Qwen2.5-1.5B (issue 38, "The bf16 GEMM too": take
the faster per shape). The layers as the engine runs them, fused:

    SmolLM2-135M   qkv K=576  N=960    o K=576  N=576    gate_up K=576  N=3072   down K=1536 N=576
    Qwen2.5-1.5B   qkv K=1536 N=2048   o K=1536 N=1536   gate_up K=1536 N=17920  down K=8960 N=1536

Columns (best of --reps rounds, ms; the methods take turns within each round, so a load that
comes and goes hits them alike):

  ours        cpu_kernels.bf16_linear(x float32, packed bf16 weight) -> float32
  torch       torch.nn.functional.linear(x bf16, w bf16) -> bf16 (oneDNN; AMX where the CPU has it)
  torch+cast  the same with the cast our layer would need: x.to(bf16) in, .float() out
  mkldnn      torch.ops.mkldnn._linear_pointwise on a weight reordered once for oneDNN
              (torch.ops.mkldnn._reorder_linear_weight; what torch.compile's CPU backend uses) -> bf16

"best" names the fastest of ours / torch+cast / mkldnn (the ones a layer with float32 activations
could use as they are). Each call gets the next of several copies of its weight, together more than
--cold-mib (default 96 MiB, over twice this machine's L3), so decode reads weights from memory as a
model's forward does. Needs a quiet machine for numbers worth keeping:

    OMP_NUM_THREADS=2 python benchmarks/cpu/gemm_vs_onednn.py --out benchmarks/cpu/gemm_vs_onednn.json

(--models smollm2 --ms 1 --layers o --reps 3: a quick check that it runs.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_gemm import bench, copies  # noqa: E402  (the same timing rounds and cold weight copies)

from radixserve.layers import cpu_kernels  # noqa: E402

MODELS = {
    "smollm2": [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576)],
    "qwen2.5-1.5b": [("qkv", 1536, 2048), ("o", 1536, 1536), ("gate_up", 1536, 17920), ("down", 8960, 1536)],
}


def cpu_flags() -> List[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return [f for f in ("avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni") if f in line.split()]


def methods(ops, x: torch.Tensor, w: torch.Tensor, m: int, cold: int) -> Dict[str, Callable[[int], object]]:
    n = w.shape[0]
    wb = copies(w.to(torch.bfloat16), cold)
    packed = [ops.pack_bf16_weight(t) for t in wb]
    mk = [torch.ops.mkldnn._reorder_linear_weight(t, m) for t in wb]
    xb = x.to(torch.bfloat16)
    return {
        "ours": lambda i: ops.bf16_linear(x, packed[i % len(packed)], n),
        "torch": lambda i: F.linear(xb, wb[i % len(wb)]),
        "torch+cast": lambda i: F.linear(x.to(torch.bfloat16), wb[i % len(wb)]).float(),
        "mkldnn": lambda i: torch.ops.mkldnn._linear_pointwise(xb, mk[i % len(mk)], None, "none", [], ""),
    }


def check_agreement(fns: Dict[str, Callable[[int], object]], x: torch.Tensor, w: torch.Tensor) -> Dict[str, float]:
    """Relative L2 error of each method against float64 on the bf16-rounded weight (not timed)."""
    ref = F.linear(x.double(), w.to(torch.bfloat16).double())
    return {k: float((f(0).double() - ref).norm() / ref.norm()) for k, f in fns.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of: " + ",".join(MODELS))
    ap.add_argument("--layers", default="", help="comma-separated subset of: qkv,o,gate_up,down (default: all)")
    ap.add_argument("--ms", default="1,16,256,512", help="rows of x: decode (1, 16) and prefill (256, 512) sizes")
    ap.add_argument("--reps", type=int, default=0, help="rounds per case (default: 30 for M<=16, 8 for more)")
    ap.add_argument("--cold-mib", type=int, default=96, help="MiB of weight copies cycled through per method")
    ap.add_argument("--out", default=str(REPO / "benchmarks/cpu/gemm_vs_onednn.json"))
    args = ap.parse_args()

    ops = cpu_kernels.get()
    assert ops is not None and ops.has_bf16_gemm(), "the C++ bf16 GEMM is not built here (cpu_kernels: AVX512_BF16)"
    ms = [int(v) for v in args.ms.split(",")]
    layers = set(args.layers.split(",")) if args.layers else None
    load0 = os.getloadavg()[0]
    header = (f"{'model':13} {'layer':8} {'K':>5} {'N':>6} {'M':>4} | {'ours':>8} {'torch':>8} {'torch+cast':>10} "
              f"{'mkldnn':>8} | {'ours/best':>9} best")
    print(f"threads {torch.get_num_threads()}, CPU flags {' '.join(cpu_flags()) or '?'}, load average {load0:.2f}; "
          "best of the rounds (ms)")
    print(header)
    print("-" * len(header))
    rows = []
    for model in args.models.split(","):
        for layer, k, n in MODELS[model]:
            if layers is not None and layer not in layers:
                continue
            w = torch.randn(n, k, generator=torch.Generator().manual_seed(k * 31 + n)) * k**-0.5
            for m in ms:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                fns = methods(ops, x, w, m, args.cold_mib << 20)
                err = check_agreement(fns, x, w)
                t = bench(fns, args.reps or (30 if m <= 16 else 8))
                best_ms = {name: v["best_ms"] for name, v in t.items()}
                usable = {name: best_ms[name] for name in ("ours", "torch+cast", "mkldnn")}
                winner = min(usable, key=usable.get)
                rows.append({"model": model, "layer": layer, "K": k, "N": n, "M": m, "ms": t, "rel_err_vs_fp64": err,
                             "best": winner, "ours_over_best": best_ms["ours"] / usable[winner]})
                print(f"{model:13} {layer:8} {k:>5} {n:>6} {m:>4} | {best_ms['ours']:8.3f} {best_ms['torch']:8.3f} "
                      f"{best_ms['torch+cast']:10.3f} {best_ms['mkldnn']:8.3f} | "
                      f"{best_ms['ours'] / usable[winner]:8.2f}x {winner}", flush=True)
    load1 = os.getloadavg()[0]
    out = {
        "label": "issue 38: the bf16 GEMM vs oneDNN",
        "what": "cpu_kernels.bf16_linear (float32 x, packed bf16 weight) vs torch's oneDNN bf16 linear (F.linear; "
                "mkldnn._linear_pointwise on a reordered weight), the engine's fused linear shapes, weights cycled "
                f"through > {args.cold_mib} MiB",
        "command": "python " + " ".join(sys.argv),
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_flags": cpu_flags(),
        "torch": torch.__version__,
        "load_average_start_end": [load0, load1],
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"load average {load1:.2f} at the end; wrote {args.out}")


if __name__ == "__main__":
    main()
