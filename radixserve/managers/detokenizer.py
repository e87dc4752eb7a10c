"""Incremental detokenization (seed 001 §21.3) and stop-string trimming.

Decoding token by token breaks multi-byte characters and merges of byte-level BPE; so we
decode a window: ids[surr_offset:] against ids[surr_offset:read_offset]. The text they
differ by is new, and is emitted only once it does not end in an incomplete UTF-8 sequence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

# Tokens before the first output token used as decoding context (SGLang's INIT offset).
INIT_INCREMENTAL_DETOKENIZATION_OFFSET = 5


@dataclass
class DecodeStatus:
    decode_ids: List[int] = field(default_factory=list)
    decoded_text: str = ""
    surr_offset: int = 0
    read_offset: int = 0


def incremental_decode(
    tokenizer: Any,
    status: DecodeStatus,
    new_ids: List[int],
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
    finished: bool = False,
) -> str:
    """Append new_ids and return the text that became final (all of it when finished)."""
    status.decode_ids.extend(new_ids)
    kw = dict(skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens)
    ids = status.decode_ids
    surr_text = _decode(tokenizer, ids[status.surr_offset : status.read_offset], kw)
    full_text = _decode(tokenizer, ids[status.surr_offset :], kw)
    new_text = full_text[len(surr_text) :]
    if finished or (new_text and not new_text.endswith("\ufffd")):
        status.decoded_text += new_text
        status.surr_offset = status.read_offset
        status.read_offset = len(ids)
        return new_text
    return ""


def _decode(tokenizer: Any, ids: List[int], kw: Dict[str, Any]) -> str:
    if not ids:
        return ""
    try:
        return tokenizer.decode(ids, **kw)
    except TypeError:  # tokenizers without spaces_between_special_tokens
        return tokenizer.decode(ids, skip_special_tokens=kw["skip_special_tokens"])


def trim_matched_stop(text: str, finished_reason: Optional[Dict[str, Any]], no_stop_trim: bool) -> str:
    """Cut the output at a matched stop string (SGLang trims unless no_stop_trim)."""
    if no_stop_trim or not finished_reason or finished_reason.get("type") != "stop":
        return text
    matched = finished_reason.get("matched")
    if isinstance(matched, str) and matched:
        pos = text.find(matched)
        if pos != -1:
            return text[:pos]
    return text


def output_ids_for_text(output_ids: List[int], finished_reason: Optional[Dict[str, Any]], no_stop_trim: bool) -> List[int]:
    """A matched stop token is not part of the text (it is still in output_ids)."""
    if not no_stop_trim and finished_reason and finished_reason.get("type") == "stop" and isinstance(finished_reason.get("matched"), int):
        return output_ids[:-1]
    return output_ids
