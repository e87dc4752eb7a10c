"""Weights from one GGUF file (llama.cpp's format), beside the safetensors loading of
model_loader.py: each tensor is renamed to the Hugging Face checkpoint name and handed to the
same load_named_weights path, so tensor parallel slicing and the fused q/k/v and gate/up
parameters work as for safetensors. A linear layer's tensor whose type is in `block_types`
(--quantization, model_loader.gguf_block_types) goes as a QuantizedWeight, in the file's blocks;
every other tensor is dequantized (F32, F16, BF16, Q8_0, Q4_0/1, Q5_0/1, the K quants, ...:
whatever gguf.quants.dequantize knows) to the model's dtype, one at a time.

llama.cpp's converter permutes the rows of the llama q/k projections (LlamaModel.permute in
convert_hf_to_gguf.py: each head's rotary halves interleaved, for its GPT-J style rope); we undo
that for llama (and mistral). qwen2/qwen3 are written unpermuted (neox rope, as ours).

gemma3: ffn_norm is the pre-feed-forward norm (post_attention_norm and post_ffw_norm the two
after), and the converter stores every norm with Gemma's + 1 added: we take it off, as
transformers' Gemma2TensorProcessor does (the model adds it back: GemmaRMSNorm)."""

from __future__ import annotations

import re
import warnings
from typing import Any, Callable, FrozenSet, Iterator, Optional

import torch

from radixserve.layers.quantization import QuantizedWeight
from radixserve.models.model_config import LoadError, ModelConfig, open_gguf
from radixserve.models.weight_utils import NamedWeight

# GGUF tensor name -> Hugging Face checkpoint name.
_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # qwen3moe: the router
}
# qwen3moe: every expert's projection stacked in one tensor [experts, rows, cols] (numpy order),
# handed on as each expert's own HF tensor (mlp.experts.<e>.<proj>.weight): dequantized, or in its
# blocks where its type is in block_types (FusedMoE.keep_gguf_blocks).
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_STACKED = "mlp.experts.<e>."  # stands for the expert index in hf_name's answer

