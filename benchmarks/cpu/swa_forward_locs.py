"""The cost of translating a batch's windowed-layer slots to the SWA pool's (issue 42): at
schedule time (SWATokenToKVPoolAllocator.forward_locs, what the scheduler does now, so that the
overlap loop's next schedule may free or move swa slots while the forward runs) against the
forward-time translation it replaces (the window table and its translation once per forward, and
the new tokens' slots once per windowed layer). Decode batches, prints a table and writes JSON.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/cpu/swa_forward_locs.py --out benchmarks/cpu/swa_forward_locs.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from radixserve.layers.attention.base_attn_backend import window_table
from radixserve.mem_cache.memory_pool import ReqToTokenPool
from radixserve.mem_cache.swa_memory_pool import SWATokenToKVPoolAllocator


def _us(fn, n: int = 50) -> float:
    """The best of n runs (the machine is shared: the minimum is the cost, the rest is others)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e6


def measure(bs: int, window: int, ctx: int, n_swa_layers: int) -> dict:
    alloc = SWATokenToKVPoolAllocator(bs * ctx, bs * (window + 64))
    r2t = ReqToTokenPool(bs + 1, ctx + 4)
    for r in range(bs):  # each request's last window + 8 tokens hold swa slots
        r2t.write((r, slice(ctx - window - 8, ctx)), alloc.alloc(window + 8))
    rows, seq, out = torch.arange(bs), [ctx] * bs, alloc.alloc(bs)
    new = _us(lambda: alloc.forward_locs(r2t.req_to_token_cpu, rows, [s - 1 for s in seq], seq, window, out))
    table = _us(lambda: alloc.translate_loc(window_table(r2t.req_to_token, rows, seq, window)[0]))
    per_layer = _us(lambda: alloc.translate_loc(out))
    return dict(bs=bs, window=window, schedule_time_us=new, forward_time_us=table + n_swa_layers * per_layer,
                forward_time_table_us=table, forward_time_per_layer_us=per_layer, n_swa_layers=n_swa_layers)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--n-swa-layers", type=int, default=15)  # Gemma 3 270M's local layers
    args = ap.parse_args()
    rows = [measure(bs, w, 4096, args.n_swa_layers) for bs, w in ((1, 512), (16, 512), (64, 512), (64, 4096 - 64))]
    print("| bs | window | schedule time (us) | forward time: table + layers x new slots (us) |")
    print("| ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['bs']} | {r['window']} | {r['schedule_time_us']:.0f} | {r['forward_time_us']:.0f} "
              f"({r['forward_time_table_us']:.0f} + {r['n_swa_layers']} x {r['forward_time_per_layer_us']:.1f}) |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
