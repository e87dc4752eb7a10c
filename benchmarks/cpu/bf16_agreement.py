"""How often each engine's greedy chat answers equal float32's, on SmolLM2-135M-Instruct.

The reference is transformers in float32 on the GGUF's weights (tests/real_model.py), greedy, one
prompt at a time. Each engine answers the same chat prompts (token ids made by the same chat
template), greedy, MAX_NEW tokens; per engine:

  agree        answers equal to the reference, token for token (trailing EOS ignored)
  prefix       mean number of leading tokens equal to the reference's
  tf |dlogprob| teacher-forced along the reference's answer (the same tokens for every engine):
               |logprob(engine) - logprob(reference)| of each reference token, mean and max

Engines: radixserve configurations run in this process (the Engine API; teacher-forced logprobs
are its input logprobs of prompt + reference answer); llama.cpp through a running `llama-server`
on the BF16 GGUF (--llama-url), teacher-forced by asking for one token after prompt + the first j
reference tokens (its prompt cache makes that one decode step) with n_probs.

    python benchmarks/cpu/bf16_agreement.py --llama-url http://127.0.0.1:18080 \\
        --out benchmarks/cpu/bf16_agreement.json
    python benchmarks/cpu/bf16_agreement.py --engines bf16,bf16-kv-fp32   # a part
    python benchmarks/cpu/bf16_agreement.py --gguf FILE --engines gguf-blocks --llama-url ... --llama-label ...
        # another quantization of the model: its own float32 reference, llama-server on FILE
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from real_model import AGREEMENT_QUESTIONS, agreement_figures, chat_prompt_ids, hf_from_gguf, smollm2_gguf  # noqa: E402

MAX_NEW = 32
# name -> (Engine keyword arguments, C++ kernels on)
# The bf16 configurations dequantize the GGUF (--quantization none): the bf16 mode, as a bf16
# checkpoint runs; "gguf-blocks" keeps the file's Q4_1 blocks (issue 38), what a GGUF runs by default.
RADIXSERVE = {
    "float32": ({"dtype": "float32"}, True),
    "bf16": ({"dtype": "bfloat16", "quantization": "none"}, True),  # what the CPU runs by default on a bf16 checkpoint
    "bf16-kv-fp16": ({"dtype": "bfloat16", "kv_cache_dtype": "float16", "quantization": "none"}, True),
    "bf16-kv-fp32": ({"dtype": "bfloat16", "kv_cache_dtype": "float32", "quantization": "none"}, True),
    "bf16-torch": ({"dtype": "bfloat16", "quantization": "none"}, False),  # RADIXSERVE_DISABLE_CPU_KERNELS=1: all in bf16
    "gguf-blocks": ({"dtype": "bfloat16", "quantization": "gguf"}, True),  # the file's blocks, 8-bit activations
}

Answer = Tuple[List[int], List[float]]  # (token ids, logprob of each)


def reference(model, prompts: List[List[int]], eos: set) -> List[Answer]:
    """transformers float32, greedy, one prompt at a time; logprobs from log_softmax."""
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=min(eos))
            toks = gen.sequences[0, len(ids):].tolist()
            lps = [torch.log_softmax(l[0].float(), -1)[t].item() for l, t in zip(gen.logits, toks)]
            out.append((toks, lps))  # with its EOS: teacher forcing asks for that token too
    return out


def strip_eos(toks: List[int], lps: List[float], eos: set) -> Answer:
    n = len(toks)
    while n and toks[n - 1] in eos:
        n -= 1
    return toks[:n], lps[:n]


def radixserve_answers(name: str, gguf: Path, prompts: List[List[int]], ref: List[Answer],
                       eos: set) -> Tuple[List[Answer], List[List[float]]]:
    """(greedy answers, teacher-forced logprobs of the reference answers)."""
    from radixserve import Engine
    from radixserve.layers import cpu_kernels

    kwargs, kernels = RADIXSERVE[name]
    cpu_kernels.ENABLED = kernels
    try:
        engine = Engine(str(gguf), max_total_tokens=16384, **kwargs)
        outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0},
                               return_logprob=True, progress=False)
        forced = teacher_forced(engine, prompts, ref)
    finally:
        cpu_kernels.ENABLED = True
    answers = []
    for o in outs:
        lps = [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
        answers.append(strip_eos(list(o["output_ids"]), lps, eos))
    del engine
    gc.collect()
    return answers, forced


def teacher_forced(engine, prompts: List[List[int]], ref: List[Answer]) -> List[List[float]]:
    """The engine's logprob of each reference token, given the prompt and the reference before it."""
    forced = []
    for p, (toks, _) in zip(prompts, ref):
        o = engine.generate(input_ids=p + toks, sampling_params={"max_new_tokens": 1, "temperature": 0},
                            return_logprob=True, logprob_start_len=len(p), progress=False)
        forced.append([lp for lp, _, _ in o["meta_info"]["input_token_logprobs"]])
    return forced


