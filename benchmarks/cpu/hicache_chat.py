"""HiCache on a multi-turn chat that outgrows the device KV pool (issue 29): SmolLM2-135M-Instruct
(the CPU's bf16 mode), offline Engine, `enable_hierarchical_cache=True` against the same engine
without it (the same --max-total-tokens, so the same device pool).

The chat: --conversations conversations share a long system prompt; each first user turn carries
its own notes (a RAG-like context), later turns ask short questions; --turns turns each, greedy,
--max-new-tokens per answer. Turn t+1's prompt is turn t's prompt + its answer ids + the next
user message (token ids concatenated the way the chat template writes them, so the whole history
is a cached prefix). The turns go round robin over the conversations, one request at a time
(turn 1 of every conversation, then turn 2, ...): by the time a conversation speaks again the
others have pushed its history out of a device pool that holds about a quarter of the live
prefixes. Without HiCache that history is recomputed; with it, it is loaded back from the host
pool.

Why the offline Engine: one request at a time, so TTFT is the prefill (plus load back) of that
request and nothing else: no HTTP, no tokenizer process, no queueing behind other requests; both
engines live in one process and take turns. TTFT = the time from submit() to the step that
gives the request its first token.

Reported per turn and overall, for each engine: TTFT (mean, p50, p90), prefill tokens computed
(prompt tokens - cached_tokens), cached tokens by tier (meta_info.cached_tokens_details; without
HiCache every cached token is a device token), output tokens/s (output tokens / wall time of the
whole chat). The engines take turns in --rounds rounds (the order flips each round); each is
flushed (device and host tiers) before its round, and its slots are checked (check_memory: device
and host, every slot free or in the tree) after it. Greedy outputs are compared between the two, and
with one more chat on an engine whose pool holds everything (--reference-pool; the issue's reference:
HiCache's loaded-back KV is the KV that engine keeps, so its outputs should be equal bit for bit,
while recomputing a history, as the engine without HiCache does, may flip a near-tie).

    python benchmarks/cpu/hicache_chat.py --threads 1 --rounds 4 --out benchmarks/cpu/hicache_chat.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from real_model import AGREEMENT_QUESTIONS, smollm2_gguf  # noqa: E402

from radixserve.engine import Engine  # noqa: E402

TIERS = ("device", "host", "storage")
TOPICS = ["a bakery", "a bicycle shop", "a small library", "a garden centre", "a music school", "a train museum",
          "a seaside hotel", "a farm market", "a pottery studio", "a chess club", "a bookbinder", "a city zoo",
          "a mountain hut", "a radio station", "a bike courier", "a repair cafe"]


def system_prompt(sentences: int) -> str:
    """A long, deterministic system prompt (a house style guide), shared by every conversation."""
    rules = [f"Rule {i + 1}: when a customer asks about item number {i * 7 + 3}, answer politely, state the price "
             f"of {i * 3 + 5} euros, and mention that delivery takes {i % 5 + 1} days." for i in range(sentences)]
    return "You are a careful assistant for a chain of shops. Follow the house rules below.\n" + "\n".join(rules)


def notes(conv: int, sentences: int) -> str:
    """The first user turn's per-conversation context."""
    topic = TOPICS[conv % len(TOPICS)]
    lines = [f"Note {j + 1} about {topic} number {conv}: it opened in {1950 + conv * 3 + j}, has {j + conv + 2} staff, "
             f"and its favourite colour is {['red', 'blue', 'green', 'yellow', 'purple'][(conv + j) % 5]}." for j in range(sentences)]
    return "Here are my notes.\n" + "\n".join(lines)


