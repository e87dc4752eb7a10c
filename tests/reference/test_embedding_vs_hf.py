"""--is-embedding against transformers (float32): Engine.encode equals AutoModel's
last_hidden_state pooled the same way (last token, mean, CLS; normalized or not), computed here,
within 1e-4 — for a Llama checkpoint (LlamaForCausalLM, "model." names) and a Qwen3 one saved
as Qwen3-Embedding is (the bare Qwen3Model: no "model." prefix, no lm_head), with and without a
sentence-transformers pooling config; batched equals alone; chunked prefill; a shared prefix
hits the radix cache; a GGUF file (SmolLM2) with and without a modules.json beside it."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch
import transformers
from hf_utils import SMALL_CONFIGS, make_hf_model_dir

from radixserve.engine import Engine

TOL = 1e-4
ST = "sentence_transformers.models."


def make_qwen3_embedding_dir(out_dir: str, seed: int = 0) -> str:
    """A Qwen3 directory as Qwen3-Embedding ships: the bare model's tensors (no "model." prefix,
    no lm_head), tied embeddings, and "Qwen3ForCausalLM" in config.json."""
    cfg = transformers.AutoConfig.for_model(**{**SMALL_CONFIGS["qwen3"], "tie_word_embeddings": True})
    torch.manual_seed(seed)
    model = transformers.AutoModel.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[-1] ** -0.5 * (1.0 if "embed" in name else 1.5))
            else:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    assert config["architectures"] == ["Qwen3Model"]  # what save_pretrained wrote; the real one says:
    config["architectures"] = ["Qwen3ForCausalLM"]
    with open(path, "w") as f:
        json.dump(config, f)
    return out_dir


def write_pooling_config(model_dir: str, mode: str, normalize: bool) -> None:
    """sentence-transformers' modules.json + 1_Pooling/config.json (+ a Normalize module)."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": ST + "Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST + "Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": ST + "Normalize"})
    with open(os.path.join(model_dir, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(model_dir, "1_Pooling"), exist_ok=True)
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    with open(os.path.join(model_dir, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 128, **{f"pooling_mode_{m}": m == mode for m in modes}}, f)


def reference(hf_model, ids: List[int], mode: str, normalize: bool) -> torch.Tensor:
    """transformers' final hidden states of the prompt, pooled here."""
    with torch.no_grad():
        h = hf_model(torch.tensor([ids])).last_hidden_state[0].float()
    v = {"lasttoken": h[-1], "mean_tokens": h.mean(0), "cls_token": h[0]}[mode]
    return torch.nn.functional.normalize(v, dim=-1) if normalize else v


def prompts(n: int, lengths: List[int], seed: int = 0) -> List[List[int]]:
    rng = random.Random(seed)
    vocab = SMALL_CONFIGS["llama"]["vocab_size"]
    return [[rng.randrange(vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def embedding_engine(model_dir: str, **kw) -> Engine:
    return Engine(model_path=model_dir, is_embedding=True, dtype="float32", skip_tokenizer_init=True,
                  max_total_tokens=kw.pop("max_total_tokens", 4096), **kw)


def assert_matches(outs: List[dict], refs: List[torch.Tensor]) -> None:
    assert len(outs) == len(refs)
    for out, ref in zip(outs, refs):
        got = torch.tensor(out["embedding"])
        assert got.shape == ref.shape
        err = (got - ref).abs().max().item()
        assert err < TOL, f"max abs error {err}"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> Dict[str, str]:
    root = tmp_path_factory.mktemp("embedding-models")
    return {"llama": make_hf_model_dir("llama", str(root / "llama")),
            "qwen3": make_qwen3_embedding_dir(str(root / "qwen3"))}


@pytest.fixture(scope="module")
def hf_models(model_dirs) -> Dict[str, torch.nn.Module]:
    return {k: transformers.AutoModel.from_pretrained(d, dtype=torch.float32).eval() for k, d in model_dirs.items()}


def with_pooling(src: str, dst: Path, mode: Optional[str], normalize: bool) -> str:
    """A copy of the model directory (symlinked files) with its own pooling config."""
    dst.mkdir()
    for name in os.listdir(src):
        os.symlink(os.path.join(src, name), dst / name)
    if mode is not None:
        write_pooling_config(str(dst), mode, normalize)
    return str(dst)


# (pooling_mode in modules.json or None for no modules.json, Normalize module) -> what is expected
POOLINGS = [(None, True), ("lasttoken", True), ("mean_tokens", True), ("mean_tokens", False), ("cls_token", True)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("mode, normalize", POOLINGS)
def test_embeddings_match_transformers(arch, mode, normalize, model_dirs, hf_models, tmp_path):
    model_dir = with_pooling(model_dirs[arch], tmp_path / "model", mode, normalize)
    engine = embedding_engine(model_dir)
    ids = prompts(5, [1, 7, 23, 40, 3], seed=1)
    outs = engine.encode(input_ids=ids)
    engine.shutdown()
    want_mode = mode or "lasttoken"
    assert_matches(outs, [reference(hf_models[arch], p, want_mode, normalize) for p in ids])
    if normalize:
        assert all(abs(torch.tensor(o["embedding"]).norm().item() - 1) < 1e-5 for o in outs)
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(p) for p in ids]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("mode", ["lasttoken", "mean_tokens"])
def test_batched_equals_alone(arch, mode, model_dirs, tmp_path):
    engine = embedding_engine(with_pooling(model_dirs[arch], tmp_path / "model", mode, True))
    ids = prompts(6, [5, 17, 2, 30], seed=2)
    batched = engine.encode(input_ids=ids)
    alone = []
    for p in ids:
        engine.wait_until_idle()  # the last prefill batch retired
        assert engine.flush_cache()  # each one computed from scratch, as in the batch
        alone.append(engine.encode(input_ids=p))
    engine.shutdown()
    for b, a in zip(batched, alone):
        assert torch.allclose(torch.tensor(b["embedding"]), torch.tensor(a["embedding"]), atol=1e-5)


@pytest.mark.parametrize("mode", ["lasttoken", "mean_tokens", "cls_token"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_takes_the_embedding_at_the_last_chunk(mode, page_size, model_dirs, hf_models, tmp_path):
    engine = embedding_engine(with_pooling(model_dirs["qwen3"], tmp_path / "model", mode, True),
                              chunked_prefill_size=16, page_size=page_size)
    ids = prompts(3, [50, 37, 9], seed=3)
    outs = engine.encode(input_ids=ids)
    stats = engine.stats()
    engine.shutdown()
    assert stats.num_chunked_prefills >= 4  # 50 + 37 tokens in chunks of 16
    assert_matches(outs, [reference(hf_models["qwen3"], p, mode, True) for p in ids])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_shared_prefix_hits_the_radix_cache(arch, model_dirs, hf_models):
    engine = embedding_engine(model_dirs[arch])  # no pooling config: last token, normalized
    prefix = prompts(1, [24], seed=4)[0]
    first, second = prefix + [1, 2, 3], prefix + [4, 5]
    out1 = engine.encode(input_ids=first)
    out2 = engine.encode(input_ids=second)
    stats = engine.stats()
    engine.shutdown()
    assert out1["meta_info"]["cached_tokens"] == 0
    assert out2["meta_info"]["cached_tokens"] == len(prefix)  # the first one's KV went into the tree
    assert stats.cached_tokens == len(prefix)
    assert_matches([out1, out2], [reference(hf_models[arch], p, "lasttoken", True) for p in (first, second)])


def test_mean_pooling_computes_the_whole_prompt(model_dirs, hf_models, tmp_path):
    """Mean pooling needs every token's hidden state, which the cache does not keep: a shared
    prefix is computed again (cached_tokens 0) and the embedding is still right."""
    engine = embedding_engine(with_pooling(model_dirs["llama"], tmp_path / "model", "mean_tokens", True))
    prefix = prompts(1, [24], seed=5)[0]
    outs = [engine.encode(input_ids=prefix + tail) for tail in ([1, 2], [3])]
    engine.shutdown()
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 0]
    assert_matches(outs, [reference(hf_models["llama"], prefix + t, "mean_tokens", True) for t in ([1, 2], [3])])


# ---- a GGUF file: the real SmolLM2 (tests/real_model.py) -----------------------------------------
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from real_model import hf_from_gguf, smollm2_gguf  # noqa: E402


@pytest.mark.parametrize("mode", [None, "mean_tokens"])
def test_gguf_embeddings_match_transformers(mode, tmp_path):
    """Last token + normalize; with a modules.json in the directory holding the file, its pooling."""
    src = smollm2_gguf()
    path = tmp_path / src.name
    os.symlink(src, path)
    if mode is not None:
        write_pooling_config(str(tmp_path), mode, normalize=True)
    engine = Engine(model_path=str(path), is_embedding=True, dtype="float32", max_total_tokens=2048)
    texts = ["The capital of France is Paris.", "Embeddings map text to vectors.", "hi"]
    ids = [engine.tokenizer.encode(t) for t in texts]
    outs = engine.encode(texts)
    engine.shutdown()
    hf = hf_from_gguf(src).model  # the LlamaModel inside: last_hidden_state
    assert_matches(outs, [reference(hf, p, mode or "lasttoken", True) for p in ids])
