"""Qwen2.5-VL (transformers' Qwen2_5_VLForConditionalGeneration): a vision encoder in front of
Qwen2's language model (models/llama.py with the q/k/v bias) whose rotary embedding is M-RoPE.

The vision encoder (Qwen2_5_VisionTransformer), per image of (t, h, w) patches:

    pixel patches [t*h*w, C*T*P*P] --patch_embed--> [N, E]
      reorder into windows (window_size pixels square, in units of 2x2 merged patches)
      blocks: RMSNorm -> attention with the 2-D rotary (row, column of each patch) -> RMSNorm -> MLP;
              inside one window, or over the whole image in fullatt_block_indexes
      merger: RMSNorm, every 2x2 patches concatenated -> MLP -> [N / 4, hidden of the LM]
      back to row-major order: one row per image placeholder token

The language model embeds a prompt's text tokens as usual and takes the encoder's rows at the
image's positions (multimodal/mm_inputs.py: the positions hold the image's pad value). An image's
embedding is computed once and kept in the MultimodalEmbeddingCache by the image's hash: the next
chunk of a chunked prefill and the next request about the same image take it from there.

Positions: the front end computed each prompt's 3-axis M-RoPE positions (multimodal/processor.py);
a token past the prompt (decode) sits at its position + the request's mrope_position_delta."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from radixserve.layers.rotary_embedding import MRotaryEmbedding
from radixserve.layers.vocab_parallel_embedding import ParallelLMHead
from radixserve.models.llama import LlamaForCausalLM, LlamaModel
from radixserve.models.model_config import LoadError, ModelConfig
from radixserve.models.weight_utils import NamedWeight, load_named_weights
from radixserve.multimodal.embedder import ImageEmbedder
from radixserve.multimodal.mm_cache import MultimodalEmbeddingCache
from radixserve.multimodal.mm_inputs import MM_PAD_BASE, MultimodalDataItem, MultimodalInputs
from radixserve.server_args import ServerArgs


@dataclass
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    in_channels: int = 3
    hidden_act: str = "silu"
    fullatt_block_indexes: Tuple[int, ...] = (7, 15, 23, 31)
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, d: dict) -> "VisionConfig":
        names = set(cls.__dataclass_fields__)
        kw = {k: v for k, v in d.items() if k in names}
        kw["fullatt_block_indexes"] = tuple(d.get("fullatt_block_indexes", cls.fullatt_block_indexes))
        kw["rope_theta"] = float((d.get("rope_parameters") or {}).get("rope_theta", cls.rope_theta))
        if kw.get("hidden_act", "silu") != "silu":
            raise LoadError(f"vision_config: unsupported hidden_act {kw['hidden_act']!r} (only silu)")
        return cls(**kw)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cu_seqlens: List[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # each [N, heads, head_dim]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, N, head_dim]
        out = torch.empty_like(q)
        # each segment (a window, or an image) attends only to itself
        for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            out[:, s:e] = F.scaled_dot_product_attention(q[:, s:e], k[:, s:e], v[:, s:e])
        return self.proj(out.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=True)
        self.up_proj = nn.Linear(dim, hidden, bias=True)
        self.down_proj = nn.Linear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, 1e-6)
        self.norm2 = RMSNorm(cfg.hidden_size, 1e-6)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.mlp = VisionMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, cu_seqlens: List[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1.forward(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2.forward(x))


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, context_dim: int, spatial_merge_size: int):
        super().__init__()
        self.hidden = context_dim * spatial_merge_size ** 2
        self.ln_q = RMSNorm(context_dim, 1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q.forward(x).view(-1, self.hidden))


class PatchEmbed(nn.Module):
    """transformers' Conv3d whose kernel is its stride: a matmul over each flattened patch."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size,
                                                    cfg.patch_size, cfg.patch_size))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return pixels.to(w.dtype) @ w.view(w.shape[0], -1).t()


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg.out_hidden_size, cfg.hidden_size, cfg.spatial_merge_size)

    @property
    def merge_unit(self) -> int:
        return self.cfg.spatial_merge_size ** 2

    def forward(self, pixels: torch.Tensor, grids: Sequence[Tuple[int, int, int]]) -> torch.Tensor:
        """pixels: the images' patches, concatenated; -> [sum of patches / merge_unit, out_hidden_size]."""
        device = pixels.device
        window_index, cu_window = window_partition(grids, self.cfg)
        window_index = window_index.to(device)
        cu_full = [0]
        for t, h, w in grids:  # full attention: over one frame of one image
            for _ in range(t):
                cu_full.append(cu_full[-1] + h * w)
        x = self._to_windows(self.patch_embed(pixels), window_index)
        rows_cols = rotary_positions(grids, self.cfg.spatial_merge_size).to(device)
        freqs = rows_cols[..., None] * vision_inv_freq(self.cfg, device)
        freqs = self._to_windows(freqs.flatten(1), window_index)  # [N, head_dim / 2]: rows' then columns'
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)
        for i, block in enumerate(self.blocks):
            x = block(x, cu_full if i in self.cfg.fullatt_block_indexes else cu_window, cos, sin)
        return self.merger(x)[torch.argsort(window_index)]

    def _to_windows(self, x: torch.Tensor, window_index: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        return x.reshape(n // self.merge_unit, self.merge_unit, -1)[window_index].reshape(n, -1)


def vision_inv_freq(cfg, device) -> torch.Tensor:
    """The 2-D rotary's frequencies, float32 whatever the model's dtype (a buffer would be cast):
    a patch's row turns the first quarter of each half of the head, its column the second."""
    quarter = cfg.head_dim // 2
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float32, device=device) / quarter))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def rotary_positions(grids: Sequence[Tuple[int, int, int]], merge: int) -> torch.Tensor:
    """[N, 2] (row, column) of each patch, in the encoder's order (merge x merge blocks together)."""
    out = []
    for t, h, w in grids:
        hpos, wpos = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        in_blocks = [p.reshape(shape).transpose(1, 2).flatten() for p in (hpos, wpos)]
        out.append(torch.stack(in_blocks, -1).repeat(t, 1))
    return torch.cat(out)


