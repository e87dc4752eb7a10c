"""Top-k/top-p filtering: torch.topk of the batch's filter bound vs a full vocabulary sort.

    python benchmarks/sampler_filter.py --output benchmarks/sampler_filter.json

Both run in the same process on the same probabilities (Qwen3's vocabulary, top_k=50,
top_p=0.9); the full sort is what filter_probs does when TOPK_CANDIDATES_MAX is 0.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from radixserve.layers import sampler
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo


def time_ms(fn, repeats: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vocab-size", type=int, default=151936)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output", default="")
    args = p.parse_args()
    torch.manual_seed(0)
    rows = []
    print(f"{'batch':>6} {'topk ms':>9} {'sort ms':>9} {'speed-up':>9}")
    for bs in args.batch_sizes:
        probs = torch.softmax(torch.randn(bs, args.vocab_size), dim=-1)
        zeros = torch.zeros(bs)
        info = SamplingBatchInfo(
            vocab_size=args.vocab_size, device="cpu", temperatures=torch.ones(bs, 1),
            top_ps=torch.full((bs,), args.top_p), top_ks=torch.full((bs,), args.top_k), min_ps=zeros,
            frequency_penalties=zeros, presence_penalties=zeros, repetition_penalties=torch.ones(bs),
            output_lens=zeros.long(), min_new_tokens=zeros.long(), sampling_seeds=[None] * bs,
            is_all_greedy=False, need_top_p_sampling=args.top_p < 1, need_top_k_sampling=True,
            filter_bound=args.top_k,
        )
        topk = time_ms(lambda: sampler.filter_probs(probs, info), args.repeats)
        saved, sampler.TOPK_CANDIDATES_MAX = sampler.TOPK_CANDIDATES_MAX, 0
        try:
            full_sort = time_ms(lambda: sampler.filter_probs(probs, info), args.repeats)
        finally:
            sampler.TOPK_CANDIDATES_MAX = saved
        rows.append({"batch_size": bs, "topk_ms": topk, "full_sort_ms": full_sort, "speedup": full_sort / topk})
        print(f"{bs:>6} {topk:>9.1f} {full_sort:>9.1f} {full_sort / topk:>8.1f}x")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "device": "cpu", "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
