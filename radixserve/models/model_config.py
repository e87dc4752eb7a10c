"""ModelConfig: what the engine needs from a Hugging Face config.json (+ generation_config.json),
or from a GGUF file's metadata (llama.cpp's format: --model-path FILE.gguf).

Accepts both the older top-level `rope_theta` / `rope_scaling` and transformers 5's
`rope_parameters` dict."""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from radixserve.hf_transformers_utils import LoadError, gguf_file

logger = logging.getLogger(__name__)

__all__ = ["GGUF_ARCHITECTURES", "GGUFIndex", "LoadError", "ModelConfig", "cpu_has_native_bf16", "gguf_to_hf_config", "has_native_bf16", "open_gguf"]

# GGUF general.architecture -> our model class (config.json "architectures"). llama.cpp writes
# Mistral (and SmolLM, ...) checkpoints as "llama"; "mistral" is accepted as the same thing.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# GGUF architectures whose Hugging Face model_type is spelled otherwise.
_GGUF_MODEL_TYPES = {"qwen3moe": "qwen3_moe"}

# Vision-language checkpoints, served with their vision encoder (models/qwen2_5_vl.py, qwen3_vl.py,
# qwen3_5_vl.py): the language model's entries are under text_config; vision_config stays in hf_config.
WITH_VISION = ("Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
               "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")

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
    gguf_file: Optional[str] = None  # set when the weights are one GGUF file (model_path names it too)
    # The attention window of the config's windowed layers (Mistral's sliding_window, Qwen2's
    # use_sliding_window, layer_types' "sliding_attention"); None when every layer attends to all.
    sliding_window: Optional[int] = None
    window_layers: List[bool] = field(default_factory=list)  # per layer: windowed (empty: none is)
    hf_config: Dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def context_len(self) -> int:
        """The longest sequence the model takes."""
        return self.max_position_embeddings

    def layer_sliding_window(self, layer_id: int) -> Optional[int]:
        """Layer layer_id's window (its query attends to the W keys up to itself), None: all keys."""
        return self.sliding_window if self.window_layers and self.window_layers[layer_id] else None

    def serving_context_len(self, requested: Optional[int], windowed_attention: bool = True) -> int:
        """--context-length (None: the model's) checked against what can be served exactly.
        windowed_attention: the attention backend applies the window. Where it does not, a model
        with one is served up to its window (there the W keys are all of them, and the answers
        are the model's own), never beyond it, where it would answer wrongly."""
        if self.sliding_window is None or windowed_attention or self.sliding_window >= self.max_position_embeddings:
            return min(requested or self.context_len, self.context_len)
        if requested is None:
            logger.warning("%s: sliding_window %d < max_position_embeddings %d; this attention backend does not apply "
                           "the window, so the context length is capped at it (answers stay exact)",
                           self.model_path or self.architecture, self.sliding_window, self.max_position_embeddings)
            return self.sliding_window
        if requested > self.sliding_window:
            raise LoadError(f"--context-length {requested}: this model attends through a sliding window of "
                            f"{self.sliding_window} tokens, which this attention backend does not apply (use "
                            f"--attention-backend torch_native); beyond the window it would answer wrongly, so at most "
                            f"--context-length {self.sliding_window} is served")
        return requested

    @classmethod
    def from_dict(cls, cfg: Dict[str, Any], model_path: Optional[str] = None) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        if not archs:
            raise LoadError(f"{_where(model_path, 'config.json')}: no 'architectures' entry")
        if archs[0] in WITH_VISION and isinstance(cfg.get("text_config"), dict):
            # the language model's entries (those it leaves unset, as eos_token_id may be, kept from the top)
            cfg = {**cfg, **{k: v for k, v in cfg["text_config"].items() if v is not None}, "architectures": archs}
        rope = cfg.get("rope_parameters") or {}
        rope = rope.get("full_attention", rope)  # per layer type (Gemma 3): the global layers' here
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        n_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=archs[0],
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size") or 0,  # none in configs whose every layer has experts (Qwen3.5-MoE)
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
            sliding_window=_sliding_window(cfg),
            window_layers=_window_layers(cfg),
            hf_config=cfg,
        )

    @classmethod
    def from_pretrained(cls, model_path: str) -> "ModelConfig":
        """A Hugging Face directory, a .gguf file, or a directory holding one .gguf file and no
        config.json."""
        gguf_path = gguf_file(model_path)
        if gguf_path is not None:
            return cls.from_gguf(gguf_path)
        if os.path.isfile(model_path):
            raise LoadError(f"{model_path}: not a model directory or a .gguf file")
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

    @classmethod
    def from_gguf(cls, path: str) -> "ModelConfig":
        """The config from a GGUF file's metadata (the tensors are read later, by
        model_executor/gguf_loader.py). model_path and gguf_file both name the file."""
        cfg = gguf_to_hf_config(open_gguf(path), path)
        config = cls.from_dict(cfg, model_path=path)
        config.o_bias = bool(cfg.get("o_bias", False))
        config.gguf_file = path
        return config

    def resolve_dtype(self, dtype: str, device: str) -> torch.dtype:
        """--dtype auto: bf16 where the device has native bf16 math (AVX512_BF16 or AMX on a CPU, or
        the engine's bf16 GEMM on AVX2: 2-4x faster matmuls than float32; bf16 tensor cores on a
        GPU), float32 checkpoints included, as SGLang and vLLM downcast those (one log line says so; --dtype float32 keeps them exact).
        Without native bf16 a float32 checkpoint stays float32, and a CPU runs any other in float32
        too (emulated bf16 is slower). A GPU runs a bf16 or float16 checkpoint in its own dtype.
        The embedded tiny model stays float32: it is there for the same bits on every machine."""
        if dtype != "auto":
            return _DTYPES[dtype]
        checkpoint = self.torch_dtype or "bfloat16"
        native = has_native_bf16(device)
        if checkpoint == "float32":
            if not native or _is_embedded_tiny_model(self.model_path):
                return torch.float32
            logger.info("--dtype auto: running the float32 checkpoint in bfloat16 (this %s has native bf16); "
                        "--dtype float32 keeps float32", device)
            return torch.bfloat16
        if device == "cpu":
            return torch.bfloat16 if native else torch.float32
        return _DTYPES.get(checkpoint, torch.bfloat16)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _is_embedded_tiny_model(model_path: Optional[str]) -> bool:
    """The tiny model served when no --model-path is given (radixserve/tiny_model.py's cache)."""
    from radixserve.tiny_model import tiny_model_cache_root

    if not model_path:
        return False
    path = Path(model_path).resolve()
    return path.name.startswith("tiny_qwen3-") and path.parent == tiny_model_cache_root().resolve()


