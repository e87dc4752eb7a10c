"""The multi-turn workload of `radixserve bench serving`: the prompt of a turn is the whole
conversation so far with the server's own answers in it, the system prompt is shared by all
users, a user's turns run one after another, and --max-concurrency bounds the requests in
flight. A fake server (an in-process httpx transport, both APIs) records what it is sent."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import httpx
import pytest

from radixserve.bench.datasets import build_turn_prompt, get_dataset, load_tokenizer_or_tiny, sample_multi_turn
from radixserve.bench.serving import benchmark, run_conversations
from radixserve.cli import build_parser, main


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer_or_tiny(None)  # the embedded tiny model's


def test_build_turn_prompt_concatenates_the_conversation():
    msgs = ["<u1>", "<u2>", "<u3>"]
    assert build_turn_prompt("SYS", msgs, []) == "SYS<u1>"
    assert build_turn_prompt("SYS", msgs, ["<a1>"]) == "SYS<u1><a1><u2>"
    assert build_turn_prompt("SYS", msgs, ["<a1>", "<a2>"]) == "SYS<u1><a1><u2><a2><u3>"
    with pytest.raises(ValueError):
        build_turn_prompt("SYS", msgs, ["a", "b", "c"])  # no fourth user message


def test_sample_multi_turn_is_seeded_and_shares_one_system_prompt(tokenizer):
    vocab = len(tokenizer)
    w = sample_multi_turn(3, 4, 120, 16, 8, vocab, seed=5, tokenizer=tokenizer)
    assert w.num_users == 3 and w.num_turns == 4 and w.output_len == 8
    assert w == sample_multi_turn(3, 4, 120, 16, 8, vocab, seed=5, tokenizer=tokenizer)  # same seed, same texts
    other = sample_multi_turn(3, 4, 120, 16, 8, vocab, seed=6, tokenizer=tokenizer)
    assert other.system_prompt != w.system_prompt
    # one system prompt for everybody; each user's messages are their own
    msgs = [m for user in w.user_messages for m in user]
    assert len(set(msgs)) == len(msgs)
    # the texts are about as long as asked (decode -> encode -> cut -> decode)
    assert abs(len(tokenizer.encode(w.system_prompt, add_special_tokens=False)) - 120) <= 3
    for m in msgs:
        assert abs(len(tokenizer.encode(m, add_special_tokens=False)) - 16) <= 2


def test_get_dataset_refuses_multi_turn():
    """The simulator cannot run it: its prompts contain the server's answers."""
    args = build_parser().parse_args(["bench", "serving", "--dataset-name", "multi-turn"])
    with pytest.raises(ValueError, match="bench serving"):
        get_dataset(args, 1000, None)


class FakeServer:
    """Both APIs, streamed: every answer is a distinct string, so a prompt that contains it
    can only have been built from this server's answer."""

    def __init__(self, fail_prompt_containing: str = "", delay: float = 0.005):
        self.prompts: list[str] = []
        self.answers: dict[str, str] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.fail = fail_prompt_containing
        self.delay = delay

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "GET":
            if path == "/v1/models":
                return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model"}]})
            return httpx.Response(404, json={"error": "no such route"})
        body = json.loads(request.content)
        prompt = body.get("prompt", body.get("text"))
        assert isinstance(prompt, str)  # text, not token ids: both servers see the same text
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.in_flight -= 1
        if self.fail and self.fail in prompt:
            return httpx.Response(500, json={"error": "boom"})
        n = len(self.prompts)
        self.prompts.append(prompt)
        pieces = [f" ans{n}", "-a", "-b"]
        answer = "".join(pieces)
        self.answers[prompt] = answer
        events = []
        if path == "/v1/completions":
            assert body["stream"] and body["ignore_eos"] and body["model"] == "fake-model"
            assert set(body) <= {"model", "prompt", "max_tokens", "temperature", "stream", "stream_options",
                                 "ignore_eos"}  # what llama-server's /v1/completions takes
            for p in pieces:
                events.append({"choices": [{"index": 0, "text": p, "finish_reason": None}]})
            events.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                           "usage": {"prompt_tokens": len(prompt) // 4, "completion_tokens": body["max_tokens"],
                                     "prompt_tokens_details": {"cached_tokens": 3}}})
        elif path == "/generate":
            text = ""
            for i, p in enumerate(pieces):
                text += p
                events.append({"text": text, "meta_info": {"completion_tokens": i + 1, "prompt_tokens": 10,
                                                           "cached_tokens": 3}})
        else:
            return httpx.Response(404)
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=sse.encode(), headers={"content-type": "text/event-stream"})


