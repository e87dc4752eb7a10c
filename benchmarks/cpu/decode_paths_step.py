"""A decode step of a GGUF model with the integer kernel's two decode paths in turns, in one
process (issue 54): cpu_kernels.quant_decode_fused_rows(0) (every block unpacked into an L1
scratch, then dotted: the path before the fused decode) and its default (blocks unpacked in
registers and dotted at once, AVX2). The steps alternate (scratch, fused, scratch, ...) on one
static batch, so that load from other processes on a shared machine lands on both; the medians
and the ratio are the numbers to read. Drives `bench one-batch`'s own driver (ModelRunner, no
scheduler).

    python benchmarks/cpu/decode_paths_step.py --model-path FILE.gguf --num-threads 2 --steps 48
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from radixserve.bench.datasets import FIRST_ORDINARY_ID  # noqa: E402
from radixserve.bench.one_batch import _OursDriver  # noqa: E402
from radixserve.layers import cpu_kernels  # noqa: E402
from radixserve.server_args import ServerArgs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=48, help="timed steps per path")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.num_threads)
    ops = cpu_kernels.get()
    before = ops.quant_decode_fused_rows()
    fused = cpu_kernels.FUSED_DECODE_ROWS_DEFAULT  # the fused path's measured limit (its default)
    need = args.batch_size * (args.input_len + 2 * args.steps + 4) + 64
    ours = _OursDriver(ServerArgs(model_path=args.model_path, max_total_tokens=need,
                                  max_running_requests=args.batch_size))
    vocab = ours.runner.model_config.vocab_size
    prompts = torch.randint(FIRST_ORDINARY_ID, vocab, (args.batch_size, args.input_len),
                            generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    ours.warm_up(prompts)
    ours.start(prompts)
    times = {"scratch": [], "fused": []}
    try:
        for _ in range(args.steps):
            for name, limit in (("scratch", 0), ("fused", fused)):
                ops.quant_decode_fused_rows(limit)
                times[name].append(ours.step() * 1e3)
    finally:
        ops.quant_decode_fused_rows(before)
        ours.finish()
    out = {"model_path": args.model_path, "threads": args.num_threads, "batch_size": args.batch_size,
           "fused_rows": fused, "isa": ops.quant_gemm_isa(),
           **{f"{k}_ms_median": statistics.median(v) for k, v in times.items()},
           **{f"{k}_ms_min": min(v) for k, v in times.items()}}
    out["scratch_over_fused_median"] = out["scratch_ms_median"] / out["fused_ms_median"]
    out["scratch_over_fused_min"] = out["scratch_ms_min"] / out["fused_ms_min"]
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