def has_native_bf16(device: str) -> bool:
    """Whether bf16 matmuls run in hardware on this device (not emulated through float32)."""
    if device == "cpu":
        return cpu_has_native_bf16()
    if device.startswith("cuda") and torch.cuda.is_available():
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    return False


def cpu_has_native_bf16() -> bool:
    """Whether bf16 weights multiply at least at float32's speed on this CPU: in hardware
    (AVX512_BF16, AMX), or in the engine's own bf16 GEMM (csrc/cpu_kernels.cpp; on AVX2 + FMA it
    widens the weights to float32 in registers, with float32 activations: half float32's bytes,
    measured faster than torch's float32 GEMM at decode and prefill sizes, benchmarks/NOTES.md)."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    if any(bool(getattr(cpu, name, lambda: False)()) for name in checks):
        return True
    from radixserve.layers import cpu_kernels

    ops = cpu_kernels.get()
    return ops is not None and bool(ops.has_bf16_gemm())


def _sliding_window(cfg: Dict[str, Any]) -> Optional[int]:
    """The window of a config's windowed layers, None when it has none (_window_layers)."""
    return int(cfg["sliding_window"]) if any(_window_layers(cfg)) else None


# Families whose configs keep a sliding_window that only use_sliding_window (off by default) turns on.
WINDOW_OFF_BY_DEFAULT = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
# layer_types entries served as their config says (linear_attention: the hybrid models' own layers).
KNOWN_LAYER_TYPES = {"full_attention", "sliding_attention", "linear_attention"}
# Families whose layer_types default to every sliding_window_pattern-th layer global, the others windowed.
WINDOW_PATTERN_DEFAULTS = {"gemma3_text": 6, "gemma3": 6}