def _args(backend: str, *extra: str):
    return build_parser().parse_args([
        "bench", "serving", "--backend", backend, "--base-url", "http://fake", "--dataset-name", "multi-turn",
        "--num-users", "3", "--num-turns", "3", "--system-prompt-len", "60", "--turn-input-len", "8",
        "--random-output-len", "5", "--disable-tqdm", "--seed", "3", *extra,
    ])


@pytest.mark.parametrize("backend", ["openai", "sglang"])
def test_each_prompt_grows_by_the_servers_answer(backend, tokenizer):
    fake = FakeServer()
    args = _args(backend, "--max-concurrency", "2")
    res = asyncio.run(benchmark(args, transport=httpx.MockTransport(fake)))
    workload = sample_multi_turn(3, 3, 60, 8, 5, len(tokenizer), seed=3, tokenizer=tokenizer)
    system = workload.system_prompt
    assert len(system) > 50

    warmup, prompts = fake.prompts[0], fake.prompts[1:]
    assert not warmup.startswith(system)  # the warm-up does not pre-cache the system prompt
    assert len(prompts) == 9
    # every prompt starts with the one shared system prompt
    assert all(p.startswith(system) for p in prompts)
    # group the prompts by their first user message: one conversation each
    convs = defaultdict(list)
    for p in prompts:
        for u, msgs in enumerate(workload.user_messages):
            if p.startswith(system + msgs[0]):
                convs[u].append(p)
    assert sorted(convs) == [0, 1, 2] and all(len(c) == 3 for c in convs.values())
    for u, conv in convs.items():
        msgs = workload.user_messages[u]
        assert conv[0] == system + msgs[0]
        for t in range(1, 3):
            # turn t = turn t-1's prompt + the answer the server gave to it + the next user message
            assert conv[t] == conv[t - 1] + fake.answers[conv[t - 1]] + msgs[t]
    # at most --max-concurrency requests were in flight
    assert fake.max_in_flight == 2

    m = res["metrics"]
    assert m["completed"] == 9 and m["failed"] == 0 and not res["errors"]
    assert m["total_output_tokens"] == 9 * (5 if backend == "openai" else 3)
    assert m["cached_tokens"] == 27 and m["output_throughput"] > 0
    assert [r["turn"] for r in res["per_turn"]] == [0, 1, 2]
    assert all(r["completed"] == 3 for r in res["per_turn"])
    rows = res["turn_requests"]
    assert sorted((r["user"], r["turn"]) for r in rows) == [(u, t) for u in range(3) for t in range(3)]
    if backend == "openai":  # prompt_tokens from usage: len(prompt) // 4, so growing by turn
        lens = [r["mean_prompt_len"] for r in res["per_turn"]]
        assert lens[0] < lens[1] < lens[2]


def test_users_run_concurrently_by_default():
    fake = FakeServer(delay=0.02)
    res = asyncio.run(benchmark(_args("openai", "--warmup-requests", "0"), transport=httpx.MockTransport(fake)))
    assert res["metrics"]["completed"] == 9
    assert fake.max_in_flight == 3  # all users at once, each with one request in flight


