"""Issue 54: radixserve's offline Engine against OpenVINO GenAI's continuous-batching pipeline,
on SmolLM2-135M-Instruct, on this machine, side by side.

The workload (the issue's): offline, --num-prompts 64 prompts of --input-len 200 random token ids
(the same ids for every engine, drawn from SmolLM2's ordinary tokens), --output-len 128 tokens
each, greedy, EOS ignored, all submitted at once. Reported per engine and format:

- output tok/s: the 64 x 128 output tokens / the wall time of the one generate call;
- TTFT one at a time: the wall time of a lone request with max_new_tokens=1 (mean of
  --single-prompts prompts, none of them in the batch, so no prefix-cache hit);
- TPOT one at a time: (the wall time of a lone 128-token request - that TTFT) / 127;
- agree: the mean length of the common prefix of each request's 128 tokens with the first
  radixserve configuration's (a sanity check that all run the same model, not a quality figure).

Each engine and format runs in its own subprocess (this file with --worker), one at a time, the
configurations in turns, --rounds rounds; the table keeps each one's best round per figure
(highest tok/s, lowest TTFT and TPOT). OpenVINO runs through --ov-python (its own virtualenv),
radixserve through this interpreter with this checkout first on PYTHONPATH. Both get 2 threads
(--threads): OpenVINO's INFERENCE_NUM_THREADS, radixserve's torch.set_num_threads.

Setup, once (PyPI only; the weights come from the local GGUF file, no model hub):

    python3 -m venv /work/venv-ov
    /work/venv-ov/bin/pip install openvino-genai==2026.4.1.0 "optimum-intel[openvino]" torch==2.13.0
        # torch pinned: this machine's pip finds the CPU wheel; unpinned, PyPI's CUDA build is GBs
    # SmolLM2 as an HF directory, from the Q8_0 GGUF (the file closest to the original bf16
    # weights; the issue's figures used the upstream HF checkpoint):
    python benchmarks/cpu/gguf_to_hf.py ~/.cache/radixserve-test/smollm2/SmolLM2-135M-Instruct.Q8_0.gguf \\
        ~/.cache/radixserve-test/smollm2/SmolLM2-135M-Instruct.Q8_0.hf
    for f in int8 fp16; do /work/venv-ov/bin/optimum-cli export openvino --task text-generation-with-past \\
        --model ~/.cache/radixserve-test/smollm2/SmolLM2-135M-Instruct.Q8_0.hf --weight-format $f \\
        ~/.cache/radixserve-bench/openvino/smollm2-135m-$f; done

Run (a round is ~4 minutes on a 2-core machine; the results: table + JSON):

    python benchmarks/cpu/offline_vs_openvino.py --rounds 2 --out benchmarks/cpu/offline_vs_openvino.json
    python benchmarks/cpu/offline_vs_openvino.py --configs ov:int8 rs:bfloat16 --rounds 1 --out ''   # a subset

The worker side imports only the standard library at the top, so the OpenVINO venv needs no
radixserve or torch at run time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

REPO = Path(__file__).resolve().parents[2]
HOME = Path.home()
HF_DIR = HOME / ".cache/radixserve-test/smollm2/SmolLM2-135M-Instruct.Q8_0.hf"
OV_DIR = HOME / ".cache/radixserve-bench/openvino"
OV_PYTHON = "/work/venv-ov/bin/python"
FIRST_ORDINARY_ID = 17  # SmolLM2's ids 0..16 are special tokens (<|endoftext|>, <|im_start|>, ...)

# "engine:format" -> what the worker runs. OpenVINO formats are exported directories under --ov-dir;
# radixserve formats are Engine keyword arguments.
CONFIGS: Dict[str, Dict[str, Any]] = {
    "ov:int8": {"engine": "openvino", "format": "int8"},
    "ov:fp16": {"engine": "openvino", "format": "fp16"},
    "rs:bfloat16": {"engine": "radixserve", "format": "bfloat16", "kwargs": {"dtype": "bfloat16"}},
    "rs:w8a8_int8": {"engine": "radixserve", "format": "w8a8_int8",
                     "kwargs": {"dtype": "bfloat16", "quantization": "w8a8_int8"}},
    "rs:float32": {"engine": "radixserve", "format": "float32", "kwargs": {"dtype": "float32"}},
    # The Q8_0 GGUF file itself, served in its blocks (the HF directory above is made from it):
    # int8 weights as OpenVINO's int8 export has them.
    "rs:gguf_q8_0": {"engine": "radixserve", "format": "gguf Q8_0",
                     "kwargs": {"dtype": "bfloat16", "model_path": str(HF_DIR.with_suffix(".gguf"))}},
}
# In turns: the two engines alternate, so a change in the machine's load lands on both.
DEFAULT_ORDER = ["ov:int8", "rs:bfloat16", "ov:fp16", "rs:w8a8_int8", "rs:float32"]


# ---- the workload ------------------------------------------------------------------------------
def make_workload(args: argparse.Namespace, vocab_size: int) -> Dict[str, Any]:
    """Random prompts, reproducible from --seed: the batch, then the lone requests' prompts."""
    rng = random.Random(args.seed)

    def prompt() -> List[int]:
        return [rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(args.input_len)]

    return {
        "prompts": [prompt() for _ in range(args.num_prompts)],
        "ttft_prompts": [prompt() for _ in range(args.single_prompts)],
        "tpot_prompts": [prompt() for _ in range(args.single_prompts)],
        "output_len": args.output_len,
    }


