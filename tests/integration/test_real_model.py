"""The real SmolLM2-135M-Instruct (Q4_1 GGUF, float32) through a real server: the chat answer
names Paris and is the offline Engine's; 6 chat prompts sent at once give what each gives alone;
the chosen tokens' logprobs are transformers' (log_softmax of its logits, same file); and a
safetensors directory made from the GGUF loads into an Engine that generates the same tokens."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import gguf  # noqa: F401 - the GGUF reader: missing is a failure, not a skip
import httpx
import pytest
import torch

from conftest import serve_until_done, start_float32_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from real_model import NEAR_TIE, QUESTIONS, chat_prompt_ids, hf_from_gguf, smollm2_gguf, smollm2_hf_dir  # noqa: E402

FRANCE = QUESTIONS[0]
BATCH_QUESTIONS = [
    FRANCE,
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Give me one tip for staying focused while studying for a long exam.",
    "What is 12 plus 7?",
    "Translate 'good morning' into Spanish.",
]
MAX_NEW = 16
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="module", autouse=True)
def _server_start(gguf_path):
    """Start the server first (wait=False): it loads while this process loads its own models."""
    return start_float32_server(gguf_path, 4096)


@pytest.fixture(scope="module")
def real_server(_server_start):
    yield from serve_until_done(_server_start)


@pytest.fixture(scope="module")
def engine(gguf_path):
    from radixserve.engine import Engine

    eng = Engine(model_path=str(gguf_path), dtype="float32", max_total_tokens=4096)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf(gguf_path):
    return hf_from_gguf(gguf_path)


def chat_body(question: str, max_tokens: int = MAX_NEW) -> dict:
    return {"messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": max_tokens,
            "logprobs": True, "top_logprobs": 2}


def engine_greedy(eng, questions, max_new: int = MAX_NEW):
    prompts = [chat_prompt_ids(eng.tokenizer, q) for q in questions]
    sp = {"max_new_tokens": max_new, "temperature": 0}
    outs = eng.generate(input_ids=prompts, sampling_params=[sp] * len(prompts), return_logprob=True,
                        top_logprobs_num=2, return_text_in_logprobs=True, progress=False)
    return prompts, outs


def served_tokens(choice: dict):
    """[(token text, logprob, [top-2 logprobs])] of one chat choice."""
    return [(e["token"], e["logprob"], [t["logprob"] for t in e["top_logprobs"]]) for e in choice["logprobs"]["content"]]


def engine_tokens(out: dict):
    meta = out["meta_info"]
    return [(s, lp, [t[0] for t in top]) for (lp, _, s), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"])]


def assert_same_greedy(got, ref, what: str) -> None:
    """Token sequences ([(text, logprob, top2)]) equal, except after a position where the
    reference's top two logprobs are within NEAR_TIE (a near-tie may flip)."""
    for k, (x, y) in enumerate(zip(got, ref)):
        if x[0] != y[0]:
            gap = y[2][0] - y[2][1]
            assert gap < NEAR_TIE, f"{what}: diverged at token {k} ({x[0]!r} vs {y[0]!r}) with logprob gap {gap}"
            return
        assert abs(x[1] - y[1]) < LOGPROB_TOL, f"{what}: token {k} logprob {x[1]} vs {y[1]}"
    assert len(got) == len(ref), f"{what}: {len(got)} tokens vs {len(ref)}"


@pytest.fixture(scope="module")
def engine_outs(engine):
    """The GGUF-loaded Engine's greedy answers to QUESTIONS (FRANCE first), batched."""
    return engine_greedy(engine, QUESTIONS)


@pytest.fixture(scope="module")
def france(engine_outs, hf, real_server):  # hf: loads while the server starts
    with real_server.client() as c:
        r = c.post("/v1/chat/completions", json=chat_body(FRANCE))
    assert r.status_code == 200, r.text
    prompts, outs = engine_outs
    return r.json()["choices"][0], prompts[0], outs[0]


