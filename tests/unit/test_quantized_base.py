"""Issue 38, item 6: LoRA and speculative decoding on quantized weights.

The reference is the same model with the dequantized weights (--quantization none on the same
GGUF; for w8a8_int8, the checkpoint with every linear weight rounded through Q8_0 written as a
float safetensors directory). With the C++ kernel off (the torch fallback: the blocks dequantized
a tile at a time, multiplied in float32) the blocks are those weights exactly, so greedy tokens and
logprobs must agree to float32 error:

- LoRA adapters on a GGUF base kept in its blocks, and on a --quantization w8a8_int8 base
  (every layer, the fused q|k|v and gate|up ones included, a LoRA target);
- a STANDALONE draft that is itself a GGUF kept in blocks, over a GGUF target kept in blocks;
  an HF-directory draft under a --quantization gguf target (the draft's loader must not be given
  the target's `gguf`, which refuses a directory);
- an EAGLE head over a GGUF target kept in blocks (the head shares its embedding and LM head);
- NGRAM drafts over a GGUF target kept in blocks;
- with the C++ integer kernel on (8-bit activations): speculation on gives the tokens of
  speculation off on the same quantized target (the verify batch and decode take the same
  per-row kernel)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import List, Optional

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

import radixserve.layers.quantization.gguf as quant_gguf
from radixserve.engine import Engine
from radixserve.layers.linear import LinearBase
from radixserve.layers.quantization import GGUFLinearMethod
from radixserve.layers.quantization.w8a8_int8 import quantize_q8_0
from radixserve.speculative.standalone_worker import draft_quantization
from radixserve.tiny_model import get_tiny_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # eagle_head
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
from lora_utils import write_adapter  # noqa: E402
from test_gguf import write_synthetic  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GGUF_KW = dict(dtype="float32", skip_tokenizer_init=True, max_total_tokens=1024, disable_overlap_schedule=True)
PROMPTS = [[5, 17, 250, 3, 99, 42], [7, 8, 9, 7, 8, 9, 7, 8], [300, 1, 44, 12]]
SAMPLING = {"max_new_tokens": 8, "temperature": 0}


@pytest.fixture
def torch_fallback(monkeypatch):
    """GGUFLinearMethod without the C++ kernel: the blocks are the dequantized weights exactly."""
    monkeypatch.setattr(quant_gguf, "kernel_types", lambda: frozenset())


def greedy(engine: Engine, prompts=PROMPTS, lora: Optional[str] = None, loras: Optional[list] = None) -> List[dict]:
    if lora is not None:
        loras = [lora] * len(prompts)
    return engine.generate(input_ids=prompts, sampling_params=dict(SAMPLING), return_logprob=True, lora_path=loras,
                           progress=False)


def generate_text(engine: Engine, prompts: List[str], lora: Optional[str] = None) -> List[dict]:
    return engine.generate(prompts, dict(SAMPLING), return_logprob=True,
                           lora_path=[lora] * len(prompts) if lora else None, progress=False)


def logprobs(out: dict) -> torch.Tensor:
    return torch.tensor([v for v, _, _ in out["meta_info"]["output_token_logprobs"]])


def assert_same(got: List[dict], want: List[dict], what: str, atol: float = 1e-4) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert g["output_ids"] == w["output_ids"], f"{what}, prompt {i}"
        assert torch.allclose(logprobs(g), logprobs(w), atol=atol, rtol=0), f"{what}, prompt {i}"


def model_of(engine: Engine):
    return engine.scheduler.tp_worker.model_runner.model


def quantized_layers(model) -> List[LinearBase]:
    return [m for m in model.modules() if isinstance(m, LinearBase) and isinstance(m.quant_method, GGUFLinearMethod)]


# ---- LoRA ---------------------------------------------------------------------------------------


def test_lora_on_gguf_blocks_matches_the_dequantized_base(tmp_path, torch_fallback):
    path = tmp_path / "m.gguf"
    hf = write_synthetic("qwen2", path)
    adapter = write_adapter(tmp_path / "ad", 8, 16.0, TARGETS, hf.state_dict(), seed=1)
    kw = dict(GGUF_KW, lora_paths=[f"ad={adapter}"])
    with Engine(str(path), quantization="none", **kw) as engine:
        want_base, want_lora = greedy(engine), greedy(engine, lora="ad")
    assert any(b["output_ids"] != a["output_ids"] for b, a in zip(want_base, want_lora))  # the adapter matters
    with Engine(str(path), quantization="gguf", **kw) as engine:
        layers = quantized_layers(model_of(engine))
        assert len(layers) == 2 * 4 and all(m.lora is not None for m in layers)  # blocks, with the LoRA delta
        mixed = greedy(engine, prompts=PROMPTS * 2, loras=[None] * len(PROMPTS) + ["ad"] * len(PROMPTS))
        assert_same(mixed[: len(PROMPTS)], want_base, "base on blocks, batched with the adapter")
        assert_same(mixed[len(PROMPTS):], want_lora, "LoRA on blocks, batched with the base")


def write_q8_0_roundtrip(src: Path, dst: Path) -> Path:
    """src's HF directory with every decoder linear weight rounded through Q8_0 (what
    --quantization w8a8_int8 holds), in float32: the dequantized reference."""
    shutil.copytree(src, dst)
    weights = load_file(str(src / "model.safetensors"))
    for name, w in weights.items():
        if w.dim() == 2 and any(f".{t}.weight" in name for t in TARGETS):
            weights[name] = torch.from_numpy(gguf.quants.dequantize(quantize_q8_0(w).numpy(), Q.Q8_0)).reshape(w.shape)
    save_file(weights, str(dst / "model.safetensors"))
    return dst


def test_lora_on_w8a8_int8_base_matches_the_dequantized_base(tmp_path, torch_fallback):
    tiny = get_tiny_model_path()
    adapter = write_adapter(tmp_path / "ad", 8, 16.0, TARGETS, load_file(str(tiny / "model.safetensors")), seed=2)
    ref_dir = write_q8_0_roundtrip(tiny, tmp_path / "q8_0")
    kw = dict(dtype="float32", max_total_tokens=2048, lora_paths=[f"ad={adapter}"])
    prompts = ["The quick brown fox", "1 2 3 4 5 1 2 3", "Hello, my name is"]
    with Engine(str(ref_dir), **kw) as engine:
        want_base, want_lora = generate_text(engine, prompts), generate_text(engine, prompts, "ad")
    with Engine(str(tiny), **kw) as engine:
        plain = generate_text(engine, prompts)
    assert any(p["output_ids"] != w["output_ids"] for p, w in zip(plain, want_base))  # Q8_0 rounding shows
    with Engine(str(tiny), quantization="w8a8_int8", **kw) as engine:
        layers = quantized_layers(model_of(engine))
        assert len(layers) == 4 * 4 and all(m.lora is not None for m in layers)
        assert_same(generate_text(engine, prompts), want_base, "w8a8 base")
        assert_same(generate_text(engine, prompts, "ad"), want_lora, "LoRA on w8a8")


# ---- speculative decoding -----------------------------------------------------------------------


@pytest.fixture
def gguf_pair(tmp_path):
    """(target GGUF, a different model's GGUF of the same vocabulary, the target's dequantized
    weights as an HF directory, the target's greedy outputs on its dequantized weights)."""
    target, other = tmp_path / "target.gguf", tmp_path / "other.gguf"
    hf = write_synthetic("qwen2", target, seed=0)
    write_synthetic("qwen2", other, seed=1)
    hf_dir = tmp_path / "target_hf"
    hf.save_pretrained(str(hf_dir))
    return target, other, hf_dir


def reference(path: Path) -> List[dict]:
    with Engine(str(path), quantization="none", **GGUF_KW) as engine:
        return greedy(engine)


@pytest.mark.parametrize("draft", ["other_gguf", "same_hf_dir"])
def test_standalone_draft_on_gguf_blocks(gguf_pair, draft, torch_fallback):
    target, other, hf_dir = gguf_pair
    draft_path = other if draft == "other_gguf" else hf_dir
    want = reference(target)
    spec = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=str(draft_path), speculative_num_steps=3)
    with Engine(str(target), quantization="gguf", **GGUF_KW, **spec) as engine:
        assert quantized_layers(model_of(engine))
        draft_model = engine.scheduler.spec_worker.draft_runner.model
        assert bool(quantized_layers(draft_model)) == (draft == "other_gguf")  # a GGUF draft keeps its blocks too
        got = greedy(engine)
    assert_same(got, want, f"STANDALONE draft {draft}")
    metas = [g["meta_info"] for g in got]
    assert all(m["spec_verify_ct"] > 0 for m in metas)
    if draft == "same_hf_dir":  # the target's own weights: every draft accepted
        assert all(m["spec_accept_length"] > 2.0 for m in metas)


