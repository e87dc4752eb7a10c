"""Issue 57: `radixserve serve --null-worker` serves requests end to end with no model forward.
The worker returns the tokens it is told to (--null-worker-token-ids: the token after a sequence
of p tokens is ids[p % len(ids)]); they must arrive, as ids and as text, through /generate
(streaming and not) and the OpenAI routes, through the real HTTP server, tokenizer manager,
scheduler and detokenizer processes."""

from __future__ import annotations

import json
import signal
from typing import List

import pytest

from conftest import ServerProcess

TOKEN_IDS = [300, 301, 302, 303, 304]


def expected_ids(prompt_len: int, n: int) -> List[int]:
    return [TOKEN_IDS[(prompt_len + k) % len(TOKEN_IDS)] for k in range(n)]


@pytest.fixture(scope="module")
def null_server():
    srv = ServerProcess("--null-worker", "--null-worker-token-ids", ",".join(map(str, TOKEN_IDS)))
    yield srv
    srv.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def tokenizer():
    from radixserve.hf_transformers_utils import get_tokenizer
    from radixserve.server_args import ServerArgs

    return get_tokenizer(ServerArgs())


def test_generate_returns_the_tokens_it_is_told(null_server, tokenizer):
    prompt = [11, 12, 13, 14, 15, 16, 17]
    want = expected_ids(len(prompt), 9)
    with null_server.client() as c:
        r = c.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 9}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == want
    assert out["text"] == tokenizer.decode(want)
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_generate_streaming_delivers_every_token(null_server, tokenizer):
    prompt = [21, 22, 23]
    want = expected_ids(len(prompt), 40)
    chunks = []
    with null_server.client() as c:
        with c.stream("POST", "/generate", json={"input_ids": prompt, "stream": True,
                                                  "sampling_params": {"max_new_tokens": 40}}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[len("data: "):]))
    assert len(chunks) > 1  # streamed, not one final answer
    assert chunks[-1]["output_ids"] == want  # cumulative, as SGLang's /generate
    assert chunks[-1]["text"] == tokenizer.decode(want)


def test_logprobs_are_those_of_one_hot_logits(null_server):
    prompt = [31, 32]
    with null_server.client() as c:
        r = c.post("/generate", json={"input_ids": prompt, "return_logprob": True, "top_logprobs_num": 2,
                                      "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert [t[1] for t in meta["output_token_logprobs"]] == expected_ids(len(prompt), 4)
    assert [t[0] for t in meta["output_token_logprobs"]] == [0.0] * 4
    assert [top[0][1] for top in meta["output_top_logprobs"]] == expected_ids(len(prompt), 4)


def test_openai_completions_and_chat(null_server, tokenizer):
    import openai

    client = openai.OpenAI(base_url=null_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    prompt = [41, 42, 43, 44]
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=12, stream=True)
    text = "".join(chunk.choices[0].text for chunk in stream)
    assert text == tokenizer.decode(expected_ids(len(prompt), 12))

    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6)
    want = expected_ids(chat.usage.prompt_tokens, 6)
    assert chat.usage.completion_tokens == 6
    assert chat.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)


def test_token_ids_flag_is_checked():
    from types import SimpleNamespace

    from radixserve.server_args import ServerArgs
    from radixserve.sim.null_worker import parse_token_ids

    with pytest.raises(ValueError, match="--null-worker-token-ids needs --null-worker"):
        ServerArgs(null_worker_token_ids="1,2")
    config = SimpleNamespace(vocab_size=10, eos_token_ids=[9])
    with pytest.raises(ValueError, match="comma-separated integers"):
        parse_token_ids("1,x", config)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        parse_token_ids("1,10", config)
    assert parse_token_ids(None, config) == [8]  # the largest id that is not EOS
