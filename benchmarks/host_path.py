"""Issue 57: the host path per token, measured with the null worker (no model forward).

Two measurements, each printed as a table and written as JSON:

  step     the Scheduler's own decode step (schedule + run_batch + process results + the
           BatchTokenIDOutput) at N running requests, in-process over NullModelWorker;
  serving  `radixserve serve --null-worker` launched per source tree, and `radixserve bench
           serving` against it at 1, 16 and 256 concurrent /generate streams.

Before/after comparisons pass several source trees (label=path); the trees are run round-robin,
`--repeats` times, on a shared machine, and the best run of each is kept (noise only slows down).
A path may carry more PYTHONPATH entries after a colon (label=tree:/dir/with/packages), e.g.
packages a tree depends on that the shared environment lacks.

    python benchmarks/host_path.py step --trees before=/tmp/base after=. --running 256 1024
    python benchmarks/host_path.py serving --trees before=/tmp/base after=. --concurrency 1 16 256
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List, Tuple


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return f"{platform.processor()} x{os.cpu_count()}"


# ---- step: run inside the tree's interpreter (`python host_path.py _step N STEPS`) ------------
def _step_child(running: int, steps: int) -> Dict[str, float]:
    """The scheduler's decode step at `running` requests, in ms (median and best of `steps`)."""
    from radixserve.managers.scheduler import Scheduler
    from radixserve.managers.scheduler_builder import build_scheduler_parts
    from radixserve.models.model_config import ModelConfig
    from radixserve.hf_transformers_utils import resolve_model_path
    from radixserve.protocol import TokenizedGenerateReqInput
    from radixserve.sampling_params import SamplingParams
    from radixserve.server_args import ServerArgs
    from radixserve.sim.null_worker import NullModelWorker

    args = ServerArgs(null_worker=True, max_running_requests=running + 8, skip_tokenizer_init=True,
                      max_total_tokens=running * 1024, chunked_prefill_size=running * 64,
                      max_prefill_tokens=running * 64)
    worker = NullModelWorker(args, ModelConfig.from_pretrained(resolve_model_path(args)))
    sent: List[int] = []
    sched = Scheduler(args, send_fn=lambda obj: sent.append(len(getattr(obj, "rids", []))),
                      parts=build_scheduler_parts(args, tp_worker=worker))
    sp = SamplingParams(max_new_tokens=steps * 4 + 64, temperature=0.0, ignore_eos=True)
    reqs = [TokenizedGenerateReqInput(str(i), None, [1 + (i * 7 + j) % 1000 for j in range(32)], sp.clone()
                                      if hasattr(sp, "clone") else SamplingParams(**vars(sp)), stream=True)
            for i in range(running)]
    sched.process_input_requests(reqs)
    for _ in range(64):  # the prefills (and a few decode steps to settle)
        sched.run_step()
        if not sched.waiting_queue and len(sched.running_batch.reqs) == running:
            break
    assert len(sched.running_batch.reqs) == running, "not every request is decoding"
    for _ in range(5):
        sched.run_step()
    times, cpu = [], []
    for _ in range(steps):
        t, c = time.perf_counter(), time.thread_time()
        sched.run_step()
        times.append((time.perf_counter() - t) * 1e3)
        cpu.append((time.thread_time() - c) * 1e3)
    times.sort()
    cpu.sort()
    # CPU time is what a shared machine distorts least (wall time includes waiting for a core)
    return {"running": running, "step_ms_median": times[len(times) // 2], "step_ms_best": times[0],
            "cpu_ms_median": cpu[len(cpu) // 2], "cpu_us_per_request": cpu[len(cpu) // 2] * 1e3 / running}


def tree_env(tree: str) -> Dict[str, str]:
    """The environment that runs `tree` (its PYTHONPATH: the tree, then any extra entries)."""
    return dict(os.environ, PYTHONPATH=":".join(os.path.abspath(p) for p in tree.split(":")))


def run_in_tree(tree: str, argv: List[str], timeout: float = 600) -> str:
    env = tree_env(tree)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *argv], env=env, cwd=tree.split(":")[0],
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{tree}: {' '.join(argv)} failed:\n{out.stderr[-3000:]}")
    return out.stdout


def measure_step(trees: List[Tuple[str, str]], running: List[int], steps: int, repeats: int) -> List[Dict[str, Any]]:
    best: Dict[Tuple[str, int], Dict[str, Any]] = {}
    for _ in range(repeats):
        for label, tree in trees:
            for n in running:
                r = json.loads(run_in_tree(tree, ["_step", str(n), str(steps)]).strip().splitlines()[-1])
                key = (label, n)
                if key not in best or r["cpu_ms_median"] < best[key]["cpu_ms_median"]:
                    best[key] = dict(r, tree=label)
    return [best[(label, n)] for label, _ in trees for n in running]


# ---- serving -----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tree: str, port: int, extra: List[str]) -> subprocess.Popen:
    env = tree_env(tree)
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--null-worker", "--port", str(port),
           "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    import urllib.request

    for _ in range(240):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except Exception:
            if proc.poll() is not None:
                raise RuntimeError(f"{tree}: the server exited ({proc.returncode})")
            time.sleep(0.5)
    raise RuntimeError(f"{tree}: the server did not start")


def stop(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except Exception:
        os.killpg(proc.pid, signal.SIGKILL)


PROCESS_NAMES = ("main (HTTP + TokenizerManager)", "scheduler", "detokenizer")


def server_processes(root: int) -> Dict[str, int]:
    """The server's processes by role: the launcher (HTTP + TokenizerManager), then its children
    in start order (launch.py starts the scheduler before the detokenizer); not the resource tracker."""
    kids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
            cmd = open(f"/proc/{d}/cmdline").read()
        except OSError:
            continue
        if int(stat[1]) == root and "resource_tracker" not in cmd:
            kids.append((int(stat[19]), int(d)))  # starttime, pid
    pids = [root] + [pid for _, pid in sorted(kids)]
    return dict(zip(PROCESS_NAMES, pids))


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def bench_once(tree: str, server_pid: int, port: int, concurrency: int, output_len: int, num_prompts: int, out_file: str) -> Dict[str, Any]:
    cmd = [sys.executable, "-m", "radixserve.cli", "bench", "serving", "--port", str(port),
           "--dataset-name", "random-ids", "--random-input-len", "32", "--random-output-len", str(output_len),
           "--random-range-ratio", "1", "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
           "--request-rate", "inf", "--disable-tqdm", "--output-file", out_file, "--tag", f"c{concurrency}",
           "--output-details"]
    env = tree_env(tree)
    import resource

    procs = server_processes(server_pid)
    before = {k: cpu_seconds(p) for k, p in procs.items()}
    client = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=900)
    client_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(out_file) as f:
        r = json.loads(f.read().strip().splitlines()[-1])
    tokens = max(r["total_output_tokens"], 1)
    # Under load a chunk carries every token the request made since its last one (the
    # TokenizerManager yields the latest state): per-chunk costs then spread over more tokens.
    r["num_chunks"] = max(sum(len(d.get("chunks") or ()) for d in r.pop("details", [])), 1)
    r["cpu_us_per_token"] = {k: (cpu_seconds(p) - before[k]) * 1e6 / tokens for k, p in procs.items()}
    r["cpu_us_per_token"]["bench client"] = ((client_after.ru_utime + client_after.ru_stime) -
                                             (client.ru_utime + client.ru_stime)) * 1e6 / tokens
    return r


def measure_serving(trees: List[Tuple[str, str]], concurrency: List[int], output_len: int, repeats: int,
                    extra: List[str]) -> List[Dict[str, Any]]:
    best: Dict[Tuple[str, int], Dict[str, Any]] = {}
    tmp = f"/tmp/host_path_bench_{os.getpid()}.jsonl"
    for _ in range(repeats):
        for label, tree in trees:
            port = free_port()
            proc = launch(tree, port, extra)
            try:
                for c in concurrency:
                    r = bench_once(tree, proc.pid, port, c, output_len, max(4, 2 * c) if c > 1 else 4, tmp)
                    row = {"tree": label, "concurrency": c, "output_tok_s": r["output_throughput"],
                           "median_tpot_ms": r["median_tpot_ms"], "median_itl_ms": r["median_itl_ms"],
                           "completed": r["completed"], "tokens_per_chunk": r["total_output_tokens"] / r["num_chunks"],
                           "main_us_per_chunk": r["cpu_us_per_token"][PROCESS_NAMES[0]] * r["total_output_tokens"] / r["num_chunks"]}
                    row.update({f"cpu_us/tok {k.split()[0]}": v for k, v in r["cpu_us_per_token"].items()})
                    key = (label, c)
                    if key not in best or row["output_tok_s"] > best[key]["output_tok_s"]:
                        best[key] = row
            finally:
                stop(proc)
    return [best[(label, c)] for label, _ in trees for c in concurrency]


# ---- report ------------------------------------------------------------------------------------
def print_table(rows: List[Dict[str, Any]], cols: List[str]) -> None:
    print(" | ".join(f"{c.replace('cpu_us/tok ', 'us/tok '):>14}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:>14.3f}" if isinstance(r[c], float) else f"{r[c]:>14}" for c in cols))


def add_ratios(rows: List[Dict[str, Any]], key_col: str, value: str, higher_is_better: bool) -> None:
    """Each row's value against the first tree's at the same key (first tree = 1.00)."""
    first: Dict[Any, float] = {}
    for r in rows:
        first.setdefault(r[key_col], r[value])
        base = first[r[key_col]]
        r["vs_first"] = (r[value] / base if higher_is_better else base / r[value]) if base and r[value] else float("nan")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_step":
        print(json.dumps(_step_child(int(sys.argv[2]), int(sys.argv[3]))))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["step", "serving"])
    p.add_argument("--trees", nargs="+", default=["current=."], help="label=path of a radixserve source tree")
    p.add_argument("--running", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 256])
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--server-args", default="", help="extra flags for `radixserve serve`")
    p.add_argument("--output", default=None, help="JSON file (default: benchmarks/host_path_<what>.json)")
    a = p.parse_args()
    trees = [tuple(t.split("=", 1)) if "=" in t else (t, t) for t in a.trees]
    if a.what == "step":
        rows = measure_step(trees, a.running, a.steps, a.repeats)
        add_ratios(rows, "running", "cpu_ms_median", higher_is_better=False)
        cols = ["tree", "running", "step_ms_median", "cpu_ms_median", "cpu_us_per_request", "vs_first"]
    else:
        rows = measure_serving(trees, a.concurrency, a.output_len, a.repeats, a.server_args.split())
        add_ratios(rows, "concurrency", "output_tok_s", higher_is_better=True)
        cols = ["tree", "concurrency", "output_tok_s", "median_tpot_ms", "vs_first", "tokens_per_chunk", "main_us_per_chunk"] + \
            [f"cpu_us/tok {k.split()[0]}" for k in (*PROCESS_NAMES, "bench client")]
    print(f"CPU: {cpu_model()}   command: {' '.join(sys.argv)}")
    print_table(rows, cols)
    out = a.output or os.path.join(os.path.dirname(os.path.abspath(__file__)), f"host_path_{a.what}.json")
    with open(out, "w") as f:
        json.dump({"cpu": cpu_model(), "command": " ".join(sys.argv), "trees": dict(trees), "rows": rows}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