def window_partition(grids: Sequence[Tuple[int, int, int]], cfg: VisionConfig) -> Tuple[torch.Tensor, List[int]]:
    """(the merged-patch order that puts each window's patches together, the windows' [start,
    end) boundaries in patches): windows of window_size pixels, cut at the image's edge."""
    win = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
    unit = cfg.spatial_merge_size ** 2
    index, cu, base = [], [0], 0
    for t, h, w in grids:
        gh, gw = h // cfg.spatial_merge_size, w // cfg.spatial_merge_size
        ids = torch.arange(t * gh * gw).reshape(t, gh, gw)
        ph, pw = (-gh) % win, (-gw) % win
        padded = F.pad(ids, (0, pw, 0, ph), value=-1)
        nh, nw = (gh + ph) // win, (gw + pw) // win
        padded = padded.reshape(t, nh, win, nw, win).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, win * win)
        sizes = (padded >= 0).sum(-1).flatten()
        flat = padded.flatten()
        index.append(flat[flat >= 0] + base)
        for s in sizes.tolist():
            if s:
                cu.append(cu[-1] + s * unit)
        base += t * gh * gw
    return torch.cat(index), cu


def check_vision_server_args(args: ServerArgs, where: str) -> None:
    """What a model that takes images does not run with yet: refused at start, one line each."""
    refused = [
        (args.speculative_algorithm is not None, "--speculative-algorithm", "the draft models know nothing of the images"),
        (args.disaggregation_mode != "null", "--disaggregation-mode", "the images' positions are not transferred with the KV"),
        (args.enable_hierarchical_cache, "--enable-hierarchical-cache", "not tested with image prefixes"),
        (args.pp_size > 1, "--pp-size > 1", "the vision encoder is not split by stage"),
        (args.tp_size > 1, "--tp-size > 1", "the vision encoder is not split across ranks yet"),
        (args.enable_lora or bool(args.lora_paths), "--enable-lora", "not tested with the vision encoder"),
        (args.is_embedding, "--is-embedding", "not an embedding model"),
        (args.load_format != "auto", f"--load-format {args.load_format}", "the vision encoder loads from safetensors only"),
        (args.quantization not in ("auto", "none"), f"--quantization {args.quantization}", "the vision encoder is not quantized"),
    ]
    for on, what, why in refused:
        if on:
            raise LoadError(f"{where}: a vision-language model does not run with {what} yet ({why})")