class Chat:
    """Token ids of each conversation, built the way SmolLM2's chat template writes them."""

    def __init__(self, tok: Any, args: argparse.Namespace):
        self.tok = tok
        self.end = tok.convert_tokens_to_ids("<|im_end|>")
        sys_ids = tok.apply_chat_template([{"role": "system", "content": system_prompt(args.system_sentences)}], tokenize=False)
        self.system_ids = self.encode(sys_ids)
        self.user_turns = [[self.first_question(c, args) if t == 0 else self.question(c, t, args) for t in range(args.turns)]
                           for c in range(args.conversations)]

    def encode(self, text: str) -> List[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def first_question(self, conv: int, args: argparse.Namespace) -> str:
        return notes(conv, args.note_sentences) + "\n" + self.question(conv, 0, args)

    def question(self, conv: int, turn: int, args: argparse.Namespace) -> str:
        return AGREEMENT_QUESTIONS[(conv * args.turns + turn) % len(AGREEMENT_QUESTIONS)]

    def user_ids(self, text: str) -> List[int]:
        return self.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")

    def next_prompt(self, history: List[int], conv: int, turn: int) -> List[int]:
        """history: the previous prompt + its answer ids (empty at turn 0)."""
        if not history:
            return self.system_ids + self.user_ids(self.user_turns[conv][0])
        closing = [] if history[-1] == self.end else [self.end]  # an answer cut by max_new_tokens
        return history + closing + self.encode("\n") + self.user_ids(self.user_turns[conv][turn])


def run_one(engine: Engine, prompt: List[int], max_new: int) -> Dict[str, Any]:
    """One request alone on the engine: TTFT, the output ids, cached tokens by tier."""
    t0 = time.perf_counter()
    # stream=True: the scheduler reports the first token at once (a non-streaming request only
    # every 50 tokens and at its end)
    (state,) = engine.submit(input_ids=prompt, sampling_params={"max_new_tokens": max_new, "temperature": 0}, stream=True,
                             return_logprob=True, top_logprobs_num=2)
    ttft = None
    while not state.finished:
        engine.step()
        if ttft is None and state.output_ids:
            ttft = time.perf_counter() - t0
    engine.wait_until_idle()  # the finished batch retires: the next request starts on an idle engine
    out = engine.frontend.make_output(state)
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] != "abort", meta
    details = meta.get("cached_tokens_details") or {"device": meta["cached_tokens"], "host": 0, "storage": 0}
    return {"ttft": ttft, "seconds": time.perf_counter() - t0, "prompt_tokens": meta["prompt_tokens"],
            "cached_tokens": meta["cached_tokens"], "cached": {t: details.get(t, 0) for t in TIERS},
            "completion_tokens": meta["completion_tokens"], "output_ids": out["output_ids"],
            "top2_gaps": [t[0][0] - t[1][0] for t in meta["output_top_logprobs"]]}  # to tell near-ties


def run_chat(engine: Engine, chat: Chat, args: argparse.Namespace) -> Dict[str, Any]:
    """Every conversation, turn by turn, round robin; the engine flushed before, checked after."""
    assert engine.flush_cache(), "flush_cache refused (requests still running?)"
    history: List[List[int]] = [[] for _ in range(args.conversations)]
    requests = []
    t0 = time.perf_counter()
    for turn in range(args.turns):
        for conv in range(args.conversations):
            prompt = chat.next_prompt(history[conv], conv, turn)
            res = run_one(engine, prompt, args.max_new_tokens)
            history[conv] = prompt + res["output_ids"]
            requests.append({"turn": turn + 1, "conv": conv, **res})
    seconds = time.perf_counter() - t0
    engine.scheduler.check_memory()  # every slot of every tier free or held by the tree, none locked
    return {"seconds": seconds, "requests": requests}