def test_eagle_head_on_gguf_blocks(gguf_pair, tmp_path, torch_fallback):
    """An EAGLE head (an HF directory) takes the target's embedding and LM head, here held in
    their blocks (dequantized rows looked up, the head multiplied in blocks)."""
    from eagle_head import make_random_eagle_head
    from radixserve.models.model_config import ModelConfig

    target, _, _ = gguf_pair
    head = make_random_eagle_head(ModelConfig.from_pretrained(str(target)).hf_config, str(tmp_path / "head"))
    want = reference(target)
    spec = dict(speculative_algorithm="EAGLE", speculative_draft_model_path=head, speculative_num_steps=3,
                speculative_eagle_topk=2, speculative_num_draft_tokens=4)
    with Engine(str(target), quantization="gguf", **GGUF_KW, **spec) as engine:
        head_model = engine.scheduler.spec_worker.draft_runner.model
        assert head_model.lm_head.weight.gguf_blocks is not None  # the target's, in blocks
        got = greedy(engine)
    assert_same(got, want, "EAGLE over blocks")
    assert all(g["meta_info"]["spec_verify_ct"] > 0 for g in got)


def test_ngram_on_gguf_blocks(gguf_pair, torch_fallback):
    target, _, _ = gguf_pair
    want = reference(target)
    with Engine(str(target), quantization="gguf", speculative_algorithm="NGRAM", speculative_num_draft_tokens=4,
                **GGUF_KW) as engine:
        got = greedy(engine)
    assert_same(got, want, "NGRAM over blocks")
    assert sum(g["meta_info"]["spec_num_proposed_drafts"] for g in got) > 0  # the repeating prompt proposed some