TOP_N = 20  # llama.cpp's n_probs when teacher-forced: the reference token must be among them


def llamacpp_answers(url: str, prompts: List[List[int]], ref: List[Answer],
                     eos: set) -> Tuple[List[Answer], List[List[float]]]:
    """(greedy answers, teacher-forced logprobs of the reference answers) from llama-server."""
    import httpx

    def complete(client, ids: List[int], n: int, n_probs: int) -> List[dict]:
        r = client.post(f"{url}/completion", json={"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1,
                                                   "n_probs": n_probs, "cache_prompt": True})
        r.raise_for_status()
        return r.json()["completion_probabilities"]

    answers, forced = [], []
    with httpx.Client(timeout=120) as client:
        for ids, (ref_toks, _) in zip(prompts, ref):
            probs = complete(client, ids, MAX_NEW, 1)
            answers.append(strip_eos([p["id"] for p in probs], [p["logprob"] for p in probs], eos))
            lps = []
            for j, tok in enumerate(ref_toks):
                top = complete(client, ids + ref_toks[:j], 1, TOP_N)[0]["top_logprobs"]
                found = [t["logprob"] for t in top if t["id"] == tok]
                lps.append(found[0] if found else float("nan"))  # far outside llama.cpp's top TOP_N
            forced.append(lps)
    return answers, forced


def compare(ref: List[Answer], cand: List[Answer], forced: List[List[float]], eos: set) -> Dict[str, float]:
    """The figures of one engine: tests/real_model.agreement_figures, which
    tests/reference/test_bf16_agreement.py asserts on (whole-sequence equality, as measured here)."""
    return agreement_figures([t for t, _ in ref], [l for _, l in ref], [t for t, _ in cand], forced, eos)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default=",".join(RADIXSERVE), help=f"radixserve configurations: {', '.join(RADIXSERVE)}")
    ap.add_argument("--llama-url", default=None, help="a llama-server serving the BF16 GGUF of the same model")
    ap.add_argument("--llama-label", default="llama.cpp BF16", help="its row's name (e.g. llama.cpp Q4_1 for the file itself)")
    ap.add_argument("--num-prompts", type=int, default=len(AGREEMENT_QUESTIONS))
    ap.add_argument("--gguf", default=None, help="another GGUF of SmolLM2 (e.g. the Q8_0 of tests/real_model.smollm2_q8_0_gguf, "
                                                 "or a llama-quantize Q4_K_M); default: the Q4_1 file")
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    args = ap.parse_args()

    gguf = Path(args.gguf) if args.gguf else smollm2_gguf()
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    questions = AGREEMENT_QUESTIONS[: args.num_prompts]
    prompts = [chat_prompt_ids(tok, q) for q in questions]
    hf = hf_from_gguf(gguf)
    eos = {tok.eos_token_id, *([hf.generation_config.eos_token_id] if isinstance(hf.generation_config.eos_token_id, int)
                               else hf.generation_config.eos_token_id or [])}
    t0 = time.time()
    ref = reference(hf, prompts, eos)
    print(f"reference (transformers float32): {time.time() - t0:.0f} s", file=sys.stderr)
    del hf
    gc.collect()

    rows: Dict[str, Dict[str, float]] = {}
    names = [n for n in args.engines.split(",") if n]
    for name in names:
        if name not in RADIXSERVE:
            raise SystemExit(f"unknown engine {name!r}: {', '.join(RADIXSERVE)}")
        rows[f"radixserve {name}"] = compare(ref, *radixserve_answers(name, gguf, prompts, ref, eos), eos)
    if args.llama_url:
        rows[args.llama_label] = compare(ref, *llamacpp_answers(args.llama_url, prompts, ref, eos), eos)

    print(f"| engine ({len(prompts)} chat prompts, greedy, {MAX_NEW} tokens) | agree with float32 | mean equal prefix "
          f"| teacher-forced abs dlogprob: mean | p99 | max |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, r in rows.items():
        print(f"| {name} | {r['agree']} / {r['prompts']} | {r['mean_prefix']:.1f} | {r['tf_dlogprob_mean']:.4f} | "
              f"{r['tf_dlogprob_p99']:.3f} | {r['tf_dlogprob_max']:.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"max_new_tokens": MAX_NEW, "questions": questions, "rows": rows},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
