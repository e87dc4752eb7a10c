"""GPU checks of issue 8 that are not a `radixserve bench` command (run by benchmarks/gpu/run.sh).

    python benchmarks/gpu/gpu_checks.py make-model qwen3-0.6b /tmp/qwen3-0.6b   # dummy weights
    python benchmarks/gpu/gpu_checks.py logits /tmp/qwen3-0.6b --output out.json
    python benchmarks/gpu/gpu_checks.py idle /tmp/qwen3-0.6b --output out.json

make-model: a checkpoint directory with the real config of the named model and random weights
  (transformers' own init, seeded), saved as bf16 safetensors. No hub access.
logits: transformers in float32 on those weights is the reference. transformers in bf16 and
  radixserve in bf16 (prefill, then token-by-token decode through the paged KV pool, CUDA graphs
  when on) both run the same token sequences; each one's error against the reference is
  measured at every position. Pass: radixserve's max and mean errors are at most 2x those of
  transformers' own bf16 run, and its top-1 agrees with the reference as often (-1 point).
  That makes "bf16 tolerance" the noise floor bf16 itself has on these weights.
mbu: decode step time and model-bandwidth utilization of one ModelRunner at the given batch
  sizes, with CUDA graphs and eager (the same runner, its graph runner set aside), dummy weights
  drawn on the device (their values do not change the bytes a step reads).
idle: the device's idle share between kernels while the overlap loop decodes (from a
  torch.profiler trace of an Engine run), beside the normal loop's.

`smoke` is a two-layer config of the same shape family, small enough for a CPU run of
`logits` (the script's own check; GPU numbers come from the real configs).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any, Dict, List, Sequence

import torch

CONFIGS: Dict[str, Dict[str, Any]] = {
    # Qwen/Qwen3-0.6B config.json (the values that shape the model).
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True, hidden_act="silu", attention_bias=False, torch_dtype="bfloat16",
        bos_token_id=151643, eos_token_id=151645,
    ),
    # meta-llama/Meta-Llama-3-8B config.json.
    "llama-3-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
        hidden_act="silu", torch_dtype="bfloat16", bos_token_id=128000, eos_token_id=128001,
    ),
    "smoke": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=1024, hidden_size=128,
        intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True, hidden_act="silu", torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1,
    ),
}


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def free_device_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- make-model -----------------------------------------------------------------------------------
def make_model(name: str, out_dir: str, seed: int = 0) -> None:
    import transformers

    config = transformers.AutoConfig.for_model(**CONFIGS[name])
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.device(device()):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params -> {out_dir} "
          f"({time.perf_counter() - t0:.0f} s)")


# ---- logits ---------------------------------------------------------------------------------------
def make_sequences(vocab: int, prompt_lens: Sequence[int], decode_len: int, seed: int) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(n + decode_len)] for n in prompt_lens]


@torch.inference_mode()
def hf_logits(model_dir: str, seqs: List[List[int]], dtype: torch.dtype) -> List[torch.Tensor]:
    """transformers' logits at every position of each sequence, one forward each, on the host."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device()).eval()
    out = [model(torch.tensor([s], device=device())).logits[0].float().cpu() for s in seqs]
    del model
    free_device_memory()
    return out


@torch.inference_mode()
def radixserve_logits(model_dir: str, seqs: List[List[int]], decode_len: int, **server_kw: Any) -> List[torch.Tensor]:
    """radixserve's logits: all prompts prefilled in one EXTEND batch (logits at every position),
    then the remaining `decode_len` tokens fed one DECODE batch at a time, as the scheduler does."""
    from radixserve.model_executor.forward_batch import ForwardBatch, ForwardMode, ModelWorkerBatch
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.models.model_config import ModelConfig
    from radixserve.server_args import ServerArgs

    total = sum(len(s) for s in seqs)
    args = ServerArgs(model_path=model_dir, max_total_tokens=max(total + 64, 4096), max_running_requests=len(seqs),
                      context_length=max(len(s) for s in seqs) + 8, **server_kw)
    runner = ModelRunner(ModelConfig.from_pretrained(model_dir), args)
    rows = list(range(len(seqs)))
    prompts = [s[: len(s) - decode_len] for s in seqs]
    r2t = runner.req_to_token_pool.req_to_token

    def run(mode: ForwardMode, ids: List[int], seq_lens: List[int], locs: torch.Tensor, ext: List[int], pre: List[int]):
        batch = ModelWorkerBatch(
            forward_mode=mode, input_ids=torch.tensor(ids, dtype=torch.int64),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64), seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=locs, seq_lens_cpu=seq_lens, extend_seq_lens=ext, extend_prefix_lens=pre,
            capture_all_logits=mode == ForwardMode.EXTEND,
        )
        return runner.forward(ForwardBatch.init_new(batch, runner))

    lens = [len(p) for p in prompts]
    locs = runner.token_to_kv_pool_allocator.alloc(sum(lens))
    start = 0
    for r, n in zip(rows, lens):
        r2t[r, :n] = locs[start : start + n].to(r2t.device, torch.int32)
        start += n
    out = run(ForwardMode.EXTEND, [t for p in prompts for t in p], lens, locs, lens, [0] * len(rows))
    per_seq = list(out.all_logits.float().cpu().split(lens))
    per_seq = [[x] for x in per_seq]
    for step in range(decode_len):
        pos = [n + step for n in lens]
        loc = runner.token_to_kv_pool_allocator.alloc(len(rows))
        r2t[torch.tensor(rows), torch.tensor(pos)] = loc.to(r2t.device, torch.int32)
        out = run(ForwardMode.DECODE, [s[p] for s, p in zip(seqs, pos)], [p + 1 for p in pos], loc, None, None)
        for i, row in enumerate(out.next_token_logits.float().cpu()):
            per_seq[i].append(row[None])
    return [torch.cat(x) for x in per_seq]


