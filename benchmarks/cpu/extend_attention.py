"""Prefill (extend) attention on one layer: the C++ tile kernel (cpu_kernels.extend_attention,
16-key tiles on AVX-512, 8-key tiles on AVX2) against the torch path the backend takes without it
(per request: gather the prefix's K/V, SDPA with a causal mask), through TorchNativeAttnBackend's
forward on the same batch (the new K/V stored the same way by both). Metadata is built once per
batch (as for all the layers of a forward) and not timed.

Shapes: Qwen2.5-1.5B's attention (12 query heads, 2 KV heads of 128) and 16 / 2 heads; requests of
`tokens` new tokens each, without a cached prefix and on one. Methods take turns in each round
(the machine is shared): best and median of the rounds.

    OMP_NUM_THREADS=2 python benchmarks/cpu/extend_attention.py --out benchmarks/cpu/extend_attention_avx2.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "unit"))

from paged_kv import make_attention_batch  # noqa: E402

from radixserve.layers import cpu_kernels  # noqa: E402
from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from radixserve.model_executor.forward_batch import ForwardMode  # noqa: E402


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def backend(tiles: bool) -> TorchNativeAttnBackend:
    be = TorchNativeAttnBackend("cpu")
    be._tiles = tiles  # False: the extend rows take the SDPA path, all else as it is
    return be


def time_case(heads: int, kv_heads: int, reqs: int, tokens: int, prefix: int, kv_dtype: torch.dtype,
              rounds: int) -> dict:
    fb, q, k, v, layer = make_attention_batch(ForwardMode.EXTEND, [prefix] * reqs, [tokens] * reqs, heads, kv_heads,
                                              128, 16, seed=0, dtype=torch.float32, kv_dtype=kv_dtype)
    outs, times = time_backends({"kernel": backend(True), "torch": backend(False)}, fb, q, k, v, layer, rounds)
    err = (outs["kernel"] - outs["torch"]).abs().max().item()
    row = {"heads": heads, "kv_heads": kv_heads, "head_dim": 128, "requests": reqs, "tokens": tokens,
           "prefix": prefix, "kv_dtype": str(kv_dtype).removeprefix("torch."), "max_abs_diff": err}
    add_times(row, times)
    row["torch_over_kernel_median"] = round(row["torch_median_ms"] / row["kernel_median_ms"], 2)
    return row


def time_backends(backends: dict, fb, q, k, v, layer, rounds: int) -> tuple:
    """({name: output}, {name: [seconds per forward]}): the backends' forwards on one batch, in
    turns each round; each backend's metadata built once, untimed."""
    metadata = {}
    for name, be in backends.items():
        be.init_forward_metadata(fb)
        metadata[name] = fb.attn_metadata
    outs, times = {}, {name: [] for name in backends}
    for _ in range(rounds):
        for name, be in backends.items():
            fb.attn_metadata = metadata[name]
            t0 = time.perf_counter()
            outs[name] = be.forward(q, k, v, layer, fb)
            times[name].append(time.perf_counter() - t0)
    return outs, times


def add_times(row: dict, times: dict) -> None:
    """Each method's best and median ms into `row`, and torch's best over the kernel's."""
    for name, ts in times.items():
        row[f"{name}_best_ms"] = round(min(ts) * 1e3, 3)
        row[f"{name}_median_ms"] = round(statistics.median(ts) * 1e3, 3)
    row["torch_over_kernel_best"] = round(row["torch_best_ms"] / row["kernel_best_ms"], 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="12/2,16/2", help="query/kv head pairs")
    ap.add_argument("--tokens", default="225,1024")
    ap.add_argument("--requests", default="1,16")
    ap.add_argument("--prefix", default="0", help="cached prefix lengths")
    ap.add_argument("--kv-dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    ops = cpu_kernels.get()
    assert ops is not None and ops.has_extend_attention(), "the kernels are not built with the tile attention"
    meta = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "isa": cpu_kernels.isa_tag(),
            "torch": torch.__version__}
    print(json.dumps(meta))
    rows = []
    kv_dtype = getattr(torch, args.kv_dtype)
    for hp in args.heads.split(","):
        heads, kv_heads = map(int, hp.split("/"))
        for reqs in map(int, args.requests.split(",")):
            for tokens in map(int, args.tokens.split(",")):
                for prefix in map(int, args.prefix.split(",")):
                    row = time_case(heads, kv_heads, reqs, tokens, prefix, kv_dtype, args.rounds)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
