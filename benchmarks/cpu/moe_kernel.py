"""The CPU MoE kernel (cpu_kernels.fused_moe_bf16, issue 41) against FusedMoE's torch loop over the
experts (the bf16 GEMM called per expert, what the CPU's bf16 mode ran before the kernel), on one
MoE layer shaped like Qwen3-30B-A3B's scaled down to fit this machine: 64 experts, top-8, hidden
2048, moe_intermediate 768 (Qwen3-30B-A3B: 128 experts, hidden 2048, moe_intermediate 768), bf16
weights packed as the served layer packs them (604 MB), float32 activations.

For each batch size (tokens in the step) the methods take turns (kernel, loop, kernel, loop, ...)
in one process; each call gets a fresh routing (a random router over fresh random tokens), so the
experts it reads mostly come from memory, as in a model's forward pass (the layer is ~19x the L3).
Columns: the median and best time of each method, loop / kernel (the speedup), "dense GEMM": one
bf16_linear over a single packed matrix of the same bytes as the step's experts (cycled cold
copies; what those bytes cost without the routing), the kernel's best bytes / time, and the
floor: the bytes of the experts the step actually uses (their packed w13 + w2) / this machine's
memory bandwidth, measured in this script as a large read's bytes per second (a sum over 1 GiB,
the best of 5 before the runs and 5 after each row, as other work on the machine lowers it; the
copy bandwidth, reads + writes, is printed beside it).

    python benchmarks/cpu/moe_kernel.py --threads 2,1 --out benchmarks/cpu/moe_kernel.json

(--threads 2,1: on a machine shared with other work, two OpenMP threads on two cores wait for each
other's time slices at every parallel region, which the loop has ~5 of per expert and the kernel
5 in all; the 1-thread rows show the code's own speed.)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from radixserve.layers import cpu_kernels  # noqa: E402
from radixserve.layers.moe import FusedMoE, TopKRouter  # noqa: E402


def bandwidths(mib: int = 1024, reps: int = 5) -> Tuple[float, float]:
    """Bytes per second (the best of reps) of a large copy (reads and writes counted) and of a large
    read (a sum): the experts' weights are only read, so the floor uses the second."""
    src = torch.ones(mib << 18, dtype=torch.float32)  # mib MiB
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    best_copy = best_read = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        t1 = time.perf_counter()
        src.sum()
        t2 = time.perf_counter()
        best_copy, best_read = min(best_copy, t1 - t0), min(best_read, t2 - t1)
    return 2 * nbytes / best_copy, nbytes / best_read


def make_layer(experts: int, hidden: int, inter: int) -> FusedMoE:
    layer = FusedMoE(experts, hidden, inter)
    g = torch.Generator().manual_seed(0)
    for e in range(experts):  # one expert at a time: the float32 draw of the whole stack is 2.4 GB
        layer.w13_weight.data[e] = torch.randn(2 * inter, hidden, generator=g) * hidden**-0.5
        layer.w2_weight.data[e] = torch.randn(hidden, inter, generator=g) * inter**-0.5
    layer.w13_weight.data = layer.w13_weight.data.bfloat16()
    layer.w2_weight.data = layer.w2_weight.data.bfloat16()
    assert layer.pack_cpu_weight(), "the bf16 GEMM is not available on this CPU (AVX512_BF16)"
    return layer


