"""A real `radixserve serve --is-embedding` subprocess (the tiny model): the official openai
client's embeddings.create (float and base64) and POST /encode answer transformers' pooled
hidden states (last token, normalized: the model directory has no modules.json); a shared
prefix hits the cache; the errors are 400s with clear messages, both ways between an embedding
and a generation server; /server_info and /get_model_info say which kind it is."""

from __future__ import annotations

import base64
from typing import List

import numpy as np
import openai
import pytest
import torch
import transformers
from conftest import ServerProcess

TOL = 1e-4


@pytest.fixture(scope="module")
def emb_server():
    srv = ServerProcess("--is-embedding", "--dtype", "float32", "--max-total-tokens", "4000")
    yield srv
    assert srv.stop() == 0, srv.read_log()[-3000:]


@pytest.fixture(scope="module")
def emb_http(emb_server):
    with emb_server.client() as c:
        yield c


@pytest.fixture(scope="module")
def emb_client(emb_server):
    return openai.OpenAI(base_url=emb_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf_reference(emb_http):
    """transformers on the very directory the server loaded: ids -> last token, normalized."""
    model_path = emb_http.get("/get_model_info").json()["model_path"]
    model = transformers.AutoModel.from_pretrained(model_path, dtype=torch.float32).eval()

    def embed(ids: List[int]) -> np.ndarray:
        with torch.no_grad():
            h = model(torch.tensor([ids])).last_hidden_state[0, -1].float()
        return torch.nn.functional.normalize(h, dim=-1).numpy()

    return embed


def token_ids(http, text: str) -> List[int]:
    return http.post("/tokenize", json={"prompt": text}).json()["tokens"]


TEXTS = ["The quick brown fox jumps over the lazy dog.", "Embeddings map text to vectors.", "hi"]


def test_openai_client_float_and_base64_match_transformers(emb_client, emb_http, hf_reference):
    refs = [hf_reference(token_ids(emb_http, t)) for t in TEXTS]
    as_float = emb_client.embeddings.create(model="radixserve-tiny-qwen3", input=TEXTS, encoding_format="float")
    as_b64 = emb_client.embeddings.create(model="radixserve-tiny-qwen3", input=TEXTS)  # the client asks base64
    for resp in (as_float, as_b64):
        assert [d.index for d in resp.data] == [0, 1, 2]
        for d, ref in zip(resp.data, refs):
            assert np.abs(np.asarray(d.embedding) - ref).max() < TOL
        assert resp.usage.prompt_tokens == sum(len(token_ids(emb_http, t)) for t in TEXTS)
        assert resp.usage.total_tokens == resp.usage.prompt_tokens
        assert resp.model == "radixserve-tiny-qwen3"
    raw = emb_http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert raw["object"] == "list" and raw["data"][0]["object"] == "embedding"
    assert np.abs(decoded - refs[0]).max() < TOL


def test_token_id_inputs(emb_client, emb_http, hf_reference):
    ids = [token_ids(emb_http, t) for t in TEXTS]
    one = emb_client.embeddings.create(model="radixserve-tiny-qwen3", input=ids[0], encoding_format="float")
    many = emb_client.embeddings.create(model="radixserve-tiny-qwen3", input=ids, encoding_format="float")
    assert len(one.data) == 1 and np.abs(np.asarray(one.data[0].embedding) - hf_reference(ids[0])).max() < TOL
    for d, p in zip(many.data, ids):
        assert np.abs(np.asarray(d.embedding) - hf_reference(p)).max() < TOL
    same = emb_client.embeddings.create(model="radixserve-tiny-qwen3", input="hi", dimensions=256, encoding_format="float")
    assert len(same.data[0].embedding) == 256  # the hidden size itself is accepted


def test_encode_native_route(emb_http, hf_reference):
    ids = token_ids(emb_http, TEXTS[0])
    r = emb_http.post("/encode", json={"text": TEXTS[0], "rid": "enc-1"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert np.abs(np.asarray(out["embedding"]) - hf_reference(ids)).max() < TOL
    meta = out["meta_info"]
    assert meta["id"] == "enc-1" and meta["prompt_tokens"] == len(ids)
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    batch = emb_http.post("/encode", json={"input_ids": [ids, ids[:3]]}).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert np.abs(np.asarray(batch[1]["embedding"]) - hf_reference(ids[:3])).max() < TOL


def test_a_shared_prefix_hits_the_cache(emb_http):
    prefix = "You are a retrieval system. Represent this passage for searching relevant documents: "
    first = emb_http.post("/encode", json={"text": prefix + "cats purr."}).json()
    second = emb_http.post("/encode", json={"text": prefix + "dogs bark loudly."}).json()
    shared = len(token_ids(emb_http, prefix)) - 1  # the last prefix token may merge with what follows
    assert second["meta_info"]["cached_tokens"] >= shared > 0
    assert first["meta_info"]["cached_tokens"] < shared


@pytest.mark.parametrize("body, message", [
    ({"input": ""}, "Input cannot be empty or whitespace only."),
    ({"input": "   "}, "Input cannot be empty or whitespace only."),
    ({"input": []}, "Input cannot be empty."),
    ({"input": [[1, 2], []]}, "Input at index 1 cannot be empty."),
    ({"input": ["ok", ""]}, "Input at index 1 cannot be empty or whitespace only."),
    ({"input": "hi", "dimensions": 64}, "dimensions=64 is not supported"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": [1, 99999]}, "Input token ids must be in [0, 8192)."),
])
def test_v1_embeddings_errors(emb_http, body, message):
    r = emb_http.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["code"] == 400


def test_unknown_model_is_404(emb_client):
    with pytest.raises(openai.NotFoundError):
        emb_client.embeddings.create(model="no-such-model", input="hi")


def test_openai_client_sees_a_400(emb_client):
    with pytest.raises(openai.BadRequestError, match="dimensions=8 is not supported"):
        emb_client.embeddings.create(model="radixserve-tiny-qwen3", input="hi", dimensions=8)


def test_encode_errors(emb_http):
    for body, message in [({"text": ""}, "The input is empty"), ({"input_ids": []}, "The input is empty"),
                          ({}, "Either text or input_ids")]:
        r = emb_http.post("/encode", json=body)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("path, body", [
    ("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 4}}),
    ("/v1/completions", {"model": "radixserve-tiny-qwen3", "prompt": "Hello", "max_tokens": 4}),
    ("/v1/chat/completions", {"model": "radixserve-tiny-qwen3", "messages": [{"role": "user", "content": "Hello"}]}),
])
def test_an_embedding_server_does_not_generate(emb_http, path, body):
    r = emb_http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert "serves an embedding model (--is-embedding): use /encode or /v1/embeddings" in r.json()["error"]["message"]


def test_an_embedding_server_says_so_and_stays_healthy(emb_http):
    assert emb_http.get("/server_info").json()["is_embedding"] is True
    assert emb_http.get("/get_model_info").json()["is_generation"] is False
    assert emb_http.get("/health_generate").status_code == 200  # an embedding, not a generation
    assert emb_http.get("/get_server_info").json()["tokenizer_manager"]["num_pending_reqs"] == 0


# ---- the generation server (conftest's session server) ----------------------------------------------
@pytest.mark.parametrize("path, body", [("/encode", {"text": "Hello"}), ("/v1/embeddings", {"input": "Hello"})])
def test_a_generation_server_answers_embedding_requests_with_400(http, path, body):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert "embedding requests need a server started with --is-embedding" in r.json()["error"]["message"]
    info = http.get("/server_info").json()
    assert info["is_embedding"] is False and http.get("/get_model_info").json()["is_generation"] is True
