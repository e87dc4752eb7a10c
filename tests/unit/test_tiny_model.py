"""The embedded tiny model: HF-loadable, deterministic, a real tokenizer, separated logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch as safetensors_torch
import torch
import transformers

from radixserve import tiny_model
from radixserve.tiny_model import (
    TINY_MODEL_ASSETS,
    WEIGHTS_FILE,
    get_tiny_model_path,
    load_tiny_config,
    make_tiny_model,
    tiny_param_shapes,
)

SPECIALS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def hf_model(model_dir):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(TINY_MODEL_ASSETS)


# ---------------------------------------------------------------- (a) weights


def test_loads_in_transformers_with_no_missing_keys(hf_model, model_dir):
    model, info = hf_model
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.float32
    # Tied LM head: it is the embedding, not a freshly initialised matrix.
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    cfg = model.config
    assert cfg.vocab_size == 8192 and cfg.hidden_size == 256 and cfg.num_hidden_layers == 4
    assert cfg.num_attention_heads == 4 and cfg.num_key_value_heads == 2 and cfg.head_dim == 64
    assert cfg.rope_parameters["rope_theta"] == 1_000_000
    # The safetensors file holds exactly the expected names and shapes (no lm_head).
    state = safetensors_torch.load_file(str(model_dir / WEIGHTS_FILE))
    expected = tiny_param_shapes(load_tiny_config())
    assert {k: tuple(v.shape) for k, v in state.items()} == expected
    assert all(v.dtype == torch.float32 for v in state.values())
    hf_names = set(model.state_dict()) - {"lm_head.weight"}
    assert hf_names == set(expected)


def test_make_tiny_model_is_deterministic(model_dir, tmp_path):
    again = make_tiny_model(tmp_path / "again")
    assert (again / WEIGHTS_FILE).read_bytes() == (model_dir / WEIGHTS_FILE).read_bytes()
    for f in TINY_MODEL_ASSETS.iterdir():
        assert (again / f.name).read_bytes() == f.read_bytes()


def test_config_and_generation_config_agree_with_tokenizer(tokenizer):
    config = json.loads((TINY_MODEL_ASSETS / "config.json").read_text())
    gen = json.loads((TINY_MODEL_ASSETS / "generation_config.json").read_text())
    eos = [SPECIALS["<|endoftext|>"], SPECIALS["<|im_end|>"]]
    assert config["eos_token_id"] == eos and gen["eos_token_id"] == eos
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 1_000_000
    assert config["vocab_size"] == len(tokenizer) == 8192


# ---------------------------------------------------------------- (b) tokenizer


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! The scheduler admits requests.",
        "调度器通过结构化的请求处理流程来管理各种类型的请求。",
        "emoji 😀🚀👩‍👩‍👧 and accents: naïve café, Ωμέγα, Привет",
        "def forward(self, x):\n\treturn x  +  1\r\n\n   trailing spaces   ",
        "  leading space, 12345 digits, 日本語のテキスト, 한국어",
        "",
    ],
)
def test_tokenizer_round_trips(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(0 <= i < 8192 for i in ids)
    assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids(tokenizer):
    for tok, tid in SPECIALS.items():
        assert tokenizer.convert_tokens_to_ids(tok) == tid
        assert tokenizer.encode(tok, add_special_tokens=False) == [tid]
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 0
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 0
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False)
    assert ids[0] == 1 and 2 in ids
    # No BOS or other token is added by default.
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)
    # Specials are dropped on request, and the text around them is kept.
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi\n"


def test_chat_template(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "你好 😀"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n你好 😀<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt == text[: -len("<|im_start|>assistant\n")]
    # OpenAI-style content parts render as their text.
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tokenizer.apply_chat_template(parts, tokenize=False) == "<|im_start|>user\nab<|im_end|>\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(SPECIALS["<|im_start|>"]) == 3 and ids.count(SPECIALS["<|im_end|>"]) == 2


# ---------------------------------------------------------------- (c) logits


def test_logits_are_well_separated(hf_model):
    model, _ = hf_model
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, 8192, (8, 25), generator=gen)  # 200 positions
    with torch.no_grad():
        logits = model(ids).logits.float()
    top2 = logits.topk(2, dim=-1).values
    gap = (top2[..., 0] - top2[..., 1]).flatten()
    assert gap.median().item() > 0.5, gap.median()
    assert (gap < 1e-3).sum().item() <= 2, gap.sort().values[:5]
    # The model does not just echo its input token (the tied-embedding failure mode).
    assert (logits.argmax(-1) == ids).float().mean().item() < 0.1


def test_greedy_continuations_are_varied(hf_model, tokenizer):
    model, _ = hf_model
    prompts = ["The scheduler admits requests", "def forward(self, x):", "调度器通过结构化的请求", "Once upon a time"]
    outputs = []
    for p in prompts:
        x = torch.tensor([tokenizer.encode(p, add_special_tokens=False)])
        out, past = [], None
        with torch.no_grad():
            for _ in range(16):
                res = model(x, past_key_values=past, use_cache=True)
                past = res.past_key_values
                x = res.logits[:, -1:].argmax(-1)
                out.append(x.item())
        outputs.append(tuple(out))
    assert len(set(outputs)) == len(prompts)
    for out in outputs:
        assert len(set(out)) >= 4, out


# ---------------------------------------------------------------- (d) cache


def test_get_tiny_model_path_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))
    first = get_tiny_model_path()
    assert first.parent == tmp_path and first.name.startswith("tiny_qwen3-")
    weights = first / WEIGHTS_FILE
    stat = weights.stat()

    def fail(*args, **kwargs):
        raise AssertionError("the cached model was rebuilt")

    monkeypatch.setattr(tiny_model, "make_tiny_model", fail)
    second = get_tiny_model_path()
    assert second == first
    assert (weights.stat().st_mtime_ns, weights.stat().st_ino) == (stat.st_mtime_ns, stat.st_ino)
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]  # no temp dirs left


def test_get_tiny_model_path_lost_race(tmp_path, monkeypatch):
    """Another process renames its copy into place first: ours is dropped, theirs is used."""
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))
    final = tmp_path / f"tiny_qwen3-{tiny_model.tiny_model_fingerprint()}"
    real_make = tiny_model.make_tiny_model

    def make_while_other_process_wins(out_dir):
        real_make(final)  # the "other process" finishes first
        (final / "winner").write_text("x")
        return real_make(out_dir)

    monkeypatch.setattr(tiny_model, "make_tiny_model", make_while_other_process_wins)
    assert get_tiny_model_path() == final
    assert (final / "winner").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name]
