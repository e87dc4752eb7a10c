"""The front end's half of the vision path (SGLang's multimodal processor), for the Qwen-VL
family: runs in the TokenizerManager's executor, off the event loop and off the scheduler.

For each image: load it (image_loader), let the model's own transformers image processor
resize and patch it, expand its one placeholder token to the number of tokens the encoder
will give (patches / spatial_merge_size^2), and replace those with the image's pad value
(pad_input_ids). The M-RoPE positions of the prompt are computed here once, as transformers'
get_rope_index does: text advances all three axes by one per token; an image's tokens sit on a
(time, row, column) grid starting at the current position, and the text after it resumes at
that position + max(rows, columns)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch

from radixserve.multimodal.image_loader import MediaLimits, load_image
from radixserve.multimodal.mm_inputs import (
    MM_PAD_BASE,
    MultimodalDataItem,
    MultimodalInputError,
    MultimodalInputs,
    image_hash,
    pad_input_ids,
)

# Architectures whose images this module prepares (their models: models/qwen2_5_vl.py, qwen3_vl.py,
# qwen3_5_vl.py).
QWEN_VL_ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
                         "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")


@dataclass
class Qwen2_5VLProcessor:
    image_processor: Any  # transformers' Qwen2VLImageProcessor(Pil) from the model directory
    image_token_id: int
    spatial_merge_size: int
    limits: MediaLimits

    @classmethod
    def from_model_dir(cls, model_path: str, hf_config: dict, limits: MediaLimits) -> "Qwen2_5VLProcessor":
        from transformers import AutoImageProcessor

        image_processor = AutoImageProcessor.from_pretrained(model_path)
        return cls(image_processor, int(hf_config["image_token_id"]),
                   int(hf_config["vision_config"]["spatial_merge_size"]), limits)

    def process(self, input_ids: Sequence[int], images: Sequence[Any],
                labels: Sequence[str]) -> Tuple[List[int], MultimodalInputs]:
        """(the prompt's ids with each image's placeholder expanded and padded, its MultimodalInputs).
        Raises MultimodalInputError naming the part at fault."""
        runs = placeholder_runs(input_ids, self.image_token_id)
        if len(runs) != len(images):
            raise MultimodalInputError(f"the prompt has {len(runs)} image placeholders for {len(images)} images "
                                       f"(each image needs one <|vision_start|><|image_pad|><|vision_end|>)")
        decoded = [load_image(src, label, self.limits) for src, label in zip(images, labels)]
        try:
            out = self.image_processor(images=decoded, return_tensors="pt")
        except Exception as e:  # e.g. an image too small or too thin for the patch grid
            raise MultimodalInputError(f"{labels[0] if len(labels) == 1 else 'an image'}: the image processor "
                                       f"refused it: {e}") from None
        grids = [tuple(int(x) for x in g) for g in out["image_grid_thw"].tolist()]
        pixels = out["pixel_values"].float().split([t * h * w for t, h, w in grids])
        ids: List[int] = []
        items: List[MultimodalDataItem] = []
        last = 0
        for (start, end), grid, pv in zip(runs, grids, pixels):
            ids += input_ids[last:start]
            n = grid[0] * grid[1] * grid[2] // self.spatial_merge_size ** 2
            items.append(MultimodalDataItem(image_hash(pv, grid), len(ids), n, pv.contiguous(), grid))
            ids += [self.image_token_id] * n
            last = end
        ids += input_ids[last:]
        positions, delta = mrope_positions(len(ids), items, self.spatial_merge_size)
        return pad_input_ids(ids, items), MultimodalInputs(items, positions, delta)


def placeholder_runs(input_ids: Sequence[int], token_id: int) -> List[Tuple[int, int]]:
    """[start, end) of each run of consecutive placeholder tokens: one image each (a prompt may
    hold one placeholder per image, or already the expanded run)."""
    runs: List[Tuple[int, int]] = []
    start = None
    for i, t in enumerate(list(input_ids) + [None]):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            runs.append((start, i))
            start = None
    return runs


def mrope_positions(num_tokens: int, items: Sequence[MultimodalDataItem],
                    spatial_merge_size: int) -> Tuple[torch.Tensor, int]:
    """([3, num_tokens] positions, delta): transformers' Qwen2_5_VLModel.get_rope_index for images."""
    parts: List[torch.Tensor] = []
    pos = last = 0
    for item in items:
        text = item.offset - last
        parts.append(torch.arange(text).expand(3, -1) + pos)
        pos += text
        t, h, w = item.image_grid_thw
        h, w = h // spatial_merge_size, w // spatial_merge_size
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        pos += max(h, w)
        last = item.end
    parts.append(torch.arange(num_tokens - last).expand(3, -1) + pos)
    positions = torch.cat(parts, dim=1).to(torch.int64)
    return positions, int(positions.max()) + 1 - num_tokens


def build_multimodal_processor(model_path: Optional[str], limits: MediaLimits) -> Optional[Qwen2_5VLProcessor]:
    """The processor for the model's images, or None where the model takes text only."""
    config_path = os.path.join(model_path, "config.json") if model_path and os.path.isdir(model_path) else None
    if config_path is None or not os.path.exists(config_path):
        return None
    with open(config_path) as f:
        hf_config = json.load(f)
    if (hf_config.get("architectures") or [None])[0] not in QWEN_VL_ARCHITECTURES:
        return None
    vocab = (hf_config.get("text_config") or hf_config).get("vocab_size", 0)
    assert vocab < MM_PAD_BASE, "pad values must lie above the vocabulary"
    return Qwen2_5VLProcessor.from_model_dir(model_path, hf_config, limits)
