"""EPLB's balance: the per-rank load's max / mean (1.0 = balanced; a step waits for the busiest
rank) before (SGLang's trivial location: expert e on rank e // (E / ep)) and after
rebalance_experts, on skewed expert loads (Zipf over the experts, a different order per layer,
as recorded distributions look), and the time the placement takes (Python, off the hot path).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/eplb_balance.py [--out benchmarks/eplb_balance.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from radixserve.eplb.eplb_algorithms import rebalance_experts, trivial_placement
from radixserve.eplb.eplb_manager import BalanceStats


def zipf_load(num_layers: int, num_experts: int, s: float, tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** s
    p = p / p.sum()
    return torch.stack([(p[torch.randperm(num_experts, generator=g)] * tokens).round().to(torch.int64) for _ in range(num_layers)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    # Qwen3-30B-A3B's shape: 48 MoE layers of 128 experts
    for s in (0.6, 1.0):
        load = zipf_load(48, 128, s, tokens=8 * 100_000)
        for ep in (4, 8):
            for redundant in (0, 16, 32):
                trivial = trivial_placement(48, 128, 128 + redundant)
                t0 = time.perf_counter()
                placed = rebalance_experts(load, 128 + redundant, ep)
                ms = (time.perf_counter() - t0) * 1e3
                b, a = BalanceStats.of(load, trivial, ep), BalanceStats.of(load, placed, ep)
                rows.append(dict(zipf_s=s, ep_size=ep, redundant=redundant, before=b.max_over_mean, after=a.max_over_mean,
                                 worst_before=b.worst_layer, worst_after=a.worst_layer, placement_ms=ms))
    print(f"{'zipf s':>6} {'ep':>3} {'redund':>6} | {'max/mean before':>15} {'after':>7} | {'worst layer before':>18} {'after':>7} | {'placement ms':>12}")
    for r in rows:
        print(f"{r['zipf_s']:>6} {r['ep_size']:>3} {r['redundant']:>6} | {r['before']:>15.3f} {r['after']:>7.3f} | "
              f"{r['worst_before']:>18.3f} {r['worst_after']:>7.3f} | {r['placement_ms']:>12.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/eplb_balance.py --out " + args.out,
                       "layers": 48, "experts": 128, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