# Where an architecture names its block tensors otherwise.
_BLOCK_BY_ARCH = {
    "gemma3": {**_BLOCK, "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
_NORM_PLUS_ONE_ARCHS = ("gemma3",)  # norms stored as 1 + weight
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# The linear layers' weights, and the embedding and LM head: the tensors that may stay in their blocks.
_LINEAR_RE = re.compile(r"^blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$")
_VOCAB = ("token_embd.weight", "output.weight")
# Folded into the config instead (rope_freqs: the llama3 rope scaling, see ModelConfig.from_gguf).
_SKIP = {"rope_freqs.weight"}
_PERMUTED_ARCHS = ("llama", "mistral")


def hf_name(gguf_name: str, arch: Optional[str] = None) -> Optional[str]:
    """The Hugging Face checkpoint name of a GGUF tensor (of a file of GGUF architecture arch);
    None for one we do not know."""
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    block = _BLOCK_BY_ARCH.get(arch, _BLOCK)
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in block:
        return f"model.layers.{m.group(1)}.{block[m.group(2)]}.{m.group(3)}"
    if m and m.group(2) in _EXPERTS and m.group(3) == "weight":
        return f"model.layers.{m.group(1)}.{_STACKED}{_EXPERTS[m.group(2)]}.weight"
    return None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's LlamaModel.permute(w, n_head, n_head) on q (n_head = heads) or
    k (n_head = kv heads) rows; works on weights and biases alike."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_block_tensors(config: ModelConfig, block_types: FrozenSet[int]) -> Iterator[str]:
    """The HF names of the linear-layer tensors that stay in their blocks (their type is in
    block_types): the layers to give GGUFLinearMethod before loading."""
    if not block_types:
        return
    for t in open_gguf(config.gguf_file).tensors:
        if int(t.tensor_type) in block_types and _LINEAR_RE.match(t.name):
            yield hf_name(t.name, config.hf_config.get("gguf_architecture"))


def gguf_block_experts(config: ModelConfig, block_types: FrozenSet[int]) -> bool:
    """Whether the file's experts stay in their blocks (some stacked expert tensor has a type in
    block_types): the MoE layers to switch to FusedMoE.keep_gguf_blocks before loading."""
    return bool(block_types) and any(int(t.tensor_type) in block_types and _expert_part(t.name)
                                     for t in open_gguf(config.gguf_file).tensors)


def _expert_part(gguf_name: str) -> bool:
    m = _BLOCK_RE.match(gguf_name)
    return bool(m) and m.group(2) in _EXPERTS


def gguf_weights(config: ModelConfig, dtype: torch.dtype, keep: Optional[Callable[[str], bool]] = None,
                 block_types: FrozenSet[int] = frozenset()) -> Iterator[NamedWeight]:
    """(HF name, tensor in dtype or QuantizedWeight, file) for every tensor of config.gguf_file.
    The file is opened and every quant type is checked here, before the model is built; the
    returned iterator then dequantizes lazily, one tensor at a time (never a full float32 copy of
    the model). keep: which HF-named tensors to read (a pipeline stage's); None: all.
    block_types: the ggml types a linear layer's weight keeps (as QuantizedWeight)."""
    path = config.gguf_file
    reader = open_gguf(path)
    import gguf

    checked = set()
    arch = config.hf_config.get("gguf_architecture")
    for t in reader.tensors:
        if t.name in _SKIP:
            continue
        if hf_name(t.name, arch) is None:
            raise LoadError(f"{path}: unexpected tensor {t.name!r} for a {config.hf_config.get('gguf_architecture')} model")
        qtype = t.tensor_type
        if t.data is None:
            raise LoadError(f"{path}: tensor {t.name!r} has ggml type id {qtype}, unknown to the gguf package")
        if qtype not in checked:  # dequantize one row: unsupported types fail here, in one line
            try:
                gguf.quants.dequantize(t.data[:1] if t.data.ndim > 1 else t.data, qtype)
            except NotImplementedError:
                name = getattr(qtype, "name", str(qtype))
                raise LoadError(f"{path}: tensor {t.name!r} has quant type {name}, which the gguf package cannot dequantize") from None
            checked.add(qtype)
    return _iterate(reader, config, dtype, path, keep, block_types)


def _iterate(reader: Any, config: ModelConfig, dtype: torch.dtype, path: str,
             keep: Optional[Callable[[str], bool]], block_types: FrozenSet[int]) -> Iterator[NamedWeight]:
    import gguf

    arch = config.hf_config.get("gguf_architecture")
    permute = arch in _PERMUTED_ARCHS
    for t in reader.tensors:
        name = hf_name(t.name, arch)
        if name is None or (keep is not None and not keep(name)):
            continue
        if _STACKED in name:
            yield from _expert_tensors(t, name, dtype, path, int(t.tensor_type) in block_types)
            continue
        if int(t.tensor_type) in block_types and (_LINEAR_RE.match(t.name) or t.name in _VOCAB):
            # The file's blocks, copied out of the memory map: [rows, row bytes], rows as the HF
            # checkpoint's (ggml shapes are innermost first: (cols, rows)).
            with warnings.catch_warnings():  # a read-only view of the memory map, read once here
                warnings.simplefilter("ignore", UserWarning)
                data = torch.from_numpy(t.data).clone()  # memory torch owns (release/resume frees it)
            if permute and (".q_proj." in name or ".k_proj." in name):  # whole rows move: the blocks stay
                data = unpermute_qk(data, config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads)
            yield name, QuantizedWeight(int(t.tensor_type), data.contiguous(), int(t.shape[0])), path
            continue
        # Dequantized to float32 (numpy), shaped [rows, cols] as in the HF checkpoint.
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        if not arr.flags.writeable:  # F32: a view of the read-only memory map
            arr = arr.copy()
        if arch in _NORM_PLUS_ONE_ARCHS and name.endswith("norm.weight"):
            arr = arr - 1  # in float32, as transformers does (GemmaRMSNorm adds the 1 back)
        tensor = torch.from_numpy(arr).to(dtype)
        if permute and (".q_proj." in name or ".k_proj." in name):
            n_head = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            tensor = unpermute_qk(tensor, n_head)
        yield name, tensor, path


def _expert_tensors(t: Any, stacked_name: str, dtype: torch.dtype, path: str, blocks: bool) -> Iterator[NamedWeight]:
    """A stacked expert tensor as each expert's [rows, cols] tensor: its blocks (blocks=True; the
    layer copies what it keeps), or dequantized one expert at a time (a float32 copy of the whole
    stack would be the layer's size x 2-8)."""
    import gguf

    for e in range(t.data.shape[0]):
        name = stacked_name.replace(_STACKED, f"mlp.experts.{e}.")
        if blocks:
            with warnings.catch_warnings():  # a read-only view of the memory map, copied by the layer
                warnings.simplefilter("ignore", UserWarning)
                data = torch.from_numpy(t.data[e])
            yield name, QuantizedWeight(int(t.tensor_type), data, int(t.shape[0])), path
            continue
        arr = gguf.quants.dequantize(t.data[e], t.tensor_type)
        if not arr.flags.writeable:
            arr = arr.copy()
        yield name, torch.from_numpy(arr).to(dtype), path
