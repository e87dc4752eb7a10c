"""Where a decode step's time goes on the CPU: the offline Engine (the production scheduler and
model code) decodes a static batch, with timers around the pieces of each step.

    python benchmarks/cpu/step_breakdown.py --model-path DIR [--dtype bfloat16] [--batch-sizes 1 16]
    RADIXSERVE_DISABLE_CPU_KERNELS=1 python benchmarks/cpu/step_breakdown.py ...   # the torch path

Pieces (ms per decode step, means over the timed steps): linear (every projection and the LM
head: the C++ GEMM or F.linear), attention (the backend: KV store + attention), norms/rope/act
(RMSNorm, rotary, SiLU-and-mul modules), sampling (ModelRunner.sample), other forward (the rest of
the model's forward: embedding, Python glue), scheduling (the scheduler's step outside the worker:
batch selection and result processing). The timers cost ~1 us a call (~0.3 ms a step at 30
layers). IPC/detokenization is not in the offline Engine: it is the served 1-user ITL minus this
step time (benchmarks/cpu_vs_peers.sh measures the former).
Prints a table; --output appends one JSON line per batch size (and phase, with --prefill: the ms
of the whole bs x input_len prefill, however many extend steps it took).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from typing import Any, Callable, Dict

import torch

STEP: Dict[str, float] = collections.defaultdict(float)  # the step under way
ACC: Dict[str, float] = collections.defaultdict(float)  # the decode steps so far
DECODE_STEPS = [0]
PREFILL: Dict[str, float] = collections.defaultdict(float)  # the prefill (extend) steps so far


def _timed(fn: Callable[..., Any], key: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            STEP[key] += time.perf_counter() - t0

    return wrapper


def _timed_step(run_step: Callable[..., Any]) -> Callable[..., Any]:
    """Scheduler.run_step: add the step's timings to ACC if it ran a DECODE batch, to PREFILL if
    it ran an EXTEND batch."""

    def wrapper(self: Any) -> Any:
        STEP.clear()
        t0 = time.perf_counter()
        batch = run_step(self)
        STEP["step"] = time.perf_counter() - t0
        if batch is not None and batch.forward_mode.is_decode():
            for k, v in STEP.items():
                ACC[k] += v
            DECODE_STEPS[0] += 1
        elif batch is not None and batch.forward_mode.is_extend():
            for k, v in STEP.items():
                PREFILL[k] += v
        return batch

    return wrapper


def install_timers() -> None:
    from radixserve.layers.activation import SiluAndMul
    from radixserve.layers.attention.base_attn_backend import AttentionBackend
    from radixserve.layers.layernorm import RMSNorm
    from radixserve.layers.linear import LinearBase
    from radixserve.layers.vocab_parallel_embedding import ParallelLMHead
    from radixserve.layers.rotary_embedding import RotaryEmbedding
    from radixserve.managers import scheduler as sched_mod
    from radixserve.model_executor.model_runner import ModelRunner

    LinearBase.matmul = _timed(LinearBase.matmul, "linear")  # C++ GEMM or F.linear
    ParallelLMHead.get_logits = _timed(ParallelLMHead.get_logits, "linear")
    AttentionBackend.forward = _timed(AttentionBackend.forward, "attention")
    for cls in (RMSNorm, RotaryEmbedding, SiluAndMul):
        cls.forward = _timed(cls.forward, "norms/rope/act")
    ModelRunner.forward = _timed(ModelRunner.forward, "forward")
    ModelRunner.sample = _timed(ModelRunner.sample, "sampling")
    sched_mod.Scheduler.run_step = _timed_step(sched_mod.Scheduler.run_step)
    sched_mod.Scheduler.run_batch = _timed(sched_mod.Scheduler.run_batch, "run_batch")


def _row(acc: Dict[str, float], n: int) -> Dict[str, float]:
    per = {k: v / max(n, 1) * 1000 for k, v in acc.items()}
    row = {k: per.get(k, 0.0) for k in ("linear", "attention", "norms/rope/act")}
    row["other forward"] = per.get("forward", 0.0) - sum(row.values())
    row["sampling"] = per.get("sampling", 0.0)
    row["scheduling"] = per.get("step", 0.0) - per.get("run_batch", 0.0)
    row["step"] = per.get("step", 0.0)
    return row


def measure(engine: Any, bs: int, input_len: int, steps: int, seed: int) -> Dict[str, Dict[str, float]]:
    """A static batch of bs random prompts, steps + 1 tokens each: one prefill (ms for the whole
    bs x input_len, however many extend steps it took), then decode steps (ms per step)."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.scheduler.vocab_size
    prompts = [torch.randint(10, vocab - 10, (input_len,), generator=g).tolist() for _ in range(bs)]
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    engine.generate(input_ids=prompts, sampling_params=params, progress=False)  # warm-up
    engine.flush_cache()
    ACC.clear()
    PREFILL.clear()
    DECODE_STEPS[0] = 0
    params["max_new_tokens"] = steps + 1
    engine.generate(input_ids=prompts, sampling_params=params, progress=False)
    engine.flush_cache()
    return {"decode": _row(ACC, DECODE_STEPS[0]), "prefill": _row(PREFILL, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--label", default=None, help="row label (default: kernels or torch path, and dtype)")
    p.add_argument("--output", default=None, help="append JSON lines here")
    p.add_argument("--prefill", action="store_true", help="also print each batch's prefill (ms for all of it)")
    args = p.parse_args()

    install_timers()
    from radixserve.engine import Engine
    from radixserve.layers import cpu_kernels

    engine = Engine(model_path=args.model_path, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, log_level="warning")
    dtype = str(engine.scheduler.tp_worker.model_runner.dtype).replace("torch.", "")
    kv = str(engine.scheduler.tp_worker.model_runner.token_to_kv_pool.dtype).replace("torch.", "")
    label = args.label or f"{'C++ kernels' if cpu_kernels.get() else 'torch path'}, {dtype}, KV {kv}"
    cols = ("linear", "attention", "norms/rope/act", "other forward", "sampling", "scheduling", "step")
    print(f"| {'config':<28} | {'phase':<7} | bs | " + " | ".join(f"{c:>14}" for c in cols) + " |")
    for bs in args.batch_sizes:
        rows = measure(engine, bs, args.input_len, args.steps, seed=bs)
        for phase in ("prefill", "decode") if args.prefill else ("decode",):
            row = rows[phase]
            print(f"| {label:<28} | {phase:<7} | {bs:>2} | " + " | ".join(f"{row[c]:>14.2f}" for c in cols) + " |", flush=True)
            if args.output:
                with open(args.output, "a") as f:
                    rec = {"label": label, "phase": phase, "kv_cache_dtype": kv, "batch_size": bs, "input_len": args.input_len, "dtype": dtype,
                           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                           "ms_per_step" if phase == "decode" else "ms_for_prefill": row}
                    f.write(json.dumps(rec) + "\n")
    engine.shutdown()


if __name__ == "__main__":
    main()
