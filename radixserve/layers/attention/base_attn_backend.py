"""The attention-backend interface (SGLang's AttentionBackend): one object per ModelRunner."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class AttentionBackend(ABC):
    @abstractmethod
    def init_forward_metadata(self, forward_batch) -> None:
        """Build, once per forward, what every layer needs (index tables, masks)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer, forward_batch) -> torch.Tensor:
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch)
        return self.forward_extend(q, k, v, layer, forward_batch)

    @abstractmethod
    def forward_extend(self, q, k, v, layer, forward_batch) -> torch.Tensor:
        """Store k/v at out_cache_loc; each request's queries attend to its prefix + itself, causal."""

    @abstractmethod
    def forward_decode(self, q, k, v, layer, forward_batch) -> torch.Tensor:
        """Store k/v at out_cache_loc; one query per request attends to its whole sequence."""
