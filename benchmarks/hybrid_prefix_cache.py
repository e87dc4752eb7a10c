"""Issue 41: what the hybrid radix cache saves on a multi-turn workload (a count, not a timing).

A random Qwen3-Next config (the reference tests' one), CONVERSATIONS conversations of TURNS turns
served together per turn: each turn sends the conversation so far (prompts and answers) plus
NEW_TOKENS new tokens and takes ANSWER_TOKENS greedy tokens. Counted: the tokens the model's
forwards computed (a hook on the embedding: every computed token passes there once), the
prefill's share of them, cached_tokens, and the state pool's snapshots; with the prefix cache on
and off (--disable-radix-cache), same outputs asserted.

    python benchmarks/hybrid_prefix_cache.py [--out benchmarks/cpu/hybrid_prefix_cache.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "reference"), str(ROOT / "tests")]

from test_qwen3_next import make_next_dir  # noqa: E402

from radixserve import Engine  # noqa: E402

CONVERSATIONS, TURNS, FIRST_PROMPT, NEW_TOKENS, ANSWER_TOKENS = 8, 4, 120, 24, 16


def run(model_dir: str, disable_radix_cache: bool, overlap: bool) -> Dict[str, object]:
    engine = Engine(model_dir, dtype="float32", skip_tokenizer_init=True, chunked_prefill_size=64,
                    max_total_tokens=16384, max_running_requests=CONVERSATIONS, disable_radix_cache=disable_radix_cache,
                    disable_overlap_schedule=not overlap, test_check_memory=True)
    computed = {"tokens": 0}
    embed = engine.scheduler.tp_worker.model_runner.model.model.embed_tokens
    embed.register_forward_hook(lambda m, a, o: computed.__setitem__("tokens", computed["tokens"] + a[0].numel()))
    rng = random.Random(0)
    convs: List[List[int]] = [[rng.randrange(512) for _ in range(FIRST_PROMPT)] for _ in range(CONVERSATIONS)]
    prompt_tokens = cached = 0
    outputs = []
    try:
        for turn in range(TURNS):
            if turn:
                convs = [c + [rng.randrange(512) for _ in range(NEW_TOKENS)] for c in convs]
            outs = engine.generate(input_ids=convs, sampling_params={"max_new_tokens": ANSWER_TOKENS, "temperature": 0,
                                                                      "ignore_eos": True}, return_logprob=True,
                                   progress=False)
            prompt_tokens += sum(len(c) for c in convs)
            cached += sum(o["meta_info"]["cached_tokens"] for o in outs)
            outputs.append([(o["output_ids"], [v for v, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs])
            convs = [c + o["output_ids"] for c, o in zip(convs, outs)]
        info = engine.get_server_info()
        engine.scheduler.check_memory()
    finally:
        engine.shutdown()
    decode_tokens = CONVERSATIONS * TURNS * (ANSWER_TOKENS - 1 + overlap)  # the overlap loop's extra step
    return dict(prefix_cache=not disable_radix_cache, overlap=overlap, prompt_tokens=prompt_tokens,
                cached_tokens=cached, computed_tokens=computed["tokens"],
                prefill_tokens_computed=computed["tokens"] - decode_tokens,
                state_snapshots=info.get("mamba_snapshots", 0), state_pool_slots=info["mamba_pool_size"],
                outputs=outputs)


def check_same_outputs(off: list, on: list) -> None:
    """Greedy tokens equal, or a near-tie: the two runs' logprobs agree (within 1e-4) up to and
    at the first token where they part (random weights give near-ties; DESIGN.md)."""
    for t, (turn_off, turn_on) in enumerate(zip(off, on)):
        for c, ((ids_a, lp_a), (ids_b, lp_b)) in enumerate(zip(turn_off, turn_on)):
            n = next((i for i, (a, b) in enumerate(zip(ids_a, ids_b)) if a != b), len(ids_a))
            gap = max((abs(a - b) for a, b in zip(lp_a[: n + 1], lp_b[: n + 1])), default=0.0)
            assert gap <= 1e-4, f"the prefix cache changed a greedy output (turn {t}, conversation {c}, token {n}, logprob gap {gap:.2e})"
            if n < len(ids_a):
                print(f"near-tie at token {n}: {ids_a[n]} vs {ids_b[n]}, logprob gap {gap:.1e}")
                return  # the conversations part here: later turns differ in their prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "cpu" / "hybrid_prefix_cache.json"))
    out_path = ap.parse_args().out
    with tempfile.TemporaryDirectory() as d:
        model_dir = make_next_dir(d)
        rows = [run(model_dir, disable, overlap) for overlap in (False, True) for disable in (True, False)]
    for off, on in ((rows[0], rows[1]), (rows[2], rows[3])):
        print("overlap" if on["overlap"] else "normal")
        check_same_outputs(off["outputs"], on["outputs"])
    print(f"{'loop':8} {'cache':6} {'prompt':>7} {'cached':>7} {'prefill computed':>17} {'snapshots':>10}")
    for r in rows:
        print(f"{'overlap' if r['overlap'] else 'normal':8} {'on' if r['prefix_cache'] else 'off':6} {r['prompt_tokens']:7d} "
              f"{r['cached_tokens']:7d} {r['prefill_tokens_computed']:17d} {r['state_snapshots']:10d}")
    for r in rows:
        r.pop("outputs")
    Path(out_path).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
