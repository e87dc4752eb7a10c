"""Workloads for `radixserve bench serving` and `radixserve simulate` (SGLang bench_serving's
dataset flags):

    random                   prompts of random tokens, sent as text (lengths: --random-input-len,
                             --random-output-len, --random-range-ratio)
    random-ids               the same, sent as token ids (exact lengths)
    generated-shared-prefix  --gsp-num-groups groups of --gsp-prompts-per-group prompts; the prompts
                             of a group share a --gsp-system-prompt-len system prompt, then a
                             --gsp-question-len question of their own (sent as token ids)
    sharegpt                 a ShareGPT-format JSON file (--dataset-path): the first human turn is
                             the prompt, the reply's token count the output length
    trace                    a JSONL file (--dataset-path), one request a line:
                             {"timestamp": s, "input_ids": [...] | "input_len": n, "output_len": n}
                             (timestamp or arrival_time; requests are sent at these times)

Random token ids avoid the tokenizer's special ids and are drawn from a seeded RNG, so one
seed gives one workload.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from typing import Any, List, Optional

DATASETS = ("random", "random-ids", "generated-shared-prefix", "sharegpt", "trace")
# Token ids below this are special in the tiny tokenizer (and typical BOS/EOS/PAD ids).
FIRST_ORDINARY_ID = 3


@dataclass
class DatasetRow:
    prompt: Optional[str]  # text to send (None: send input_ids)
    input_ids: Optional[List[int]]  # token ids (always set for ids datasets)
    prompt_len: int
    output_len: int
    arrival_time: Optional[float] = None  # seconds from the start (trace only)
    group: Optional[int] = None  # shared-prefix group


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--dataset-name", default="random", choices=DATASETS)
    g.add_argument("--dataset-path", default=None, help="ShareGPT JSON or JSONL trace file")
    g.add_argument("--num-prompts", type=int, default=1000, help="requests to send (gsp: groups x prompts per group)")
    g.add_argument("--seed", type=int, default=1)
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=1024)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths are uniform in [len * ratio, len]")
    g.add_argument("--gsp-num-groups", type=int, default=64)
    g.add_argument("--gsp-prompts-per-group", type=int, default=16)
    g.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    g.add_argument("--gsp-question-len", type=int, default=128)
    g.add_argument("--gsp-output-len", type=int, default=256)
    g.add_argument("--gsp-shuffle", action="store_true",
                   help="interleave the groups (default: group after group, as SGLang sends them)")
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="override the reply lengths")
    g.add_argument("--sharegpt-context-len", type=int, default=2048,
                   help="skip conversations whose prompt + output exceed this")


def _lengths(rng: random.Random, n: int, length: int, ratio: float) -> List[int]:
    lo = max(int(length * ratio), 1)
    return [rng.randint(lo, max(length, lo)) for _ in range(n)]


def _random_ids(rng: random.Random, n: int, vocab_size: int) -> List[int]:
    return [rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(n)]


def sample_random(num: int, input_len: int, output_len: int, ratio: float, vocab_size: int, seed: int,
                  tokenizer: Any = None, as_text: bool = False) -> List[DatasetRow]:
    rng = random.Random(seed)
    in_lens = _lengths(rng, num, input_len, ratio)
    out_lens = _lengths(rng, num, output_len, ratio)
    rows = []
    for n, m in zip(in_lens, out_lens):
        ids = _random_ids(rng, n, vocab_size)
        if as_text and tokenizer is not None:
            text = tokenizer.decode(ids)
            rows.append(DatasetRow(text, None, len(tokenizer.encode(text)), m))
        else:
            rows.append(DatasetRow(None, ids, n, m))
    return rows


def sample_generated_shared_prefix(num_groups: int, prompts_per_group: int, system_prompt_len: int,
                                   question_len: int, output_len: int, vocab_size: int, seed: int,
                                   shuffle: bool = False) -> List[DatasetRow]:
    rng = random.Random(seed)
    systems = [_random_ids(rng, system_prompt_len, vocab_size) for _ in range(num_groups)]
    rows = []
    for g, system in enumerate(systems):
        for _ in range(prompts_per_group):
            ids = system + _random_ids(rng, question_len, vocab_size)
            rows.append(DatasetRow(None, ids, len(ids), output_len, group=g))
    if shuffle:
        rng.shuffle(rows)
    return rows


def sample_sharegpt(path: str, num: int, tokenizer: Any, seed: int, output_len: Optional[int] = None,
                    context_len: int = 2048) -> List[DatasetRow]:
    """SGLang's filter: conversations with at least two turns; skip too short (< 4 tokens) or too
    long (prompt > 1024 or prompt + output > context_len) ones."""
    if tokenizer is None:
        raise ValueError("the sharegpt dataset needs a tokenizer (--tokenizer)")
    with open(path) as f:
        data = json.load(f)
    convs = [d["conversations"] for d in data if len(d.get("conversations", d.get("conversation", []))) >= 2]
    random.Random(seed).shuffle(convs)
    rows: List[DatasetRow] = []
    for conv in convs:
        if len(rows) == num:
            break
        prompt, reply = conv[0]["value"], conv[1]["value"]
        prompt_len = len(tokenizer.encode(prompt))
        out_len = output_len or len(tokenizer.encode(reply))
        if prompt_len < 4 or (output_len is None and out_len < 4):
            continue
        if prompt_len > 1024 or prompt_len + out_len > context_len:
            continue
        rows.append(DatasetRow(prompt, None, prompt_len, out_len))
    if not rows:
        raise ValueError(f"{path}: no usable conversations")
    return rows


def load_trace(path: str, vocab_size: int, seed: int, num: Optional[int] = None) -> List[DatasetRow]:
    rng = random.Random(seed)
    rows: List[DatasetRow] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            t = d.get("timestamp", d.get("arrival_time"))
            if "input_ids" in d:
                ids = [int(x) for x in d["input_ids"]]
            elif "input_len" in d:
                ids = _random_ids(rng, int(d["input_len"]), vocab_size)
            else:
                raise ValueError(f"{path}:{lineno}: give input_ids or input_len")
            if "output_len" not in d:
                raise ValueError(f"{path}:{lineno}: missing output_len")
            rows.append(DatasetRow(None, ids, len(ids), int(d["output_len"]), None if t is None else float(t)))
    if num:
        rows = rows[:num]
    if rows and all(r.arrival_time is not None for r in rows):
        t0 = min(r.arrival_time for r in rows)
        for r in rows:
            r.arrival_time -= t0
        rows.sort(key=lambda r: r.arrival_time)
    return rows


def get_dataset(args: argparse.Namespace, vocab_size: int, tokenizer: Any = None) -> List[DatasetRow]:
    name = args.dataset_name
    if name in ("random", "random-ids"):
        return sample_random(args.num_prompts, args.random_input_len, args.random_output_len,
                             args.random_range_ratio, vocab_size, args.seed, tokenizer, as_text=name == "random")
    if name == "generated-shared-prefix":
        return sample_generated_shared_prefix(args.gsp_num_groups, args.gsp_prompts_per_group,
                                              args.gsp_system_prompt_len, args.gsp_question_len,
                                              args.gsp_output_len, vocab_size, args.seed, args.gsp_shuffle)
    if not args.dataset_path:
        raise ValueError(f"--dataset-name {name} needs --dataset-path")
    if name == "sharegpt":
        return sample_sharegpt(args.dataset_path, args.num_prompts, tokenizer, args.seed,
                               args.sharegpt_output_len, args.sharegpt_context_len)
    return load_trace(args.dataset_path, vocab_size, args.seed, args.num_prompts)


def arrival_times(n: int, request_rate: float, burstiness: float, seed: int) -> List[float]:
    """Send times (s from the start): all at 0 for rate inf, else gamma-distributed gaps with
    mean 1/rate (burstiness 1 = Poisson; lower is burstier), as SGLang's get_request."""
    if request_rate == float("inf") or request_rate <= 0:
        return [0.0] * n
    rng = random.Random(seed + 7919)
    theta = 1.0 / (request_rate * burstiness)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, theta)
    return out
