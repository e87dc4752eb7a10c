"""The embedded default model: a tiny Qwen3 with a real tokenizer and seeded random weights.

Tests, benchmarks and `radixserve serve` with no --model-path run on it, with no network
and no download. The tokenizer and configs are committed under ``assets/tiny_qwen3/``
(``scripts/train_tokenizer.py`` made the tokenizer); the weights (~20 MB) are not: they
are drawn from a seeded generator on first use and cached.

    get_tiny_model_path()          -> $RADIXSERVE_CACHE/tiny_qwen3-<hash>/   (cached)
    make_tiny_model(out_dir)       -> out_dir/ with config, tokenizer, model.safetensors

The directory is an ordinary Hugging Face model directory:
``transformers.AutoModelForCausalLM.from_pretrained(path)`` loads it with no missing or
unexpected keys, so it is also the reference model of the HF comparison tests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

TINY_MODEL_ASSETS: Path = Path(__file__).resolve().parent / "assets" / "tiny_qwen3"
WEIGHTS_FILE = "model.safetensors"
# Bump when the way weights are drawn changes, so stale caches are not reused.
_FORMAT_VERSION = 1


@dataclass(frozen=True)
class TinyInit:
    """How the random weights are drawn (all normal, mean 0; norm weights are 1.0).

    Why not the usual std=0.02 init: with tied embeddings and a block output that is tiny
    next to the embedding, the last hidden state is ~ the input token's own embedding and
    the model predicts its input token forever. Near-tied logits are the other failure:
    greedy decoding then flips on float noise between two equally valid code paths
    (batched vs single, chunked vs not, CPU vs GPU). Because every block reads its input
    through an RMSNorm, what matters most is the size of the block outputs relative to
    the embedding (context vs current token) and the embedding scale (= logit scale).

    - embed_std=0.3: the embedding is also the LM head, and the final RMSNorm makes the
      last hidden state RMS ~1, so logits have std ~ sqrt(256) * 0.3 ~ 4.8. The top-1 vs
      top-2 gap is then mostly > 0.5 (median ~0.9 on random prompts, practically none
      < 1e-3), yet the softmax is not one-hot (entropy ~2.5 nats, mean p_max ~0.43), so
      sampling still has something to choose from.
    - in_gain=1.5 (q, k, v, gate, up) and out_gain=2.0 (o, down), std = gain/sqrt(fan_in):
      each attention / MLP output has RMS ~2 / ~3 against the embedding's 0.3 (q and k
      pass through q_norm/k_norm, so their gain only matters for v, gate and up), so
      predictions depend on context and greedy continuations are varied text (about 20
      distinct tokens in 24) instead of a loop of 2-3 tokens (gains 1/1) or the input
      token repeated (std 0.02). Larger gains make the net more chaotic: argmax agreement
      of bf16 with fp32 is ~95% here, ~99% with gains 1/1, ~93% with gains 2/2.
    The logit-gap property is checked in tests/unit/test_tiny_model.py.
    """

    seed: int = 0
    embed_std: float = 0.3
    in_gain: float = 1.5
    out_gain: float = 2.0


DEFAULT_INIT = TinyInit()


def load_tiny_config(assets: Path = TINY_MODEL_ASSETS) -> dict:
    with open(assets / "config.json", encoding="utf-8") as f:
        return json.load(f)


def tiny_param_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of transformers' Qwen3ForCausalLM for ``config``
    (tied embeddings: no lm_head.weight), in a fixed order (the order weights are drawn)."""
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim
    assert config.get("tie_word_embeddings", False), "the tiny model ties its LM head to the embedding"
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, hidden)
        shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
        shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_out)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def _param_std(name: str, shape: tuple[int, ...], init: TinyInit) -> float | None:
    """Std of a normal init for ``name``, or None for a norm weight (filled with 1.0)."""
    if name.endswith("norm.weight"):
        return None
    if name == "model.embed_tokens.weight":
        return init.embed_std
    fan_in = shape[1]
    is_output_side = name.endswith(("o_proj.weight", "down_proj.weight"))
    return (init.out_gain if is_output_side else init.in_gain) / math.sqrt(fan_in)


def tiny_state_dict(config: dict | None = None, init: TinyInit = DEFAULT_INIT) -> dict[str, torch.Tensor]:
    """The seeded float32 weights. Drawn on the CPU from one torch.Generator in the fixed
    order of ``tiny_param_shapes``, so every machine with the same torch gets the same bits."""
    config = load_tiny_config() if config is None else config
    gen = torch.Generator(device="cpu").manual_seed(init.seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in tiny_param_shapes(config).items():
        std = _param_std(name, shape, init)
        if std is None:
            state[name] = torch.ones(shape, dtype=torch.float32)
        else:
            state[name] = torch.randn(shape, generator=gen, dtype=torch.float32) * std
    return state


def make_tiny_model(out_dir: str | Path, init: TinyInit = DEFAULT_INIT) -> Path:
    """Write a complete HF model directory: the committed assets plus seeded weights."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for src in sorted(TINY_MODEL_ASSETS.iterdir()):
        if src.is_file():
            shutil.copyfile(src, out / src.name)
    state = tiny_state_dict(load_tiny_config(), init)
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out


def tiny_model_fingerprint(init: TinyInit = DEFAULT_INIT) -> str:
    """Short hash of everything that determines the model directory's contents."""
    h = hashlib.sha256()
    h.update(f"format={_FORMAT_VERSION};init={dataclasses.astuple(init)!r}".encode())
    for src in sorted(TINY_MODEL_ASSETS.iterdir()):
        if src.is_file():
            h.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def tiny_model_cache_root() -> Path:
    """$RADIXSERVE_CACHE, else $XDG_CACHE_HOME/radixserve, else ~/.cache/radixserve."""
    if os.environ.get("RADIXSERVE_CACHE"):
        return Path(os.environ["RADIXSERVE_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "radixserve"


def get_tiny_model_path() -> Path:
    """The cached tiny model directory, created on first use.

    Creation is atomic: the directory is built under a temporary name next to its final
    place and renamed into it, so a directory with the final name is always complete.
    When two processes race, one rename wins and the other drops its copy.
    """
    root = tiny_model_cache_root()
    final = root / f"tiny_qwen3-{tiny_model_fingerprint()}"
    if (final / WEIGHTS_FILE).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        make_tiny_model(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            # Lost the race (final exists and is not empty): the winner's copy is complete.
            if not (final / WEIGHTS_FILE).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
