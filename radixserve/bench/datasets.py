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
    multi-turn               chat sessions (`bench serving` only: a prompt depends on the server's
                             earlier answers): --num-users users share one --system-prompt-len
                             system prompt; each runs --num-turns turns one after another, the
                             prompt of turn t being the text of the whole conversation so far
                             (system prompt + user message 1 + answer 1 + ... + user message t,
                             --turn-input-len tokens a user message, --random-output-len tokens
                             an answer), sent as plain text completions

Random token ids avoid the tokenizer's special ids and are drawn from a seeded RNG, so one
seed gives one workload.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

DATASETS = ("random", "random-ids", "generated-shared-prefix", "sharegpt", "trace", "multi-turn")
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


def load_tokenizer_or_tiny(path: Optional[str]) -> Any:
    """The tokenizer at `path` (a model directory or hub name) for text prompts; the embedded
    tiny model's when `path` is None or cannot be loaded here (a server's model path may be
    one this machine does not have)."""
    from radixserve.hf_transformers_utils import load_tokenizer
    from radixserve.tiny_model import get_tiny_model_path

    if path:
        try:
            return load_tokenizer(path)
        except Exception:
            pass
    return load_tokenizer(str(get_tiny_model_path()))


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--dataset-name", "--dataset", default="random", choices=DATASETS)
    g.add_argument("--dataset-path", default=None, help="ShareGPT JSON or JSONL trace file")
    g.add_argument("--num-prompts", type=int, default=1000, help="requests to send (gsp: groups x prompts per group)")
    g.add_argument("--seed", type=int, default=1)
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=1024, help="(multi-turn: tokens of an answer)")
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
    g.add_argument("--num-users", type=int, default=16, help="multi-turn: concurrent chat users")
    g.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per user")
    g.add_argument("--system-prompt-len", type=int, default=600,
                   help="multi-turn: tokens of the system prompt all users share")
    g.add_argument("--turn-input-len", type=int, default=32,
                   help="multi-turn: tokens of a user message (answers: --random-output-len)")


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


def random_text(rng: random.Random, n: int, vocab_size: int, tokenizer: Any) -> str:
    """Text of about n tokens: random ids decoded, re-encoded, cut to n and decoded again (the
    first decode alone re-encodes to ~5-10% more tokens)."""
    if n <= 0:
        return ""
    text = tokenizer.decode(_random_ids(rng, n, vocab_size))
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:n])


@dataclass
class MultiTurnWorkload:
    """The fixed part of a multi-turn run; the answers come from the server while it runs."""
    system_prompt: str
    user_messages: List[List[str]]  # [user][turn]
    output_len: int  # max_new_tokens of every answer

    @property
    def num_users(self) -> int:
        return len(self.user_messages)

    @property
    def num_turns(self) -> int:
        return len(self.user_messages[0]) if self.user_messages else 0


def sample_multi_turn(num_users: int, num_turns: int, system_prompt_len: int, turn_input_len: int,
                      output_len: int, vocab_size: int, seed: int, tokenizer: Any) -> MultiTurnWorkload:
    """One system prompt shared by all users, then each user's messages, all from one seeded RNG
    (same seed, same tokenizer: same texts)."""
    if tokenizer is None:
        raise ValueError("the multi-turn dataset needs a tokenizer (--tokenizer)")
    if num_users < 1 or num_turns < 1:
        raise ValueError("multi-turn needs --num-users >= 1 and --num-turns >= 1")
    if output_len < 1:
        raise ValueError("multi-turn needs --random-output-len >= 1")
    rng = random.Random(seed)
    system = random_text(rng, system_prompt_len, vocab_size, tokenizer)
    users = [[random_text(rng, turn_input_len, vocab_size, tokenizer) for _ in range(num_turns)]
             for _ in range(num_users)]
    return MultiTurnWorkload(system, users, output_len)


def build_turn_prompt(system_prompt: str, user_messages: Sequence[str], answers: Sequence[str]) -> str:
    """The prompt of turn len(answers) (0-based): system prompt + user message 1 + answer 1 + ...
    + this turn's user message, concatenated as they are (plain completions, no chat template,
    so every server sees the same text)."""
    t = len(answers)
    if t >= len(user_messages):
        raise ValueError(f"turn {t} of a conversation with {len(user_messages)} user messages")
    parts = [system_prompt]
    for msg, ans in zip(user_messages, answers):
        parts += [msg, ans]
    parts.append(user_messages[t])
    return "".join(parts)


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
    if name == "multi-turn":
        raise ValueError("the multi-turn dataset runs only in `radixserve bench serving` "
                         "(its prompts contain the server's answers)")
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