def timed(fn: Any) -> Tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def timed_cpu(fn: Any) -> Tuple[Any, float, float]:
    """(result, wall s, CPU s of this process: all its threads)."""
    c0 = time.process_time()
    out, wall = timed(fn)
    return out, wall, time.process_time() - c0


def single_request_figures(generate_one: Any, wl: Dict[str, Any]) -> Dict[str, float]:
    """TTFT and TPOT one at a time. generate_one(ids, max_new_tokens) -> the output ids."""
    ttfts = [timed(lambda p=p: generate_one(p, 1))[1] for p in wl["ttft_prompts"]]
    ttft = sum(ttfts) / len(ttfts)
    e2es = []
    for p in wl["tpot_prompts"]:
        out, dt = timed(lambda p=p: generate_one(p, wl["output_len"]))
        if len(out) != wl["output_len"]:
            raise RuntimeError(f"a lone request generated {len(out)} tokens, expected {wl['output_len']}")
        e2es.append(dt)
    e2e = sum(e2es) / len(e2es)
    return {"ttft_ms": 1e3 * ttft, "tpot_ms": 1e3 * (e2e - ttft) / (wl["output_len"] - 1),
            "ttft_all_ms": [1e3 * t for t in ttfts], "e2e_all_ms": [1e3 * t for t in e2es]}


def batch_figures(outputs: List[List[int]], elapsed: float, cpu_s: float, wl: Dict[str, Any]) -> Dict[str, Any]:
    n_out = sum(len(o) for o in outputs)
    if n_out != len(wl["prompts"]) * wl["output_len"]:
        raise RuntimeError(f"generated {n_out} tokens, expected {len(wl['prompts']) * wl['output_len']} (EOS ignored)")
    # Per CPU second: what a shared machine's load moves least (each engine's threads still
    # spin a little while waiting; both wait policies count here).
    return {"time_s": elapsed, "cpu_s": cpu_s, "output_tokens": n_out, "output_tok_s": n_out / elapsed,
            "output_tok_per_cpu_s": n_out / cpu_s, "loadavg_after": os.getloadavg()[0], "output_ids": outputs}


