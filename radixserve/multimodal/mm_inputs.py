"""What a request with images carries to the scheduler and the model (SGLang's MultimodalInputs).

The prompt's placeholder tokens of an image are replaced by one pad value derived from the
image's hash (pad_input_ids), so the radix cache, which keys on token ids, shares a prefix only
where the images are the same. A pad value is >= MM_PAD_BASE, above any vocabulary, so it can
never be mistaken for a token (the model embeds those positions from the encoder instead):

    prompt ids:  | text ... | <vision_start> | pad pad pad ... pad | <vision_end> | text ... |
                                              ^ item.offset        ^ offset + num_tokens
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import List, Set, Tuple

import torch

MM_PAD_BASE = 1 << 30  # pad values live in [2^30, 2^31): above every vocabulary, inside int32


class MultimodalInputError(ValueError):
    """An image a request cannot use (the front end answers 400 with this message)."""


def image_hash(pixel_values: torch.Tensor, grid_thw: Tuple[int, int, int]) -> int:
    """A 64-bit hash of what the encoder will see (the processed pixels and their grid): two
    requests with the same image at the same size share it, whatever URL they sent it by."""
    h = hashlib.sha256()
    h.update(repr(tuple(grid_thw)).encode())
    h.update(pixel_values.contiguous().view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "little")


def pad_value_of(hash_: int) -> int:
    return MM_PAD_BASE + hash_ % MM_PAD_BASE


@dataclass
class MultimodalDataItem:
    """One image of a prompt: its encoder input and where its tokens sit in the prompt."""

    hash: int
    offset: int  # index of its first placeholder token in the (expanded) prompt
    num_tokens: int  # placeholder tokens = encoder output rows (patches / spatial_merge_size^2)
    pixel_values: torch.Tensor  # [num_patches, channels * temporal_patch * patch * patch] float32
    image_grid_thw: Tuple[int, int, int]  # patches along time, height, width

    @property
    def pad_value(self) -> int:
        return pad_value_of(self.hash)

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    def __post_init__(self) -> None:
        assert self.offset >= 0 and self.num_tokens > 0
        t, h, w = self.image_grid_thw
        assert self.pixel_values.shape[0] == t * h * w, (self.pixel_values.shape, self.image_grid_thw)


@dataclass
class MultimodalInputs:
    """A request's images, in prompt order, and its M-RoPE positions (3 rows: time, height,
    width) for every prompt token; a token at position p >= len(prompt) (decode, or a retracted
    request's outputs) sits at p + mrope_position_delta on all three axes."""

    items: List[MultimodalDataItem]
    mrope_positions: torch.Tensor  # [3, prompt_len] int64
    mrope_position_delta: int
    _pad_values: Set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        self._pad_values = {item.pad_value for item in self.items}
        ends = [0] + [i.end for i in self.items]
        assert all(item.offset >= end for item, end in zip(self.items, ends)), "items overlap or are out of order"

    def is_pad(self, token_id: int) -> bool:
        return token_id in self._pad_values

    def unpadded(self, input_ids: List[int], placeholder: int = 0) -> List[int]:
        """The ids with this request's pad values replaced by `placeholder` (for the checks
        that want vocabulary ids)."""
        return [placeholder if t in self._pad_values else t for t in input_ids]


def pad_input_ids(input_ids: List[int], items: List[MultimodalDataItem]) -> List[int]:
    """SGLang's pad_input_ids: each image's placeholder tokens become its pad value."""
    out = list(input_ids)
    for item in items:
        out[item.offset:item.end] = [item.pad_value] * item.num_tokens
    return out