def pct(values: List[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def summarize(reqs: List[Dict[str, Any]]) -> Dict[str, Any]:
    ttft = [r["ttft"] * 1000 for r in reqs]
    return {
        "requests": len(reqs),
        "ttft_ms_mean": statistics.fmean(ttft), "ttft_ms_p50": statistics.median(ttft), "ttft_ms_p90": pct(ttft, 0.9),
        "prompt_tokens": sum(r["prompt_tokens"] for r in reqs),
        "prefill_tokens_computed": sum(r["prompt_tokens"] - r["cached_tokens"] for r in reqs),
        "cached_tokens": sum(r["cached_tokens"] for r in reqs),
        "cached_tokens_by_tier": {t: sum(r["cached"][t] for r in reqs) for t in TIERS},
        "output_tokens": sum(r["completion_tokens"] for r in reqs),
    }


def report(runs: Dict[str, List[Dict[str, Any]]], turns: int) -> Dict[str, Any]:
    """Per engine: per turn and overall (all rounds pooled); per round: the ratios off / hicache."""
    out: Dict[str, Any] = {}
    for name, rounds in runs.items():
        reqs = [r for rnd in rounds for r in rnd["requests"]]
        overall = summarize(reqs)
        overall["output_tokens_per_s"] = overall["output_tokens"] / sum(rnd["seconds"] for rnd in rounds)
        overall["prefill_tokens_computed_per_round"] = overall["prefill_tokens_computed"] / len(rounds)
        out[name] = {"overall": overall, "per_turn": [summarize([r for r in reqs if r["turn"] == t]) for t in range(1, turns + 1)],
                     "round_seconds": [rnd["seconds"] for rnd in rounds]}
    per_round = []
    for off, hi in zip(runs["off"], runs["hicache"]):
        mean = lambda rnd: statistics.fmean(r["ttft"] for r in rnd["requests"])  # noqa: E731
        per_round.append({"ttft_mean_ratio_off_over_hicache": mean(off) / mean(hi),
                          "wall_ratio_off_over_hicache": off["seconds"] / hi["seconds"],
                          "load_average_1m": off.get("load", hi.get("load"))})
    out["per_round"] = per_round
    first_off, first_hi = runs["off"][0]["requests"], runs["hicache"][0]["requests"]
    same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(first_off, first_hi))
    out["greedy_outputs_equal"] = f"{same}/{len(first_off)}"
    out["divergences"] = [d for name, rounds in runs.items() for i, rnd in enumerate(rounds)
                          for d in divergences(first_off, rnd["requests"], f"{name} round {i + 1}")]
    return out


def divergences(ref: List[Dict[str, Any]], got: List[Dict[str, Any]], label: str) -> List[Dict[str, Any]]:
    """Per conversation, the first request whose output differs from the reference (off, round 1;
    later turns of that conversation then see another history), with the top-2 logprob gaps of
    both at the first differing token: a near-tie (a gap of a few bf16 roundings) or not."""
    seen, out = set(), []
    for a, b in zip(ref, got):
        if a["conv"] in seen or a["output_ids"] == b["output_ids"]:
            continue
        seen.add(a["conv"])
        k = next((i for i, (x, y) in enumerate(zip(a["output_ids"], b["output_ids"])) if x != y), None)
        out.append({"run": label, "conv": a["conv"], "turn": a["turn"], "token": k,
                    "ref_gap": a["top2_gaps"][k] if k is not None else None,
                    "gap": b["top2_gaps"][k] if k is not None else None,
                    "cached_ref": a["cached"], "cached": b["cached"]})
    return out


def print_table(res: Dict[str, Any], turns: int) -> None:
    head = f"{'engine':>8} {'turn':>5} {'TTFT mean':>10} {'p50':>8} {'p90':>8} {'prefill':>8} {'device':>7} {'host':>7} {'storage':>7}"
    print(head)
    for name in ("off", "hicache"):
        rows = [(str(t + 1), s) for t, s in enumerate(res[name]["per_turn"])] + [("all", res[name]["overall"])]
        for label, s in rows:
            c = s["cached_tokens_by_tier"]
            print(f"{name:>8} {label:>5} {s['ttft_ms_mean']:8.1f}ms {s['ttft_ms_p50']:6.1f}ms {s['ttft_ms_p90']:6.1f}ms "
                  f"{s['prefill_tokens_computed']:8d} {c['device']:7d} {c['host']:7d} {c['storage']:7d}")
    for name in ("off", "hicache"):
        print(f"{name}: {res[name]['overall']['output_tokens_per_s']:.1f} output tok/s")
    for i, r in enumerate(res["per_round"]):
        print(f"round {i + 1}: TTFT mean off/hicache x{r['ttft_mean_ratio_off_over_hicache']:.2f}, "
              f"wall off/hicache x{r['wall_ratio_off_over_hicache']:.2f}, load {r['load_average_1m']}")
    print(f"greedy outputs equal (round 1, off vs hicache): {res['greedy_outputs_equal']}")
    if "hicache_equals_reference" in res:
        print(f"HiCache outputs equal the {res['reference_pool']}-token pool's: {res['hicache_equals_reference']}")
    for d in res["divergences"] + res.get("reference_divergences", []):
        print(f"  differs from off round 1: {d['run']} conv {d['conv']} turn {d['turn']} token {d['token']}: "
              f"top-2 logprob gap {d['ref_gap']} (off) / {d['gap']}; cached {d['cached_ref']} / {d['cached']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system-sentences", type=int, default=8, help="system prompt length (about 30 tokens each)")
    parser.add_argument("--note-sentences", type=int, default=4, help="first user turn's notes (about 30 tokens each)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--max-total-tokens", type=int, default=1280, help="the device KV pool of both engines")
    parser.add_argument("--hicache-ratio", type=float, default=4.0)
    parser.add_argument("--hicache-write-policy", default="write_through")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reference-pool", type=int, default=16384,
                        help="after the rounds, one chat on an engine without HiCache whose pool holds everything, "
                             "compared with HiCache's outputs (0: skip)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    path = str(smollm2_gguf())
    common = dict(model_path=path, dtype=args.dtype, max_total_tokens=args.max_total_tokens, page_size=args.page_size,
                  log_level="warning")
    engines = {"off": Engine(**common),
               "hicache": Engine(**common, enable_hierarchical_cache=True, hicache_ratio=args.hicache_ratio,
                                 hicache_write_policy=args.hicache_write_policy)}
    chat = Chat(engines["off"].tokenizer, args)
    last = [chat.next_prompt([], c, 0) for c in range(args.conversations)]
    print(f"system prompt {len(chat.system_ids)} tokens; first prompts {min(map(len, last))}-{max(map(len, last))} tokens", flush=True)
    for eng in engines.values():  # warm up (first-call allocations), not measured
        run_one(eng, last[0][:64], 4)
    runs: Dict[str, List[Dict[str, Any]]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name in (list(engines) if r % 2 == 0 else list(reversed(engines))):
            rnd = run_chat(engines[name], chat, args)
            rnd["load"] = os.getloadavg()[0]
            runs[name].append(rnd)
            print(f"round {r + 1} {name:>8}: {rnd['seconds']:6.1f}s, load {rnd['load']:.2f}", flush=True)
    res = report(runs, args.turns)
    if args.reference_pool:  # an engine whose pool holds every conversation: the issue's reference
        ref_engine = Engine(**{**common, "max_total_tokens": args.reference_pool})
        ref = run_chat(ref_engine, chat, args)["requests"]
        ref_engine.shutdown()
        hi = runs["hicache"][0]["requests"]
        res["reference_pool"] = args.reference_pool
        res["hicache_equals_reference"] = f"{sum(a['output_ids'] == b['output_ids'] for a, b in zip(ref, hi))}/{len(ref)}"
        res["reference_divergences"] = divergences(ref, hi, "hicache round 1 vs the big pool")
    print_table(res, args.turns)
    live = [r["prompt_tokens"] + r["completion_tokens"] for r in runs["off"][0]["requests"][-args.conversations:]]
    for eng in engines.values():
        eng.shutdown()
    if args.out:
        for rounds in runs.values():
            for rnd in rounds:
                for req in rnd["requests"]:
                    req.pop("output_ids")
                    req.pop("top2_gaps")
        Path(args.out).write_text(json.dumps({
            "model": Path(path).name, "dtype": args.dtype, "engine": "offline Engine, one request at a time",
            "command": "python " + " ".join(sys.argv), "threads": torch.get_num_threads(),
            "workload": {k: getattr(args, k) for k in ("conversations", "turns", "system_sentences", "note_sentences",
                                                       "max_new_tokens", "max_total_tokens", "hicache_ratio",
                                                       "hicache_write_policy", "page_size", "rounds")},
            "system_prompt_tokens": len(chat.system_ids), "live_prefix_tokens_at_last_turn": sum(live),
            "distinct_tokens_at_last_turn": len(chat.system_ids) + sum(n - len(chat.system_ids) for n in live),
            **{k: v for k, v in res.items()},
            "requests": {name: [[{k: v for k, v in q.items()} for q in rnd["requests"]] for rnd in rounds] for name, rounds in runs.items()},
        }, indent=1) + "\n")


if __name__ == "__main__":
    main()
