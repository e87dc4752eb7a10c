"""`radixserve simulate`: replay a workload through the real Scheduler with a simulated worker.

    radixserve simulate --model-config llama-3-8b --hardware h100 \\
        --dataset-name generated-shared-prefix --gsp-num-groups 32 --gsp-prompts-per-group 16 \\
        --request-rate 16 --schedule-policy lpm
    radixserve simulate ... --sweep --output benchmarks/simulate_x.json --plot benchmarks/simulate_x.png
    radixserve simulate --fit-cpu benchmarks/one_batch.json      # re-calibrate the cpu preset
    radixserve simulate --model-config llama-3-8b --hardware h100 --pp-size 4   # the PP bubble per stage

Every `radixserve serve` flag applies (--schedule-policy, --chunked-prefill-size,
--enable-mixed-chunk, --max-total-tokens, --page-size, --mem-fraction-static, ...), with the
workload flags of `bench serving`. --sweep runs one configuration per value of
--sweep-policies, --sweep-chunked-prefill-sizes, --sweep-mixed-chunk and --sweep-pool-sizes,
changing one factor at a time from the base flags (--sweep-grid: every combination).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from typing import Any, Dict, List, Optional, Tuple

from radixserve.bench.datasets import add_dataset_args, get_dataset, load_tokenizer_or_tiny
from radixserve.bench.report import append_jsonl, ensure_parent_dir, format_report, markdown_table, plot_results, write_json
from radixserve.server_args import SCHEDULE_POLICIES, ServerArgs
from radixserve.sim.cost_model import (
    DEVICE_PRESETS, CostModel, fit_cpu_device, get_device, load_one_batch_points, points_to_one_batch_report, predict_point,
)
from radixserve.sim.models import MODEL_PRESETS, load_model_config
from radixserve.sim.simulator import SimResult, Simulator


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    # "resolve": the workload's --seed replaces ServerArgs' --seed (one seed for both).
    p = subparsers.add_parser(
        "simulate", conflict_handler="resolve", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="replay a workload through the real scheduler on a virtual clock (cost model, no model run)",
        description=__doc__,
    )
    ServerArgs.add_cli_args(p)
    add_dataset_args(p)
    s = p.add_argument_group("simulation")
    s.add_argument("--model-config", default=None,
                   help=f"model shape: a preset ({', '.join(MODEL_PRESETS)}), a config.json or a model "
                        "directory; default: --model-path, else the tiny model")
    s.add_argument("--hardware", default="h100", choices=sorted(DEVICE_PRESETS), help="device preset of the cost model")
    s.add_argument("--peak-tflops", type=float, default=None, help="override the preset's peak FLOP/s (in TFLOP/s)")
    s.add_argument("--mem-bandwidth-gbs", type=float, default=None, help="override the preset's bandwidth (GB/s)")
    s.add_argument("--memory-gb", type=float, default=None, help="override the preset's device memory (GB)")
    s.add_argument("--step-overhead-ms", type=float, default=None, help="override the per-forward overhead (ms)")
    s.add_argument("--request-rate", type=float, default=float("inf"))
    s.add_argument("--burstiness", type=float, default=1.0)
    s.add_argument("--max-concurrency", type=int, default=None)
    s.add_argument("--output", default=None, help="write the results as JSON")
    s.add_argument("--output-file", default=None, help="append one JSON line per configuration")
    s.add_argument("--plot", default=None, help="PNG: distributions (one run) or the comparison (--sweep)")
    s.add_argument("--disable-tqdm", action="store_true")
    s.add_argument("--fit-cpu", nargs="+", default=None, metavar="ONE_BATCH_JSON",
                   help="fit the cpu preset to bench one-batch results, print it and the errors, and exit")
    w = p.add_argument_group("sweep")
    w.add_argument("--sweep", action="store_true", help="compare configurations in one table and one plot")
    w.add_argument("--sweep-grid", action="store_true", help="every combination instead of one factor at a time")
    w.add_argument("--sweep-policies", nargs="+", default=["fcfs", "lpm", "dfs-weight", "lof"], choices=SCHEDULE_POLICIES)
    w.add_argument("--sweep-chunked-prefill-sizes", nargs="+", type=int, default=[512, 2048, 8192],
                   help="<= 0 disables chunking")
    w.add_argument("--sweep-mixed-chunk", nargs="+", default=["off", "on"], choices=["off", "on"])
    w.add_argument("--sweep-pool-sizes", nargs="+", type=float, default=[0.25, 1.0],
                   help="KV pool sizes: tokens, or a fraction (<= 1) of the pool the device gives")
    p.set_defaults(func=run)
    return p


def device_from_args(args: argparse.Namespace):
    dev = get_device(args.hardware)
    return dev.with_overrides(
        peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else None,
        mem_bandwidth=args.mem_bandwidth_gbs * 1e9 if args.mem_bandwidth_gbs else None,
        memory_bytes=args.memory_gb * 1e9 if args.memory_gb else None,
        step_overhead_s=args.step_overhead_ms / 1e3 if args.step_overhead_ms is not None else None,
    )


def sweep_configs(args: argparse.Namespace, base: ServerArgs, default_pool: int) -> List[Dict[str, Any]]:
    """The ServerArgs changes of each configuration (the first is the base)."""

    def pool(v: float) -> int:
        return int(v * default_pool) if v <= 1.0 else int(v)

    axes: List[Tuple[str, List[Any]]] = [
        ("schedule_policy", list(args.sweep_policies)),
        ("chunked_prefill_size", [c if c > 0 else -1 for c in args.sweep_chunked_prefill_sizes]),
        ("enable_mixed_chunk", [v == "on" for v in args.sweep_mixed_chunk]),
        ("max_total_tokens", [pool(v) for v in args.sweep_pool_sizes]),
    ]
    base_values = {
        "schedule_policy": base.schedule_policy, "chunked_prefill_size": base.chunked_prefill_size,
        "enable_mixed_chunk": base.enable_mixed_chunk, "max_total_tokens": base.max_total_tokens or default_pool,
    }
    configs: List[Dict[str, Any]] = []
    if args.sweep_grid:
        for combo in itertools.product(*(vals for _, vals in axes)):
            configs.append(dict(zip([k for k, _ in axes], combo)))
    else:
        configs.append(dict(base_values))
        for key, vals in axes:
            for v in vals:
                configs.append(dict(base_values, **{key: v}))
    out: List[Dict[str, Any]] = []
    for c in configs:
        if c.get("enable_mixed_chunk") and c["chunked_prefill_size"] <= 0:
            continue  # mixed chunk needs chunked prefill
        if c not in out:
            out.append(c)
    return out


def _chunk_label(chunk: int) -> str:
    return str(chunk) if chunk > 0 else "off"


def config_label(c: Dict[str, Any]) -> str:
    chunk = _chunk_label(c["chunked_prefill_size"])
    return f"{c['schedule_policy']} chunk={chunk}{' mixed' if c['enable_mixed_chunk'] else ''} pool={c['max_total_tokens']}"


SWEEP_COLUMNS = [
    ("policy", lambda c, m: c["schedule_policy"]),
    ("chunk", lambda c, m: _chunk_label(c["chunked_prefill_size"])),
    ("mixed", lambda c, m: "on" if c["enable_mixed_chunk"] else "off"),
    ("pool tokens", lambda c, m: str(c["max_total_tokens"])),
    ("done", lambda c, m: str(m["completed"])),
    ("duration s", lambda c, m: f"{m['duration']:.1f}"),
    ("req/s", lambda c, m: f"{m['request_throughput']:.2f}"),
    ("out tok/s", lambda c, m: f"{m['output_throughput']:.0f}"),
    ("TTFT mean ms", lambda c, m: f"{m['mean_ttft_ms']:.0f}"),
    ("TTFT p99 ms", lambda c, m: f"{m['p99_ttft_ms']:.0f}"),
    ("TPOT mean ms", lambda c, m: f"{m['mean_tpot_ms']:.1f}"),
    ("ITL p99 ms", lambda c, m: f"{m['p99_itl_ms']:.1f}"),
    ("E2E mean s", lambda c, m: f"{m['mean_e2e_latency_ms'] / 1e3:.2f}"),
    ("cache hit", lambda c, m: f"{m['cache_hit_rate']:.3f}"),
    ("retracted", lambda c, m: str(m["num_retracted_reqs"])),
]


def sweep_table(results: List[Dict[str, Any]]) -> str:
    header = [name for name, _ in SWEEP_COLUMNS]
    rows = [[fn(r["config"], r["metrics"]) for _, fn in SWEEP_COLUMNS] for r in results]
    return markdown_table(header, rows)


def plot_sweep(results: List[Dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [config_label(r["config"]) for r in results]
    ms = [r["metrics"] for r in results]
    y = list(range(len(results)))
    fig, axes = plt.subplots(1, 4, figsize=(20, 0.45 * len(results) + 2.2), sharey=True)
    panels = [
        ("output throughput (tok/s)", [("out tok/s", [m["output_throughput"] for m in ms])]),
        ("TTFT (s)", [("mean", [m["mean_ttft_ms"] / 1e3 for m in ms]), ("p99", [m["p99_ttft_ms"] / 1e3 for m in ms])]),
        ("TPOT / ITL (ms)", [("TPOT mean", [m["mean_tpot_ms"] for m in ms]), ("ITL p99", [m["p99_itl_ms"] for m in ms])]),
        ("prefix cache hit rate", [("hit rate", [m["cache_hit_rate"] for m in ms])]),
    ]
    for ax, (name, series) in zip(axes, panels):
        h = 0.8 / len(series)
        for k, (sname, vals) in enumerate(series):
            ax.barh([v + (k - (len(series) - 1) / 2) * h for v in y], vals, height=h, label=sname)
        ax.set_title(name)
        ax.grid(axis="x", alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=8)
    axes[0].set_yticks(y)
    axes[0].set_yticklabels(labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(title)
    fig.tight_layout()
    ensure_parent_dir(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fit_cpu(args: argparse.Namespace) -> int:
    """Fit the cpu preset; with --output, also write the merged measurements and the fit (the
    file tests/unit/test_simulator.py checks the preset against)."""
    cfg = load_model_config(args.model_config or args.model_path)
    points = load_one_batch_points(args.fit_cpu)  # the fastest run of each point
    # Fit on every run within 1.3x of the fastest: the spread of runs that were not disturbed.
    dev = fit_cpu_device(cfg, load_one_batch_points(args.fit_cpu, keep_within=1.3))
    print(dev)
    table = _error_table(CostModel(cfg, dev), points)
    print(table)
    preset = DEVICE_PRESETS["cpu"]
    print("with the cpu preset as it is in cost_model.py:")
    print(_error_table(CostModel(cfg, preset), points))
    if args.output:
        write_json(args.output, dict(benchmark="simulate_cpu_calibration", model_path="tiny (embedded)", device="cpu",
                                     sources=list(args.fit_cpu), fitted=dataclasses.asdict(dev), table=table,
                                     reports=points_to_one_batch_report(points)))
        print(f"wrote {args.output}")
    return 0


def _error_table(cm: CostModel, points) -> str:
    rows = []
    for p in points:
        pred = predict_point(cm, p)
        rows.append([p["kind"], str(p["batch_size"]), str(p["input_len"]), f"{p['seconds'] * 1e3:.2f}",
                     f"{pred * 1e3:.2f}", f"{(pred / p['seconds'] - 1) * 100:+.0f}%"])
    return markdown_table(["step", "batch", "input len", "measured ms", "predicted ms", "error"], rows)


def run_one(server_args: ServerArgs, cfg, device, rows, args: argparse.Namespace, progress: bool) -> SimResult:
    sim = Simulator(server_args, cfg, device, rows, request_rate=args.request_rate, burstiness=args.burstiness,
                    max_concurrency=args.max_concurrency, seed=args.seed, progress=progress)
    return sim.run()


def run(args: argparse.Namespace) -> int:
    if args.fit_cpu:
        return _fit_cpu(args)
    cfg = load_model_config(args.model_config or args.model_path)
    device = device_from_args(args)
    base = ServerArgs.from_cli_args(args)
    if base.chunked_prefill_size is None:  # unset: the simulated device's default, not this machine's
        base = base.replace(chunked_prefill_size=base.chunked_prefill_size_on(device.kind))
    tokenizer = None  # random: no tokenizer, so the prompts stay token ids (as random-ids)
    if args.dataset_name == "sharegpt":
        tokenizer = load_tokenizer_or_tiny(args.tokenizer_path or args.model_path)
    rows = get_dataset(args, cfg.vocab_size, tokenizer)
    for r in rows:
        if r.input_ids is None:  # ShareGPT text: the simulator schedules token ids
            r.input_ids = [t % cfg.vocab_size for t in tokenizer.encode(r.prompt)]
    header = [("Model", cfg.model_path or cfg.architecture), ("Hardware", device.name),
              ("Dataset", args.dataset_name), ("Traffic request rate", args.request_rate),
              ("Max request concurrency", args.max_concurrency or "not set")]
    command_meta = dict(model=cfg.model_path or cfg.architecture, hardware=device.name, device_spec=dataclasses.asdict(device),
                        dataset_name=args.dataset_name, num_requests=len(rows), request_rate=args.request_rate,
                        max_concurrency=args.max_concurrency, seed=args.seed)

    if not args.sweep:
        res = run_one(base, cfg, device, rows, args, progress=not args.disable_tqdm)
        m = res.metrics
        print(format_report(m, "Simulated Serving Result", header + [("KV pool tokens", res.pool["max_total_num_tokens"])]))
        print(f"simulated {m['duration']:.1f} s in {res.wall_seconds:.1f} s wall ({m['num_forwards']} forwards)")
        for st in m.get("pp_stages", []):  # --pp-size: the PP schedule's bubble, stage by stage
            print(f"PP stage {st['stage']}: {st['layers_share']:.0%} of the layers, busy {st['busy_share']:.1%}, "
                  f"bubble {st['bubble']:.1%}")
        record = dict(command_meta, config=_config_of(base, res), metrics=m, scheduler_stats=res.scheduler_stats,
                      wall_seconds=res.wall_seconds)
        _write(args, [record])
        if args.plot:
            plot_results(res.outputs, m, args.plot, f"simulate: {cfg.model_path} on {device.name}, {args.dataset_name}")
            print(f"wrote {args.plot}")
        return 0 if m["completed"] else 1

    default_pool = _default_pool(base.replace(max_total_tokens=None), cfg, device)  # what the device gives
    configs = sweep_configs(args, base, default_pool)
    results: List[Dict[str, Any]] = []
    for i, c in enumerate(configs):
        sa = base.replace(**c)
        res = run_one(sa, cfg, device, rows, args, progress=False)
        results.append(dict(config=c, label=config_label(c), metrics=res.metrics, scheduler_stats=res.scheduler_stats,
                            wall_seconds=res.wall_seconds))
        m = res.metrics
        if not args.disable_tqdm:
            print(f"[{i + 1}/{len(configs)}] {config_label(c)}: {m['output_throughput']:.0f} out tok/s, "
                  f"TTFT mean {m['mean_ttft_ms']:.0f} ms, hit {m['cache_hit_rate']:.3f} ({res.wall_seconds:.1f} s wall)", flush=True)
    table = sweep_table(results)
    print(table)
    _write(args, [dict(command_meta, **r) for r in results], table=table)
    if args.plot:
        plot_sweep(results, args.plot, f"simulate --sweep: {cfg.model_path} on {device.name}, {args.dataset_name}, "
                                        f"{len(rows)} requests, rate {args.request_rate}, "
                                        f"max concurrency {args.max_concurrency or 'not set'}")
        print(f"wrote {args.plot}")
    return 0


def _default_pool(base: ServerArgs, cfg, device) -> int:
    from radixserve.sim.worker import SimModelWorker

    probe = base.replace(max_running_requests=1, context_length=min(cfg.context_len, 16))
    return SimModelWorker(probe, cfg, device).max_total_num_tokens


def _config_of(sa: ServerArgs, res: SimResult) -> Dict[str, Any]:
    return dict(schedule_policy=sa.schedule_policy, chunked_prefill_size=sa.chunked_prefill_size,
                enable_mixed_chunk=sa.enable_mixed_chunk, max_total_tokens=res.pool["max_total_num_tokens"],
                max_running_requests=res.pool["max_running_requests"], page_size=sa.page_size)


def _write(args: argparse.Namespace, records: List[Dict[str, Any]], table: Optional[str] = None) -> None:
    if args.output_file:
        for r in records:
            append_jsonl(args.output_file, r)
    if args.output:
        argv = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
        write_json(args.output, dict(benchmark="simulate", args=argv, results=records, table=table))
        print(f"wrote {args.output}")
