"""Model loading: sharded checkpoints, rope config forms, dummy weights, and one-line errors
that name the file and the tensor."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.model_executor.model_loader import get_model
from radixserve.models.model_config import LoadError, ModelConfig
from radixserve.tiny_model import get_tiny_model_path


@pytest.fixture()
def tiny_dir(tmp_path):
    d = tmp_path / "tiny"
    shutil.copytree(get_tiny_model_path(), d)
    return d


def _load(path, load_format="auto", dtype=torch.float32):
    cfg = ModelConfig.from_pretrained(str(path))
    return get_model(cfg, load_format, dtype, "cpu")


def test_sharded_checkpoint_loads_like_single_file(tiny_dir, tmp_path):
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    names = sorted(tensors)
    shard_dir = tmp_path / "sharded"
    shutil.copytree(tiny_dir, shard_dir)
    os.remove(shard_dir / "model.safetensors")
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fn = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(shard_dir / fn))
        weight_map.update({n: fn for n in part})
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a, b = _load(tiny_dir), _load(shard_dir)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)


def test_missing_shard_names_the_file(tiny_dir):
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    (tiny_dir / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: "model-00002-of-00002.safetensors" for n in tensors}})
    )
    with pytest.raises(LoadError, match="model-00002-of-00002.safetensors: file not found"):
        _load(tiny_dir)


def test_shape_mismatch_names_file_and_tensor(tiny_dir):
    path = tiny_dir / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(path))
    with pytest.raises(LoadError) as e:
        _load(tiny_dir)
    msg = str(e.value)
    assert "model.safetensors" in msg and "model.layers.1.mlp.down_proj.weight" in msg and "\n" not in msg


def test_missing_tensor_is_reported(tiny_dir):
    path = tiny_dir / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, str(path))
    with pytest.raises(LoadError, match=r"model.layers.0.self_attn.qkv_proj.weight \(shard k\)"):
        _load(tiny_dir)


def test_unknown_architecture_and_missing_config(tiny_dir, tmp_path):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (tiny_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match="unsupported architecture 'GPTNeoXForCausalLM'"):
        _load(tiny_dir)
    with pytest.raises(LoadError, match="config.json: file not found"):
        ModelConfig.from_pretrained(str(tmp_path / "nowhere"))


def test_no_weights_suggests_dummy(tiny_dir):
    os.remove(tiny_dir / "model.safetensors")
    with pytest.raises(LoadError, match="no \\*.safetensors files"):
        _load(tiny_dir)
    m1, m2 = _load(tiny_dir, "dummy"), _load(tiny_dir, "dummy")  # seeded: the same twice
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p1, p2)


def test_rope_theta_from_either_config_form():
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2)
    old = ModelConfig.from_dict(dict(base, rope_theta=123.0))
    new = ModelConfig.from_dict(dict(base, rope_parameters={"rope_type": "default", "rope_theta": 456.0}))
    scaled = ModelConfig.from_dict(dict(base, rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))
    assert old.rope_theta == 123.0 and new.rope_theta == 456.0
    assert scaled.rope_theta == 5e5 and scaled.rope_scaling["rope_type"] == "llama3"


def test_dtype_and_generation_config_eos(tiny_dir):
    model = _load(tiny_dir, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    (tiny_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 0]}))
    assert ModelConfig.from_pretrained(str(tiny_dir)).eos_token_ids == [0, 2, 5]
