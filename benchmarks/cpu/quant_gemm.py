"""The quantized GEMM of the CPU kernels (cpu_kernels.quant_linear, issue 38) against the float
GEMMs it replaces, on the linear layers of Qwen2.5-1.5B (hidden 1536, intermediate 8960, 12 query
heads and 2 KV heads of 128):

    gate/up  K=1536 N=8960     down  K=8960 N=1536     q/o  K=1536 N=1536     k/v  K=1536 N=256

in Q4_K and Q6_K, for M = 1 and 16 rows of x (decode) and 128, 512 (prefill). Columns:

  quant     quant_linear(x float32, the GGUF blocks): x quantized to 8 bits per block, integer dots
            (AVX512-VNNI, or AVX2: cpu_kernels.quant_gemm_isa() names the build; in the JSON as "isa")
  torch-bf16  torch.nn.functional.linear with x and the dequantized weight in bf16 (oneDNN)
  deq-bf16  the prefill path of the served layers (M >= 64 here): the blocks dequantized to bf16 a
            tile at a time (cpu_kernels.quant_dequantize_bf16), x rounded to bf16, oneDNN's GEMM
  rs-bf16   the engine's own bf16 GEMM today (cpu_kernels.bf16_linear: float32 x, packed bf16 weight)
  deq-f32   the blocks dequantized to float32 a tile at a time (cpu_kernels.quant_dequantize_f32,
            ~4 MB of float32 a tile) + torch's float32 GEMM (M >= 64): the candidate on any CPU
  fp32      torch.nn.functional.linear in float32

Without AVX512_BF16 (cpu_kernels.has_bf16_gemm() false, e.g. AVX2) the bf16 columns do not apply:
deq-bf16 and rs-bf16 are left out (n/a in the table), torch-bf16 is timed at M <= 16 only (oneDNN's
bf16 there converts to float32 and is not a path the engine takes), and "x" is fp32 / quant.

Times are the best (and the median) of --reps rounds; in each round the methods take turns, and
each call gets the next of several copies of its weight, together more than twice the L3 (96 MiB
each method), so that the weights come from memory as they do in a model's forward pass, not from
the cache. For M=1 the table gives the effective bandwidth: the method's weight bytes / time
(the floor of a decode step is reading those bytes once: quantized Q4_K is 4.5 bits a weight,
Q6_K 6.56, bf16 16). "err" is quant's relative L2 error against fp32 on the dequantized weight
(the 8-bit activations' share). Random weight blocks with valid scales (gguf cannot quantize the
K-quants); the values do not matter to the times.

    OMP_NUM_THREADS=2 python benchmarks/cpu/quant_gemm.py --threads 2,1 --out benchmarks/cpu/quant_gemm.json
    OMP_NUM_THREADS=2 python benchmarks/cpu/quant_gemm.py --threads 2,1 --ms 1,16,64,256,512 \
        --out benchmarks/cpu/quant_gemm_avx2.json          (the AVX2 run)

(--threads 2,1: both thread counts in one run and one JSON; on a machine shared with other work,
two OpenMP threads on two cores wait for each other's time slices, and the 1-thread rows show the
kernels' own speed.)

--decode-paths (issue 54) times only the integer kernel's two decode paths against each other, on
the shapes above plus the LM head (151936 x 1536; Q6_K in a Q4_K_M file, Q8_0 in a Q8_0 one):

  fused     cpu_kernels.quant_decode_fused_rows(16): each block unpacked in registers and dotted
            at once with up to 4 rows of x (AVX2; llama.cpp's ggml_vec_dot_q4_K_q8_K scheme)
  scratch   quant_decode_fused_rows(0): each block unpacked into an L1 scratch, then dotted (the
            path before issue 54's fused decode)

in turns, for M = 1, 2, 4, 8, 16, with GB/s = the weight's bytes / best time (the weights are read
once for any M <= 16). "err" is against the float product on the first rows only.

    python benchmarks/cpu/quant_gemm.py --decode-paths --threads 1,2 --out benchmarks/cpu/quant_gemm_decode_avx2.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from radixserve.layers import cpu_kernels  # noqa: E402
from radixserve.layers.quantization.gguf import QuantizedWeight, dequantized_bf16_matmul, dequantized_f32_matmul  # noqa: E402

SHAPES = [("gate/up", 1536, 8960), ("down", 8960, 1536), ("q/o", 1536, 1536), ("k/v", 1536, 256)]
TYPES = [Q.Q4_K, Q.Q6_K]
LM_HEAD = ("lm_head", 1536, 151936)
LM_HEAD_TYPES = [Q.Q6_K, Q.Q8_0]
COLD_BYTES = 96 << 20  # per method: the weight copies cycled through


def random_blocks(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    """GGUF bytes [n, row_bytes] of random K-quant blocks with valid fp16 scale fields."""
    rng = np.random.default_rng(seed)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    nb = n * k // block
    b = rng.integers(0, 256, size=(nb, type_size), dtype=np.uint8)

    def fp16(scale):
        return (rng.uniform(0.5, 1.5, size=nb) * scale).astype(np.float16).view(np.uint8).reshape(nb, 2)

    if qtype == Q.Q6_K:
        b[:, 208:210] = fp16(2e-3)
    elif block == 32:  # d only
        b[:, 0:2] = fp16(2e-3)
    else:
        b[:, 0:2] = fp16(2e-3)
        b[:, 2:4] = fp16(1e-2)
    return b.reshape(n, k // block * type_size)


def copies(t: torch.Tensor, budget: int = COLD_BYTES) -> List[torch.Tensor]:
    n = max(1, -(-budget // (t.numel() * t.element_size())))
    return [t] + [t.clone() for _ in range(n - 1)]


def bench(fns: Dict[str, Callable[[int], object]], reps: int) -> Dict[str, Dict[str, float]]:
    """{name: {best_ms, median_ms}}; fns[name](i) runs call i (i picks the weight copy)."""
    times: Dict[str, List[float]] = {k: [] for k in fns}
    for i in range(2):  # warm-up (and first-touch of every copy happens in the rounds below)
        for f in fns.values():
            f(i)
    for i in range(reps):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f(i)
            times[name].append(time.perf_counter() - t0)
    return {k: {"best_ms": min(v) * 1e3, "median_ms": statistics.median(v) * 1e3} for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default=os.environ.get("OMP_NUM_THREADS", ""),
                    help="torch thread counts to run, e.g. 2,1 (default: OMP_NUM_THREADS, else torch's default)")
    ap.add_argument("--ms", default="1,16,128,512")
    ap.add_argument("--reps", type=int, default=0, help="rounds per case (default: 30 for M<=16, 6 for more)")
    ap.add_argument("--shapes", default="", help="comma-separated subset of: " + ",".join(s[0] for s in SHAPES))
    ap.add_argument("--out", default=str(REPO / "benchmarks/cpu/quant_gemm.json"))
    ap.add_argument("--decode-paths", action="store_true", help="the fused and scratch decode paths only (see above)")
    args = ap.parse_args()
    thread_counts = [int(v) for v in str(args.threads).split(",") if v.strip()] or [torch.get_num_threads()]
    ops = cpu_kernels.get()
    assert ops is not None and ops.has_quant_gemm(), "quant_linear is not built (cpu_kernels: AVX512-VNNI or AVX2)"
    if args.decode_paths:
        ms = [int(v) for v in args.ms.split(",")] if args.ms != ap.get_default("ms") else [1, 2, 4, 8, 16]
        shapes = [s for s in SHAPES + [LM_HEAD] if not args.shapes or s[0] in args.shapes.split(",")]
        out = decode_paths(ops, shapes, ms, thread_counts, args.reps or 20)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")
        return
    rs_bf16 = bool(ops.has_bf16_gemm())
    ms = [int(v) for v in args.ms.split(",")]
    shapes = [s for s in SHAPES if not args.shapes or s[0] in args.shapes.split(",")]
    load0 = os.getloadavg()

    rows = []
    header = (f"{'layer':8} {'type':5} {'M':>4} | {'quant ms':>9} {'deq-bf16':>9} {'deq-f32':>9} {'torch-bf16':>10} {'rs-bf16':>8} "
              f"{'fp32':>8} | {'x ' + ('bf16' if rs_bf16 else 'fp32'):>6} | {'GB/s q':>6} {'bf16':>5} {'fp32':>5} | "
              f"{'GFLOPS q':>8} {'deq-f32':>7} | err")
    for threads in thread_counts:
        torch.set_num_threads(threads)
        print(f"\nthreads {threads}, load average {os.getloadavg()[0]:.2f}; best of the rounds (ms)")
        print(header)
        print("-" * len(header))
        rows += run_shapes(ops, shapes, ms, args.reps, rs_bf16, threads)
    load1 = os.getloadavg()
    out = {
        "label": "issue 38",
        "what": "quant_linear (GGUF blocks, 8-bit activations, integer dots) and the prefill paths (deq_bf16, deq_f32) vs torch bf16 / "
        "the engine's bf16 GEMM / fp32 F.linear on the dequantized weight; Qwen2.5-1.5B linear shapes; weights cycled through > 2x L3",
        "isa": ops.quant_gemm_isa(),
        "has_bf16_gemm": rs_bf16,
        "threads": thread_counts,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "load_average_start_end": [load0[0], load1[0]],
        "note": "x bf16 = torch-bf16 time / quant time; GB/s = the method's weight bytes / best time",
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"load average {load1[0]:.2f} at the end; wrote {args.out}")


def decode_paths(ops, shapes, ms: List[int], thread_counts: List[int], reps: int) -> dict:
    """The fused and the scratch decode paths of quant_linear, in turns (see the docstring)."""
    load0 = os.getloadavg()
    prev = ops.quant_decode_fused_rows()
    rows = []

    def with_rows(limit: int, x: torch.Tensor, w: torch.Tensor, qtype: Q, k: int) -> torch.Tensor:
        ops.quant_decode_fused_rows(limit)
        return ops.quant_linear(x, w, int(qtype), k)

    print(f"{'thr':>3} {'layer':8} {'type':5} {'M':>3} | {'fused ms':>9} {'scratch':>9} | {'GB/s f':>6} {'s':>6} | "
          f"{'f/s':>5} | err")
    try:
        for label, k, n in shapes:
            for qtype in (LM_HEAD_TYPES if (label, k, n) == LM_HEAD else TYPES):
                data = torch.from_numpy(random_blocks(qtype, n, k, seed=int(qtype)))
                nref = min(n, 512)
                w32 = torch.from_numpy(gguf.quants.dequantize(data[:nref].numpy(), qtype).reshape(nref, k))
                wq = copies(data)
                for threads in thread_counts:
                    torch.set_num_threads(threads)
                    for m in ms:
                        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                        fns = {"fused": lambda i: with_rows(16, x, wq[i % len(wq)], qtype, k),
                               "scratch": lambda i: with_rows(0, x, wq[i % len(wq)], qtype, k)}
                        t = bench(fns, reps if n * k < 1e8 else max(4, reps // 4))
                        errs = {}
                        for name, limit in (("fused", 16), ("scratch", 0)):
                            y = with_rows(limit, x, data[:nref], qtype, k).double()
                            ref = F.linear(x.double(), w32.double())
                            errs[name] = float((y - ref).norm() / ref.norm())
                        best = {name: v["best_ms"] for name, v in t.items()}
                        gbps = {name: data.numel() / v / 1e6 for name, v in best.items()}
                        rows.append({"threads": threads, "layer": label, "K": k, "N": n, "type": qtype.name, "M": m,
                                     "weight_bytes": data.numel(), "ms": t, "gbps_best": gbps,
                                     "fused_over_scratch_speed": best["scratch"] / best["fused"],
                                     "err_vs_fp32_first_rows": errs})
                        print(f"{threads:>3} {label:8} {qtype.name:5} {m:>3} | {best['fused']:9.3f} {best['scratch']:9.3f} | "
                              f"{gbps['fused']:6.1f} {gbps['scratch']:6.1f} | {best['scratch'] / best['fused']:5.2f} | "
                              f"{errs['fused']:.1e} {errs['scratch']:.1e}", flush=True)
                del wq, data
    finally:
        ops.quant_decode_fused_rows(prev)
    load1 = os.getloadavg()
    return {
        "label": "issue 54: fused AVX2 decode",
        "what": "quant_linear's decode paths in turns: fused (blocks unpacked in registers and dotted at once) vs scratch "
        "(unpacked into an L1 scratch, then dotted); random blocks, weights cycled through > 2x L3",
        "isa": ops.quant_gemm_isa(),
        "fused_rows_default": prev,
        "threads": thread_counts,
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "load_average_start_end": [load0[0], load1[0]],
        "note": "GB/s = weight bytes / best time; f/s = scratch time / fused time",
        "rows": rows,
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_shapes(ops, shapes, ms, reps_arg, rs_bf16, threads) -> list:
    rows = []
    for label, k, n in shapes:
        for qtype in TYPES:
            data = torch.from_numpy(random_blocks(qtype, n, k, seed=int(qtype)))
            w32 = torch.from_numpy(gguf.quants.dequantize(data.numpy(), qtype).reshape(n, k)).contiguous()
            wq = copies(data)
            wb = copies(w32.to(torch.bfloat16))
            wf = copies(w32, budget=max(COLD_BYTES, 2 * w32.numel() * 4))
            wp = [ops.pack_bf16_weight(w) for w in wb] if rs_bf16 else []
            for m in ms:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                xb = x.to(torch.bfloat16)
                fns = {
                    "quant": lambda i: ops.quant_linear(x, wq[i % len(wq)], int(qtype), k),
                    "fp32": lambda i: F.linear(x, wf[i % len(wf)]),
                }
                if rs_bf16 or m <= 16:
                    fns["torch_bf16"] = lambda i: F.linear(xb, wb[i % len(wb)])
                if rs_bf16:
                    fns["rs_bf16"] = lambda i: ops.bf16_linear(x, wp[i % len(wp)], n)
                if m >= 64 and rs_bf16:  # the prefill path: a bf16 tile dequantized at a time, oneDNN's GEMM
                    fns["deq_bf16"] = lambda i: dequantized_bf16_matmul(x, QuantizedWeight(int(qtype), wq[i % len(wq)], k))
                if m >= 64:  # a float32 tile dequantized at a time, torch's float32 GEMM
                    fns["deq_f32"] = lambda i: dequantized_f32_matmul(x, QuantizedWeight(int(qtype), wq[i % len(wq)], k))
                reps = reps_arg or (30 if m <= 16 else 6)
                t = bench(fns, reps)
                y = ops.quant_linear(x, data, int(qtype), k).double()
                ref = F.linear(x.double(), w32.double())
                err = float((y - ref).norm() / ref.norm())
                qbytes, bbytes, fbytes = data.numel(), n * k * 2, n * k * 4
                row = {
                    "threads": threads, "layer": label, "K": k, "N": n, "type": qtype.name, "M": m, "err_vs_fp32": err,
                    "weight_bytes": {"quant": qbytes, "bf16": bbytes, "fp32": fbytes},
                    "ms": {name: v for name, v in t.items()},
                }
                best = {name: v["best_ms"] for name, v in t.items()}
                nan = float("nan")
                row["gbps_best"] = {"quant": qbytes / best["quant"] / 1e6, "fp32": fbytes / best["fp32"] / 1e6}
                if "torch_bf16" in best:
                    row["gbps_best"]["torch_bf16"] = bbytes / best["torch_bf16"] / 1e6
                if rs_bf16:
                    row["gbps_best"]["rs_bf16"] = bbytes / best["rs_bf16"] / 1e6
                row["gflops_best"] = {name: 2 * m * n * k / v / 1e6 for name, v in best.items()}
                rows.append(row)
                gb, gf = row["gbps_best"], row["gflops_best"]
                speedup = (best["torch_bf16"] if rs_bf16 else best["fp32"]) / best["quant"]
                print(f"{label:8} {qtype.name:5} {m:>4} | {best['quant']:9.3f} {best.get('deq_bf16', nan):9.3f} "
                      f"{best.get('deq_f32', nan):9.3f} {best.get('torch_bf16', nan):10.3f} {best.get('rs_bf16', nan):8.3f} "
                      f"{best['fp32']:8.3f} | {speedup:5.2f}x | "
                      + (f"{gb['quant']:6.1f} {gb.get('torch_bf16', nan):5.1f} {gb['fp32']:5.1f}" if m == 1 else f"{'':6} {'':5} {'':5}")
                      + f" | {gf['quant']:8.1f} {gf.get('deq_f32', nan):7.1f} | {err:.1e}", flush=True)
            del wq, wb, wf, wp
    return rows


if __name__ == "__main__":
    main()
