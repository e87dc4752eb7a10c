"""Model configs for the simulator: presets of well-known shapes (no weights needed), or any
Hugging Face config.json / model directory."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

from radixserve.models.model_config import ModelConfig

_LLAMA3_COMMON: Dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "max_position_embeddings": 8192,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "eos_token_id": [128001, 128009], "torch_dtype": "bfloat16",
}

MODEL_PRESETS: Dict[str, Dict[str, Any]] = {
    "llama-3-8b": dict(_LLAMA3_COMMON, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8),
    "llama-3-70b": dict(_LLAMA3_COMMON, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8),
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "eos_token_id": [151645, 151643], "torch_dtype": "bfloat16",
    },
}


def load_model_config(spec: Optional[str]) -> ModelConfig:
    """None or "tiny": the embedded tiny model; a preset name; a config.json or a model directory."""
    if spec is None or spec == "tiny":
        from radixserve.tiny_model import get_tiny_model_path

        return ModelConfig.from_pretrained(str(get_tiny_model_path()))
    if spec.lower() in MODEL_PRESETS:
        return ModelConfig.from_dict(MODEL_PRESETS[spec.lower()], model_path=spec.lower())
    if os.path.isdir(spec):
        return ModelConfig.from_pretrained(spec)
    if os.path.isfile(spec):
        with open(spec) as f:
            return ModelConfig.from_dict(json.load(f), model_path=spec)
    raise ValueError(f"--model-config {spec!r}: not a preset ({', '.join(MODEL_PRESETS)}, tiny), file or directory")
