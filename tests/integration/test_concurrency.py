"""64 concurrent streaming requests with shared prefixes: greedy outputs equal the offline
Engine's, and the repeated prefixes come from the radix cache."""

from __future__ import annotations

import asyncio
import json

import httpx

from conftest import MAX_TOTAL_TOKENS, wait_idle

PREFIXES = [
    "You are a helpful assistant. Answer the question briefly and precisely, please. ",
    "The following is a conversation between a user and a very knowledgeable librarian. ",
    "Translate the next sentence into French, keeping the tone and the punctuation: ",
    "Write a haiku about the sea, the wind, the salt and the slow passing of the tides: ",
]
MAX_NEW = 8


def prompts():
    return [f"{PREFIXES[i % 4]}Question number {i}: what is {i} plus {i}?" for i in range(64)]


async def stream_one(client: httpx.AsyncClient, text: str) -> dict:
    body = {"text": text, "stream": True, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}
    last = None
    async with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
    return last


async def run_all(url: str, texts: list) -> list:
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=url, timeout=180, limits=limits) as client:
        return await asyncio.gather(*[stream_one(client, t) for t in texts])


def test_64_concurrent_streams_match_offline_engine(server, http):
    from radixserve.engine import Engine

    texts = prompts()
    # one request per prefix first, so the 64 that follow find their prefix in the tree
    for p in PREFIXES:
        http.post("/generate", json={"text": p, "sampling_params": {"max_new_tokens": 1}})
    outs = asyncio.run(run_all(server.url, texts))
    assert all(o["meta_info"]["finish_reason"]["type"] in ("length", "stop") for o in outs)
    hits = [o["meta_info"]["cached_tokens"] for o in outs]
    assert sum(1 for h in hits if h > 0) >= 60, hits

    engine = Engine(max_total_tokens=MAX_TOTAL_TOKENS)
    ref = engine.generate(texts, {"max_new_tokens": MAX_NEW, "temperature": 0}, progress=False)
    mismatched = [i for i, (o, r) in enumerate(zip(outs, ref)) if o["output_ids"] != r["output_ids"]]
    assert not mismatched, [(outs[i]["output_ids"], ref[i]["output_ids"]) for i in mismatched]
    assert [o["text"] for o in outs] == [r["text"] for r in ref]
    wait_idle(http)
