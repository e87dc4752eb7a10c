"""Paged decode attention on one layer: the C++ kernel (cpu_kernels.decode_attention; the block
path: 16 keys a block on AVX-512, 8 on AVX2) against the torch path the backend takes without the
kernels (gather each request's K/V, SDPA), through TorchNativeAttnBackend's forward on the same
batch, next to the step's memory floor: the K/V bytes the batch must read / the read bandwidth of
torch's x.sum() over 512 MiB. Metadata is built once per batch (as for all the layers of a
forward) and not timed.

Shapes (query heads / KV heads x head_dim, requests x keys each): SmolLM2-135M's at the offline
benchmark's 64 requests of ~264 keys, Qwen2.5-1.5B's at 16 requests and one of 512 keys. The pool
is fp16 and q float32 (the CPU's bf16 mode), pages of 16 slots placed at random (a radix cache's
pool after a while). Methods take turns in each round: best and median of the rounds.

    OMP_NUM_THREADS=2 python benchmarks/cpu/decode_attention.py --out benchmarks/cpu/decode_attention_avx2.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "unit"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import radixserve  # noqa: E402,F401  (before torch: libgomp's short wait, the kernels' worker pool, as served)
import torch  # noqa: E402

from extend_attention import add_times, cpu_model, time_backends  # noqa: E402
from paged_kv import make_attention_batch  # noqa: E402

from radixserve.layers import cpu_kernels  # noqa: E402
from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from radixserve.model_executor.forward_batch import ForwardMode  # noqa: E402

# (label, query heads, kv heads, head_dim, requests, keys per request)
CASES = [("smollm2-135m", 9, 3, 64, 64, 264), ("qwen2.5-1.5b", 12, 2, 128, 16, 512),
         ("qwen2.5-1.5b", 12, 2, 128, 1, 512)]


def read_bandwidth_gbs() -> float:
    x = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    best = min(timed(x.sum) for _ in range(5))
    return x.numel() * 4 / best / 1e9


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_case(label: str, heads: int, kv_heads: int, head_dim: int, reqs: int, keys: int, rounds: int,
              gbs: float) -> dict:
    fb, q, k, v, layer = make_attention_batch(ForwardMode.DECODE, [keys - 1] * reqs, [1] * reqs, heads, kv_heads,
                                              head_dim, 16, seed=0, dtype=torch.float32, kv_dtype=torch.float16)
    backends = {"kernel": TorchNativeAttnBackend("cpu"), "torch": TorchNativeAttnBackend("cpu", use_cpu_kernels=False)}
    outs, times = time_backends(backends, fb, q, k, v, layer, rounds)
    kv_bytes = reqs * keys * kv_heads * head_dim * 2 * 2  # K and V, fp16
    row = {"model": label, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "requests": reqs,
           "keys": keys, "max_abs_diff": (outs["kernel"] - outs["torch"]).abs().max().item(),
           "floor_ms": round(kv_bytes / (gbs * 1e9) * 1e3, 3)}
    add_times(row, times)
    row["kernel_over_floor_best"] = round(row["kernel_best_ms"] / row["floor_ms"], 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    assert cpu_kernels.get() is not None, "the C++ CPU kernels did not build"
    gbs = read_bandwidth_gbs()
    meta = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "isa": cpu_kernels.isa_tag(),
            "torch": torch.__version__, "read_gbs": round(gbs, 1),
            "division": cpu_kernels.get().parallel_division()}
    print(json.dumps(meta))
    print(f"{'model':14} {'H/Hkv x D':>10} {'reqs x keys':>12} | {'kernel ms':>9} {'torch ms':>9} {'floor ms':>8} |"
          f" {'torch/kernel':>12} {'kernel/floor':>12}")
    rows = []
    for case in CASES:
        row = time_case(*case, args.rounds, gbs)
        rows.append(row)
        print(f"{row['model']:14} {f'{case[1]}/{case[2]} x {case[3]}':>10} {f'{case[4]} x {case[5]}':>12} | "
              f"{row['kernel_best_ms']:9.3f} {row['torch_best_ms']:9.3f} {row['floor_ms']:8.3f} | "
              f"{row['torch_over_kernel_best']:12.2f} {row['kernel_over_floor_best']:12.2f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
