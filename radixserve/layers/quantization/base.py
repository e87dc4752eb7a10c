"""LinearMethodBase: how a linear layer holds and applies its weight (SGLang's seam)."""

from __future__ import annotations

from typing import Any, Optional

import torch


class LinearMethodBase:
    """One per layer. `load_rows` takes the rows [offset, offset + rows) of the layer's (this
    rank's) output from a checkpoint tensor already cut to this rank, for `param` (the layer's
    weight, or a tensor of its shape that a caller probes the layout with); `apply` is x @ W^T (+ bias)."""

    def load_rows(self, layer: Any, param: torch.Tensor, offset: int, loaded: Any) -> None:
        raise NotImplementedError

    def apply(self, layer: Any, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        raise NotImplementedError
