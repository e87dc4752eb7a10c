"""Load a model from a Hugging Face directory (single or sharded safetensors), from one GGUF
file (gguf_loader.py), or make dummy (seeded random) weights. Every error names the file and,
where there is one, the tensor."""

from __future__ import annotations

import glob
import json
import logging
import os
from functools import partial
from typing import Callable, Dict, FrozenSet, Iterator, List, Optional, Tuple

import torch
from safetensors import safe_open
from torch import nn

from radixserve.distributed.parallel_state import get_pp_group, get_tp_group
from radixserve.layers.cpu_weight_only import weight_only_available
from radixserve.layers.moe import FusedMoE
from radixserve.layers.quantization import GGUFLinearMethod, kernel_types
from radixserve.layers.quantization.gguf import TRITON_TYPES
from radixserve.model_executor.gguf_loader import gguf_block_experts, gguf_block_tensors, gguf_weights
from radixserve.models.llama import is_stage_weight
from radixserve.models.model_config import LoadError, ModelConfig
from radixserve.models.qwen3_moe import is_sparse_layer, num_experts
from radixserve.models.registry import get_model_class
from radixserve.models.weight_utils import NamedWeight, param_name_for
from radixserve.utils import progress

logger = logging.getLogger(__name__)


# Every quantized ggml type the gguf package dequantizes: what --quantization gguf keeps in blocks
# where the C++ kernel is not built (its torch fallback dequantizes a tile of rows at a time).
GGUF_QUANT_TYPES = frozenset({2, 3, 6, 7, 8, 10, 11, 12, 13, 14})  # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K..Q6_K


def check_w8a8(quantization: str, config: ModelConfig, device: str) -> bool:
    """--quantization w8a8_int8: whether to quantize the linear layers at load; refused with one
    line where it cannot apply."""
    if quantization != "w8a8_int8":
        return False
    if config.gguf_file:
        raise LoadError(f"--quantization w8a8_int8 quantizes a safetensors checkpoint; {config.gguf_file} is a GGUF "
                        "file, whose own blocks --quantization gguf keeps")
    if device != "cpu" and not triton_available():
        raise LoadError("--quantization w8a8_int8 on a GPU needs triton (its Q8_0 kernel is Triton's there); pip install triton")
    return True


def triton_available() -> bool:
    """Whether triton can be imported (the GPU's GGUF kernels), without importing it."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def use_w8a8(model: nn.Module) -> int:
    """Before loading: every linear layer whose input width whole Q8_0 blocks cut quantizes its
    checkpoint rows at load. The embedding, the LM head and the MoE routers and expert gates stay
    as loaded, as in SGLang: a router's rounded logits would pick other experts. Returns how many."""
    from radixserve.layers.linear import LinearBase
    from radixserve.layers.moe import TopKRouter
    from radixserve.layers.quantization.w8a8_int8 import W8A8Int8LinearMethod, can_quantize

    layers = [m for m in model.modules() if isinstance(m, LinearBase) and not isinstance(m, TopKRouter)
              and m.out_features > 1 and can_quantize(m.in_features)]
    for layer in layers:
        layer.use_quant_method(W8A8Int8LinearMethod())
    return len(layers)


def gguf_block_types(quantization: str, config: ModelConfig, dtype: torch.dtype, device: str) -> FrozenSet[int]:
    """--quantization: the ggml types whose linear-layer tensors stay in their blocks (empty: every
    tensor is dequantized at load, as with --quantization none). auto keeps them in the CPU's bf16
    mode (bf16 weights, float32 activations: llama.cpp's numerics) where the integer kernel is
    built; --dtype float32 dequantizes, the exact reference for a quantized file."""
    if quantization == "gguf" and not config.gguf_file:
        raise LoadError(f"--quantization gguf: {config.model_path} is not a .gguf file")
    if quantization == "none" or not config.gguf_file:
        return frozenset()
    if device != "cpu":
        # A GPU keeps the blocks only when asked (the Triton kernels, layers/quantization/triton_gguf.py,
        # take every type GGUF_QUANT_TYPES names); auto dequantizes to --dtype, as before.
        if quantization != "gguf":
            return frozenset()
        if not triton_available():
            raise LoadError("--quantization gguf on a GPU needs triton (the GGUF kernels there are Triton's); "
                            "pip install triton, or use --quantization none (dequantized at load)")
        return TRITON_TYPES
    if quantization == "gguf":
        return kernel_types() or GGUF_QUANT_TYPES
    return kernel_types() if weight_only_available(dtype, device) else frozenset()


