"""EAGLE draft heads for the tests, in EAGLE's checkpoint layout (radixserve/models/llama_eagle.py):
a random head for any target (its drafts are rejected: the outputs must not show it), and a
target built so that its own layer is a head whose drafts are (nearly) always right.

A head trained on the tiny model's own continuations did not help: its random weights make
continuations no small head predicts (0% top-1 on fresh prompts after 200 Adam steps)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict

import torch
from safetensors.torch import save_file


def _head_config(target: dict, intermediate: int) -> dict:
    heads = target["num_attention_heads"]
    return {
        "architectures": ["LlamaForCausalLMEagle"], "model_type": "llama",
        "hidden_size": target["hidden_size"], "intermediate_size": intermediate, "num_hidden_layers": 1,
        "num_attention_heads": heads, "num_key_value_heads": target.get("num_key_value_heads", heads),
        "head_dim": target.get("head_dim") or target["hidden_size"] // heads, "vocab_size": target["vocab_size"],
        "max_position_embeddings": target.get("max_position_embeddings", 4096),
        "rope_theta": target.get("rope_theta", (target.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6), "tie_word_embeddings": False, "torch_dtype": "float32",
    }


def _random_weights(cfg: dict, gen: torch.Generator) -> Dict[str, torch.Tensor]:
    h, hd, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def w(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, generator=gen) / math.sqrt(inp)

    return {
        "fc.weight": w(h, 2 * h), "fc.bias": torch.zeros(h),
        "layers.0.self_attn.q_proj.weight": w(q, h), "layers.0.self_attn.k_proj.weight": w(kv, h),
        "layers.0.self_attn.v_proj.weight": w(kv, h), "layers.0.self_attn.o_proj.weight": w(h, q),
        "layers.0.post_attention_layernorm.weight": torch.ones(h),
        "layers.0.mlp.gate_proj.weight": w(inter, h), "layers.0.mlp.up_proj.weight": w(inter, h),
        "layers.0.mlp.down_proj.weight": w(h, inter),
    }


def make_random_eagle_head(target_config: dict, out_dir: str, seed: int = 0) -> str:
    """A random EAGLE head for a target of this (Hugging Face style) config: its drafts are
    nearly always rejected, which the outputs must not show."""
    cfg = _head_config(target_config, 2 * target_config["hidden_size"])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(_random_weights(cfg, torch.Generator().manual_seed(seed)), str(out / "model.safetensors"))
    return str(out)


def make_copy_pair(out_dir: str, seed: int = 0) -> tuple:
    """(target dir, head dir): a one-layer Llama target whose EAGLE head is its own layer, so
    the head's drafts are (nearly) the target's tokens. The target's embeddings have unit RMS
    and its norms unit weights, so its input norm is the identity EAGLE's layer 0 leaves out
    and its final norm only scales (the argmax stays); fc passes the token's embedding through.
    The head at draft position p sees the tokens the target sees at p + 1 (one place earlier:
    rotary depends only on distances) except the first token: nearly, not exactly, the target."""
    from transformers import AutoConfig, AutoModelForCausalLM

    root = Path(out_dir)
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=128,
               intermediate_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if p.dim() == 1 else torch.randn_like(p) * p.shape[-1] ** -0.5 * 1.5)
        emb = model.get_input_embeddings().weight
        emb.copy_(emb / emb.pow(2).mean(-1, keepdim=True).sqrt())
    target = str(root / "target")
    model.save_pretrained(target)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    h = cfg["hidden_size"]
    head = {"fc.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1), "fc.bias": torch.zeros(h)}
    for name, t in sd.items():
        if name.startswith("model.layers.0.") and "input_layernorm" not in name:
            head[name[len("model."):]] = t
    head_dir = root / "head"
    head_dir.mkdir(parents=True, exist_ok=True)
    (head_dir / "config.json").write_text(json.dumps(_head_config(cfg, cfg["intermediate_size"]), indent=1))
    save_file(head, str(head_dir / "model.safetensors"))
    return target, str(head_dir)