# ---- the workers: one engine and format in this process ----------------------------------------
def run_openvino(fmt: str, wl: Dict[str, Any], args: argparse.Namespace) -> Dict[str, Any]:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    model_dir = os.path.join(args.ov_dir, f"smollm2-135m-{fmt}")
    sched = ov_genai.SchedulerConfig()
    sched.cache_size = 2  # GB of KV cache: the 64 requests x 328 tokens fit at once
    sched.enable_prefix_caching = False  # as radixserve's lone requests: distinct prompts anyway
    props = {"INFERENCE_NUM_THREADS": args.threads}
    (pipe, load_s) = timed(lambda: ov_genai.ContinuousBatchingPipeline(model_dir, sched, "CPU", props))

    def config(n: int) -> Any:
        gc = ov_genai.GenerationConfig()
        gc.max_new_tokens = n
        gc.min_new_tokens = n
        gc.ignore_eos = True
        gc.do_sample = False
        return gc

    def generate(prompts: List[List[int]], n: int) -> List[List[int]]:
        tensors = [ov.Tensor(np.array([p], dtype=np.int64)) for p in prompts]
        results = pipe.generate(tensors, [config(n)] * len(prompts))
        return [list(r.m_generation_ids[0]) for r in results]

    generate([p[:16] for p in wl["prompts"][:2]], 4)  # warm-up: the first inference compiles kernels
    outputs, elapsed, cpu_s = timed_cpu(lambda: generate(wl["prompts"], wl["output_len"]))
    res = {**batch_figures(outputs, elapsed, cpu_s, wl), "load_s": load_s}
    res.update(single_request_figures(lambda p, n: generate([p], n)[0], wl))
    res["openvino"] = {"version": ov.get_version(), "genai_version": getattr(ov_genai, "__version__", "?"),
                       "scheduler": {"cache_size_gb": sched.cache_size,
                                     "max_num_batched_tokens": sched.max_num_batched_tokens,
                                     "max_num_seqs": sched.max_num_seqs,
                                     "dynamic_split_fuse": sched.dynamic_split_fuse},
                       **compiled_properties(ov, os.path.join(model_dir, "openvino_model.xml"), args.threads)}
    return res


def compiled_properties(ov: Any, xml: str, threads: int) -> Dict[str, Any]:
    """What the CPU plugin chose for this model here: activation precision, KV cache precision,
    the int8 weights' activation quantization group (0: off), and the linear layers' kernels."""
    core = ov.Core()
    compiled = core.compile_model(xml, "CPU", {"INFERENCE_NUM_THREADS": threads})
    props = {}
    for name in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "DYNAMIC_QUANTIZATION_GROUP_SIZE",
                 "EXECUTION_MODE_HINT", "INFERENCE_NUM_THREADS"):
        try:
            value = compiled.get_property(name)
            props[name] = value.get_type_name() if hasattr(value, "get_type_name") else str(value)
        except Exception as e:  # a property this version does not have
            props[name] = f"n/a ({type(e).__name__})"
    # The linear layers and attention as compiled: node type, kernel ("undef" until a dynamic
    # shape first runs; openvino_profile.py reports the kernel that ran) and weight precision.
    kernels: Dict[str, int] = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        rt = op.get_rt_info()
        layer, kernel, precision = (rt[k].astype(str) for k in ("layerType", "primitiveType", "runtimePrecision"))
        if layer in ("FullyConnected", "MatMul", "ScaledDotProductAttention", "PagedAttention"):
            key = f"{layer} {kernel} {precision}"
            kernels[key] = kernels.get(key, 0) + 1
    return {"compiled_properties": props, "kernels": kernels}