def get_model(config: ModelConfig, load_format: str, dtype: torch.dtype, device: str, seed: int = 0,
              block_types: FrozenSet[int] = frozenset(), w8a8: bool = False) -> nn.Module:
    where = config.gguf_file or _path(config.model_path, "config.json")
    model_cls = get_model_class(config.architecture, where)
    # --pp-size: only this stage's tensors are read (or dequantized)
    keep = partial(is_stage_weight, num_layers=config.num_hidden_layers, tied=config.tie_word_embeddings) \
        if get_pp_group().size > 1 else None
    if load_format == "dummy":
        weights = dummy_weights(config, seed, keep)
    elif config.gguf_file:
        if load_format not in ("auto", "gguf"):
            raise LoadError(f"{config.gguf_file}: a GGUF file, but --load-format {load_format}; use --load-format auto")
        weights = gguf_weights(config, dtype, keep, block_types)  # opens the file and checks its quant types now
    else:
        weights = iterate_safetensors(config.model_path, keep)
    with torch.device(device):
        model = model_cls(config)
    # The layers that keep a GGUF's blocks drop their float weights first, before the cast below
    # would write (and so make resident) a bf16 copy of them.
    for name in gguf_block_tensors(config, block_types) if load_format != "dummy" else ():
        if keep is not None and not keep(name):  # another pipeline stage's layer
            continue
        layer = model.get_submodule(param_name_for(name, model.stacked_params_mapping)[0].rsplit(".", 1)[0])
        if not isinstance(layer.quant_method, GGUFLinearMethod):  # a fused layer: once for its parts
            layer.use_quant_method(GGUFLinearMethod())
    if load_format != "dummy" and config.gguf_file and gguf_block_experts(config, block_types):
        for moe in (m for m in model.modules() if isinstance(m, FusedMoE)):
            moe.keep_gguf_blocks()  # the experts too: the file's size in memory, not bf16's
    if w8a8:
        logger.info("--quantization w8a8_int8: %d linear layers quantized to Q8_0 blocks as they load", use_w8a8(model))
    # Cast before loading: the (still untouched) float32 parameters are never filled, so a
    # bf16 model never holds a float32 copy of its weights; each tensor is cast as it is copied in.
    model = model.to(dtype=dtype)
    total = None if keep is not None else _num_tensors(config, load_format)
    model.load_weights(_with_progress(weights, total, "Loading weights" + (" (GGUF)" if config.gguf_file else "")))
    return model.to(dtype=dtype).eval()


def _num_tensors(config: ModelConfig, load_format: str) -> Optional[int]:
    """How many tensors the checkpoint holds (the progress bar's total); None where counting costs a read."""
    if load_format == "dummy":
        return len(checkpoint_shapes(config))
    if config.gguf_file:
        return None
    total = 0
    for fn in safetensors_files(config.model_path):
        with safe_open(fn, framework="pt") as f:  # reads the header only
            total += len(f.keys())
    return total


def _with_progress(weights: Iterator[NamedWeight], total: Optional[int], desc: str) -> Iterator[NamedWeight]:
    """The weights, counted on a progress bar (TP rank 0 only; a terminal only) that names the shard
    being read (a GGUF's tensors are dequantized or copied out of their blocks as they come)."""
    bar = progress(total=total, desc=desc, unit="tensor", enabled=get_tp_group().rank == 0)
    shard = None
    try:
        for name, tensor, fn in weights:
            if fn != shard and not bar.disable:
                shard = fn
                bar.set_postfix_str(os.path.basename(fn), refresh=False)
            yield name, tensor, fn
            bar.update(1)
    finally:
        bar.close()


