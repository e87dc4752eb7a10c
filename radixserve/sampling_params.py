"""SamplingParams with SGLang's field names and defaults; verify() gives clear errors."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Union

_SAMPLING_EPS = 1e-6
TOP_K_ALL = 1 << 30  # top_k = -1 means "all tokens"
# Limits that keep one request from hanging or crashing the scheduler: integers reach
# int64 tensors and Python loops, n fans out into that many requests.
MAX_INT_PARAM = 2**31 - 1
MAX_N = 128
MAX_STOPS = 64
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")


@dataclass
class SamplingParams:
    max_new_tokens: Optional[int] = 128
    min_new_tokens: int = 0
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    stop_regex: Optional[Union[str, List[str]]] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    logit_bias: Optional[Dict[str, float]] = None
    sampling_seed: Optional[int] = None
    regex: Optional[str] = None
    json_schema: Optional[str] = None
    ebnf: Optional[str] = None
    custom_params: Optional[Dict[str, Any]] = None

    # Filled by normalize(): stop strings as a list, the longest one's length.
    stop_strs: List[str] = field(default_factory=list, repr=False)
    stop_regex_strs: List[str] = field(default_factory=list, repr=False)
    stop_str_max_len: int = field(default=0, repr=False)

    @classmethod
    def from_dict(cls, d: Optional[Dict[str, Any]]) -> "SamplingParams":
        d = dict(d or {})
        known = {f.name for f in fields(cls) if f.repr}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**d)

    def normalize(self, tokenizer: Any = None) -> None:
        """Make stops lists; greedy when temperature is ~0 (SGLang: top_k = 1)."""
        if 0 <= self.temperature < _SAMPLING_EPS:
            self.temperature = 1.0
            self.top_k = 1
        if self.top_k == -1:
            self.top_k = TOP_K_ALL
        self.stop_strs = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_regex_strs = (
            [self.stop_regex] if isinstance(self.stop_regex, str) else list(self.stop_regex or [])
        )
        if self.stop_strs:
            if tokenizer is not None:
                self.stop_str_max_len = max(
                    len(tokenizer.encode(s, add_special_tokens=False)) for s in self.stop_strs
                )
            else:
                self.stop_str_max_len = max(len(s) for s in self.stop_strs)

    def verify(self, vocab_size: Optional[int] = None) -> None:
        """Raise ValueError with SGLang-like messages for out-of-range values."""
        self._verify_limits(vocab_size)
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k < 1 and self.top_k != -1:
            raise ValueError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}.")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if not 0 <= self.min_new_tokens:
            raise ValueError(f"min_new_tokens must be at least 0, got {self.min_new_tokens}.")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], "
                f"got {self.min_new_tokens}."
            )
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        grammars = [x for x in (self.regex, self.json_schema, self.ebnf) if x is not None]
        if len(grammars) > 1:
            raise ValueError("Only one of regex, json_schema, or ebnf can be set.")
        if self.logit_bias is not None:
            for k, v in self.logit_bias.items():
                try:
                    tid = int(k)
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias keys must be token ids, got {k!r}.") from None
                if vocab_size is not None and not 0 <= tid < vocab_size:
                    raise ValueError(f"logit_bias token id {tid} is out of the vocabulary [0, {vocab_size}).")
                if not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise ValueError(f"logit_bias values must be finite numbers, got {v!r}.")
        if vocab_size is not None and self.stop_token_ids:
            for t in self.stop_token_ids:
                if not 0 <= int(t) < vocab_size:
                    raise ValueError(f"stop_token_ids entry {t} is out of the vocabulary [0, {vocab_size}).")


    def _verify_limits(self, vocab_size: Optional[int]) -> None:
        """Finite floats, bounded integers and lists, stop regexes that compile: what would
        otherwise fail inside the scheduler, after the request was accepted."""
        for name in _FLOAT_FIELDS:
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}.")
        top_k_max = vocab_size if vocab_size is not None else TOP_K_ALL
        if self.top_k > top_k_max and self.top_k != TOP_K_ALL:  # TOP_K_ALL: -1 after normalize()
            raise ValueError(f"top_k must be -1 (disable), or in [1, {top_k_max}], got {self.top_k}.")
        for name in ("max_new_tokens", "min_new_tokens"):
            value = getattr(self, name)
            if value is not None and value > MAX_INT_PARAM:
                raise ValueError(f"{name} must be at most {MAX_INT_PARAM}, got {value}.")
        if self.n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {self.n}.")
        if self.sampling_seed is not None and not 0 <= self.sampling_seed < 2**63:
            raise ValueError(f"sampling_seed must be in [0, 2**63), got {self.sampling_seed}.")
        for name in ("stop", "stop_regex", "stop_token_ids"):
            value = getattr(self, name)
            if isinstance(value, list) and len(value) > MAX_STOPS:
                raise ValueError(f"{name} takes at most {MAX_STOPS} entries, got {len(value)}.")
        regexes = [self.stop_regex] if isinstance(self.stop_regex, str) else list(self.stop_regex or [])
        for pattern in regexes:
            try:
                re.compile(pattern)
            except (re.error, TypeError) as e:
                raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {e}.") from None


def input_ids_error(input_ids: List[int], context_len: int, vocab_size: int) -> Optional[str]:
    """Why a prompt cannot run (empty, no room left in the context, unknown token ids), or
    None. The front end refuses such a request (400); the scheduler checks again, since it
    is also driven directly (simulator, tests)."""
    n = len(input_ids)
    if n == 0:
        return "The input is empty: give a prompt or input_ids."
    if n >= context_len:
        return f"The input ({n} tokens) is longer than the model's context length ({context_len} tokens)."
    if min(input_ids) < 0 or max(input_ids) >= vocab_size:
        return f"Input token ids must be in [0, {vocab_size})."
    return None


def context_length_error(input_len: int, max_new_tokens: Optional[int], context_len: int) -> Optional[str]:
    """SGLang's message when an explicit max_new_tokens cannot fit beside the input. (An input
    that alone fills the context gets the scheduler's own message; a default or absent
    max_new_tokens is clipped to the room left instead.)"""
    if max_new_tokens is None or input_len >= context_len or input_len + max_new_tokens < context_len:
        return None
    return (
        f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
        f"You requested a total of {input_len + max_new_tokens} tokens: {input_len} tokens from the input "
        f"messages and {max_new_tokens} tokens for the completion. Please reduce the number of tokens in "
        f"the input messages or the completion to fit within the limit."
    )
