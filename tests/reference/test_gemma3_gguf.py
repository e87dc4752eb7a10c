"""The real Gemma 3 270M (Q4_K_M GGUF from four PyPI wheels, cached under $RADIXSERVE_TEST_CACHE:
tests/real_model.py's gemma3_gguf) served with --dtype float32 (the file dequantized: the exact
path) against transformers float32 reading the same file: 12 chat prompts, greedy, the same
tokens and logprobs within 1e-3, two of them longer than the file's 512-token window (the
local layers must really drop the keys before it: with the window off, the first of those
differs at its first token, by a logit gap of 1.0)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List

import torch

from radixserve.engine import Engine
from radixserve.model_executor.gguf_loader import hf_name
from radixserve.models.model_config import ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from real_model import AGREEMENT_QUESTIONS, NEAR_TIE, QUESTIONS, gemma3_gguf, hf_dir_from_gguf  # noqa: E402
from hf_utils import load_hf  # noqa: E402

LOGPROB_TOL = 1e-3
WINDOW = 512
END_OF_TURN = 106  # <end_of_turn>: the file's EOS is <eos> only; a chat turn ends here
# The file has no chat template: Gemma 3's turn format (its tokenizer_config's template, text only).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _long_question(k: int) -> str:
    """~600 tokens: the question list rotated by k, then which one to answer."""
    qs = AGREEMENT_QUESTIONS[k:] + AGREEMENT_QUESTIONS[:k]
    return "Here is a list of questions:\n" + "\n".join(qs) + "\nAnswer only the first question of the list."


def _prompts(tok) -> List[List[int]]:
    questions = QUESTIONS + AGREEMENT_QUESTIONS[1:8] + [_long_question(k) for k in (0, 23)]
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True,
                                     chat_template=GEMMA3_CHAT_TEMPLATE) for q in questions]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def test_gemma3_gguf_config_and_names():
    config = ModelConfig.from_pretrained(str(gemma3_gguf()))
    assert config.architecture == "Gemma3ForCausalLM" and config.sliding_window == WINDOW
    assert config.window_layers == [(i + 1) % 6 != 0 for i in range(18)]  # layers 5, 11, 17 global
    assert config.rope_theta == 1e6 and config.hf_config["rope_local_base_freq"] == 10000.0
    assert config.hf_config["query_pre_attn_scalar"] == 256 and config.tie_word_embeddings
    assert config.eos_token_ids == [1, END_OF_TURN]  # <eos>, and the end of a chat turn
    assert hf_name("blk.3.ffn_norm.weight", "gemma3") == "model.layers.3.pre_feedforward_layernorm.weight"
    assert hf_name("blk.3.post_attention_norm.weight", "gemma3") == "model.layers.3.post_attention_layernorm.weight"
    assert hf_name("blk.3.post_ffw_norm.weight", "gemma3") == "model.layers.3.post_feedforward_layernorm.weight"
    assert hf_name("blk.3.ffn_norm.weight", "llama") == "model.layers.3.post_attention_layernorm.weight"


def test_gemma3_gguf_matches_transformers():
    path = gemma3_gguf()
    engine = Engine(model_path=str(path), dtype="float32", max_total_tokens=8192)
    try:
        tok = engine.tokenizer
        prompts = _prompts(tok)
        assert sum(len(p) > WINDOW + 32 for p in prompts) == 2, [len(p) for p in prompts]
        sp = {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [END_OF_TURN]}
        ours = engine.generate(input_ids=prompts, sampling_params=[sp] * len(prompts), return_logprob=True,
                               progress=False)
    finally:
        engine.shutdown()

    hf = load_hf(str(hf_dir_from_gguf(path)))  # transformers' reading of the file, saved once (reading it: ~1 min)
    worst = 0.0
    for i, (prompt, got) in enumerate(zip(prompts, ours)):
        ids = got["output_ids"]
        with torch.no_grad():  # transformers' logits along our answer: its greedy choice at each step
            logits = hf(torch.tensor([prompt + ids]), logits_to_keep=len(ids) + 1).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, -1)
        for k, token in enumerate(ids):
            top2 = logprobs[k].topk(2)
            if int(top2.indices[0]) != token:  # only a near tie may flip between two float32 runs
                gap = (top2.values[0] - top2.values[1]).item()
                assert gap < NEAR_TIE, f"prompt {i} ({len(prompt)} tokens): token {k} differs, logit gap {gap:.2e}"
                break
            err = abs(got["meta_info"]["output_token_logprobs"][k][0] - logprobs[k, token].item())
            worst = max(worst, err)
            assert err < LOGPROB_TOL, f"prompt {i} ({len(prompt)} tokens): token {k} logprob off by {err:.2e}"
    print(f"max |logprob error| {worst:.2e}")


def test_gemma3_gguf_swa_pool_serves_as_one_pool():
    """--enable-hybrid-swa-memory on the real file: the 15 local layers keep a SWA pool of a few
    windows while the 3 global ones keep every token. The same tokens and logprobs (within 1e-3)
    as one pool (held against transformers above), through chunked prefill, and again with a prefix
    hit beyond the window (each long prompt asked again with a new last question)."""
    path = gemma3_gguf()
    sp = {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [END_OF_TURN]}
    chunk, swa_slots, full_slots = 128, 4 * WINDOW, 8192
    results = {}
    for swa in (False, True):
        engine = Engine(model_path=str(path), dtype="float32", max_total_tokens=full_slots, chunked_prefill_size=chunk,
                        enable_hybrid_swa_memory=swa, swa_full_tokens_ratio=swa_slots / full_slots,
                        test_check_memory=True)
        try:
            tok = engine.tokenizer
            prompts = [p for p in _prompts(tok) if len(p) > WINDOW + 32] + _prompts(tok)[:2]
            again = [p[:-6] + tok.encode(" Answer the second one.", add_special_tokens=False) + p[-6:]
                     for p in prompts[:2]]
            first = engine.generate(input_ids=prompts, sampling_params=[sp] * len(prompts), return_logprob=True,
                                    progress=False)
            second = engine.generate(input_ids=again, sampling_params=[sp] * 2, return_logprob=True, progress=False)
            if swa:
                info = engine.scheduler.internal_state()
                assert info["swa_max_total_num_tokens"] == swa_slots and info["max_total_num_tokens"] == full_slots
                assert min(o["meta_info"]["cached_tokens"] for o in second) > WINDOW  # hits past the window
            engine.scheduler.check_memory()
        finally:
            engine.shutdown()
        results[swa] = first + second
    for i, (one, two) in enumerate(zip(results[False], results[True])):
        assert one["output_ids"] == two["output_ids"], f"request {i}"
        a = torch.tensor([v for v, _, _ in one["meta_info"]["output_token_logprobs"]])
        b = torch.tensor([v for v, _, _ in two["meta_info"]["output_token_logprobs"]])
        assert (a - b).abs().max().item() < LOGPROB_TOL, f"request {i}"