def test_served_chat_names_paris_and_equals_engine(france):
    choice, _, out = france
    assert "Paris" in choice["message"]["content"]
    assert "Paris" in out["text"]
    assert_same_greedy(served_tokens(choice), engine_tokens(out), "server vs Engine")


def test_logprobs_match_transformers(france, hf):
    """The chosen tokens' logprobs (Engine's and the server's) are log_softmax of transformers'
    logits on the same tokens, teacher-forced, in float32."""
    choice, prompt, out = france
    ids = out["output_ids"]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
    ref = torch.log_softmax(logits, -1)[torch.arange(len(ids)), torch.tensor(ids)].tolist()
    ours = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert len(ours) == len(ids) >= 4
    diff = max(abs(a - b) for a, b in zip(ours, ref))
    assert diff < LOGPROB_TOL, f"Engine vs transformers: max |logprob diff| {diff}"
    # The server's tokens are the Engine's (test_served_chat_names_paris_and_equals_engine), or
    # differ first at a near-tie: its logprobs are transformers' up to there, and there its top two
    # are transformers' top two on the same context, within NEAR_TIE of each other.
    served = served_tokens(choice)
    served_text = [t for t, _, _ in served]
    engine_text = [s for _, _, s in out["meta_info"]["output_token_logprobs"]]
    k = 0
    while k < min(len(served_text), len(engine_text)) and served_text[k] == engine_text[k]:
        k += 1
    assert k >= 1, f"the server's first token {served_text[:1]} is not the Engine's {engine_text[:1]}"
    diff = max(abs(x[1] - b) for x, b in zip(served[:k], ref[:k]))
    assert diff < LOGPROB_TOL, f"server vs transformers: max |logprob diff| {diff} over its first {k} tokens"
    if served_text != engine_text:
        assert k < len(ids), f"the server answered {len(served_text)} tokens where the Engine's {len(ids)} ended"
        top2 = torch.log_softmax(logits[k], -1).topk(2).values.tolist()
        assert max(abs(a - b) for a, b in zip(served[k][2], top2)) < LOGPROB_TOL, (k, served[k][2], top2)
        assert top2[0] - top2[1] < NEAR_TIE, f"server and Engine diverged at token {k} with logprob gap {top2[0] - top2[1]}"


async def _chat_all(url: str, questions) -> list:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        rs = await asyncio.gather(*[client.post("/v1/chat/completions", json=chat_body(q)) for q in questions])
    for r in rs:
        assert r.status_code == 200, r.text
    return [r.json()["choices"][0] for r in rs]


def test_batched_chat_equals_alone(real_server):
    with real_server.client() as c:
        alone = []
        for q in BATCH_QUESTIONS:
            r = c.post("/v1/chat/completions", json=chat_body(q))
            assert r.status_code == 200, r.text
            alone.append(r.json()["choices"][0])
    together = asyncio.run(_chat_all(real_server.url, BATCH_QUESTIONS))
    for i, (got, ref) in enumerate(zip(together, alone)):
        assert_same_greedy(served_tokens(got), served_tokens(ref), f"prompt {i} batched vs alone")
    assert len({ch["message"]["content"] for ch in alone}) == len(BATCH_QUESTIONS)  # real, different answers


def test_safetensors_dir_from_gguf_equals_gguf(gguf_path, engine_outs, hf):
    """config.json + model.safetensors + tokenizer written from transformers' reading of the
    GGUF: an Engine on that directory generates what the GGUF-loaded Engine generates."""
    from radixserve.engine import Engine

    hf_dir = smollm2_hf_dir(gguf_path, hf)
    prompts, ref = engine_outs
    other = Engine(model_path=str(hf_dir), dtype="float32", max_total_tokens=2048)
    try:
        assert other.scheduler.model_config.gguf_file is None
        prompts2, got = engine_greedy(other, QUESTIONS)
    finally:
        other.shutdown()
    assert prompts2 == prompts  # the saved tokenizer and chat template are the GGUF's
    for i, (a, b) in enumerate(zip(got, ref)):
        assert_same_greedy(engine_tokens(a), engine_tokens(b), f"prompt {i} safetensors vs gguf")