class Qwen2_5_VLForConditionalGeneration(nn.Module):
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping
    takes_images = True  # the model runner checks the server args (check_vision_server_args)
    # what Qwen3-VL (models/qwen3_vl.py) sets otherwise
    qkv_bias, qk_norm = True, False
    mrope_interleaved, default_mrope_section = False, (16, 24, 24)

    def __init__(self, config: ModelConfig, mm_cache: Optional[MultimodalEmbeddingCache] = None):
        super().__init__()
        self.config = config
        hf = config.hf_config
        self.visual = self.make_visual(hf["vision_config"])
        self.model = LlamaModel(config, qkv_bias=self.qkv_bias or config.attention_bias, qk_norm=self.qk_norm)
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        mrope = MRotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                 list(rope.get("mrope_section", self.default_mrope_section)), self.mrope_interleaved)
        for layer in self.model.layers:
            layer.self_attn.rotary_emb = mrope
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.mm_cache = mm_cache if mm_cache is not None else MultimodalEmbeddingCache()
        self.embedder = ImageEmbedder(self.visual, self.mm_cache, lambda: self.lm_head.weight.device)

    @property
    def images_encoded(self) -> int:
        """Images the vision encoder has run on (the cache's misses that ran)."""
        return self.embedder.images_encoded

    def make_visual(self, vision_config: dict) -> nn.Module:
        return Qwen2_5_VisionTransformer(VisionConfig.from_dict(vision_config))

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch,
                get_embedding: bool = False) -> LogitsProcessorOutput:
        mm: Optional[List[Optional[MultimodalInputs]]] = getattr(forward_batch, "multimodal_inputs", None)
        deepstack = None
        if mm is None:  # text only: plain ids, 1-D positions (every M-RoPE axis the same)
            hidden = self.model.embed_tokens(input_ids)
        else:
            hidden = self.model.embed_tokens(input_ids.masked_fill(input_ids >= MM_PAD_BASE, 0))
            if forward_batch.forward_mode.is_extend():
                hidden, deepstack = merge_image_embeddings(hidden, mm, forward_batch, self.embedder)
            positions = batch_mrope_positions(positions, mm, forward_batch)
        residual = None
        for i, layer in enumerate(self.model.layers):
            hidden, residual = layer.forward(positions, hidden, residual, forward_batch)
            if deepstack is not None and i < deepstack[1].shape[0]:  # Qwen3-VL: more of the image, early layers
                hidden = hidden.index_add(0, deepstack[0], deepstack[1][i])
        hidden, _ = self.model.norm(hidden, residual)
        if get_embedding:
            return hidden
        return self.logits_processor(hidden, self.lm_head, forward_batch)

    # ---- weights --------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[NamedWeight], require_all: bool = True) -> None:
        self.embedder.clear()  # a weight update: the cached encoder outputs are the old weights'
        vision = VisionWeights(self.visual, type(self).__name__)
        load_named_weights(self, vision.take((_canonical_name(n), t, fn) for n, t, fn in weights),
                           self.stacked_params_mapping, require_all, not_required=("visual.",))
        vision.check_all_loaded(require_all, self.config.model_path)


