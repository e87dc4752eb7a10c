"""Where an Engine's resident memory goes on a CPU: anonymous RSS (smaps_rollup) after import, after
the load and after one request, and every CPU tensor storage found by the garbage collector grouped
by dtype (the largest listed). Issue 54 (session 9):

    python benchmarks/cpu/memory_breakdown.py "$(python benchmarks/cpu/fetch_gguf.py qwen2.5-coder-1.5b-q4_k_m)" --max-total-tokens 8192
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import warnings
from pathlib import Path

import torch

from radixserve import Engine
from radixserve.layers.gemm_select import cpu_model


def rollup() -> dict:
    with open("/proc/self/smaps_rollup") as f:
        return {p[0].rstrip(":"): int(p[1]) // 1024 for p in (line.split() for line in f)
                if p[0] in ("Rss:", "Anonymous:", "Pss_File:")}


def storages() -> list:
    seen = {}
    warnings.simplefilter("ignore", FutureWarning)  # isinstance on a deprecated torch.distributed alias
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type == "cpu":
            s = o.untyped_storage()
            if s.nbytes() > seen.get(s.data_ptr(), (0,))[0]:
                seen[s.data_ptr()] = (s.nbytes(), str(o.dtype), tuple(o.shape))
    return sorted(seen.values(), reverse=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--max-total-tokens", type=int, default=8192)
    ap.add_argument("--out", default="benchmarks/cpu/memory_breakdown.json")
    args = ap.parse_args()
    phases = {"imported": rollup()}
    engine = Engine(args.model, max_total_tokens=args.max_total_tokens)
    phases["loaded"] = rollup()
    engine.generate(input_ids=list(range(1000, 1250)), sampling_params={"max_new_tokens": 8})
    phases["after a 250-token request"] = rollup()
    found = storages()
    by_dtype = collections.Counter()
    for n, dtype, _ in found:
        by_dtype[dtype] += n
    for phase, r in phases.items():
        print(f"{phase:28s} RSS {r['Rss']:6d} MB, anonymous {r['Anonymous']:6d} MB")
    print("tensor storages by dtype (MB):", {k: v >> 20 for k, v in by_dtype.most_common()})
    for n, dtype, shape in found[:6]:
        print(f"  {n >> 20:5d} MB {dtype} {shape}")
    Path(args.out).write_text(json.dumps({"cpu": cpu_model(), "model": args.model, "phases": phases,
                                          "by_dtype_mb": {k: v >> 20 for k, v in by_dtype.items()},
                                          "largest": [[n >> 20, d, list(s)] for n, d, s in found[:6]]}, indent=1))
    engine.shutdown()


if __name__ == "__main__":
    main()