def compare(candidate: List[torch.Tensor], reference: List[torch.Tensor]) -> Dict[str, float]:
    diff = torch.cat([(c - r).abs().flatten() for c, r in zip(candidate, reference)])
    ref_top = torch.cat([r.argmax(-1) for r in reference])
    cand_top = torch.cat([c.argmax(-1) for c in candidate])
    scale = torch.cat([r.flatten() for r in reference]).std()
    return {"max_abs_err": float(diff.max()), "mean_abs_err": float(diff.mean()),
            "top1_agreement": float((ref_top == cand_top).float().mean()), "reference_logit_std": float(scale)}


def check_logits(model_dir: str, attention_backend: str, disable_cuda_graph: bool, seed: int = 0) -> Dict[str, Any]:
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    decode_len = 16
    # Ragged prompts; 4 requests decode together, so a CUDA graph (bs 4) replays each step.
    seqs = make_sequences(vocab, [37, 128, 300, 511], decode_len, seed)
    reference = hf_logits(model_dir, seqs, torch.float32)
    hf_bf16 = compare(hf_logits(model_dir, seqs, torch.bfloat16), reference)
    ours = compare(
        radixserve_logits(model_dir, seqs, decode_len, dtype="bfloat16", attention_backend=attention_backend,
                          disable_cuda_graph=disable_cuda_graph),
        reference,
    )
    passed = (ours["max_abs_err"] <= 2 * hf_bf16["max_abs_err"] and ours["mean_abs_err"] <= 2 * hf_bf16["mean_abs_err"]
              and ours["top1_agreement"] >= hf_bf16["top1_agreement"] - 0.01)
    return {"model_dir": model_dir, "positions": sum(len(s) for s in seqs), "decode_steps": decode_len,
            "attention_backend": attention_backend, "cuda_graph": not disable_cuda_graph and device() == "cuda",
            "transformers_bf16_vs_fp32": hf_bf16, "radixserve_bf16_vs_fp32": ours, "passed": passed}