def run_radixserve(kwargs: Dict[str, Any], wl: Dict[str, Any], args: argparse.Namespace) -> Dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    from radixserve.engine import Engine

    kwargs = {"model_path": args.hf_dir, **kwargs}
    engine, load_s = timed(lambda: Engine(**kwargs))

    def generate(prompts: List[List[int]], n: int) -> List[List[int]]:
        sp = {"max_new_tokens": n, "ignore_eos": True, "temperature": 0}
        outs = engine.generate(input_ids=prompts, sampling_params=[sp] * len(prompts), progress=False)
        return [o["output_ids"] for o in outs]

    generate([p[:16] for p in wl["prompts"][:2]], 4)  # warm-up, then an empty radix cache
    engine.wait_until_idle()
    if not engine.flush_cache():
        raise RuntimeError("could not flush the radix cache after the warm-up")
    outputs, elapsed, cpu_s = timed_cpu(lambda: generate(wl["prompts"], wl["output_len"]))
    res = {**batch_figures(outputs, elapsed, cpu_s, wl), "load_s": load_s}
    res.update(single_request_figures(lambda p, n: generate([p], n)[0], wl))
    res["radixserve"] = {"engine_kwargs": kwargs, "weights_dtype": str(engine.dtype), "torch": torch.__version__}
    engine.shutdown()
    return res


def worker(args: argparse.Namespace) -> int:
    wl = json.loads(Path(args.workload).read_text())
    cfg = CONFIGS[args.worker]
    if cfg["engine"] == "openvino":
        res = run_openvino(cfg["format"], wl, args)
    else:
        res = run_radixserve(cfg["kwargs"], wl, args)
    Path(args.result).write_text(json.dumps(res))
    return 0


# ---- the driver ----------------------------------------------------------------------------------
def cpu_model() -> str:
    """The CPU as /proc/cpuinfo names it, with its family / model and the SIMD flags that matter."""
    info: Dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    flags = set(info.get("flags", "").split())
    simd = [f for f in ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
            if f in flags]
    return (f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model {info.get('model', '?')}), "
            f"{os.cpu_count()} CPUs, {' '.join(simd)}")


def run_config(name: str, workload_path: str, args: argparse.Namespace) -> Dict[str, Any]:
    cfg = CONFIGS[name]
    python = args.ov_python if cfg["engine"] == "openvino" else sys.executable
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        cmd = [python, __file__, "--worker", name, "--workload", workload_path, "--result", result.name,
               "--threads", str(args.threads), "--hf-dir", args.hf_dir, "--ov-dir", args.ov_dir]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(Path(result.name).read_text())