def test_a_failed_turn_ends_only_its_conversation(tokenizer):
    workload = sample_multi_turn(3, 3, 60, 8, 5, len(tokenizer), seed=3, tokenizer=tokenizer)
    fake = FakeServer(fail_prompt_containing=workload.user_messages[1][1])  # user 1, turn 2 (1-based)
    res = asyncio.run(benchmark(_args("openai"), transport=httpx.MockTransport(fake)))
    m = res["metrics"]
    assert m["completed"] == 7 and m["failed"] == 2
    rows = {(r["user"], r["turn"]): r for r in res["turn_requests"]}
    assert rows[(1, 0)]["success"] and not rows[(1, 1)]["success"] and not rows[(1, 2)]["success"]
    assert "500" in rows[(1, 1)]["error"] and rows[(1, 2)]["error"] == "not sent: turn 1 failed"
    assert not any(workload.user_messages[1][2] in p for p in fake.prompts)  # never sent
    assert all(rows[(u, t)]["success"] for u in (0, 2) for t in range(3))


def test_run_conversations_never_overlaps_a_users_turns(tokenizer):
    """A user's next turn is sent only after the previous answer is in (the prompt needs it)."""
    from radixserve.bench.metrics import RequestOutput

    workload = sample_multi_turn(4, 3, 20, 4, 2, len(tokenizer), seed=1, tokenizer=tokenizer)
    active, log = set(), []

    async def send(row):
        u = row.group
        assert u not in active
        active.add(u)
        await asyncio.sleep(0.001 * (u + 1))
        active.discard(u)
        log.append((u, row.prompt))
        return RequestOutput(success=True, prompt_len=row.prompt_len, output_len=2, generated_text=f"[{len(log)}]")

    outs = asyncio.run(run_conversations(workload, send, tokenizer))
    assert [(o.user, o.turn) for o in outs] == [(u, t) for u in range(4) for t in range(3)]
    for u in range(4):
        prompts = [p for v, p in log if v == u]
        answers = [o.generated_text for o in outs if o.user == u]
        for t in range(1, 3):
            assert prompts[t] == prompts[t - 1] + answers[t - 1] + workload.user_messages[u][t]
        assert outs[u * 3].prompt_len == len(tokenizer.encode(prompts[0]))


def test_cli_writes_per_turn_rows(tmp_path, monkeypatch):
    """The JSON line of a multi-turn run (main -> run -> benchmark, the fake server patched in)."""
    import radixserve.bench.serving as serving

    fake = FakeServer()
    real = serving.benchmark
    monkeypatch.setattr(serving, "benchmark", lambda args: real(args, transport=httpx.MockTransport(fake)))
    out = tmp_path / "mt.jsonl"
    assert main(["bench", "serving", "--backend", "openai", "--base-url", "http://fake", "--dataset", "multi-turn",
                 "--num-users", "2", "--num-turns", "2", "--system-prompt-len", "30", "--turn-input-len", "4",
                 "--random-output-len", "3", "--disable-tqdm", "--output-file", str(out), "--tag", "t"]) == 0
    rec = json.loads(out.read_text())
    assert rec["dataset_name"] == "multi-turn" and rec["tag"] == "t"
    assert rec["num_prompts"] == 4 and rec["completed"] == 4
    assert (rec["num_users"], rec["num_turns"], rec["output_len"]) == (2, 2, 3)
    assert len(rec["turn_requests"]) == 4 and [r["turn"] for r in rec["per_turn"]] == [0, 1]
    assert rec["usage_cache_hit_rate"] > 0


def test_random_dataset_warms_up_on_prompts_of_its_own():
    """The warm-up must not put a measured prompt into the server's prefix cache."""
    fake = FakeServer(delay=0)
    args = build_parser().parse_args([
        "bench", "serving", "--backend", "openai", "--base-url", "http://fake", "--dataset-name", "random",
        "--num-prompts", "4", "--random-input-len", "20", "--random-output-len", "3", "--disable-tqdm",
        "--warmup-requests", "2"])
    res = asyncio.run(benchmark(args, transport=httpx.MockTransport(fake)))
    assert res["metrics"]["completed"] == 4 and len(fake.prompts) == 6
    warm, measured = fake.prompts[:2], fake.prompts[2:]
    assert not set(warm) & set(measured)