def _window_layers(cfg: Dict[str, Any]) -> List[bool]:
    """Which layers attend through the window, by transformers' rules: `layer_types` names them
    where a config has it (transformers 5 saves it); else a non-null `sliding_window` windows every
    layer of Mistral, and for the Qwen families only with use_sliding_window (off by default):
    the layers from max_window_layers on (Qwen2, Qwen3), every layer (Qwen3-MoE)."""
    n = cfg["num_hidden_layers"]
    if not cfg.get("sliding_window"):
        return []
    layer_types = cfg.get("layer_types")
    model_type = cfg.get("model_type", "")
    if layer_types is not None:
        unknown = sorted(set(layer_types) - KNOWN_LAYER_TYPES)
        if unknown:  # e.g. Llama 4's chunked_attention: served as full attention it would answer wrongly
            raise LoadError(f"layer_types {unknown} (with sliding_window {cfg['sliding_window']}): this attention "
                            f"is not implemented; radixserve serves {sorted(KNOWN_LAYER_TYPES)} only")
        windowed = [t == "sliding_attention" for t in layer_types]
    elif model_type in WINDOW_PATTERN_DEFAULTS:
        pattern = int(cfg.get("sliding_window_pattern") or WINDOW_PATTERN_DEFAULTS[model_type])
        windowed = [(i + 1) % pattern != 0 for i in range(n)]
    elif not cfg.get("use_sliding_window", model_type not in WINDOW_OFF_BY_DEFAULT):
        windowed = []
    else:
        first = 0 if model_type == "qwen3_moe" else cfg.get("max_window_layers", 0)
        windowed = [i >= first for i in range(n)]
    return windowed if any(windowed) else []


def _as_list(x: Any) -> List[int]:
    if x is None:
        return []
    return [int(v) for v in x] if isinstance(x, (list, tuple)) else [int(x)]


def _where(model_path: Optional[str], name: str) -> str:
    return os.path.join(model_path, name) if model_path else name


# ---- GGUF metadata -> a Hugging Face style config dict --------------------------------------

_MISSING = object()


def open_gguf(path: str) -> "GGUFIndex":
    """The file's metadata and tensor table (GGUFIndex); LoadError naming the file if it is not
    a GGUF file we can read."""
    try:
        return GGUFIndex(path)
    except ImportError:
        raise LoadError(f"{path}: reading a GGUF file needs the gguf package (pip install gguf)") from None
    except (ValueError, struct.error, OSError, UnicodeDecodeError, IndexError) as e:
        raise LoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {str(e).strip()})") from None


class SkippedArray:
    """A metadata array left unread (the token list, the merges): only its length is kept."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        return f"<array of {self.n} values, not read>"


@dataclass
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType (an int when the package does not know it)
    shape: Tuple[int, ...]  # ggml order, innermost first (as gguf.ReaderTensor.shape)
    data: Any  # numpy view of the bytes, as gguf.GGUFReader gives it; None for an unknown type


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_ARRAY = 4096  # longer arrays (tokens, merges, scores) are skipped: the config needs none


class GGUFIndex:
    """A GGUF file's metadata (key -> Python value) and tensor table, read from a memory map:
    each tensor's data is a zero-copy numpy view shaped as gguf.GGUFReader shapes it (what
    gguf.quants.dequantize takes). gguf.GGUFReader reads the same, but makes numpy objects of
    every token string and merge: seconds for a 50k vocabulary, at every start; this reader
    skips those arrays (the tokenizer is built by transformers from the file itself)."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._mm
        if buf[:4] != b"GGUF":
            raise ValueError("no GGUF magic number")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (a big-endian file, or not 2 or 3)")
        off = 24
        self.fields: Dict[str, Any] = {}
        for _ in range(n_kv):
            key, off = _gguf_str(buf, off)
            (vtype,) = struct.unpack_from("<I", buf, off)
            self.fields[key], off = _gguf_value(buf, off + 4, vtype)
        infos = []
        for _ in range(n_tensors):
            name, off = _gguf_str(buf, off)
            (n_dims,) = struct.unpack_from("<I", buf, off)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
            ttype, rel = struct.unpack_from("<IQ", buf, off + 4 + 8 * n_dims)
            off += 16 + 8 * n_dims
            infos.append((name, dims, ttype, rel))
        align = int(self.fields.get("general.alignment", 32))
        start = off + (-off % align)
        self.tensors = [GGUFTensor(name, *self._tensor(start + rel, ttype, dims)) for name, dims, ttype, rel in infos]

    def _tensor(self, offset: int, ttype: int, dims: Tuple[int, ...]) -> Tuple[Any, Tuple[int, ...], Any]:
        import numpy as np
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        try:
            qtype = GGMLQuantizationType(ttype)
        except ValueError:
            return ttype, tuple(dims), None
        shape = tuple(reversed(dims))
        plain = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                 "I16": np.int16, "I32": np.int32, "I64": np.int64}.get(qtype.name)
        n = math.prod(dims)
        if plain is None:
            block, size = GGML_QUANT_SIZES[qtype]
            shape, plain, n = quant_shape_to_byte_shape(shape, qtype), np.uint8, n * size // block
        return qtype, tuple(dims), np.frombuffer(self._mm, dtype=plain, count=n, offset=offset).reshape(shape)