def common_prefix(a: List[int], b: List[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def best_of(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Each figure's best round: highest tok/s, lowest TTFT and TPOT."""
    fastest = max(runs, key=lambda r: r["output_tok_s"])
    return {**{k: v for k, v in fastest.items() if k != "output_ids"},
            "ttft_ms": min(r["ttft_ms"] for r in runs), "tpot_ms": min(r["tpot_ms"] for r in runs),
            "output_tok_per_cpu_s": max(r["output_tok_per_cpu_s"] for r in runs),
            "rounds": [{k: r[k] for k in ("output_tok_s", "output_tok_per_cpu_s", "ttft_ms", "tpot_ms", "load_s",
                                          "loadavg_after")} for r in runs]}


def summarize(runs: Dict[str, List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    rows = {name: {"config": name, "engine": CONFIGS[name]["engine"], "format": CONFIGS[name]["format"], **best_of(rs)}
            for name, rs in runs.items()}
    reference = next((n for n in runs if CONFIGS[n]["engine"] == "radixserve"), next(iter(runs)))
    ref_ids = runs[reference][0]["output_ids"]
    for name, rs in runs.items():
        ids = rs[0]["output_ids"]
        rows[name]["agree_with"] = reference
        rows[name]["agree_mean_prefix"] = sum(common_prefix(a, b) for a, b in zip(ids, ref_ids)) / len(ids)
    ov = [r for r in rows.values() if r["engine"] == "openvino"]
    best_ov = max(ov, key=lambda r: r["output_tok_s"]) if ov else None
    for r in rows.values():
        if best_ov is not None:  # > 1: faster than OpenVINO's best format
            r["vs_best_ov"] = {"config": best_ov["config"], "tok_s": r["output_tok_s"] / best_ov["output_tok_s"],
                               "tok_per_cpu_s": r["output_tok_per_cpu_s"] / best_ov["output_tok_per_cpu_s"],
                               "tpot": best_ov["tpot_ms"] / r["tpot_ms"], "ttft": best_ov["ttft_ms"] / r["ttft_ms"]}
    return list(rows.values())


def format_table(rows: List[Dict[str, Any]], output_len: int) -> str:
    header = ["engine", "format", "out tok/s", "TPOT ms", "TTFT ms", "x best OV tok/s", "x TPOT", "x TTFT",
              "tok / CPU s", "x best OV", "agree"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 2 + "---:|" * (len(header) - 2)]
    for r in rows:
        vs = r.get("vs_best_ov")
        cells = [r["engine"], r["format"], f"{r['output_tok_s']:.1f}", f"{r['tpot_ms']:.1f}", f"{r['ttft_ms']:.0f}",
                 *(f"{vs[k]:.2f}x" if vs else "-" for k in ("tok_s", "tpot", "ttft")),
                 f"{r['output_tok_per_cpu_s']:.1f}", f"{vs['tok_per_cpu_s']:.2f}x" if vs else "-",
                 f"{r['agree_mean_prefix']:.0f}/{output_len}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(args: argparse.Namespace, cpu: str, runs: Dict[str, List[Dict[str, Any]]], rounds: int,
           quiet: bool = False) -> None:
    """The table (printed unless quiet) and the JSON of the runs so far."""
    rows = summarize(runs)
    table = format_table(rows, args.output_len)
    if not quiet:
        print(f"\nCPU: {cpu}; {args.threads} threads; {args.num_prompts} prompts x {args.input_len} tokens, "
              f"{args.output_len} out, greedy, EOS ignored; best of {rounds} round(s)\n{table}", flush=True)
    if args.out:
        doc = {"benchmark": "offline_vs_openvino", "cpu": cpu, "threads": args.threads, "hf_dir": args.hf_dir,
               "ov_dir": args.ov_dir, "num_prompts": args.num_prompts, "input_len": args.input_len,
               "output_len": args.output_len, "single_prompts": args.single_prompts, "seed": args.seed,
               "rounds": rounds, "command": " ".join(sys.argv), "results": rows, "table": table}
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


def driver(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    vocab_size = len(AutoTokenizer.from_pretrained(args.hf_dir))
    wl = make_workload(args, vocab_size)
    cpu = cpu_model()
    print(f"CPU: {cpu}", flush=True)
    runs: Dict[str, List[Dict[str, Any]]] = {name: [] for name in args.configs}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(wl, f)
        workload_path = f.name
    try:
        for rnd in range(args.rounds):
            for name in args.configs:
                res = run_config(name, workload_path, args)
                runs[name].append(res)
                print(f"round {rnd + 1} {name}: {res['output_tok_s']:.1f} tok/s ({res['output_tok_per_cpu_s']:.1f} "
                      f"per CPU s), TPOT {res['tpot_ms']:.1f} ms, "
                      f"TTFT {res['ttft_ms']:.0f} ms (load {res['load_s']:.1f} s, loadavg {os.getloadavg()[0]:.2f})",
                      flush=True)
                # after every run: a long run stopped early (a busy shared machine) keeps what it measured
                report(args, cpu, {n: rs for n, rs in runs.items() if rs}, rnd + 1, quiet=name != args.configs[-1])
    finally:
        os.unlink(workload_path)
    return 0


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=DEFAULT_ORDER, choices=list(CONFIGS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--single-prompts", type=int, default=3, help="lone requests per TTFT / TPOT figure")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-dir", default=str(HF_DIR))
    p.add_argument("--ov-dir", default=str(OV_DIR))
    p.add_argument("--ov-python", default=OV_PYTHON)
    p.add_argument("--out", default="benchmarks/cpu/offline_vs_openvino.json", help="JSON results ('' to skip)")
    p.add_argument("--worker", choices=list(CONFIGS), help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    sys.exit(main())
