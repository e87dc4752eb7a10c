"""ModelConfig: what the engine needs from a Hugging Face config.json (+ generation_config.json).

Accepts both the older top-level `rope_theta` / `rope_scaling` and transformers 5's
`rope_parameters` dict."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch


class LoadError(RuntimeError):
    """A model directory that cannot be loaded: the message names the file (and tensor)."""


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[Dict[str, Any]]
    tie_word_embeddings: bool
    attention_bias: bool = False
    o_bias: bool = False
    partial_rotary_factor: float = 1.0
    hidden_act: str = "silu"
    torch_dtype: Optional[str] = None
    eos_token_ids: List[int] = field(default_factory=list)
    model_path: Optional[str] = None
    hf_config: Dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def context_len(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_dict(cls, cfg: Dict[str, Any], model_path: Optional[str] = None) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        if not archs:
            raise LoadError(f"{_where(model_path, 'config.json')}: no 'architectures' entry")
        rope = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        n_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=archs[0],
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            partial_rotary_factor=float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))),
            hidden_act=cfg.get("hidden_act", "silu"),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            eos_token_ids=_as_list(eos),
            model_path=model_path,
            hf_config=cfg,
        )

    @classmethod
    def from_pretrained(cls, model_path: str) -> "ModelConfig":
        path = os.path.join(model_path, "config.json")
        if not os.path.isfile(path):
            raise LoadError(f"{path}: file not found")
        try:
            with open(path) as f:
                cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise LoadError(f"{path}: invalid JSON ({e})") from None
        try:
            config = cls.from_dict(cfg, model_path)
        except KeyError as e:
            raise LoadError(f"{path}: missing key {e}") from None
        gen_path = os.path.join(model_path, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                gen_eos = _as_list(json.load(f).get("eos_token_id"))
            config.eos_token_ids = sorted(set(config.eos_token_ids) | set(gen_eos))
        return config

    def resolve_dtype(self, dtype: str, device: str) -> torch.dtype:
        """--dtype auto: a float32 checkpoint runs in float32; any other runs in its own dtype on a
        GPU (bf16 when unsaid) and in bf16 on a CPU with native bf16 math (AVX512_BF16 or AMX:
        2-4x faster matmuls than float32), else in float32 (emulated bf16 is slower)."""
        if dtype == "auto":
            dtype = self.torch_dtype or "bfloat16"
            if dtype == "float32":
                return torch.float32
            if device == "cpu":
                return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def cpu_has_native_bf16() -> bool:
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


def _as_list(x: Any) -> List[int]:
    if x is None:
        return []
    return [int(v) for v in x] if isinstance(x, (list, tuple)) else [int(x)]


def _where(model_path: Optional[str], name: str) -> str:
    return os.path.join(model_path, name) if model_path else name
