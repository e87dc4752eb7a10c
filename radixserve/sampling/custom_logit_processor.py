"""Custom logit processors (SGLang's `custom_logit_processor`, behind --enable-custom-logit-processor).

SGLang ships a processor as a dill-pickled class in the request and unpickles it in the
scheduler: any client can then run code there. Here a request only *names* a processor from
this registry; its arguments are the request's `sampling_params.custom_params` (a JSON object),
checked by the processor's `validate` at the front end (400 on a bad one). A deployment adds
its own with `register_custom_logit_processor` in a module it imports at start.

Each step, SamplingBatchInfo groups the batch's rows by processor name and calls each processor
once on its rows' logits [n, V] (after penalties and logit_bias, before the grammar's bans and
sampling), so a processor is vectorized over its rows.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch


class CustomLogitProcessor:
    """Subclass, set `name`, override `validate` and `__call__`."""

    name: str = ""

    def validate(self, params: Dict[str, Any], vocab_size: int) -> None:
        """Raise ValueError with a message for the client when `params` are wrong."""

    def __call__(self, logits: torch.Tensor, custom_params: List[Dict[str, Any]]) -> torch.Tensor:
        """logits: [n, V] rows of the requests that named this processor; one params dict per
        row. Returns the new logits (in place or a new tensor of the same shape)."""
        raise NotImplementedError


def _token_ids(params: Dict[str, Any], key: str, vocab_size: int) -> List[int]:
    ids = params.get(key)
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"custom_params.{key} must be a non-empty list of token ids.")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"custom_params.{key} must hold token ids in [0, {vocab_size}).")
    return ids


class DisallowedTokensLogitsProcessor(CustomLogitProcessor):
    """SGLang's example: never sample `token_ids` ({"token_ids": [..]})."""

    name = "disallowed_tokens"

    def validate(self, params: Dict[str, Any], vocab_size: int) -> None:
        _token_ids(params, "token_ids", vocab_size)

    def __call__(self, logits: torch.Tensor, custom_params: List[Dict[str, Any]]) -> torch.Tensor:
        rows = [i for i, p in enumerate(custom_params) for _ in p["token_ids"]]
        cols = [t for p in custom_params for t in p["token_ids"]]
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
        return logits


class DeterministicLogitProcessor(CustomLogitProcessor):
    """SGLang's test processor: always sample `token_id` ({"token_id": N})."""

    name = "force_token"

    def validate(self, params: Dict[str, Any], vocab_size: int) -> None:
        _token_ids({"token_id": [params.get("token_id")]}, "token_id", vocab_size)

    def __call__(self, logits: torch.Tensor, custom_params: List[Dict[str, Any]]) -> torch.Tensor:
        ids = torch.tensor([p["token_id"] for p in custom_params], device=logits.device).view(-1, 1)
        logits.fill_(float("-inf"))
        logits.scatter_(1, ids, 0.0)
        return logits


_REGISTRY: Dict[str, CustomLogitProcessor] = {}


def register_custom_logit_processor(processor: CustomLogitProcessor) -> None:
    if not processor.name or processor.name in _REGISTRY:
        raise ValueError(f"A custom logit processor needs a new, non-empty name, got {processor.name!r}.")
    _REGISTRY[processor.name] = processor


def get_custom_logit_processor(name: str) -> Optional[CustomLogitProcessor]:
    return _REGISTRY.get(name)


def custom_logit_processor_names() -> List[str]:
    return sorted(_REGISTRY)


def check_custom_logit_processor(name: Any, params: Any, enabled: bool, vocab_size: int) -> Optional[str]:
    """Why a request's processor cannot run (the 400's message), or None."""
    if name is None:
        return None
    if not enabled:
        return "custom_logit_processor needs a server started with --enable-custom-logit-processor."
    processor = _REGISTRY.get(name) if isinstance(name, str) else None
    if processor is None:
        return (f"custom_logit_processor must be the name of a registered processor "
                f"({', '.join(custom_logit_processor_names())}), got {name!r}.")
    if params is not None and not isinstance(params, dict):
        return "sampling_params.custom_params must be a JSON object."
    try:
        processor.validate(params or {}, vocab_size)
    except ValueError as e:
        return str(e)
    return None


def apply_custom_logit_processors(logits: torch.Tensor, names: List[Optional[str]],
                                  params: List[Optional[Dict[str, Any]]]) -> None:
    """Run each named processor once on its rows of `logits` [B, V] (in place)."""
    for name in sorted({n for n in names if n is not None}):
        rows = [i for i, n in enumerate(names) if n == name]
        index = torch.tensor(rows, device=logits.device)
        out = _REGISTRY[name](logits.index_select(0, index), [params[i] or {} for i in rows])
        logits.index_copy_(0, index, out)


for _p in (DisallowedTokensLogitsProcessor(), DeterministicLogitProcessor()):
    register_custom_logit_processor(_p)