def _gguf_str(buf: Any, off: int) -> Tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, off)
    return bytes(buf[off + 8 : off + 8 + n]).decode("utf-8"), off + 8 + n


def _gguf_value(buf: Any, off: int, vtype: int) -> Tuple[Any, int]:
    if vtype in _SCALARS:
        fmt = "<" + _SCALARS[vtype]
        return struct.unpack_from(fmt, buf, off)[0], off + struct.calcsize(fmt)
    if vtype == _STRING:
        return _gguf_str(buf, off)
    if vtype != _ARRAY:
        raise ValueError(f"unknown metadata value type {vtype}")
    etype, n = struct.unpack_from("<IQ", buf, off)
    off += 12
    if etype in _SCALARS:
        fmt = f"<{n}{_SCALARS[etype]}"
        end = off + struct.calcsize(fmt)
        return (list(struct.unpack_from(fmt, buf, off)) if n <= _MAX_ARRAY else SkippedArray(n)), end
    out = []
    for _ in range(n):  # strings (or nested arrays): walk them, keep them only when few
        if etype == _STRING:
            (size,) = struct.unpack_from("<Q", buf, off)
            if n <= _MAX_ARRAY:
                out.append(bytes(buf[off + 8 : off + 8 + size]).decode("utf-8"))
            off += 8 + size
        else:
            value, off = _gguf_value(buf, off, etype)
            out.append(value)
    return (out if n <= _MAX_ARRAY else SkippedArray(n)), off


def _gguf_moe_config(hp: Any, tensors: Dict[str, Any], n_layers: int) -> Dict[str, Any]:
    """Qwen3-MoE's config entries: llama.cpp's qwen3moe always renormalizes the top-k weights
    (transformers' GGUF loading sets norm_topk_prob too); a layer without a router is dense."""
    return {
        "num_experts": int(hp("expert_count")),
        "num_experts_per_tok": int(hp("expert_used_count")),
        "moe_intermediate_size": int(hp("expert_feed_forward_length")),
        "norm_topk_prob": True,
        "mlp_only_layers": [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors],
    }


