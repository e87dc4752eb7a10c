"""PEFT LoRA adapters for the tests, written by hand in PEFT's format (adapter_config.json +
adapter_model.safetensors with PEFT's tensor names; peft itself is not needed), and the tiny
model with an adapter merged into its weights (the reference: W + lora_alpha / r * B @ A)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, List, Tuple

import torch
from safetensors.torch import load_file, save_file

from radixserve.tiny_model import get_tiny_model_path

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")

# The adapters of the tiny-model LoRA tests: name -> (rank, lora_alpha, target modules)
ADAPTERS = {
    "a4": (4, 8.0, ["q_proj", "v_proj"]),
    "b8": (8, 8.0, ["k_proj", "o_proj", "gate_proj", "down_proj"]),
    "c16": (16, 32.0, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}
PROMPTS = ["The quick brown fox", "Once upon a time there", "1 2 3 4 5", "Hello, my name is"]
SAMPLING = {"max_new_tokens": 8, "temperature": 0.0}
ENGINE_ARGS = dict(dtype="float32", max_total_tokens=2048, disable_radix_cache=True, test_check_memory=True)


def _group(module: str) -> str:
    return "self_attn" if module in ATTN else "mlp"


def base_weights() -> Dict[str, torch.Tensor]:
    return load_file(str(get_tiny_model_path() / "model.safetensors"))


def write_adapter(out: Path, rank: int, alpha: float, targets: List[str], base: Dict[str, torch.Tensor],
                  seed: int) -> Path:
    """A PEFT LoRA directory with random non-zero A and B (B is zero at PEFT's init: not here),
    for every decoder layer of the checkpoint `base`."""
    num_layers = 1 + max(int(n.split(".")[2]) for n in base if n.startswith("model.layers."))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for module in targets:
            w = base[f"model.layers.{layer}.{_group(module)}.{module}.weight"]
            out_f, in_f = w.shape
            prefix = f"base_model.model.model.layers.{layer}.{_group(module)}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) / in_f**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.5 / rank**0.5
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets,
              "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def merged_weights(base: Dict[str, torch.Tensor], adapter_dir: Path) -> Dict[str, torch.Tensor]:
    """The checkpoint tensors with the adapter merged: W + (lora_alpha / r) * B @ A."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    weights = dict(base)
    lora = load_file(str(adapter_dir / "adapter_model.safetensors"))
    for name, a in lora.items():
        if ".lora_A." not in name:
            continue
        b = lora[name.replace(".lora_A.", ".lora_B.")]
        target = name.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
        weights[target] = weights[target] + scaling * (b @ a)
    return weights


def write_merged_model(out: Path, adapter_dir: Path) -> Path:
    """The tiny model's directory with the adapter merged (merged_weights)."""
    shutil.copytree(get_tiny_model_path(), out)
    save_file(merged_weights(base_weights(), adapter_dir), str(out / "model.safetensors"))
    return out


def hf_greedy(model, ids: List[int], n_new: int) -> Tuple[List[int], List[float]]:
    """transformers' greedy tokens and their logprobs, a full forward per step (no KV cache to differ)."""
    seq, out, lps = list(ids), [], []
    with torch.no_grad():
        for _ in range(n_new):
            logprobs = torch.log_softmax(model(torch.tensor([seq])).logits[0, -1].float(), -1)
            tok = int(logprobs.argmax())
            out.append(tok)
            lps.append(float(logprobs[tok]))
            seq.append(tok)
    return out, lps
