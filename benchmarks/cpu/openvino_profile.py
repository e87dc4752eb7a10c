"""Where OpenVINO's CPU time goes on SmolLM2-135M (issue 54), per node type, next to
`benchmarks/cpu/step_breakdown.py`'s figures for radixserve. Runs in OpenVINO's virtualenv:

    /work/venv-ov/bin/python benchmarks/cpu/openvino_profile.py \\
        --model ~/.cache/radixserve-bench/openvino/smollm2-135m-int8 --batch-sizes 1 64

It compiles the exported openvino_model.xml (the stateful model optimum writes: KV cache in
ReadValue/Assign state, SDPA attention; the continuous-batching pipeline runs the same linear
layers but rewrites the attention into PagedAttention and keeps only the last position's logits)
on the CPU with PERF_COUNT and --threads threads. Per batch size B: one prefill of B x --input-len
random tokens (in chunks of at most 1024 tokens; once to warm up, once timed), then --steps decode steps of B tokens; the CPU plugin's per-node timings are summed
by node type and kernel ("exec type": the implementation the plugin picked, e.g. brgemm_avx2 or
jit_avx2, and the precision it ran in). The prefill's logits cover every position here (5.7 GFLOP of
LM head for 200 tokens that the pipeline does not compute): read its FullyConnected row with that
in mind. PERF_COUNT itself costs time per node: read shares, not absolute times.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from typing import Dict, List, Tuple

import numpy as np
import openvino as ov

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_vs_openvino import FIRST_ORDINARY_ID, compiled_properties  # noqa: E402


class NodeTimes:
    """Per-inference node times of one infer request. The CPU plugin reports each node's running
    mean over the request's inferences so far, so the last inference's time is
    n * mean_n - (n - 1) * mean_(n-1)."""

    def __init__(self) -> None:
        self.count = 0
        self.means: Dict[str, float] = {}

    def last(self, request: ov.InferRequest) -> Dict[Tuple[str, str], float]:
        self.count += 1
        n, out = self.count, collections.defaultdict(float)
        for info in request.get_profiling_info():
            if info.status != ov.ProfilingInfo.Status.EXECUTED:
                continue
            mean = info.real_time.total_seconds() * 1e3
            out[(info.node_type, info.exec_type)] += n * mean - (n - 1) * self.means.get(info.node_name, 0.0)
            self.means[info.node_name] = mean
        return out


def add(acc: Dict[Tuple[str, str], float], times: Dict[Tuple[str, str], float]) -> None:
    for k, v in times.items():
        acc[k] += v


def prefill(req: ov.InferRequest, times: NodeTimes, ids: np.ndarray, acc: Dict[Tuple[str, str], float]) -> float:
    """The prompt rows ids [B, L] from an empty state, in chunks of <= 1024 tokens (the logits of
    every position of 64 x 200 tokens would be 2.5 GB). Returns the wall ms."""
    bs, input_len = ids.shape
    chunk = max(1, min(input_len, 1024 // bs))
    req.reset_state()
    wall = 0.0
    for start in range(0, input_len, chunk):
        end = min(start + chunk, input_len)
        feed = {"input_ids": ids[:, start:end], "attention_mask": np.ones((bs, end), np.int64),
                "position_ids": np.tile(np.arange(start, end, dtype=np.int64), (bs, 1)),
                "beam_idx": np.arange(bs, dtype=np.int32)}
        t0 = time.perf_counter()
        req.infer(feed)
        wall += time.perf_counter() - t0
        add(acc, times.last(req))
    return wall * 1e3


def run_batch(compiled: ov.CompiledModel, bs: int, input_len: int, steps: int, vocab: int,
              rng: np.random.Generator) -> Dict[str, object]:
    req = compiled.create_infer_request()
    ids = rng.integers(FIRST_ORDINARY_ID, vocab, size=(bs, input_len), dtype=np.int64)
    times = NodeTimes()
    prefill(req, times, ids, collections.defaultdict(float))  # warm-up: a shape's first inference compiles kernels
    prefill_acc: Dict[Tuple[str, str], float] = collections.defaultdict(float)
    prefill_wall = prefill(req, times, ids, prefill_acc)
    decode: Dict[Tuple[str, str], float] = collections.defaultdict(float)
    next_ids = req.get_tensor("logits").data[:, -1].argmax(-1)
    walls: List[float] = []
    for step in range(steps):
        pos = input_len + step
        feed = {"input_ids": next_ids[:, None].astype(np.int64), "attention_mask": np.ones((bs, pos + 1), np.int64),
                "position_ids": np.full((bs, 1), pos, np.int64), "beam_idx": np.arange(bs, dtype=np.int32)}
        t0 = time.perf_counter()
        req.infer(feed)
        walls.append(time.perf_counter() - t0)
        last = times.last(req)
        if step > 0:  # the first decode step compiles the shape's kernels
            add(decode, last)
        next_ids = req.get_tensor("logits").data[:, -1].argmax(-1)
    timed = steps - 1
    return {"prefill_wall_ms": prefill_wall, "prefill": dict(prefill_acc),
            "decode_wall_ms": sorted(walls[1:])[len(walls[1:]) // 2] * 1e3,
            "decode": {k: v / timed for k, v in decode.items()}}


def print_table(title: str, times: Dict[Tuple[str, str], float], top: int = 12) -> None:
    total = sum(times.values())
    print(f"\n{title}: {total:.2f} ms in nodes")
    print("| node type | kernel (exec type) | ms | share |\n|---|---|---:|---:|")
    for (node, kernel), ms in sorted(times.items(), key=lambda kv: -kv[1])[:top]:
        print(f"| {node} | {kernel} | {ms:.3f} | {ms / total:.0%} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="an exported OpenVINO directory")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    p.add_argument("--input-len", type=int, default=200)
    p.add_argument("--steps", type=int, default=9, help="decode steps (the first is not timed)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    xml = os.path.join(os.path.expanduser(args.model), "openvino_model.xml")
    core = ov.Core()
    model = core.read_model(xml)
    vocab = model.output("logits").get_partial_shape()[2].get_length()
    compiled = core.compile_model(model, "CPU", {"PERF_COUNT": True, "INFERENCE_NUM_THREADS": args.threads})
    info = compiled_properties(ov, xml, args.threads)
    print(f"OpenVINO {ov.get_version()}, {args.model}")
    print("compiled:", info["compiled_properties"])
    print("kernels:", info["kernels"])
    rng = np.random.default_rng(0)
    for bs in args.batch_sizes:
        r = run_batch(compiled, bs, args.input_len, args.steps, vocab, rng)
        print(f"\n== batch {bs}: prefill {bs} x {args.input_len} {r['prefill_wall_ms']:.0f} ms wall; "
              f"decode step {r['decode_wall_ms']:.2f} ms wall (median)")
        print_table(f"decode step, batch {bs}", r["decode"])
        print_table(f"prefill, batch {bs}", r["prefill"], top=8)
    return 0


if __name__ == "__main__":
    sys.exit(main())
