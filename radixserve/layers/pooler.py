"""Pooler (SGLang's name): one embedding per request from the model's final hidden states, for
--is-embedding. Which pooling comes from the model directory's sentence-transformers config:

    modules.json  -> the sentence_transformers.models.Pooling module -> {path}/config.json
                     pooling_mode_lasttoken | pooling_mode_mean_tokens | pooling_mode_cls_token
                  -> a sentence_transformers.models.Normalize module: normalized
    no modules.json: the last token, normalized (Qwen3-Embedding, e5-mistral, gte-Qwen...)

A GGUF file uses the modules.json of the directory holding it, else the same default.

A request's prompt may take several forwards (chunked prefill), so a forward returns each
request's *part*, and `PoolingConfig.merge` / `finish` (run by the scheduler) combine them:

    LAST  part = hidden state of the request's last token in this forward   (the last part wins)
    CLS   part = hidden state of position 0 when this forward holds it      (the first part wins)
    MEAN  part = sum of the hidden states of this forward's tokens          (parts add up, / n)

CLS and MEAN need the hidden state of tokens a cached prefix would skip, so their requests take
no prefix from the radix cache (`needs_every_token`); LAST needs only the last token's.
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from radixserve.hf_transformers_utils import LoadError

ST_POOLING = "sentence_transformers.models.Pooling"
ST_NORMALIZE = "sentence_transformers.models.Normalize"
ST_TRANSFORMER = "sentence_transformers.models.Transformer"


class PoolingType(enum.Enum):
    LAST = "lasttoken"
    CLS = "cls_token"
    MEAN = "mean_tokens"


@dataclass(frozen=True)
class PoolingConfig:
    pooling_type: PoolingType = PoolingType.LAST
    normalize: bool = True

    @property
    def needs_every_token(self) -> bool:
        """Whether the embedding needs the hidden state of tokens before the last one."""
        return self.pooling_type != PoolingType.LAST

    @classmethod
    def from_model_path(cls, model_path: Optional[str]) -> "PoolingConfig":
        """The pooling of a model directory (or of the directory holding a .gguf file)."""
        if not model_path:
            return cls()
        directory = model_path if os.path.isdir(model_path) else os.path.dirname(model_path)
        modules_path = os.path.join(directory, "modules.json")
        if not os.path.isfile(modules_path):
            return cls()
        modules = _read_json(modules_path)
        if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
            raise LoadError(f"{modules_path}: expected a list of modules")
        kinds = [str(m.get("type", "")) for m in modules]
        unsupported = [k for k in kinds if k not in (ST_TRANSFORMER, ST_POOLING, ST_NORMALIZE)]
        if unsupported:
            raise LoadError(f"{modules_path}: unsupported sentence-transformers module {unsupported[0]!r} "
                            "(supported: Transformer, Pooling, Normalize)")
        pooling = [m for m in modules if m.get("type") == ST_POOLING]
        if len(pooling) != 1:
            raise LoadError(f"{modules_path}: expected one {ST_POOLING} module, found {len(pooling)}")
        pooling_path = os.path.join(directory, str(pooling[0].get("path", "")), "config.json")
        return cls(_pooling_type(pooling_path), normalize=ST_NORMALIZE in kinds)

    # ---- combining the parts of a chunked prompt (scheduler side) ----------------------------
    def merge(self, pooled: Optional[torch.Tensor], part: torch.Tensor) -> torch.Tensor:
        """The pooled state after one more forward's part (see the module docstring)."""
        if pooled is None or self.pooling_type == PoolingType.LAST:
            return part
        if self.pooling_type == PoolingType.CLS:
            return pooled
        return pooled + part

    def finish(self, pooled: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The embedding from the pooled state of all `num_tokens` prompt tokens."""
        if self.pooling_type == PoolingType.MEAN:
            pooled = pooled / num_tokens
        return nn.functional.normalize(pooled, p=2.0, dim=-1) if self.normalize else pooled


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise LoadError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise LoadError(f"{path}: invalid JSON ({e})") from None


def _pooling_type(path: str) -> PoolingType:
    cfg: Dict[str, Any] = _read_json(path)
    modes = [k.removeprefix("pooling_mode_") for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
    if len(modes) != 1:
        raise LoadError(f"{path}: expected exactly one pooling_mode_* set to true, found {modes or 'none'}")
    supported = {t.value: t for t in PoolingType}
    if modes[0] not in supported:
        raise LoadError(f"{path}: pooling_mode_{modes[0]} is not supported "
                        f"(supported: {', '.join('pooling_mode_' + v for v in supported)})")
    if cfg.get("include_prompt", True) is False:
        raise LoadError(f"{path}: include_prompt false (pooling without the instruction tokens) is not supported")
    return supported[modes[0]]


@dataclass
class EmbeddingPoolerOutput:
    embeddings: torch.Tensor  # [bs, hidden] float32: each request's part (see the module docstring)


class Pooler(nn.Module):
    """Each request's part of its pooled state, from the final hidden states of an EXTEND
    forward (its tokens laid out request after request, extend_seq_lens_cpu of each)."""

    def __init__(self, config: PoolingConfig):
        super().__init__()
        self.config = config

    def forward(self, hidden_states: torch.Tensor, forward_batch: Any) -> EmbeddingPoolerOutput:
        lens: List[int] = list(forward_batch.extend_seq_lens_cpu)
        hidden = hidden_states.float()  # sums and the norm in float32, whatever the model's dtype
        device = hidden.device
        ends = torch.cumsum(torch.tensor(lens, device=device), 0)
        kind = self.config.pooling_type
        if kind == PoolingType.LAST:
            return EmbeddingPoolerOutput(hidden[ends - 1])
        if kind == PoolingType.CLS:
            # Position 0 is in this forward only where nothing came before it.
            holds_first = torch.tensor([p == 0 for p in forward_batch.extend_prefix_lens_cpu], device=device)
            return EmbeddingPoolerOutput(hidden[ends - torch.tensor(lens, device=device)] * holds_first[:, None])
        owner = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
        sums = torch.zeros(len(lens), hidden.shape[-1], dtype=hidden.dtype, device=device)
        return EmbeddingPoolerOutput(sums.index_add_(0, owner, hidden))