def gguf_to_hf_config(reader: GGUFIndex, path: str) -> Dict[str, Any]:
    """The config.json a GGUF's metadata stands for (keys as ModelConfig.from_dict reads them),
    plus "gguf_architecture" (the loader undoes llama.cpp's Q/K row permutation for llama) and
    "o_bias". Raises LoadError naming the file and what is missing or unsupported."""

    def meta(key: str, default: Any = _MISSING) -> Any:
        if key not in reader.fields:
            if default is _MISSING:
                raise LoadError(f"{path}: GGUF metadata has no {key!r}")
            return default
        return reader.fields[key]

    arch = str(meta("general.architecture"))
    if arch not in GGUF_ARCHITECTURES:
        raise LoadError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
    n_split = int(meta("split.count", 1))
    if n_split > 1:
        raise LoadError(f"{path}: a split GGUF ({n_split} files) is not supported; merge it first (llama-gguf-split --merge)")

    def hp(key: str, default: Any = _MISSING) -> Any:
        return meta(f"{arch}.{key}", default)

    def uniform(key: str, default: Any = _MISSING) -> int:
        v = hp(key, default)
        if isinstance(v, list):  # per-layer values: we support only models whose layers agree
            if len(set(v)) != 1:
                raise LoadError(f"{path}: per-layer {arch}.{key} values differ ({sorted(set(v))}); unsupported")
            v = v[0]
        return int(v)

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise LoadError(f"{path}: no tensor 'token_embd.weight'")
    hidden = int(hp("embedding_length"))
    n_heads = uniform("attention.head_count")
    n_kv = uniform("attention.head_count_kv", n_heads)
    head_dim = int(hp("attention.key_length", hidden // n_heads))
    value_dim = int(hp("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise LoadError(f"{path}: {arch}.attention.value_length {value_dim} != key_length {head_dim}; unsupported")
    rope_dim = int(hp("rope.dimension_count", head_dim))
    rope_theta = float(hp("rope.freq_base", 10000.0))
    # ggml shapes are innermost first: token_embd is [hidden, vocab].
    vocab = int(tensors["token_embd.weight"].shape[1])
    eos = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        tid = meta(f"tokenizer.ggml.{key}", None)
        if tid is not None and int(tid) not in eos:
            eos.append(int(tid))
    cfg: Dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": _GGUF_MODEL_TYPES.get(arch, arch),
        "gguf_architecture": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": uniform("feed_forward_length", hp("expert_feed_forward_length", 0)),
        "num_hidden_layers": int(hp("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "max_position_embeddings": int(hp("context_length", 4096)),
        "rms_norm_eps": float(hp("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": _gguf_rope_scaling(hp, tensors, rope_dim, rope_theta, path),
        "partial_rotary_factor": rope_dim / head_dim,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": arch in ("llama", "mistral") and "blk.0.attn_q.bias" in tensors,
        "o_bias": "blk.0.attn_output.bias" in tensors,
        "hidden_act": "silu",
        "torch_dtype": _gguf_checkpoint_dtype(meta("general.file_type", None)),
        "eos_token_id": eos,
    }
    if arch == "qwen3moe":
        cfg.update(_gguf_moe_config(hp, tensors, cfg["num_hidden_layers"]))
    window = hp("attention.sliding_window", None)
    if window:
        cfg["sliding_window"] = int(window)
    if arch == "gemma3":
        cfg.update(_gguf_gemma3_config(cfg))
        if GEMMA3_END_OF_TURN not in eos:  # a chat turn ends there (the HF checkpoints' generation_config says so)
            eos.append(GEMMA3_END_OF_TURN)
    bos = meta("tokenizer.ggml.bos_token_id", None)
    if bos is not None:
        cfg["bos_token_id"] = int(bos)
    return cfg


GEMMA3_END_OF_TURN = 106  # <end_of_turn> in every Gemma 3 vocabulary


def _gguf_gemma3_config(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """What a gemma3 GGUF leaves to the defaults that transformers' and llama.cpp's Gemma 3 share:
    GeGLU (tanh), local RoPE base 10000, every 6th layer global (llama.cpp's n_swa_pattern);
    query_pre_attn_scalar is head_dim, except the 27B (62 layers: hidden / heads, llama.cpp's rule)."""
    scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if cfg["num_hidden_layers"] == 62 else cfg["head_dim"]
    return {"model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh", "rope_local_base_freq": 10000.0,
            "sliding_window_pattern": 6, "query_pre_attn_scalar": scalar}


def _gguf_checkpoint_dtype(file_type: Optional[int]) -> str:
    """What --dtype auto sees as the checkpoint's dtype. An all-F32 file is float32 and a
    mostly-F16 one float16; quantized files came from bf16/fp16 checkpoints: bfloat16 (which
    resolve_dtype runs as bf16 on a GPU or a CPU with native bf16, else float32)."""
    return {0: "float32", 1: "float16"}.get(file_type, "bfloat16") if file_type is not None else "bfloat16"


def _gguf_rope_scaling(hp: Any, tensors: Dict[str, Any], rope_dim: int, base: float, path: str) -> Optional[Dict[str, Any]]:
    kind = hp("rope.scaling.type", None)
    factor = hp("rope.scaling.factor", None)
    if kind == "linear" and factor is not None and float(factor) != 1.0:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind not in (None, "none", "linear"):
        raise LoadError(f"{path}: rope scaling {kind!r} is not supported (only linear and llama3)")
    if "rope_freqs.weight" in tensors:
        # Llama 3.x: the converter stores the llama3 scaling as one factor per frequency.
        # Rebuild the rope_scaling dict it came from (Meta's constants) and check it matches.
        import numpy as np

        got = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float64).reshape(-1)
        if np.allclose(got, 1.0):
            return None
        scaling = {"rope_type": "llama3", "factor": float(got.max()), "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": int(hp("rope.scaling.original_context_length", 8192))}
        want = _llama3_rope_factors(scaling, rope_dim, base)
        if len(want) != len(got) or not np.allclose(got, want, rtol=1e-3):
            raise LoadError(f"{path}: rope_freqs.weight is not a llama3 rope scaling we can rebuild; unsupported")
        return scaling
    return None


def _llama3_rope_factors(cfg: Dict[str, Any], rope_dim: int, base: float) -> List[float]:
    """llama.cpp's convert_hf_to_gguf rope_freqs for a llama3 rope_scaling (inv_freq / factor)."""
    factor, low, high = cfg["factor"], cfg["low_freq_factor"], cfg["high_freq_factor"]
    old_ctx = cfg["original_max_position_embeddings"]
    out = []
    for i in range(0, rope_dim, 2):
        wavelen = 2 * math.pi * base ** (i / rope_dim)
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out
