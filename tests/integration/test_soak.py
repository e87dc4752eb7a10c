"""Soak: a few hundred mixed requests (native and OpenAI, streaming and not, n > 1), with
aborts and client disconnects at random points. Afterwards nothing runs or waits, every KV slot
is free or in the radix tree (none locked), and a second round leaves memory flat."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any, Dict, List

import httpx

from conftest import MAX_TOTAL_TOKENS, server_state, wait_idle

ROUND = 100  # requests per round
CONCURRENCY = 24


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def one_request(c: httpx.AsyncClient, rng: random.Random, i: int, model: str) -> str:
    """Send one random request; return how it ended: ok, aborted, disconnected, refused."""
    kind = rng.choice(["native", "native_stream", "chat", "chat_stream", "n2", "abort"])
    rid = f"soak-{i}-{rng.randrange(10**9)}"
    max_new = rng.randrange(1, 64)
    text = " ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat", "and", "then"]) for _ in range(rng.randrange(1, 150)))
    sp = {"max_new_tokens": max_new, "temperature": rng.choice([0, 0.7, 1.0]), "ignore_eos": rng.random() < 0.5}
    disconnect_after = rng.choice([None, None, 0, 1, 5])  # stream chunks before the client leaves
    if kind in ("native", "n2", "abort"):
        body: Dict[str, Any] = {"text": text, "sampling_params": {**sp, "n": 2 if kind == "n2" else 1}, "rid": rid}
        task = asyncio.ensure_future(c.post("/generate", json=body))
        if kind == "abort":
            await asyncio.sleep(rng.random() * 0.5)
            await c.post("/abort_request", json={"rid": rid})
        elif disconnect_after is not None:  # a non-streaming client that gives up
            await asyncio.sleep(rng.random() * 0.3)
            task.cancel()
        try:
            r = await task
        except asyncio.CancelledError:
            return "disconnected"
        assert r.status_code in (200, 503), r.text
        return "ok" if r.status_code == 200 else "refused"
    if kind == "native_stream":
        req = c.build_request("POST", "/generate", json={"text": text, "sampling_params": sp, "stream": True})
    else:
        messages = [{"role": "user", "content": text}]
        req = c.build_request("POST", "/v1/chat/completions", json={
            "model": model, "messages": messages, "max_tokens": max_new, "stream": kind == "chat_stream",
            "temperature": sp["temperature"],
        })
    r = await c.send(req, stream=True)
    try:
        assert r.status_code in (200, 503), (await r.aread())
        chunks = 0
        async for _ in r.aiter_lines():
            chunks += 1
            if disconnect_after is not None and chunks > disconnect_after:
                return "disconnected"
        return "ok"
    finally:
        await r.aclose()


async def soak_round(url: str, headers: Dict[str, str], model: str, seed: int) -> List[str]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(CONCURRENCY)

    async def bounded(i: int) -> str:
        async with sem:
            return await one_request(c, rng, i, model)

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as c:
        return await asyncio.gather(*[bounded(i) for i in range(ROUND)])


def assert_everything_free(http: httpx.Client) -> None:
    info = wait_idle(http, timeout=60)
    state = info["internal_states"][0]
    assert state["protected_tokens"] == 0, state  # no node locked by a request that is gone
    assert state["available_tokens"] + state["evictable_tokens"] == MAX_TOTAL_TOKENS, state
    assert state["num_grammar_queue_reqs"] == 0
    assert http.get("/health").status_code == 200


def test_soak_mixed_requests_aborts_and_disconnects_leak_nothing(server, http, model_name):
    pids = [server.proc.pid, server_state(http)["scheduler_pid"]]
    outcomes = asyncio.run(soak_round(server.url, server.headers, model_name, seed=1))
    assert outcomes.count("ok") > ROUND // 3 and "disconnected" in outcomes, outcomes
    assert_everything_free(http)
    rss_before = [rss_mb(p) for p in pids]
    asyncio.run(soak_round(server.url, server.headers, model_name, seed=2))
    assert_everything_free(http)
    rss_after = [rss_mb(p) for p in pids]
    for before, after in zip(rss_before, rss_after):  # flat: a second round adds (almost) nothing
        assert after - before < max(64.0, 0.15 * before), (rss_before, rss_after)
    # the server still answers a normal request exactly
    r = http.post("/generate", json={"text": "still here", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4