def routings(n: int, m: int, hidden: int, experts: int, top_k: int) -> List[Tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(m)
    router = TopKRouter(hidden, experts, top_k, renormalize=True)
    router.weight.data = torch.randn(experts, hidden, generator=g) * hidden**-0.5
    out = []
    for _ in range(n):
        x = torch.randn(m, hidden, generator=g)
        weights, ids = router.route(x)
        out.append((x, weights, ids))
    return out


def dense_copies(ops, nbytes: float, hidden: int, cold: int = 96 << 20) -> List[torch.Tensor]:
    """Packed [N, hidden] bf16 weights of nbytes each, enough copies that cycling through them
    reads from memory: one dense GEMM over the bytes the step's experts hold."""
    n = max(16, int(nbytes / (2 * hidden)) // 16 * 16)
    w = ops.pack_bf16_weight(torch.randn(n, hidden).bfloat16())
    return [w] + [w.clone() for _ in range(max(1, -(-cold // int(nbytes))) )]


def expert_bytes(layer: FusedMoE, ids: torch.Tensor) -> int:
    per_expert = layer.w13_packed[0].numel() * 2 + layer.w2_packed[0].numel() * 2
    return int(ids.unique().numel()) * per_expert


def bench(fns: Dict[str, Callable[[tuple], object]], inputs: List[tuple], reps: int) -> Dict[str, List[float]]:
    """Turns: round r runs every method once, each on its own routing (no warm experts shared)."""
    times: Dict[str, List[float]] = {name: [] for name in fns}
    i = 0
    for r in range(reps):
        order = list(fns) if r % 2 == 0 else list(reversed(list(fns)))
        for name in order:
            t0 = time.perf_counter()
            fns[name](inputs[i % len(inputs)])
            times[name].append(time.perf_counter() - t0)
            i += 1
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", default="2,1", help="torch thread counts, each a block of rows")
    ap.add_argument("--out", default=str(REPO / "benchmarks/cpu/moe_kernel.json"))
    args = ap.parse_args()

    ops = cpu_kernels.get()
    assert ops is not None and ops.has_bf16_gemm(), "needs the C++ kernels with AVX512_BF16"
    layer = make_layer(args.experts, args.hidden, args.inter)
    threads0 = torch.get_num_threads()
    copy_bw, bw = bandwidths()
    rows = []
    for threads, m in [(int(t), int(b)) for t in args.threads.split(",") for b in args.batches.split(",")]:
        torch.set_num_threads(threads)
        inputs = routings(2 * args.reps + 2, m, args.hidden, args.experts, args.top_k)
        dense = dense_copies(ops, statistics.median(expert_bytes(layer, a[2]) for a in inputs), args.hidden)
        calls = iter(range(1 << 30))
        fns = {
            "kernel": lambda a: ops.fused_moe_bf16(a[0], layer.w13_packed, layer.w2_packed, a[1], a[2], layer.inter),
            "loop": lambda a: layer.forward_loop(*a),
            "dense": lambda a: ops.bf16_linear(a[0], dense[next(calls) % len(dense)], dense[0].shape[0] * 16, None),
        }
        bench(fns, inputs[-2:], 2)  # warm-up (thread pool, allocator)
        times = bench(fns, inputs[:-2], args.reps)
        used = [expert_bytes(layer, a[2]) for a in inputs[:-2]]
        med = {k: statistics.median(v) for k, v in times.items()}
        copy_bw, bw = (max(a, b) for a, b in zip((copy_bw, bw), bandwidths()))  # the best seen: load varies
        floor = statistics.median(used) / bw
        rows.append({
            "threads": threads, "batch": m, "experts_used_median": statistics.median(int(a[2].unique().numel()) for a in inputs[:-2]),
            "bytes_used_median": statistics.median(used), "floor_ms": floor * 1e3,
            **{f"{k}_ms_median": v * 1e3 for k, v in med.items()},
            **{f"{k}_ms_best": min(v) * 1e3 for k, v in times.items()},
            "loop_over_kernel": med["loop"] / med["kernel"], "kernel_over_floor": med["kernel"] / floor,
            "loop_over_kernel_best": min(times["loop"]) / min(times["kernel"]),
            "kernel_best_over_floor": min(times["kernel"]) / floor,
            "kernel_best_gb_s": statistics.median(used) / min(times["kernel"]) / 1e9,
        })

    print(f"read bandwidth {bw / 1e9:.1f} GB/s (copy {copy_bw / 1e9:.1f}, {threads0} threads), "
          f"E={args.experts} top-{args.top_k} hidden={args.hidden} inter={args.inter}")
    print("times: median (best) ms; loop/kernel and kernel/floor from medians (best)")
    print(f"{'thr':>3} {'batch':>5} {'experts':>7} {'MB used':>8} {'floor':>6} {'kernel':>14} {'loop':>14} {'dense GEMM':>14} "
          f"{'loop/kernel':>12} {'kernel/floor':>13} {'kernel GB/s':>11}")
    for r in rows:
        print(f"{r['threads']:>3} {r['batch']:>5} {r['experts_used_median']:>7} {r['bytes_used_median'] / 1e6:>8.1f} {r['floor_ms']:>6.2f} "
              + " ".join(f"{r[k + '_ms_median']:>6.2f} ({r[k + '_ms_best']:>5.2f})" for k in ("kernel", "loop", "dense"))
              + f" {r['loop_over_kernel']:>5.2f} ({r['loop_over_kernel_best']:>4.2f})"
              f" {r['kernel_over_floor']:>5.2f} ({r['kernel_best_over_floor']:>5.2f}) {r['kernel_best_gb_s']:>11.1f}")
    out = {"command": " ".join(["python", "benchmarks/cpu/moe_kernel.py", *sys.argv[1:]]),
           "cpu": platform.processor() or platform.machine(),
           "read_bandwidth_gb_s": bw / 1e9, "copy_bandwidth_gb_s": copy_bw / 1e9, "config": {k: getattr(args, k) for k in ("experts", "top_k", "hidden", "inter", "reps")},
           "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
