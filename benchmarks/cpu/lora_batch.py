"""Multi-LoRA batch cost on SmolLM2-135M-Instruct (the CPU's bf16 mode), offline Engine (issue 28).

16 concurrent requests (greedy, ignore_eos, the same prompts every time) spread over 1, 4 and 8
PEFT adapters (random non-zero A and B, every one of q/k/v/o/gate/up/down, rank --rank), against
the base model alone: the same engine (--enable-lora, the same flags), requests without
lora_path. Reported per configuration: output tokens/s of the whole generate call, and the median
time of a decode step of the full batch (Scheduler.run_step timed; prefill steps left out). The
goal of the issue: 8 adapters cost at most 1.3x the base model's time per step.

Noise: the configurations take turns inside each round (base, 1, 4, 8, ...), for --rounds rounds;
reported are the ratios to base within each round (their median) and the ratio of the configs'
fastest rounds. With --backends torch,kernel both LoRA backends
(radixserve.lora.layers.set_lora_backend) alternate in the same rounds, so the before/after
comparison sees the same load.

    python benchmarks/cpu/lora_batch.py --threads 1 --rounds 2 --max-new-tokens 32 --out benchmarks/cpu/lora_batch.json
    python benchmarks/cpu/lora_batch.py --threads 1 --delta-only --out benchmarks/cpu/lora_batch_delta.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from real_model import AGREEMENT_QUESTIONS, chat_prompt_ids, smollm2_gguf  # noqa: E402

from radixserve.engine import Engine  # noqa: E402
from radixserve.lora import layers as lora_layers  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONCURRENCY = 16


def write_random_adapter(out: Path, dims: Dict[str, tuple], num_layers: int, rank: int, seed: int) -> Path:
    """A PEFT LoRA directory (PEFT's tensor names) with random non-zero A and B for every layer
    and every target; dims: module -> (in_features, out_features)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for module in TARGETS:
            in_f, out_f = dims[module]
            group = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, in_f, generator=gen) / in_f**0.5).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_f, rank, generator=gen) * 0.05 / rank**0.5).contiguous()
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2.0 * rank, "target_modules": TARGETS,
              "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def smollm2_dims(hf_config: Any) -> tuple:
    h, i = hf_config.hidden_size, hf_config.intermediate_size
    kv = hf_config.num_key_value_heads * (h // hf_config.num_attention_heads)
    dims = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    return dims, hf_config.num_hidden_layers


class Backends:
    """The LoRA backends to compare: "torch", "kernel", and "kernel-bf16": the kernel on bf16 copies
    of the pool's float32 slots (what the pool would hold if it kept the weights' dtype in the
    bf16 mode; made after the warm-up has put every adapter in its slot, and no slot changes
    after it: as many slots as adapters)."""

    def __init__(self, engine: Engine):
        self.pool = engine.scheduler.tp_worker.model_runner.lora_manager.pool
        self.f32 = (self.pool.a_buffers, self.pool.b_buffers)
        self.bf16: Optional[tuple] = None

    def use(self, name: str) -> None:
        if name == "kernel-bf16" and self.bf16 is None:
            self.bf16 = tuple({m: t.bfloat16() for m, t in d.items()} for d in self.f32)
        self.pool.a_buffers, self.pool.b_buffers = self.bf16 if name == "kernel-bf16" else self.f32
        lora_layers.set_lora_backend("kernel" if name == "kernel-bf16" else name)


class StepTimer:
    """Wraps the engine's Scheduler.run_step: the seconds of each decode step of the full batch."""

    def __init__(self, engine: Engine, batch_size: int):
        self.batch_size = batch_size
        self.steps: List[float] = []
        sched = engine.scheduler
        run_step = self.engine_run_step = sched.run_step

        def timed() -> Any:
            t0 = time.perf_counter()
            batch = run_step()
            dt = time.perf_counter() - t0
            if batch is not None and batch.forward_mode.is_decode() and batch.batch_size() == self.batch_size:
                self.steps.append(dt)
            return batch

        sched.run_step = self.wrapped = timed


class StepInterleaver:
    """Per decode step of one batch, the next of `modes` in turn: "base" (the forward skips the
    LoRA delta: what the same batch costs without adapters) or a LoRA backend. Steps a few
    milliseconds apart see the same load from other jobs, which whole runs seconds apart do not."""

    def __init__(self, engine: Engine, timer: StepTimer, modes: List[str], backends: Backends):
        self.modes, self.mode, self.count = modes, None, 0
        self.by_mode: Dict[str, List[float]] = {m: [] for m in modes}
        manager = engine.scheduler.tp_worker.model_runner.lora_manager
        prepare = manager.prepare_lora_batch

        def interleaved(forward_batch: Any) -> Any:
            info = prepare(forward_batch)
            if self.modes and forward_batch.forward_mode.is_decode():
                self.mode = self.modes[self.count % len(self.modes)]
                self.count += 1
                if self.mode == "base":
                    info = manager.state.info = forward_batch.lora_info = None
                else:
                    backends.use(self.mode)
            return info

        manager.prepare_lora_batch = interleaved
        run_step = timer.wrapped

        def timed() -> Any:
            self.mode = None
            t0 = time.perf_counter()
            batch = run_step()
            dt = time.perf_counter() - t0
            if self.mode is not None and batch is not None and batch.batch_size() == timer.batch_size:
                self.by_mode[self.mode].append(dt)
            return batch

        engine.scheduler.run_step = timed


def run_once(engine: Engine, timer: StepTimer, prompts: List[List[int]], paths: List[Optional[str]],
             max_new: int) -> Dict[str, float]:
    engine.scheduler.run_step()
    assert engine.flush_cache(), "the prefix cache was not flushed"
    timer.steps.clear()
    sp = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=[dict(sp) for _ in prompts], lora_path=paths, progress=False)
    seconds = time.perf_counter() - t0
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    # the median step: a step that another job on the machine delayed does not move it
    return {"tokens_per_s": tokens / seconds, "ms_per_decode_step": 1e3 * statistics.median(timer.steps),
            "decode_steps": len(timer.steps), "output_tokens": tokens}


