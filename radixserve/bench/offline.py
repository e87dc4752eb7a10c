"""`radixserve bench offline`: offline throughput, nano-vllm's benchmark shape scaled to a CPU.

`--num-prompts` requests of random token ids (input length uniform in [min, max] input len,
output length uniform in [min, max] output len, ignore_eos, temperature 0), all submitted at
once to the offline `Engine` (the production scheduler, in-process); we time the whole
`engine.generate` call and report output tokens / second.

In the same run (unless `--skip-hf`) transformers' `generate` runs the same requests in
static batches of `--hf-batch-size`, in submission order, left-padded with an attention mask.
A static batch runs until its longest request is done (min_new_tokens = max_new_tokens = the
batch's longest output), so HF's "useful" tok/s counts only the tokens each request asked for;
"raw" counts every generated token, padding rows included.

    radixserve bench offline                                           # 128 prompts, tiny model
    radixserve bench offline --num-prompts 4 --max-input-len 32 --max-output-len 8 --output /tmp/o.json
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from typing import Any, Dict, List, Optional, Tuple, TypeVar

import torch

from radixserve.bench.datasets import FIRST_ORDINARY_ID
from radixserve.bench.report import loadavg, machine_info, markdown_table, write_json
from radixserve.server_args import ServerArgs

DEFAULT_OUTPUT = "benchmarks/offline.json"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("offline", help="offline throughput of the Engine on random prompts, vs transformers generate")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--min-input-len", type=int, default=64)
    p.add_argument("--max-input-len", type=int, default=512)
    p.add_argument("--min-output-len", type=int, default=32)
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--skip-hf", action="store_true", help="do not run the transformers baseline")
    p.add_argument("--skip-other-loop", action="store_true",
                   help="run only the selected event loop (default: overlap and normal side by side)")
    p.add_argument("--output", default=DEFAULT_OUTPUT, help="JSON results path ('' to skip)")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="also run the prompts constrained by this JSON schema, vs unconstrained at the same output lengths")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's default, one per core)")
    ServerArgs.add_cli_args(p)  # --seed (the workload's seed too), --model-path, --max-total-tokens, ...
    p.set_defaults(func=run)
    return p


def make_workload(args: argparse.Namespace, vocab_size: int) -> Tuple[List[List[int]], List[int]]:
    """Random prompts and output lengths, reproducible from --seed."""
    rng = random.Random(args.seed)
    prompts, out_lens = [], []
    for _ in range(args.num_prompts):
        n = rng.randint(args.min_input_len, args.max_input_len)
        prompts.append([rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(n)])
        out_lens.append(rng.randint(args.min_output_len, args.max_output_len))
    return prompts, out_lens


def _check_args(args: argparse.Namespace) -> None:
    if args.num_prompts < 1 or args.hf_batch_size < 1:
        raise ValueError("--num-prompts and --hf-batch-size must be >= 1")
    if not 1 <= args.min_input_len <= args.max_input_len:
        raise ValueError("need 1 <= --min-input-len <= --max-input-len")
    if not 1 <= args.min_output_len <= args.max_output_len:
        raise ValueError("need 1 <= --min-output-len <= --max-output-len")


# ---- ours ------------------------------------------------------------------------------------
S = TypeVar("S")


def stats_delta(before: S, after: S) -> S:
    """after - before, field by field, of two snapshots of a dataclass of counters
    (Engine.stats(), Engine.grammar_stats())."""
    return type(after)(**{f.name: getattr(after, f.name) - getattr(before, f.name) for f in dataclasses.fields(after)})


def uses_overlap_loop(engine: Any) -> bool:
    return engine.server_args.overlap_schedule_enabled(engine.device)


def run_ours(engine: Any, prompts: List[List[int]], out_lens: List[int], label: str = "radixserve") -> Dict[str, Any]:
    sps = [{"max_new_tokens": n, "ignore_eos": True, "temperature": 0} for n in out_lens]
    # Warm-up: a few short requests through the same code paths, then an empty radix cache.
    warm = [p[:16] for p in prompts[:2]]
    engine.generate(input_ids=warm, sampling_params=[{"max_new_tokens": 4, "ignore_eos": True, "temperature": 0}] * len(warm), progress=False)
    engine.wait_until_idle()  # let the last batch retire, so the flush is allowed
    if not engine.flush_cache():
        raise RuntimeError("could not flush the radix cache after the warm-up")
    before = engine.stats()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = engine.generate(input_ids=prompts, sampling_params=sps, progress=True)  # a bar on a terminal only
    elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    st = stats_delta(before, engine.stats())
    # "Forward" = model forward + sampling: on the forward thread (overlap), inline (normal).
    forward_s = st.forward_thread_busy_s if uses_overlap_loop(engine) else st.forward_s
    out_tokens = sum(len(o["output_ids"]) for o in outs)
    if out_tokens != sum(out_lens):
        raise RuntimeError(f"radixserve generated {out_tokens} tokens, expected {sum(out_lens)} (ignore_eos)")
    summary = _summary(label, prompts, out_tokens, elapsed, cpu_s)
    summary.update(
        # share of the wall time the scheduling thread spent scheduling / processing results
        sched_share=(st.schedule_s + st.process_s) / elapsed,
        forward_s=forward_s,
        wall_over_forward=elapsed / forward_s if forward_s else None,
        steps=st.num_batches,
    )
    return summary


# ---- transformers ------------------------------------------------------------------------------
def run_hf(model_path: str, prompts: List[List[int]], out_lens: List[int], batch_size: int, pad_id: int,
           dtype: torch.dtype = torch.float32, device: str = "cpu") -> Dict[str, Any]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    model.generation_config.pad_token_id = pad_id

    def gen_batch(batch: List[List[int]], n_new: int) -> int:
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.int64)
        mask = torch.zeros((len(batch), width), dtype=torch.int64)
        for i, p in enumerate(batch):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=n_new, min_new_tokens=n_new,
                do_sample=False, pad_token_id=pad_id, use_cache=True,
            )
        return (out.shape[1] - width) * len(batch)

    gen_batch([p[:16] for p in prompts[:2]], 4)  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    raw_tokens = 0
    for i in range(0, len(prompts), batch_size):
        raw_tokens += gen_batch(prompts[i : i + batch_size], max(out_lens[i : i + batch_size]))
    elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    res = _summary(f"transformers (static batch {batch_size})", prompts, sum(out_lens), elapsed, cpu_s)
    res["raw_output_tokens"] = raw_tokens
    res["raw_output_tok_s"] = raw_tokens / elapsed
    return res


def _summary(system: str, prompts: List[List[int]], out_tokens: int, elapsed: float,
             cpu_s: Optional[float] = None) -> Dict[str, Any]:
    extra: Dict[str, Any] = {}
    if cpu_s:
        # CPU seconds of this process (all threads). With --num-threads 1 there is no OpenMP
        # spin-waiting, so this measures the work done and hardly moves when other processes
        # load the machine, unlike time_s.
        extra = {"cpu_time_s": cpu_s, "output_tok_per_cpu_s": out_tokens / cpu_s}
    return {
        # 1/5/15-minute load average when the run ended: > ~1 on this shared 2-core machine
        # means other processes competed for the cores and the timing is noisy.
        "loadavg_after": loadavg(),
        "system": system,
        "requests": len(prompts),
        "input_tokens": sum(len(p) for p in prompts),
        "output_tokens": out_tokens,
        "time_s": elapsed,
        "output_tok_s": out_tokens / elapsed,
        **extra,
    }


# ---- command -----------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    from radixserve.engine import Engine
    from radixserve.tiny_model import get_tiny_model_path

    _check_args(args)
    server_args = ServerArgs.from_cli_args(args)
    model_path = server_args.model_path or get_tiny_model_path()
    engine = Engine(**{**vars(server_args), "model_path": model_path})
    dtype, device = engine.dtype, engine.device
    prompts, out_lens = make_workload(args, engine.vocab_size)

    overlap = uses_overlap_loop(engine)
    loop = "overlap" if overlap else "normal"
    ours = run_ours(engine, prompts, out_lens, f"radixserve ({loop} loop)")
    print(f"{ours['system']}: {ours['output_tok_s']:.0f} output tok/s ({ours['time_s']:.1f} s)", flush=True)
    results = [ours]
    if not args.skip_other_loop:  # the other event loop, same workload, same process
        other = Engine(**{**vars(server_args), "model_path": model_path,
                          "disable_overlap_schedule": overlap})
        other_loop = "overlap" if loop == "normal" else "normal"
        results.append(run_ours(other, prompts, out_lens, f"radixserve ({other_loop} loop)"))
        other.shutdown()
        print(f"{results[-1]['system']}: {results[-1]['output_tok_s']:.0f} output tok/s", flush=True)
        by_loop = {loop: ours, other_loop: results[-1]}
        by_loop["overlap"]["ratio_vs_normal_loop"] = by_loop["overlap"]["output_tok_s"] / by_loop["normal"]["output_tok_s"]
    if args.json_schema:  # structured output's cost: see run_json_schema at the end of this file
        results += run_json_schema(engine, prompts, out_lens, args.json_schema)
    if not args.skip_hf:
        pad_id = engine.tokenizer.pad_token_id if engine.tokenizer is not None and engine.tokenizer.pad_token_id is not None else 0
        engine.shutdown()
        # Same weights, dtype and device.
        hf = run_hf(model_path, prompts, out_lens, args.hf_batch_size, pad_id, dtype, device)
        for r in results:
            r["ratio_vs_hf"] = r["output_tok_s"] / hf["output_tok_s"]
            r["cpu_ratio_vs_hf"] = r["output_tok_per_cpu_s"] / hf["output_tok_per_cpu_s"]
        hf["ratio_vs_hf"] = hf["cpu_ratio_vs_hf"] = 1.0
        results.append(hf)

    table = format_table(results)
    print(table)
    report = {
        "benchmark": "offline",
        "model_path": args.model_path or "tiny (embedded)",
        "dtype": str(dtype).replace("torch.", ""),
        "device": device,
        "num_prompts": args.num_prompts,
        "input_len_range": [args.min_input_len, args.max_input_len],
        "output_len_range": [args.min_output_len, args.max_output_len],
        "seed": args.seed,
        "hf_batch_size": None if args.skip_hf else args.hf_batch_size,
        "server_args": {k: v for k, v in vars(server_args).items()},
        **machine_info(),
        "notes": "output_tok_s counts the requested output tokens; for transformers raw_output_tok_s also counts "
        "tokens generated past a request's length while its static batch finishes. "
        "ratio_vs_hf = output_tok_s / transformers' output_tok_s (goal: radixserve >= 2); "
        "cpu_ratio_vs_hf is the same ratio per CPU second of this process (robust to other load with --num-threads 1).",
        "results": results,
        "table": table,
    }
    if args.output:
        write_json(args.output, report)
        print(f"wrote {args.output}")
    return 0


def format_table(results: List[Dict[str, Any]]) -> str:
    header = ["system", "requests", "input toks", "output toks", "time s", "output tok/s", "ratio", "CPU s", "CPU ratio",
              "sched share", "wall / forward"]
    rows = []
    for r in results:
        tok_s = f"{r['output_tok_s']:.0f}"
        if "raw_output_tok_s" in r:
            tok_s += f" (raw {r['raw_output_tok_s']:.0f})"
        rows.append([
            r["system"], str(r["requests"]), str(r["input_tokens"]), str(r["output_tokens"]),
            f"{r['time_s']:.2f}", tok_s, f"{r['ratio_vs_hf']:.2f}" if "ratio_vs_hf" in r else "-",
            f"{r['cpu_time_s']:.1f}" if "cpu_time_s" in r else "-",
            f"{r['cpu_ratio_vs_hf']:.2f}" if "cpu_ratio_vs_hf" in r else "-",
            f"{r['sched_share']:.1%}" if "sched_share" in r else "-",
            f"{r['wall_over_forward']:.2f}" if r.get("wall_over_forward") else "-",
        ])
    return markdown_table(header, rows)


# ---- structured output (--json-schema FILE) -------------------------------------------------------
def run_json_schema(engine: Any, prompts: List[List[int]], out_lens: List[int], path: str) -> List[Dict[str, Any]]:
    """The same prompts with the schema (greedy, max_new_tokens as in the workload): each
    request stops where its JSON is complete. Then the same prompts unconstrained with exactly
    those output lengths (ignore_eos), so both rows do the same forwards: the difference is
    the grammar's cost (mask fill on the scheduler thread, mask apply in the sampler,
    accept_token, and the overlap given up for decode batches with grammar requests).
    The per-step mask costs and the compile times come from the grammar backend's own
    counters (Engine.grammar_stats())."""
    import json

    with open(path) as f:
        schema = json.dumps(json.load(f))
    if engine.grammar_stats() is None:
        raise RuntimeError("--json-schema needs the xgrammar grammar backend (scripts/install.sh installs it)")
    engine.wait_until_idle()
    # Cold compile (the tokenizer info on first use + the schema), by a short warm-up request.
    g0 = engine.grammar_stats()
    engine.generate(input_ids=[prompts[0][:16]], sampling_params=[{"max_new_tokens": 4, "temperature": 0, "json_schema": schema}],
                    progress=False)
    first_compile_s = stats_delta(g0, engine.grammar_stats()).compile_s
    engine.wait_until_idle()
    # The flush empties the radix cache and the compiled grammars: the run compiles the schema
    # again (warm: the tokenizer info stays), as a server's first request with it would.
    if not engine.flush_cache():
        raise RuntimeError("could not flush the radix cache before the constrained run")

    sps = [{"max_new_tokens": n, "temperature": 0, "json_schema": schema} for n in out_lens]
    g0 = engine.grammar_stats()
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=sps, progress=False)
    elapsed = time.perf_counter() - t0
    engine.wait_until_idle()  # the last forward's mask counted too
    g = stats_delta(g0, engine.grammar_stats())
    lens = [len(o["output_ids"]) for o in outs]
    finished = [o["meta_info"]["finish_reason"]["type"] for o in outs]
    constrained = _summary("radixserve + json_schema", prompts, sum(lens), elapsed)
    constrained.update(
        json_schema_file=path, first_compile_s=first_compile_s, compile_s=g.compile_s,
        num_stopped=finished.count("stop"), num_length=finished.count("length"),
        mask_fill_ms_per_step=1e3 * g.fill_s / max(g.fill_calls, 1),
        mask_apply_us_per_row=1e6 * g.apply_s / max(g.apply_rows, 1),
    )
    unconstrained = run_ours(engine, prompts, lens)
    unconstrained["system"] = "radixserve, same lengths unconstrained"
    constrained["cost_vs_unconstrained"] = 1 - constrained["output_tok_s"] / unconstrained["output_tok_s"]
    print(
        f"radixserve + json_schema: {constrained['output_tok_s']:.0f} output tok/s ({elapsed:.1f} s; "
        f"{constrained['num_stopped']} stopped by the grammar, {constrained['num_length']} at max_new_tokens; "
        f"compile {1e3 * g.compile_s:.1f} ms, mask fill {constrained['mask_fill_ms_per_step']:.2f} ms/step, "
        f"apply {constrained['mask_apply_us_per_row']:.0f} us/row)", flush=True)
    print(
        f"radixserve unconstrained, same output lengths: {unconstrained['output_tok_s']:.0f} output tok/s "
        f"({unconstrained['time_s']:.1f} s); constrained costs {100 * constrained['cost_vs_unconstrained']:.1f}% of throughput",
        flush=True)
    return [constrained, unconstrained]