# ---- mbu ----------------------------------------------------------------------------------------
def config_only_dir(name: str, out_dir: str) -> str:
    """A directory holding only config.json (for --load-format dummy: no weights written)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(CONFIGS[name], f)
    return out_dir


def dummy_weights_on_device(config: Any, seed: int, keep: Any = None):
    """model_loader.dummy_weights' names and scales, drawn on the device: the host's generator
    takes most of a minute for 8 B values, and a timing does not depend on them."""
    from radixserve.model_executor.model_loader import checkpoint_shapes

    torch.manual_seed(seed)
    for name, shape in checkpoint_shapes(config).items():
        scale = shape[-1] ** -0.5 if len(shape) > 1 else 0.02
        tensor = torch.ones(shape, device=device()) if name.endswith("norm.weight") else \
            torch.randn(*shape, device=device()) * scale
        if keep is None or keep(name):
            yield name, tensor, "dummy"


def decode_mbu(name: str, batch_sizes: Sequence[int], input_len: int, decode_steps: int) -> Dict[str, Any]:
    from radixserve.bench import one_batch
    from radixserve.model_executor import model_loader
    from radixserve.server_args import ServerArgs

    model_loader.dummy_weights = dummy_weights_on_device
    model_dir = config_only_dir(name, f"/tmp/{name}-config")
    args = ServerArgs(model_path=model_dir, load_format="dummy", dtype="bfloat16", attention_backend="triton",
                      max_total_tokens=max(batch_sizes) * (input_len + decode_steps + 8) + 64,
                      max_running_requests=max(batch_sizes), cuda_graph_max_bs=max(batch_sizes),
                      context_length=input_len + decode_steps + 8)
    t0 = time.perf_counter()
    driver = one_batch._OursDriver(args)
    load_s = time.perf_counter() - t0
    runner = driver.runner
    graphs = runner.cuda_graph_runner
    bandwidth = one_batch.measure_mem_bandwidth_gbs(runner.device)
    rows = []
    for bs in batch_sizes:
        prompts = torch.randint(2, runner.model_config.vocab_size, (bs, input_len))
        for use_graphs in (True, False):
            runner.cuda_graph_runner = graphs if use_graphs else None
            row = {"batch_size": bs, "cuda_graph": use_graphs and graphs is not None,
                   "ours": one_batch._measure({"ours": driver}, prompts, decode_steps)["ours"]}
            one_batch.add_mbu(row, runner, input_len, decode_steps, bandwidth)
            rows.append(row)
            print(f"bs {bs:3d} graphs {row['cuda_graph']!s:5}: {row['ours']['decode_ms_per_step']:.3f} ms/step, "
                  f"{row['ours']['decode_gb_s']:.0f} GB/s, MBU {row['ours']['mbu']:.1%}", flush=True)
    runner.cuda_graph_runner = graphs
    return {"model": name, "input_len": input_len, "decode_steps": decode_steps, "load_s": load_s,
            "mem_bandwidth_gbs": bandwidth, "rows": rows}


# ---- idle -----------------------------------------------------------------------------------------
def busy_union_us(intervals: List[tuple]) -> float:
    """Total length of the union of [start, end) intervals (kernels may overlap across streams)."""
    busy, cur_start, cur_end = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    if cur_end is not None:
        busy += cur_end - cur_start
    return busy


def device_idle(model_dir: str, overlap: bool, num_reqs: int, output_len: int, **server_kw: Any) -> Dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from radixserve.engine import Engine

    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, disable_overlap_schedule=not overlap, **server_kw)
    rng = random.Random(0)
    vocab = engine.scheduler.vocab_size
    prompts = [[rng.randrange(2, vocab) for _ in range(64)] for _ in range(num_reqs)]
    sp = {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0}
    engine.generate(input_ids=prompts[:4], sampling_params=[{**sp, "max_new_tokens": 8}] * 4, progress=False)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=[sp] * num_reqs, progress=False)
        wall = time.perf_counter() - t0
    engine.shutdown()
    kernels = [(e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    span = max(e for _, e in kernels) - min(s for s, _ in kernels)
    busy = busy_union_us(kernels)
    return {"loop": "overlap" if overlap else "normal", "requests": num_reqs, "output_len": output_len,
            "wall_s": wall, "kernel_span_us": span, "kernel_busy_us": busy, "idle_share": 1 - busy / span,
            "output_tok_s": num_reqs * output_len / wall}


# ---- command --------------------------------------------------------------------------------------
def main(argv: Sequence[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-model")
    m.add_argument("name", choices=sorted(CONFIGS))
    m.add_argument("out_dir")
    lg = sub.add_parser("logits")
    lg.add_argument("model_dir")
    lg.add_argument("--attention-backend", default="triton" if device() == "cuda" else "torch_native")
    lg.add_argument("--disable-cuda-graph", action="store_true")
    lg.add_argument("--output", default="")
    mb = sub.add_parser("mbu")
    mb.add_argument("name", choices=sorted(CONFIGS))
    mb.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    mb.add_argument("--input-len", type=int, default=512)
    mb.add_argument("--decode-steps", type=int, default=32)
    mb.add_argument("--output", default="")
    idle = sub.add_parser("idle")
    idle.add_argument("model_dir")
    idle.add_argument("--num-reqs", type=int, default=64)
    idle.add_argument("--output-len", type=int, default=256)
    idle.add_argument("--output", default="")
    args = p.parse_args(argv)

    if args.cmd == "make-model":
        make_model(args.name, args.out_dir)
        return 0
    if args.cmd == "logits":
        report = check_logits(args.model_dir, args.attention_backend, args.disable_cuda_graph)
    elif args.cmd == "mbu":
        report = decode_mbu(args.name, args.batch_sizes, args.input_len, args.decode_steps)
    else:
        if device() != "cuda":
            print("idle: needs a CUDA device (it reads kernel times from the profiler)")
            return 2
        kw = dict(attention_backend="triton")
        report = {"runs": [device_idle(args.model_dir, o, args.num_reqs, args.output_len, **kw) for o in (True, False)]}
    report["device"] = torch.cuda.get_device_name() if device() == "cuda" else "cpu"
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return 0 if report.get("passed", True) else 1


if __name__ == "__main__":
    sys.exit(main())