def test_speculation_with_the_integer_kernel_keeps_the_tokens(gguf_pair):
    """The real kernel (8-bit activations, where it is built): speculation on, the tokens of
    speculation off on the same blocks."""
    if not quant_gguf.kernel_types():
        pytest.skip("the C++ integer kernel is not built on this CPU (AVX512-VNNI)")
    target, other, _ = gguf_pair
    with Engine(str(target), quantization="gguf", **GGUF_KW) as engine:
        off = greedy(engine)
    for spec in (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4),
                 dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=str(other), speculative_num_steps=3)):
        with Engine(str(target), quantization="gguf", **GGUF_KW, **spec) as engine:
            assert_same(greedy(engine), off, spec["speculative_algorithm"], atol=1e-3)


def test_draft_quantization_follows_the_draft_format():
    gguf_cfg, hf_cfg = type("C", (), {"gguf_file": "d.gguf"})(), type("C", (), {"gguf_file": None})()
    assert draft_quantization("gguf", gguf_cfg) == "gguf" and draft_quantization("gguf", hf_cfg) == "auto"
    assert draft_quantization("w8a8_int8", hf_cfg) == "w8a8_int8" and draft_quantization("w8a8_int8", gguf_cfg) == "auto"
    assert draft_quantization("none", gguf_cfg) == "none"


# ---- release / resume ---------------------------------------------------------------------------


def test_w8a8_int8_release_frees_the_blocks_and_resume_restores_them():
    """(GGUF blocks: test_gguf.py.) A w8a8_int8 model's Q8_0 segments are freed by a release of
    the weights and come back, byte for byte, on resume: the answers do not change."""
    prompts = ["The quick brown fox", "1 2 3 4 5 1 2 3"]
    with Engine(str(get_tiny_model_path()), quantization="w8a8_int8", dtype="float32", max_total_tokens=2048) as engine:
        before = generate_text(engine, prompts)
        segments = [s for m in quantized_layers(model_of(engine)) for s in m.quant_method.ordered]
        assert segments and all(s.qtype == int(Q.Q8_0) for s in segments)
        held = [s.data.clone() for s in segments]
        engine.release_memory_occupation()
        assert all(s.data.untyped_storage().nbytes() == 0 for s in segments)
        engine.resume_memory_occupation()
        assert all(torch.equal(s.data, h) for s, h in zip(segments, held))
        assert_same(generate_text(engine, prompts), before, "after release/resume", atol=0)