class VisionWeights:
    """The vision tower's tensors (visual.*) copied into `visual` as they stream by; the
    language model's passed on."""

    def __init__(self, visual: nn.Module, model_name: str):
        self.params = dict(visual.named_parameters())
        self.model_name = model_name
        self.loaded: set = set()

    def take(self, weights: Iterable[NamedWeight]) -> Iterable[NamedWeight]:
        """The language model's weights of `weights` (names already canonical: visual.* / model.*)."""
        for name, tensor, fn in weights:
            if not name.startswith("visual."):
                yield name, tensor, fn
                continue
            key = name[len("visual."):]
            param = self.params.get(key)
            if param is None:
                raise LoadError(f"{fn}: unexpected tensor {name!r} for {self.model_name}")
            if tuple(param.shape) != tuple(tensor.shape):
                raise LoadError(f"{fn}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
            self.loaded.add(key)

    def check_all_loaded(self, require_all: bool, where: Optional[str]) -> None:
        missing = sorted(set(self.params) - self.loaded)
        if missing and require_all:
            raise LoadError(f"{where or 'checkpoint'}: no tensor for parameter 'visual.{missing[0]}' "
                            f"({len(missing)} missing)")


def merge_image_embeddings(hidden: torch.Tensor, mm: List[Optional[MultimodalInputs]], forward_batch,
                           embedder: ImageEmbedder) -> Tuple[torch.Tensor, Optional[Tuple[torch.Tensor, torch.Tensor]]]:
    """The rows of this forward's tokens that are image tokens take the encoder's output; a
    chunk may hold any part of an image (chunked prefill), or none of it (a cached prefix).
    Also (those rows, [num_deepstack, rows, hidden]) where the encoder gives DeepStack
    features (Qwen3-VL: the columns after the first hidden_size), else None."""
    spans: List[Tuple[int, MultimodalDataItem, int, int]] = []  # (row in batch, item, first, end row of item)
    start = 0
    for m, pre, ext in zip(mm, forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu):
        for item in (m.items if m is not None else ()):
            lo, hi = max(item.offset, pre), min(item.end, pre + ext)
            if lo < hi:
                spans.append((start + lo - pre, item, lo - item.offset, hi - item.offset))
        start += ext
    if not spans:
        return hidden, None
    embeddings = embedder.embeddings([s[1] for s in spans])
    rows = torch.cat([torch.arange(row, row + b - a) for row, _, a, b in spans]).to(hidden.device)
    image = torch.cat([embeddings[item.hash][a:b] for _, item, a, b in spans]).to(hidden.dtype)
    width = hidden.shape[1]
    hidden[rows] = image[:, :width]
    if image.shape[1] == width:
        return hidden, None
    return hidden, (rows, image[:, width:].reshape(len(rows), -1, width).transpose(0, 1))


def _canonical_name(name: str) -> str:
    """transformers 5 saves model.visual.* / model.language_model.*; the released checkpoints
    visual.* / model.*. Ours: visual.* / model.* / lm_head.*."""
    if name.startswith("model.visual."):
        return name[len("model."):]
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


def batch_mrope_positions(positions: torch.Tensor, mm: List[Optional[MultimodalInputs]], forward_batch) -> torch.Tensor:
    """[3, T] M-RoPE positions of a batch's tokens: a prompt token's from its request's table, any
    later token (decode, a retracted request's outputs) at its position + the request's delta,
    a text-only request's on all three axes alike. One slice per request, not per token."""
    out = positions.unsqueeze(0).repeat(3, 1)
    if forward_batch.forward_mode.is_decode():
        deltas = [m.mrope_position_delta if m is not None else 0 for m in mm]
        return out + torch.tensor(deltas, dtype=out.dtype, device=out.device)
    start = 0
    for m, pre, ext in zip(mm, forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu):
        if m is not None:
            table = m.mrope_positions
            in_prompt = max(0, min(pre + ext, table.shape[1]) - pre)
            if in_prompt:
                out[:, start:start + in_prompt] = table[:, pre:pre + in_prompt].to(out.device)
            out[:, start + in_prompt:start + ext] += m.mrope_position_delta
        start += ext
    return out
