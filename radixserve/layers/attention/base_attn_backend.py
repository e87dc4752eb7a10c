"""The attention-backend interface (SGLang's AttentionBackend): one object per ModelRunner."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, List, Optional, Tuple

import torch


def window_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: List[int],
                 window: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A sliding-window layer's decode: each request's last `window` slots as one row of a table
    the decode kernels read in place of req_to_token (rows 0..n-1), and how many of each row are
    its own (host int64). One gather per forward, shared by every windowed layer."""
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    first = (lens - window).clamp(min=0)  # the first key each request's query sees
    width = int((lens - first).max())
    cols = (first[:, None] + torch.arange(width)).clamp(max=req_to_token.shape[1] - 1).to(req_to_token.device)
    rows = req_pool_indices.to(req_to_token.device).long()
    return req_to_token[rows[:, None], cols].contiguous(), lens - first


class AttentionBackend(ABC):
    # Why this backend cannot run under CUDA graphs (cuda_graph_runner.py); None when it can.
    # A graph replays with only the contents of its device tensors changed: work planned from
    # per-step Python values (e.g. torch_native grouping requests by seq_lens_cpu) stays frozen.
    cuda_graph_unsupported_reason: Optional[str] = (
        "it has no CUDA-graph hooks; a replayed graph keeps the work it planned at capture, so a backend "
        "that plans from CPU-side lengths (torch_native groups requests by seq_lens_cpu) cannot be captured"
    )

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

    # ---- CUDA graphs (decode only) ----------------------------------------------------------
    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """seq_len of the padding requests a replay adds to reach a captured batch size."""
        return 1

    def init_cuda_graph_state(self, max_bs: int, num_heads: int, head_dim: int) -> None:
        """Allocate, once, the static buffers every captured decode forward reads and writes."""
        self._raise_no_cuda_graph()

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
    ) -> Any:
        """The metadata a decode forward of bs requests is captured with (forward_batch.attn_metadata).
        Everything in it that changes between steps must live in static tensors."""
        self._raise_no_cuda_graph()

    def init_forward_metadata_replay_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
    ) -> None:
        """Refill, in place, the metadata captured for bs from this step's (padded) inputs."""
        self._raise_no_cuda_graph()

    def _raise_no_cuda_graph(self) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} cannot run under CUDA graphs: {self.cuda_graph_unsupported_reason}. "
            "Use --attention-backend triton, or --disable-cuda-graph."
        )
