"""Speculative decoding with a draft model on SmolLM2-135M-Instruct (the GGUF, the CPU's bf16
mode), one user, offline Engine: output tokens/s and accepted length of STANDALONE (draft = the
same GGUF: every draft accepted, no cheaper than the target) and EAGLE (a random head: its
drafts are rejected, what a head costs per step) against speculation off. No trained draft for
SmolLM2 exists offline, so this measures the machinery's cost, not a speed-up. The variants take
turns in rounds (one engine at a time); greedy, 64 new tokens, 3 chat prompts.

    python benchmarks/cpu/spec_draft_models.py --rounds 2 --out benchmarks/cpu/spec_draft_models.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from eagle_head import make_random_eagle_head  # noqa: E402
from real_model import chat_prompt_ids, smollm2_gguf  # noqa: E402

from radixserve.engine import Engine  # noqa: E402
from radixserve.models.model_config import ModelConfig  # noqa: E402

QUESTIONS = [
    "Repeat the following text exactly, word for word:\n\nThe city library opens at nine in the morning and closes at six.",
    "Write a haiku about the sea.",
    "What is the capital of France? Answer in two sentences.",
]


def variants(gguf: str, head: str) -> Dict[str, Dict]:
    return {
        "off": {},
        "STANDALONE, draft = the same GGUF, 3 steps": dict(
            speculative_algorithm="STANDALONE", speculative_draft_model_path=gguf, speculative_num_steps=3),
        "EAGLE random head, chain (3 steps)": dict(
            speculative_algorithm="EAGLE", speculative_draft_model_path=head, speculative_num_steps=3,
            speculative_eagle_topk=1, speculative_num_draft_tokens=4),
        "EAGLE random head, tree (5 steps, topk 4, 8 tokens)": dict(speculative_algorithm="EAGLE", speculative_draft_model_path=head),
    }


def run(kw: Dict, prompts, max_new: int) -> Dict:
    engine = Engine(**kw)
    engine.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 4, "temperature": 0}, progress=False)
    toks, secs, accept, outs = 0, 0.0, [], []
    for p in prompts:
        t0 = time.perf_counter()
        o = engine.generate(input_ids=p, sampling_params={"max_new_tokens": max_new, "temperature": 0}, progress=False)
        secs += time.perf_counter() - t0
        toks += len(o["output_ids"])
        accept.append(o["meta_info"].get("spec_accept_length", 1.0))
        outs.append(o["output_ids"])
    engine.shutdown()
    return dict(tokens=toks, seconds=secs, accept_length=sum(accept) / len(accept), outputs=outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gguf = str(smollm2_gguf())
    head = make_random_eagle_head(ModelConfig.from_pretrained(gguf).hf_config, tempfile.mkdtemp() + "/head")
    base = dict(model_path=gguf, dtype="bfloat16", max_total_tokens=4096)
    engine = Engine(**base)
    prompts = [chat_prompt_ids(engine.tokenizer, q) for q in QUESTIONS]
    engine.shutdown()
    table = {name: [] for name in variants(gguf, head)}
    for _ in range(args.rounds):
        for name, kw in variants(gguf, head).items():
            table[name].append(run(dict(base, **kw), prompts, args.max_new_tokens))
    off = table["off"]
    rows = []
    print("| variant | tok/s per round | vs off (median) | accept length | outputs equal off |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, runs in table.items():
        tps = [r["tokens"] / r["seconds"] for r in runs]
        ratios = sorted(t / (o["tokens"] / o["seconds"]) for t, o in zip(tps, off))
        equal = sum(a == b for a, b in zip(runs[0]["outputs"], off[0]["outputs"]))
        row = dict(variant=name, tok_s=tps, ratio_median=ratios[len(ratios) // 2],
                   accept_length=runs[0]["accept_length"], equal=f"{equal}/{len(prompts)}")
        rows.append(row)
        print(f"| {name} | {', '.join(f'{t:.1f}' for t in tps)} | {row['ratio_median']:.2f}x | "
              f"{row['accept_length']:.2f} | {row['equal']} |")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(command=" ".join(sys.argv), rows=rows), indent=1))


if __name__ == "__main__":
    main()
