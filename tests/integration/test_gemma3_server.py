"""The real Gemma 3 270M (Q4_K_M GGUF, float32) through a real server with the SWA pool
(issue 42): the file carries no chat template, so /v1/chat/completions uses Gemma's turn format
(the fallback for a tokenizer with <start_of_turn> / <end_of_turn> and no template): the chat
answer is /generate's on the ids that format gives, and /get_server_info shows both pools."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import transformers

from conftest import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from real_model import QUESTIONS, gemma3_gguf  # noqa: E402

FULL_SLOTS, SWA_SLOTS = 4096, 2048


@pytest.fixture(scope="module")
def gemma3_server():
    srv = ServerProcess("--model-path", str(gemma3_gguf()), "--dtype", "float32", "--max-total-tokens", str(FULL_SLOTS),
                        "--chunked-prefill-size", "256", "--enable-hybrid-swa-memory",
                        "--swa-full-tokens-ratio", str(SWA_SLOTS / FULL_SLOTS))
    yield srv
    srv.stop()


def test_server_info_shows_both_pools(gemma3_server):
    with gemma3_server.client() as c:
        st = c.get("/get_server_info").json()["internal_states"][0]
    assert st["max_total_num_tokens"] == FULL_SLOTS and st["swa_max_total_num_tokens"] == SWA_SLOTS
    assert st["sliding_window_size"] == 512 and st["swa_available_tokens"] + st["swa_evictable_tokens"] == SWA_SLOTS


def test_chat_without_a_template_in_the_file_uses_gemma_turns(gemma3_server):
    path = gemma3_gguf()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert not tok.chat_template  # the premise: the file has none
    ids = tok.encode(f"<bos><start_of_turn>user\n{QUESTIONS[0]}<end_of_turn>\n<start_of_turn>model\n",
                     add_special_tokens=False)
    with gemma3_server.client() as c:
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": QUESTIONS[0]}],
                                                    "max_tokens": 12, "temperature": 0})
        assert chat.status_code == 200, chat.text
        gen = c.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
        assert gen.status_code == 200, gen.text
    body = chat.json()
    assert body["usage"]["prompt_tokens"] == len(ids)
    # the same ids, so the same greedy answer (the 270M base model's, not necessarily a good one)
    assert body["choices"][0]["message"]["content"] in (gen.json()["text"], gen.json()["text"].strip())
