"""The kernels --enable-deterministic-inference changes (issue 56), timed with the mode off and on,
interleaved call by call (best of --reps), on SmolLM2-135M's shapes:

  bf16_linear   M = 1, 2 (the AVX2 tiles whose even and odd k summed apart: one chain with the
                flag), 5 and 16 (one chain either way: the control)
  decode        paged decode attention of B requests of L keys: the adaptive split (as many splits
                as leave no thread idle, by the batch) against fixed 256-key splits

    OMP_NUM_THREADS=2 python benchmarks/cpu/deterministic_kernels.py --out benchmarks/cpu/deterministic_kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch


def best_of(calls: Dict[str, Callable[[], object]], reps: int) -> Dict[str, float]:
    best = {k: float("inf") for k in calls}
    for _ in range(reps):
        for k, call in calls.items():  # interleaved: the same noise for both
            t = time.perf_counter()
            call()
            best[k] = min(best[k], time.perf_counter() - t)
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from radixserve.layers import batch_invariant, cpu_kernels, gemm_select

    ops = cpu_kernels.get()
    rows: List[dict] = []
    gen = torch.Generator().manual_seed(0)

    def timed(on: bool, call: Callable[[], object]) -> Callable[[], object]:
        def run():
            batch_invariant.enable_batch_invariant_mode(on)
            for _ in range(10):
                call()
        return run

    for k, n, name in [(576, 1536, "SmolLM2 up"), (1536, 576, "SmolLM2 down")]:
        packed = ops.pack_bf16_weight((torch.randn(n, k, generator=gen) / 30).to(torch.bfloat16))
        for m in (1, 2, 5, 16):
            x = torch.randn(m, k, generator=gen)
            call = lambda: ops.bf16_linear(x, packed, n)  # noqa: E731
            t = best_of({"off": timed(False, call), "on": timed(True, call)}, args.reps)
            rows.append({"kernel": f"bf16_linear {name} {k}x{n}", "M": m, "off_ms": t["off"] * 100,
                         "on_ms": t["on"] * 100, "on_over_off": t["on"] / t["off"]})
    heads, kv_heads, d = 9, 3, 64  # SmolLM2's attention
    for b, length in [(1, 300), (1, 1000), (4, 1000), (16, 300)]:
        slots = 4096
        k_buf = torch.randn(slots, kv_heads, d, generator=gen).to(torch.float16)
        v_buf = torch.randn(slots, kv_heads, d, generator=gen).to(torch.float16)
        table = torch.stack([torch.randperm(slots, generator=gen)[:length] for _ in range(b)]).to(torch.int32)
        q = torch.randn(b, heads, d, generator=gen)
        out = torch.empty_like(q)
        rows_ = torch.arange(b, dtype=torch.int64)
        lens = torch.full((b,), length, dtype=torch.int64)
        calls = {s: (lambda s=s: [ops.decode_attention(out, q, k_buf, v_buf, table, rows_, lens, 0.125, 0, s)
                                  for _ in range(10)]) for s in (0, batch_invariant.DECODE_SPLIT_TOKENS)}
        t = best_of({"off": calls[0], "on": calls[batch_invariant.DECODE_SPLIT_TOKENS]}, args.reps)
        rows.append({"kernel": f"decode_attention B={b} L={length} (9 heads / 3 kv, D 64, fp16 pool)", "M": b,
                     "off_ms": t["off"] * 100, "on_ms": t["on"] * 100, "on_over_off": t["on"] / t["off"]})
    batch_invariant.enable_batch_invariant_mode(False)
    print(f"CPU: {gemm_select.cpu_model()}, {torch.get_num_threads()} threads, AVX512_BF16: {ops.has_avx512_bf16()}")
    print(f"{'kernel':70s} {'M/B':>4s} {'off ms':>8s} {'on ms':>8s} {'on/off':>7s}")
    for r in rows:
        print(f"{r['kernel']:70s} {r['M']:4d} {r['off_ms']:8.3f} {r['on_ms']:8.3f} {r['on_over_off']:7.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"cpu": gemm_select.cpu_model(), "threads": torch.get_num_threads(),
                                              "avx512_bf16": bool(ops.has_avx512_bf16()), "reps": args.reps,
                                              "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
