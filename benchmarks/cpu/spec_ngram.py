"""NGRAM speculative decoding on SmolLM2-135M-Instruct (the CPU's bf16 mode), offline Engine:
output tokens/s with and without --speculative-algorithm NGRAM, greedy, on

  repetitive  "repeat this text", code editing, extraction: the answer copies its prompt
  random      short open questions (answers that copy little)

at 1 concurrent request (the prompts one after another) and 16 (all at once), with the accepted
length (tokens per verify step, SGLang's spec_accept_length) and whether the outputs equal
speculation off. The n-gram cache and the prefix cache are cleared before each measurement; the two
engines take turns (chunk by chunk) so that other load on the machine falls on both alike.

    python benchmarks/cpu/spec_ngram.py --out benchmarks/cpu/spec_ngram.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from real_model import AGREEMENT_QUESTIONS, chat_prompt_ids, smollm2_gguf  # noqa: E402

from radixserve.engine import Engine  # noqa: E402

PARAGRAPHS = [
    "The city library opens at nine in the morning and closes at six in the evening. Members may borrow up to "
    "five books at a time for three weeks. Late returns cost ten cents per day, and lost books must be replaced.",
    "Our team meets every Monday to plan the week. On Wednesday we review progress, and on Friday we write a short "
    "report that lists what was finished, what was blocked, and what will be done next.",
    "To make a simple tomato soup, cook one chopped onion in butter, add two cans of tomatoes and a cup of stock, "
    "simmer for twenty minutes, then blend until smooth and season with salt and pepper.",
    "The museum has three floors. The first floor shows ancient history, the second floor shows modern art, and the "
    "third floor has a cafe with a view of the river and the old bridge.",
]
CODE = [
    "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n",
    "def greet(name):\n    message = 'Hello, ' + name\n    print(message)\n    return message\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def add(self):\n        self.count += 1\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'is even')\n    else:\n        print(i, 'is odd')\n",
]


def repetitive_questions() -> List[str]:
    qs = [f"Repeat the following text exactly, word for word:\n\n{p}" for p in PARAGRAPHS]
    qs += [f"Rename the function arguments to longer names and return the whole code:\n\n{c}" for c in CODE]
    qs += [f"Copy every sentence of this text that mentions a number:\n\n{p}" for p in PARAGRAPHS]
    qs += [f"Rewrite this code with a comment above each line:\n\n{c}" for c in CODE]
    return qs


def clear(engine: Engine) -> None:
    engine.scheduler.run_step()  # the finished requests leave the running batch, so the flush can run
    assert engine.flush_cache(), "the prefix cache was not flushed"
    if engine.scheduler.spec_worker is not None:
        engine.scheduler.spec_worker.clear_cache_pool()


def measure(engines: Dict[str, Engine], prompts: List[List[int]], concurrency: int, max_new: int) -> Dict[str, Any]:
    """Each engine runs the prompts `concurrency` at a time; the engines take turns chunk by
    chunk, so that load from elsewhere on the machine falls on both alike."""
    sp = {"max_new_tokens": max_new, "temperature": 0}
    for engine in engines.values():
        clear(engine)
    seconds = {name: 0.0 for name in engines}
    outs: Dict[str, List[Dict[str, Any]]] = {name: [] for name in engines}
    for i in range(0, len(prompts), concurrency):
        chunk = prompts[i : i + concurrency]
        for name, engine in engines.items():
            t0 = time.perf_counter()
            outs[name] += engine.generate(input_ids=chunk, sampling_params=[sp] * len(chunk), progress=False)
            seconds[name] += time.perf_counter() - t0
    res = {}
    for name in engines:
        tokens = sum(o["meta_info"]["completion_tokens"] for o in outs[name])
        metas = [o["meta_info"] for o in outs[name] if "spec_verify_ct" in o["meta_info"]]
        res[name] = {
            "output_tokens": tokens, "seconds": seconds[name], "tokens_per_s": tokens / seconds[name],
            "spec_accept_length": (sum(m["completion_tokens"] for m in metas) / sum(m["spec_verify_ct"] for m in metas)) if metas else None,
            "outputs": [o["output_ids"] for o in outs[name]],
        }
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="--speculative-num-draft-tokens (default: the flag's)")
    parser.add_argument("--bfs-breadth", type=int, default=1, help="--speculative-ngram-max-bfs-breadth (1: a chain)")
    parser.add_argument("--concurrency", default="1,16")
    args = parser.parse_args()

    path = smollm2_gguf()
    base = dict(model_path=str(path), dtype=args.dtype, max_total_tokens=32768)
    spec = dict(speculative_algorithm="NGRAM", speculative_ngram_max_bfs_breadth=args.bfs_breadth)
    if args.num_draft_tokens is not None:
        spec["speculative_num_draft_tokens"] = args.num_draft_tokens
    engines = {"off": Engine(**base), "ngram": Engine(**base, **spec)}
    tok = engines["off"].tokenizer
    workloads = {
        "repetitive": [chat_prompt_ids(tok, q) for q in repetitive_questions()],
        "random": [chat_prompt_ids(tok, q) for q in AGREEMENT_QUESTIONS[:16]],
    }
    for engine in engines.values():  # warm up (first-call allocations), not measured
        engine.generate(input_ids=workloads["random"][:2], sampling_params={"max_new_tokens": 8, "temperature": 0})
    rows = []
    for wname, prompts in workloads.items():
        for conc in [int(c) for c in args.concurrency.split(",")]:
            res = measure(engines, prompts, conc, args.max_new_tokens)
            same = sum(a == b for a, b in zip(res["off"]["outputs"], res["ngram"]["outputs"]))
            row = {
                "workload": wname, "concurrency": conc, "num_prompts": len(prompts),
                "off_tokens_per_s": res["off"]["tokens_per_s"], "ngram_tokens_per_s": res["ngram"]["tokens_per_s"],
                "speedup": res["ngram"]["tokens_per_s"] / res["off"]["tokens_per_s"],
                "spec_accept_length": res["ngram"]["spec_accept_length"],
                "outputs_equal": f"{same}/{len(prompts)}",
                "off_output_tokens": res["off"]["output_tokens"], "ngram_output_tokens": res["ngram"]["output_tokens"],
            }
            rows.append(row)
            print(f"{wname:>10} c={conc:<3} off {row['off_tokens_per_s']:7.1f} tok/s  ngram {row['ngram_tokens_per_s']:7.1f} tok/s"
                  f"  x{row['speedup']:.2f}  accept_length {row['spec_accept_length'] or 0:.2f}  equal {row['outputs_equal']}",
                  flush=True)
    result = {
        "model": path.name, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
        "speculative_num_draft_tokens": engines["ngram"].server_args.speculative_num_draft_tokens,
        "speculative_ngram_max_bfs_breadth": args.bfs_breadth,
        "command": " ".join(sys.argv), "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