def safetensors_files(model_path: str) -> List[str]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted({os.path.join(model_path, v) for v in weight_map.values()})
        for fn in files:
            if not os.path.isfile(fn):
                raise LoadError(f"{fn}: file not found (listed in {index})")
        return files
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise LoadError(f"{model_path}: no *.safetensors files (use --load-format dummy for random weights)")
    return files


def iterate_safetensors(model_path: str, keep: Optional[Callable[[str], bool]] = None) -> Iterator[NamedWeight]:
    """keep: which tensors to read (a pipeline stage's); None: all."""
    for fn in safetensors_files(model_path):
        with safe_open(fn, framework="pt") as f:
            for name in f.keys():
                if keep is None or keep(name):
                    yield name, f.get_tensor(name), fn


def checkpoint_shapes(config: ModelConfig) -> Dict[str, Tuple[int, ...]]:
    """Name -> shape of every tensor of a Hugging Face checkpoint of this config, in file order
    (full tensors, before any TP split)."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    nq, nkv = config.num_attention_heads, config.num_key_value_heads
    qkv_bias = config.attention_bias or config.architecture == "Qwen2ForCausalLM"
    qk_norm = config.architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    moe = config.architecture == "Qwen3MoeForCausalLM"
    shapes: Dict[str, Tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        layer_shapes = {
            "self_attn.q_proj.weight": (nq * d, h),
            "self_attn.k_proj.weight": (nkv * d, h),
            "self_attn.v_proj.weight": (nkv * d, h),
            "self_attn.o_proj.weight": (h, nq * d),
        }
        if moe and is_sparse_layer(config.hf_config, layer):  # the router, then each expert's projections
            e, mi = num_experts(config.hf_config), config.hf_config["moe_intermediate_size"]
            layer_shapes["mlp.gate.weight"] = (e, h)
            for x in range(e):
                layer_shapes.update({f"mlp.experts.{x}.gate_proj.weight": (mi, h), f"mlp.experts.{x}.up_proj.weight": (mi, h),
                                     f"mlp.experts.{x}.down_proj.weight": (h, mi)})
        else:
            layer_shapes.update({"mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)})
        if qkv_bias:
            layer_shapes.update({"self_attn.q_proj.bias": (nq * d,), "self_attn.k_proj.bias": (nkv * d,),
                                 "self_attn.v_proj.bias": (nkv * d,)})
        if config.o_bias:
            layer_shapes["self_attn.o_proj.bias"] = (h,)
        layer_shapes.update({"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)})
        if qk_norm:
            layer_shapes.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
        shapes.update({p + name: shape for name, shape in layer_shapes.items()})
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def dummy_weights(config: ModelConfig, seed: int, keep: Optional[Callable[[str], bool]] = None) -> Iterator[NamedWeight]:
    """Seeded random weights named and shaped like a Hugging Face checkpoint, so they go
    through the same loaders (and the same TP slicing) as real ones. keep: which to yield; every
    tensor is still drawn, so a pipeline stage gets the very weights of the whole model."""
    gen = torch.Generator().manual_seed(seed)
    for name, shape in checkpoint_shapes(config).items():
        if name == "model.embed_tokens.weight":
            tensor = torch.randn(*shape, generator=gen)
        elif name == "model.norm.weight":
            tensor = torch.ones(shape)
        elif name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * torch.randn(*shape, generator=gen)
        else:
            tensor = torch.randn(*shape, generator=gen) * (shape[-1] ** -0.5 if len(shape) > 1 else 0.02)
        if keep is None or keep(name):
            yield name, tensor, "dummy"


def _path(model_path, name: str) -> str:
    return os.path.join(model_path, name) if model_path else name
