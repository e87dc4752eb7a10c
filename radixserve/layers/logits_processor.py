"""Computes logits only where they are needed: the last position of each request
(what sampling needs), or every extend position when the batch asks for all of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn


@dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor  # [bs, vocab], float32
    all_logits: Optional[torch.Tensor] = None  # [num_tokens, vocab] when capture_all_logits
    input_token_logprobs: Optional[torch.Tensor] = None  # [n] for input_logprob_positions
    # [num_tokens, hidden]: the final hidden states (EAGLE's features) when the batch asks for them
    hidden_states: Optional[torch.Tensor] = None
    # [bs, hidden]: each request's final hidden state (after the final norm) at its last position,
    # the one its sampled token came from (SGLang's return_hidden_states)
    last_hidden_states: Optional[torch.Tensor] = None
    # [n, k] for input_logprob_positions: the logprobs of input_token_ids_logprob_ids (token_ids_logprob)
    input_token_ids_logprobs: Optional[torch.Tensor] = None
    # [n, k] for input_logprob_positions: the k best tokens' logprobs and ids (input_top_logprobs_k)
    input_top_logprobs_val: Optional[torch.Tensor] = None
    input_top_logprobs_idx: Optional[torch.Tensor] = None


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, hidden_states: torch.Tensor, lm_head, forward_batch) -> LogitsProcessorOutput:
        out = self._forward(hidden_states, lm_head, forward_batch)
        if getattr(forward_batch, "capture_hidden_states", False):
            out.hidden_states = hidden_states
        if getattr(forward_batch, "return_hidden_states", False):
            out.last_hidden_states = self._last_positions(hidden_states, forward_batch).float()
        pos = forward_batch.input_logprob_positions
        if pos is not None and pos.numel():
            # logits only at the positions asked for, then the logprob of each next prompt token
            logprobs = torch.log_softmax(lm_head.get_logits(hidden_states[pos.to(hidden_states.device)]).float(), -1)
            ids = forward_batch.input_logprob_token_ids.to(logprobs.device)
            out.input_token_logprobs = logprobs.gather(1, ids[:, None]).squeeze(1)
            asked = getattr(forward_batch, "input_token_ids_logprob_ids", None)
            if asked is not None:
                out.input_token_ids_logprobs = logprobs.gather(1, asked.to(logprobs.device))
            k = min(getattr(forward_batch, "input_top_logprobs_k", 0), logprobs.shape[-1])
            if k > 0:
                out.input_top_logprobs_val, out.input_top_logprobs_idx = logprobs.topk(k, dim=-1)
        return out

    @staticmethod
    def _last_positions(hidden_states: torch.Tensor, forward_batch) -> torch.Tensor:
        if forward_batch.forward_mode.is_decode():
            return hidden_states
        lens = torch.tensor(forward_batch.extend_seq_lens_cpu, device=hidden_states.device)
        return hidden_states[torch.cumsum(lens, 0) - 1]

    def _forward(self, hidden_states: torch.Tensor, lm_head, forward_batch) -> LogitsProcessorOutput:
        last_hidden = self._last_positions(hidden_states, forward_batch)
        if forward_batch.capture_all_logits:
            all_logits = lm_head.get_logits(hidden_states).float()
            if forward_batch.forward_mode.is_decode():
                return LogitsProcessorOutput(all_logits, all_logits)
            lens = torch.tensor(forward_batch.extend_seq_lens_cpu, device=hidden_states.device)
            return LogitsProcessorOutput(all_logits[torch.cumsum(lens, 0) - 1], all_logits)
        return LogitsProcessorOutput(lm_head.get_logits(last_hidden).float())
