"""Qwen3.5 with images (transformers' Qwen3_5ForConditionalGeneration and
Qwen3_5MoeForConditionalGeneration: the released Qwen3.5 checkpoints are natively multimodal).

  - the language model is models/qwen3_5.py's hybrid (GatedDeltaNet + gated full attention), its
    full-attention layers' rotary the interleaved M-RoPE over the first partial_rotary_factor of
    each head (transformers' Qwen3_5TextRotaryEmbedding);
  - the vision encoder is Qwen3-VL's (models/qwen3_vl.py) without DeepStack: patch embedding, the
    learned position table resampled to the image's grid, LayerNorm/GELU blocks, one merger;
  - the image rows, the M-RoPE positions of a batch and the encoder's cache are Qwen2.5-VL's
    (models/qwen2_5_vl.py: merge_image_embeddings, batch_mrope_positions, multimodal/embedder.py).

The prefix cache of a hybrid model is the MambaRadixCache: it keys on the prompt's ids, where each
image's tokens hold the image's pad value, so a state snapshot after an image belongs to that image
only; a hit restores the linear layers' state there and the prefill resumes after it (an image
split by a hit or a chunk takes its remaining rows from the embedding cache)."""

from __future__ import annotations

from typing import Iterable, List, Optional

import torch

from radixserve.layers.logits_processor import LogitsProcessorOutput
from radixserve.layers.rotary_embedding import MRotaryEmbedding
from radixserve.models.model_config import ModelConfig
from radixserve.models.qwen2_5_vl import VisionWeights, _canonical_name, batch_mrope_positions, merge_image_embeddings
from radixserve.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from radixserve.models.qwen3_vl import Qwen3_VisionTransformer, Qwen3VisionConfig
from radixserve.models.weight_utils import NamedWeight
from radixserve.multimodal.embedder import ImageEmbedder
from radixserve.multimodal.mm_cache import MultimodalEmbeddingCache
from radixserve.multimodal.mm_inputs import MM_PAD_BASE, MultimodalInputs

DEFAULT_MROPE_SECTION = (11, 11, 10)  # transformers' Qwen3_5TextRotaryEmbedding


class Qwen3_5VisionMixin:
    """The vision half, put in front of a Qwen3.5 causal LM class (dense or MoE)."""

    takes_images = True  # the model runner checks the server args (check_vision_server_args)
    loaded_elsewhere = ("visual.",)  # by load_weights below, not the language model's loader

    def __init__(self, config: ModelConfig, mm_cache: Optional[MultimodalEmbeddingCache] = None):
        super().__init__(config)
        hf = config.hf_config
        # Qwen3.5's tower has no DeepStack mergers (whatever the config dict carries)
        self.visual = Qwen3_VisionTransformer(Qwen3VisionConfig.from_dict({**hf["vision_config"],
                                                                           "deepstack_visual_indexes": []}))
        rope = hf.get("rope_parameters") or {}
        mrope = MRotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                 list(rope.get("mrope_section", DEFAULT_MROPE_SECTION)),
                                 bool(rope.get("mrope_interleaved", True)), config.partial_rotary_factor)
        for layer in self.model.layers:
            if not layer.is_linear:
                layer.self_attn.rotary_emb = mrope
        self.mm_cache = mm_cache if mm_cache is not None else MultimodalEmbeddingCache()
        self.embedder = ImageEmbedder(self.visual, self.mm_cache, lambda: self.lm_head.weight.device)

    @property
    def images_encoded(self) -> int:
        return self.embedder.images_encoded

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch,
                get_embedding: bool = False) -> LogitsProcessorOutput:
        mm: Optional[List[Optional[MultimodalInputs]]] = getattr(forward_batch, "multimodal_inputs", None)
        if mm is None:  # text only: plain ids, 1-D positions (every M-RoPE axis the same)
            return super().forward(input_ids, positions, forward_batch, get_embedding)
        embeds = self.model.embed_tokens(input_ids.masked_fill(input_ids >= MM_PAD_BASE, 0))
        if forward_batch.forward_mode.is_extend():
            embeds, _ = merge_image_embeddings(embeds, mm, forward_batch, self.embedder)
        positions = batch_mrope_positions(positions, mm, forward_batch)
        hidden = self.model(input_ids, positions, forward_batch, input_embeds=embeds)
        return self.logits_processor(hidden, self.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[NamedWeight], require_all: bool = True) -> None:
        """transformers' names: model.visual.*, model.language_model.*, lm_head.*, mtp.* (skipped)."""
        self.embedder.clear()  # a weight update: the cached encoder outputs are the old weights'
        vision = VisionWeights(self.visual, type(self).__name__)
        super().load_weights(vision.take((_canonical_name(n), t, fn) for n, t, fn in weights), require_all)
        vision.check_all_loaded(require_all, self.config.model_path)


class Qwen3_5ForConditionalGeneration(Qwen3_5VisionMixin, Qwen3_5ForCausalLM):
    pass


class Qwen3_5MoeForConditionalGeneration(Qwen3_5VisionMixin, Qwen3_5MoeForCausalLM):
    pass
