"""The GatedDeltaNet decode step (issue 41): the C++ kernel (cpu_kernels.gated_delta_decode, the
states updated in place in the pool) against its torch reference as the layer ran it before
(gather the states, recurrent_gated_delta_step, scatter them back), on one linear-attention
layer of Qwen3-Next-80B-A3B's shape (32 value heads of 128 x 128 float32 states: 2 MiB a request),
batch 1 and 16, states scattered over a pool larger than the L3.

The floor is the state bytes: each request's state read once and written once (2 x 2 MiB), at
this machine's bandwidth. Methods take turns in each round; best and median of the rounds.

    OMP_NUM_THREADS=2 python benchmarks/cpu/gdn_decode.py --out benchmarks/cpu/gdn_decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from radixserve.layers import cpu_kernels  # noqa: E402
from radixserve.layers.gated_delta_net import l2norm, recurrent_gated_delta_step  # noqa: E402

H, DK, DV = 32, 128, 128  # Qwen3-Next-80B-A3B: linear_num_value_heads, linear_key_head_dim, linear_value_head_dim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    ops = cpu_kernels.get()
    assert ops is not None, "the C++ CPU kernels did not build"
    rows = []
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}; ms per layer step (best / median)")
    print(f"{'batch':>5} | {'torch':>15} | {'C++ kernel':>15} | {'floor':>6} | torch / C++")
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        g = torch.Generator().manual_seed(bs)
        slots_total = max(96, 6 * bs)  # 192+ MiB of states, cycled through: more than the L3
        pool = torch.randn(slots_total, H, DK, DV, generator=g) * 0.1
        q = l2norm(torch.randn(bs, H, DK, generator=g)) * DK ** -0.5
        k = l2norm(torch.randn(bs, H, DK, generator=g))
        v = torch.randn(bs, H, DV, generator=g)
        decay, beta = -torch.rand(bs, H, generator=g), torch.rand(bs, H, generator=g)
        init = torch.ones(bs, dtype=torch.bool)

        def torch_step(i: int) -> None:
            slots = (torch.arange(bs) + i * bs) % slots_total
            state = pool[slots] * init[:, None, None, None]
            _, state = recurrent_gated_delta_step(q, k, v, decay, beta, state)
            pool[slots] = state

        def kernel_step(i: int) -> None:
            ops.gated_delta_decode(q, k, v, decay, beta, pool, (torch.arange(bs) + (i + 3) * bs) % slots_total, init)

        times = {"torch": [], "kernel": []}
        for i in range(args.reps + 2):
            for name, fn in (("torch", torch_step), ("kernel", kernel_step)):
                t0 = time.perf_counter()
                fn(i)
                if i >= 2:
                    times[name].append((time.perf_counter() - t0) * 1e3)
        state_bytes = bs * H * DK * DV * 4
        row = {"batch": bs, "heads": H, "dk": DK, "dv": DV, "state_bytes_per_step": 2 * state_bytes,
               **{f"{n}_ms": {"best": min(t), "median": statistics.median(t)} for n, t in times.items()}}
        rows.append(row)
        tb, kb = min(times["torch"]), min(times["kernel"])
        floor_ms = 2 * state_bytes / 25e9 * 1e3  # at ~25 GB/s (benchmarks/NOTES.md: this machine's reads)
        print(f"{bs:>5} | {tb:6.3f} / {statistics.median(times['torch']):6.3f} | {kb:6.3f} / "
              f"{statistics.median(times['kernel']):6.3f} | {floor_ms:6.3f} | {tb / kb:5.2f}x", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"what": __doc__.split("\n")[0], "threads": torch.get_num_threads(),
                                              "load_average": os.getloadavg()[0], "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
