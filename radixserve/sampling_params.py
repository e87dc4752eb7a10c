"""SamplingParams with SGLang's field names and defaults; verify() gives clear errors."""

from __future__ import annotations

import math
import regex
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Union

_SAMPLING_EPS = 1e-6
TOP_K_ALL = 1 << 30  # top_k = -1 means "all tokens"
# Limits that keep one request from hanging or crashing the scheduler: integers reach
# int64 tensors and Python loops, n fans out into that many requests.
MAX_INT_PARAM = 2**31 - 1
MAX_N = 128
MAX_STOPS = 64
MAX_STOP_REGEX_CHARS = 1024  # the scheduler matches every stop regex after every token
MAX_STOP_STR_BYTES = 1024  # the scheduler decodes this many bytes' worth of tokens after every token
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: +-100 already bans or forces a token
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
_INT_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k", "n", "sampling_seed", "stream_interval")
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
_TEXT_FIELDS = ("stop", "stop_regex", "regex", "json_schema", "ebnf", "structural_tag")


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
    structural_tag: Optional[str] = None  # SGLang's: xgrammar's structural tag, as a JSON string
    custom_params: Optional[Dict[str, Any]] = None
    stream_interval: Optional[int] = None  # a streamed request reports every this many tokens; None: --stream-interval

    # Filled by normalize(): stop strings as a list, the most tokens one can span.
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
        check_json_types(d)
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
            # The most output tokens a stop string can span: the scheduler decodes that many (+1)
            # from the end. Not its own encoding's length (SGLang's): the model may spell it in
            # more, smaller tokens ("----" as four "-"), and then the stop was missed. A token
            # decodes to at least one byte, so the UTF-8 length bounds it.
            self.stop_str_max_len = max(len(s.encode("utf-8")) for s in self.stop_strs)

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
        if self.stream_interval is not None and self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}.")
        grammars = [x for x in (self.regex, self.json_schema, self.ebnf, self.structural_tag) if x is not None]
        if len(grammars) > 1:
            raise ValueError("Only one of regex, json_schema, ebnf or structural_tag can be set.")
        if self.logit_bias is not None:
            for k, v in self.logit_bias.items():
                try:
                    tid = int(k)
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias keys must be token ids, got {k!r}.") from None
                if vocab_size is not None and not 0 <= tid < vocab_size:
                    raise ValueError(f"logit_bias token id {tid} is out of the vocabulary [0, {vocab_size}).")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise ValueError(f"logit_bias values must be finite numbers, got {v!r}.")
                if abs(v) > MAX_LOGIT_BIAS:
                    raise ValueError(
                        f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {v!r} for token {k}.")
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
        for name in ("max_new_tokens", "min_new_tokens", "stream_interval"):
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
        for name in _TEXT_FIELDS:
            value = getattr(self, name)
            for text in [value] if isinstance(value, str) else list(value or []):
                error = unicode_error(text, name)
                if error is not None:
                    raise ValueError(error)
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for stop in stops:
            if isinstance(stop, str) and len(stop.encode("utf-8", "surrogatepass")) > MAX_STOP_STR_BYTES:
                raise ValueError(f"stop takes strings of at most {MAX_STOP_STR_BYTES} bytes (UTF-8), got "
                                 f"{len(stop.encode('utf-8', 'surrogatepass'))}.")
        regexes = [self.stop_regex] if isinstance(self.stop_regex, str) else list(self.stop_regex or [])
        for pattern in regexes:
            if isinstance(pattern, str) and len(pattern) > MAX_STOP_REGEX_CHARS:
                raise ValueError(f"stop_regex takes patterns of at most {MAX_STOP_REGEX_CHARS} characters, got {len(pattern)}.")
            try:  # the `regex` module: the scheduler matches with it, under a time limit
                regex.compile(pattern)
            except (regex.error, TypeError, OverflowError, RecursionError) as e:
                raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {e}.") from None


def check_json_types(d: Dict[str, Any]) -> None:
    """What pydantic's lax mode would coerce but JSON means otherwise: a boolean where a number
    goes (true would be 1), and a string or number where a boolean goes ("no" would be false)."""
    for name, value in d.items():
        if name in _INT_FIELDS + _FLOAT_FIELDS and isinstance(value, bool):
            raise ValueError(f"sampling_params.{name}: Input should be a number, not a boolean ({str(value).lower()}).")
        if name in _BOOL_FIELDS and value is not None and not isinstance(value, bool):
            raise ValueError(f"sampling_params.{name}: Input should be true or false, got {value!r}.")
    ids = d.get("stop_token_ids")
    if isinstance(ids, list) and any(isinstance(t, bool) for t in ids):
        raise ValueError("sampling_params.stop_token_ids: Input should be a list of token ids (integers), not booleans.")
    bias = d.get("logit_bias")
    if isinstance(bias, dict) and any(isinstance(v, bool) for v in bias.values()):
        raise ValueError("sampling_params.logit_bias: Input should map token ids to numbers, not booleans.")


def unicode_error(text: Any, name: str) -> Optional[str]:
    """Why `text` cannot be encoded as UTF-8 (a lone surrogate such as "\\ud800", which
    Python's JSON parser lets through), or None. Such a string breaks the tokenizer and the
    JSON response."""
    if not isinstance(text, str):
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"{name} is not valid Unicode: it holds the lone surrogate {text[e.start]!r} at position {e.start} "
                f"(a \\uD800-\\uDFFF escape must be half of a surrogate pair).")
    return None


def sample_seed(seed: Optional[int], j: int) -> Optional[int]:
    """The seed of sample j of an n > 1 request with sampling_seed `seed`: sample 0 keeps it
    (the same text as n = 1 with that seed), the others get distinct seeds derived from it,
    so the n samples differ from each other and the whole set is reproducible."""
    if seed is None or j == 0:
        return seed
    return (seed + j * 0x9E3779B97F4A7C15) % 2**63


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