def delta_only(rank: int, rounds: int) -> List[Dict[str, Any]]:
    """The LoRA delta alone, without the model: SmolLM2's 30 layers x (qkv, o, gate_up, down), 16
    decode tokens, 8 slots of random A/B; the torch loop and the kernel on float32 slots (what
    the pool holds in the bf16 mode) and the kernel on bf16 slots, taking turns; ms per step,
    the fastest of `rounds` turns each."""
    from radixserve.lora.layers import LoRABatchInfo, LoRABatchState, LoRALinearDelta
    from radixserve.lora.mem_pool import LoRAMemoryPool

    h, i, kv, layers = 576, 1536, 192, 30
    dims = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}
    fused = [[("q_proj", 0, h), ("k_proj", h, kv), ("v_proj", h + kv, kv)], [("o_proj", 0, h)],
             [("gate_proj", 0, i), ("up_proj", i, i)], [("down_proj", 0, h)]]
    state = LoRABatchState()
    pools = {dt: LoRAMemoryPool(8, rank, dims, layers, dt, "cpu") for dt in (torch.float32, torch.bfloat16)}
    for m in dims:
        for buffers in ("a_buffers", "b_buffers"):
            getattr(pools[torch.float32], buffers)[m].normal_()
            getattr(pools[torch.bfloat16], buffers)[m].copy_(getattr(pools[torch.float32], buffers)[m])
    deltas = {dt: [(LoRALinearDelta(layer, parts, pool, state), dims[parts[0][0]][0], sum(p[2] for p in parts))
                   for layer in range(layers) for parts in fused] for dt, pool in pools.items()}
    xs = {k: torch.randn(CONCURRENCY, k) for k in (h, i)}
    ys = {n: torch.zeros(CONCURRENCY, n) for n in (h + 2 * kv, h, 2 * i)}
    modes = [("torch", torch.float32), ("kernel", torch.float32), ("kernel", torch.bfloat16)]
    rows = []
    for n in (1, 4, 8):
        segs = [(t, t + 1, t % n, 2.0) for t in range(CONCURRENCY)] if n > 1 else [(0, CONCURRENCY, 0, 2.0)]
        best: Dict[str, float] = {}
        for _ in range(rounds):
            for backend, dt in modes:
                state.info = LoRABatchInfo(segments=segs)
                lora_layers.set_lora_backend(backend)
                t0 = time.perf_counter()
                for lora, k, out in deltas[dt]:
                    lora.apply(xs[k], ys[out])
                key = f"{backend}/{str(dt).split('.')[-1]} slots"
                best[key] = min(best.get(key, float("inf")), 1e3 * (time.perf_counter() - t0))
        rows.append({"adapters": n, "ms_per_step": best})
        print(f"delta only, {n} adapter(s): " + "  ".join(f"{k} {v:.2f}" for k, v in best.items()) + " ms/step", flush=True)
    lora_layers.set_lora_backend("kernel")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", default="1,4,8", help="numbers of adapters the 16 requests are spread over")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", default="torch,kernel,kernel-bf16", help="LoRA backends to alternate (Backends)")
    parser.add_argument("--delta-only", action="store_true", help="time the LoRA delta alone (no model)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's); 1 on a machine other jobs load, where every "
                             "OpenMP barrier of a 2-thread step waits for a descheduled thread")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.delta_only:
        rows = delta_only(args.rank, 15)
        if args.out:
            Path(args.out).write_text(json.dumps({"rank": args.rank, "threads": torch.get_num_threads(), "command": " ".join(
                ["python"] + sys.argv), "delta_only": rows}, indent=1) + "\n")
        return

    from transformers import AutoConfig

    path = smollm2_gguf()
    dims, num_layers = smollm2_dims(AutoConfig.from_pretrained(str(path.with_suffix(".hf"))))
    counts = [int(c) for c in args.adapters.split(",")]
    backends = args.backends.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"ad{i}" for i in range(max(counts))]
        lora_paths = [f"{n}={write_random_adapter(Path(tmp) / n, dims, num_layers, args.rank, seed=i + 1)}"
                      for i, n in enumerate(names)]
        engine = Engine(model_path=str(path), dtype=args.dtype, max_total_tokens=32768, enable_lora=True,
                        lora_paths=lora_paths, max_loras_per_batch=max(counts), max_lora_rank=args.rank)
        timer = StepTimer(engine, CONCURRENCY)
        switch = Backends(engine)
        tok = engine.tokenizer
        prompts = [chat_prompt_ids(tok, q) for q in AGREEMENT_QUESTIONS[:CONCURRENCY]]
        configs: Dict[str, List[Optional[str]]] = {"base": [None] * CONCURRENCY}
        for n in counts:
            configs[f"{n} adapter{'s' if n > 1 else ''}"] = [names[i % n] for i in range(CONCURRENCY)]
        # base once per round (its requests take no LoRA backend), each adapter config per backend
        runs = [(backends[0], "base")] + [(b, name) for b in backends for name in configs if name != "base"]
        for backend, name in runs:  # warm up: every adapter into its slot, first-call allocations
            switch.use("kernel" if backend == "kernel-bf16" else backend)
            run_once(engine, timer, prompts[:4] * 4, configs[name], 4)
        results: Dict[str, List[Dict[str, float]]] = {f"{b}/{n}": [] for b, n in runs}
        for rnd in range(args.rounds):
            for backend, name in runs:
                switch.use(backend)
                res = run_once(engine, timer, prompts, configs[name], args.max_new_tokens)
                results[f"{backend}/{name}"].append(res)
                print(f"round {rnd + 1} {backend:>6} {name:>10}: {res['tokens_per_s']:7.1f} tok/s "
                      f"{res['ms_per_decode_step']:6.2f} ms/step ({res['decode_steps']} steps)", flush=True)
        # the same batches, the modes taking turns step by step
        modes = ["base"] + backends
        interleaved = []
        for rnd in range(args.rounds):
            for name, paths in configs.items():
                if name == "base":
                    continue
                inter = StepInterleaver(engine, timer, modes, switch)
                run_once(engine, timer, prompts, paths, args.max_new_tokens)
                inter.modes = []
                engine.scheduler.run_step = timer.wrapped
                ms = {m: 1e3 * statistics.median(v) for m, v in inter.by_mode.items()}
                interleaved.append({"round": rnd + 1, "config": name, "ms_per_decode_step": ms,
                                    "steps": {m: len(v) for m, v in inter.by_mode.items()}})
                print(f"round {rnd + 1} interleaved {name:>10}: " + "  ".join(f"{m} {v:6.2f}" for m, v in ms.items())
                      + " ms/step", flush=True)
        switch.use("kernel")
        engine.shutdown()

    base_key = f"{backends[0]}/base"
    rows = []
    for key, res in results.items():
        ratios = [r["ms_per_decode_step"] / b["ms_per_decode_step"] for r, b in zip(res, results[base_key])]
        best = min(r["ms_per_decode_step"] for r in res)
        rows.append({
            "config": key, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in res),
            "ms_per_decode_step": statistics.median(r["ms_per_decode_step"] for r in res), "ms_per_decode_step_min": best,
            "step_vs_base_per_round": ratios, "step_vs_base_median": statistics.median(ratios),
            "step_vs_base_of_minima": best / min(r["ms_per_decode_step"] for r in results[base_key]), "rounds": res,
        })
    print(f"\n{'config':>20} | {'tok/s':>7} | {'ms/step':>7} | {'min':>7} | step / base: of minima, median (per round)")
    for row in rows:
        per = ", ".join(f"{r:.2f}" for r in row["step_vs_base_per_round"])
        print(f"{row['config']:>20} | {row['tokens_per_s']:7.1f} | {row['ms_per_decode_step']:7.2f} | "
              f"{row['ms_per_decode_step_min']:7.2f} | {row['step_vs_base_of_minima']:.2f}, "
              f"{row['step_vs_base_median']:.2f} ({per})")
    inter_rows = []
    print("\ninterleaved step by step, median over rounds of (mode / base in the same run):")
    for name in configs:
        if name == "base":
            continue
        runs_of = [r["ms_per_decode_step"] for r in interleaved if r["config"] == name]
        row = {"config": name, "base_ms": statistics.median(r["base"] for r in runs_of)}
        for m in backends:
            row[f"{m}_ms"] = statistics.median(r[m] for r in runs_of)
            row[f"{m}_vs_base"] = statistics.median(r[m] / r["base"] for r in runs_of)
        inter_rows.append(row)
        print(f"{name:>10}: base {row['base_ms']:6.2f} ms  " + "  ".join(
            f"{m} {row[m + '_ms']:6.2f} ms ({row[m + '_vs_base']:.2f}x)" for m in backends))
    result = {"model": path.name, "dtype": args.dtype, "rank": args.rank, "targets": TARGETS,
              "threads": torch.get_num_threads(), "load_average_after": list(os.getloadavg()),
              "concurrency": CONCURRENCY, "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
              "command": " ".join(["python"] + sys.argv), "rows": rows,
              "interleaved": inter_rows, "interleaved_runs": interleaved}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
