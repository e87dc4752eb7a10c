"""Issue 54 (third item): how much slower is a forward when another busy process takes a core?

Reported: on a 2-core machine with one competing busy process a ~225-token prompt took ~6x its
quiet time in radixserve against ~2.5x in llama.cpp. This harness measures that slowdown for
several thread-pool configurations in ONE run:

- Each configuration is a worker subprocess (this file with --worker) started with its own
  environment, so what libgomp reads once at start-up (OMP_WAIT_POLICY, GOMP_SPINCOUNT) takes
  effect, and its own torch.set_num_threads. It loads the model (radixserve's ModelRunner, as
  `radixserve bench one-batch` drives it), warms up, then on each "go" runs the workload: one
  EXTEND forward of --input-len random tokens and --decode-steps DECODE forwards.
- Rounds alternate quiet / loaded for every configuration in turn (round-robin), so the load
  that other processes put on this shared machine lands on all of them. "Loaded" = a
  `python -c "while True: pass"` pinned to one core (--busy-core), started just before the
  run and killed after it.
- Reported per configuration: median and best prefill / decode-step time, quiet and loaded, and
  the slowdown ratio loaded / quiet (of the medians). The load average is recorded per run.

    python benchmarks/cpu/contention.py --model smollm2 --rounds 5 --out benchmarks/cpu/contention_smollm2.json
    python benchmarks/cpu/contention.py --model qwen1.5b --configs default passive --rounds 3 \
        --sequential --out benchmarks/cpu/contention_qwen1.5b.json

--sequential runs one worker at a time (all its rounds, still quiet/loaded alternating) for a
model too large to keep one copy per configuration in memory.

--divisions pool omp times the C++ kernels' work divisions (csrc/parallel.h) in turns inside each
worker (cpu_kernels.set_parallel_division before each run): one process, one model copy, the
same load on both; results are keyed config/division.

    python benchmarks/cpu/contention.py --model qwen1.5b --configs engine --divisions pool omp \
        --rounds 4 --out benchmarks/cpu/contention_pool_qwen1.5b.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[2]
QWEN_15B = "/root/.cache/radixserve-bench/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"

# name -> (environment overrides, torch threads or None for torch's default).
# RADIXSERVE_OMP_DEFAULTS=0 keeps the engine's own thread-pool defaults (if any) out of the
# configurations that are about the raw libgomp settings.
CONFIGS: Dict[str, Tuple[Dict[str, str], Optional[int]]] = {
    "default": ({}, None),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, None),
    "spin0": ({"GOMP_SPINCOUNT": "0"}, None),
    "spin1k": ({"GOMP_SPINCOUNT": "1000"}, None),
    "spin3k": ({"GOMP_SPINCOUNT": "3000"}, None),
    "spin10k": ({"GOMP_SPINCOUNT": "10000"}, None),
    "spin100k": ({"GOMP_SPINCOUNT": "100000"}, None),
    "active": ({"OMP_WAIT_POLICY": "ACTIVE"}, None),
    "threads1": ({}, 1),
    # the C++ kernels' static division (at::parallel_for) instead of parallel_for_dynamic
    "static": ({"RADIXSERVE_PARALLEL_STATIC": "1"}, None),
    "passive_static": ({"OMP_WAIT_POLICY": "PASSIVE", "RADIXSERVE_PARALLEL_STATIC": "1"}, None),
    # what the engine sets by default (radixserve/__init__.py), not overridden
    "engine": ({"RADIXSERVE_OMP_DEFAULTS": "1"}, None),
}
# Variables a configuration must not inherit from the caller (each config sets its own).
POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_SCHEDULE",
               "RADIXSERVE_PARALLEL_STATIC", "RADIXSERVE_OMP_DEFAULTS")


# ---- worker ----------------------------------------------------------------------------------
def _model_path(name: str) -> Optional[str]:
    if name == "tiny":
        return None
    if name == "smollm2":
        sys.path.insert(0, str(REPO / "tests"))
        from real_model import smollm2_gguf

        return str(smollm2_gguf())
    if name == "qwen1.5b":
        return QWEN_15B
    return name  # a path


def worker(args: argparse.Namespace) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from radixserve.bench.datasets import FIRST_ORDINARY_ID
    from radixserve.bench.one_batch import _OursDriver
    from radixserve.server_args import ServerArgs

    sa = ServerArgs(model_path=_model_path(args.model), max_total_tokens=args.input_len + args.decode_steps + 64,
                    max_running_requests=1, dtype=args.dtype)
    driver = _OursDriver(sa)
    vocab = driver.runner.model_config.vocab_size
    prompts = torch.randint(FIRST_ORDINARY_ID, vocab, (1, args.input_len),
                            generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    driver.warm_up(prompts)
    info = {"ready": True, "threads": torch.get_num_threads(), "dtype": str(driver.runner.dtype),
            "model_path": driver.model_path,
            "env": {k: os.environ[k] for k in POLICY_VARS if k in os.environ}}
    print(json.dumps(info), flush=True)
    from radixserve.layers import cpu_kernels

    for line in sys.stdin:
        words = line.split()
        if not words or words[0] != "go":
            break
        if len(words) > 1:  # the kernels' work division for this run
            cpu_kernels.get().set_parallel_division(words[1])
        c0 = time.process_time()
        prefill = driver.start(prompts)
        steps = [driver.step() for _ in range(args.decode_steps)]
        cpu = time.process_time() - c0
        driver.finish()
        print(json.dumps({"prefill_s": prefill, "decode_s": statistics.median(steps), "cpu_s": cpu}), flush=True)


# ---- driver ----------------------------------------------------------------------------------
class Worker:
    def __init__(self, name: str, args: argparse.Namespace):
        env_over, threads = CONFIGS[name]
        env = {k: v for k, v in os.environ.items() if k not in POLICY_VARS}
        env.update(env_over)
        env.setdefault("RADIXSERVE_OMP_DEFAULTS", "0")  # raw libgomp behaviour unless a config asks otherwise
        cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--input-len", str(args.input_len),
               "--decode-steps", str(args.decode_steps), "--dtype", args.dtype]
        if threads:
            cmd += ["--threads", str(threads)]
        self.name = name
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._read()

    def _read(self) -> Dict[str, Any]:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"worker {self.name} exited (rc {self.proc.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def run(self, division: str = "") -> Dict[str, Any]:
        self.proc.stdin.write(f"go {division}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class Busy:
    """`python -c "while True: pass"` pinned to one core, for the duration of a `with`."""

    def __init__(self, core: int):
        self.core = core

    def __enter__(self) -> "Busy":
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        os.sched_setaffinity(self.proc.pid, {self.core})
        time.sleep(0.3)  # let it start spinning (and the scheduler notice)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.proc.kill()
        self.proc.wait()


def cpu_model() -> str:  # not gemm_select's: importing radixserve sets GOMP_SPINCOUNT, which the workers would inherit
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _stats(runs: List[Dict[str, Any]], key: str) -> Dict[str, float]:
    vals = [r[key] for r in runs]
    return {"median": statistics.median(vals), "best": min(vals)}


def summarize(name: str, w_info: Dict[str, Any], quiet: List[Dict[str, Any]], loaded: List[Dict[str, Any]]) -> Dict[str, Any]:
    row: Dict[str, Any] = {"config": name, "env": w_info["env"], "threads": w_info["threads"]}
    for key in ("prefill_s", "decode_s", "cpu_s"):
        q, l = _stats(quiet, key), _stats(loaded, key)
        row[key] = {"quiet": q, "loaded": l, "slowdown": l["median"] / q["median"]}
    row["runs"] = {"quiet": quiet, "loaded": loaded}
    return row


def format_table(rows: List[Dict[str, Any]]) -> str:
    head = ("| config | threads | prefill quiet s (med/best) | prefill loaded s (med/best) | prefill slowdown "
            "| decode quiet ms (med/best) | decode loaded ms (med/best) | decode slowdown | CPU s quiet / loaded |")
    lines = [head, "|" + " --- |" * 9]
    for r in rows:
        p, d = r["prefill_s"], r["decode_s"]
        lines.append(
            f"| {r['config']} | {r['threads']} | {p['quiet']['median']:.3f} / {p['quiet']['best']:.3f} "
            f"| {p['loaded']['median']:.3f} / {p['loaded']['best']:.3f} | {p['slowdown']:.2f}x "
            f"| {d['quiet']['median'] * 1e3:.1f} / {d['quiet']['best'] * 1e3:.1f} "
            f"| {d['loaded']['median'] * 1e3:.1f} / {d['loaded']['best'] * 1e3:.1f} | {d['slowdown']:.2f}x "
            f"| {r['cpu_s']['quiet']['median']:.2f} / {r['cpu_s']['loaded']['median']:.2f} |")
    return "\n".join(lines)


def _one(w: Worker, busy_core: int, loaded: bool, division: str = "") -> Dict[str, Any]:
    if loaded:
        with Busy(busy_core):
            r = w.run(division)
    else:
        r = w.run(division)
    r["loadavg1"] = os.getloadavg()[0]
    return r


def main(args: argparse.Namespace) -> None:
    divisions = args.divisions or [""]
    labels = [f"{c}/{d}" if d else c for c in args.configs for d in divisions]
    results: Dict[str, Dict[str, List[Dict[str, Any]]]] = {lb: {"quiet": [], "loaded": []} for lb in labels}
    infos: Dict[str, Dict[str, Any]] = {}
    t0 = time.time()

    def rounds(workers: List[Worker]) -> None:
        for i in range(args.rounds):
            for w in workers:  # quiet, then loaded, config after config: noise lands on all alike
                for j, d in enumerate(divisions if i % 2 == 0 else divisions[::-1]):
                    label = f"{w.name}/{d}" if d else w.name
                    for loaded in (False, True) if (i + j) % 2 == 0 else (True, False):
                        r = _one(w, args.busy_core, loaded, d)
                        results[label]["loaded" if loaded else "quiet"].append(r)
                        print(f"round {i} {label:14s} {'loaded' if loaded else 'quiet ':6s} prefill {r['prefill_s']:.3f} s "
                              f"decode {r['decode_s'] * 1e3:.1f} ms  cpu {r['cpu_s']:.2f} s  load {r['loadavg1']:.1f}",
                              flush=True)

    if args.sequential:
        for c in args.configs:
            w = Worker(c, args)
            infos[c] = w.info
            rounds([w])
            w.close()
    else:
        workers = [Worker(c, args) for c in args.configs]
        infos = {w.name: w.info for w in workers}
        rounds(workers)
        for w in workers:
            w.close()

    rows = [summarize(lb, infos[lb.split("/")[0]], results[lb]["quiet"], results[lb]["loaded"]) for lb in labels]
    table = format_table(rows)
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores")
    print(table)
    if args.out:
        report = {
            "benchmark": "contention",
            "cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "machine": platform.machine(),
            "model": args.model, "model_path": next(iter(infos.values()))["model_path"],
            "dtype": next(iter(infos.values()))["dtype"],
            "input_len": args.input_len, "decode_steps": args.decode_steps, "rounds": args.rounds,
            "busy": f"python -c 'while True: pass' pinned to core {args.busy_core}",
            "sequential": args.sequential, "wall_s": time.time() - t0,
            "notes": "slowdown = median loaded / median quiet; decode_s is the median step of each run; "
                     "loadavg1 per run shows the other processes' load on this shared machine",
            "results": rows, "table": table,
        }
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default="smollm2", help="smollm2 | qwen1.5b | tiny | a model path")
    p.add_argument("--input-len", type=int, default=225)
    p.add_argument("--dtype", default="auto", help="ServerArgs.dtype (auto | bfloat16 | float32)")
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--busy-core", type=int, default=1)
    p.add_argument("--sequential", action="store_true", help="one worker at a time (large models)")
    p.add_argument("--divisions", nargs="*", default=[], choices=["pool", "omp", "static"],
                   help="the kernels' work divisions to time in turns in each worker")
    p.add_argument("--out", default="")
    return p.parse_args()


if __name__ == "__main__":
    a = parse_args()
    worker(a) if a.worker else main(a)
