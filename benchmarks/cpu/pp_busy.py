"""Issue 30: does the pipeline keep every stage busy? Per-stage busy share from timestamps.

Each variant runs the same concurrent batch (decode-heavy, shared prefixes) through real
schedulers (managers/scheduler_pp.py; stages are processes on gloo), and each stage records
perf_counter() (start, end) of its forwards. Over the window from the first forward's start to
the last one's end, a stage's busy share is the time it spent in forwards; "overlap" is the
share of the window in which both stages computed at once (micro-batches on different stages).
On one small CPU the two stages share the cores (each process computes on one thread, pp1
too), so this is about the schedule (busy share, bubbles), not a speed-up. Variants alternate round by round (noise hits all alike).

    python benchmarks/cpu/pp_busy.py --rounds 3 --out benchmarks/cpu/pp_busy.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import time
from typing import Any, Dict, List, Tuple

VARIANTS = {  # name -> (pp_size, extra ServerArgs)
    "pp1": (1, {}),
    "pp2, 1 micro-batch": (2, dict(pp_max_micro_batch_size=1024)),
    "pp2, 2 micro-batches": (2, dict(pp_max_micro_batch_size=None)),  # None: filled in as bs / 2
    "pp2, 3 in flight": (2, dict(pp_max_micro_batch_size=None, pp_async_batch_depth=1)),  # bs / 3 each
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _requests(n: int, prompt_len: int, out_len: int, vocab: int) -> List[Any]:
    import torch

    from radixserve.protocol import TokenizedGenerateReqInput
    from radixserve.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, vocab, (prompt_len // 2,), generator=g).tolist()
    reqs = []
    for i in range(n):
        sp = SamplingParams(max_new_tokens=out_len, temperature=0, ignore_eos=True)
        sp.normalize()
        ids = prefix + torch.randint(3, vocab, (prompt_len - len(prefix),), generator=g).tolist()
        reqs.append(TokenizedGenerateReqInput(f"r{i}", None, ids, sp))
    return reqs


def _rank(rank: int, pp: int, addr: str, flags: Dict[str, Any], reqs: List[Any], out: str) -> None:
    from radixserve.hf_transformers_utils import resolve_model_path
    from radixserve.managers.scheduler import Scheduler
    from radixserve.managers.scheduler_pp import PPStage
    from radixserve.models.model_config import ModelConfig
    from radixserve.server_args import ServerArgs

    import torch

    torch.set_num_threads(1)  # every stage on one core, pp1 too: the variants compute alike
    args = ServerArgs(pp_size=pp, dist_init_addr=addr, disable_overlap_schedule=True, **flags)
    if rank > 0:
        stage = PPStage(args, ModelConfig.from_pretrained(resolve_model_path(args)), 0, rank)
        stage.run()
        _dump(out, rank, stage.busy.intervals, {})
        stage.shutdown()
        return
    inbox = [list(reqs)]
    sched = Scheduler(args, recv_fn=lambda: inbox.pop() if inbox else [])
    busy: List[Tuple[float, float]] = []
    if sched.pp is None:  # pp=1: time the normal loop's forwards the same way
        run_batch = sched.run_batch

        def timed(batch):
            t0 = time.perf_counter()
            result = run_batch(batch)
            busy.append((t0, time.perf_counter()))
            return result

        sched.run_batch = timed
    for it in range(1_000_000):
        sched.process_input_requests(sched.recv_requests())
        sched.run_step()
        if it > 0 and not sched.has_work():
            break
    extra = {"forward_ct": sched.forward_ct, "max_inflight": sched.pp.max_inflight if sched.pp else 1}
    _dump(out, 0, sched.pp.busy.intervals if sched.pp else busy, extra)
    sched.shutdown()


def _dump(out: str, rank: int, intervals: List[Tuple[float, float]], extra: Dict[str, Any]) -> None:
    with open(f"{out}.stage{rank}.json", "w") as f:
        json.dump({"intervals": intervals, **extra}, f)


def run_variant(pp: int, flags: Dict[str, Any], reqs: List[Any], tmp: str) -> Dict[str, Any]:
    ctx = mp.get_context("spawn")
    addr = f"127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, pp, addr, flags, reqs, tmp)) for r in range(pp)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
        assert p.exitcode == 0, f"a stage exited with {p.exitcode}"
    stages = []
    for r in range(pp):
        with open(f"{tmp}.stage{r}.json") as f:
            stages.append(json.load(f))
        os.remove(f"{tmp}.stage{r}.json")
    return summarize(stages)


def summarize(stages: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Busy share of each stage and the share with all stages busy, over the forwards' window."""
    start = min(s["intervals"][0][0] for s in stages)
    end = max(s["intervals"][-1][1] for s in stages)
    window = end - start
    busy = [sum(b - a for a, b in s["intervals"]) / window for s in stages]
    # all stages busy at once: sweep over the interval edges
    edges = sorted([(a, 1) for s in stages for a, _ in s["intervals"]] + [(b, -1) for s in stages for _, b in s["intervals"]])
    depth, last, together = 0, start, 0.0
    for t, d in edges:
        if depth == len(stages):
            together += t - last
        depth, last = depth + d, t
    return {"window_s": window, "busy_share": busy, "all_busy_share": together / window,
            "forwards": stages[0].get("forward_ct"), "max_inflight": stages[0].get("max_inflight")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=12)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--model-path", default=None, help="default: the embedded tiny model")
    ap.add_argument("--out", default="benchmarks/cpu/pp_busy.json")
    a = ap.parse_args()
    base = dict(max_total_tokens=8192, chunked_prefill_size=2048, dtype="float32")
    if a.model_path:
        base["model_path"] = a.model_path
    from radixserve.models.model_config import ModelConfig
    from radixserve.server_args import ServerArgs
    from radixserve.hf_transformers_utils import resolve_model_path

    vocab = ModelConfig.from_pretrained(resolve_model_path(ServerArgs(**base))).vocab_size
    reqs = _requests(a.num_requests, a.prompt_len, a.output_len, vocab)
    tmp = f"/tmp/pp_busy_{os.getpid()}"
    rows: Dict[str, List[Dict[str, Any]]] = {name: [] for name in VARIANTS}
    for rnd in range(a.rounds):
        for name, (pp, extra) in VARIANTS.items():
            flags = dict(base, **extra)
            if "pp_max_micro_batch_size" in extra and extra["pp_max_micro_batch_size"] is None:
                in_flight = 2 + extra.get("pp_async_batch_depth", 0)
                flags["pp_max_micro_batch_size"] = -(-a.num_requests // in_flight)
            rows[name].append(run_variant(pp, flags, reqs, tmp))
            r = rows[name][-1]
            print(f"round {rnd} {name:<22} busy {['%.2f' % b for b in r['busy_share']]} all-busy {r['all_busy_share']:.2f} "
                  f"window {r['window_s']:.2f}s", flush=True)
    table = []
    print(f"\n{'variant':<22} {'stage busy share (median)':<28} {'all stages busy':<16} {'window s':<9} forwards  max in flight")
    for name, runs in rows.items():
        busy = [statistics.median(r["busy_share"][i] for r in runs) for i in range(len(runs[0]["busy_share"]))]
        together = statistics.median(r["all_busy_share"] for r in runs)
        window = statistics.median(r["window_s"] for r in runs)
        table.append({"variant": name, "busy_share": busy, "all_busy_share": together, "window_s": window,
                      "forwards": runs[0]["forwards"], "max_inflight": runs[0]["max_inflight"], "rounds": runs})
        print(f"{name:<22} {' / '.join('%.2f' % b for b in busy):<28} {together:<16.2f} {window:<9.2f} "
              f"{runs[0]['forwards']:<9} {runs[0]['max_inflight']}")
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "cpu_count": os.cpu_count(), "variants": table}, f, indent=1)
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
