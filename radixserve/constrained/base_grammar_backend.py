"""Grammar backends for constrained decoding (seed 000 "grammar queue", seed 001 §12).

A request with `json_schema`, `regex` or `ebnf` needs a compiled grammar before it can be
scheduled. Compiling takes milliseconds (a pathological schema: much longer), so it runs
in a thread pool while the request waits in the scheduler's GrammarQueue
(radixserve/managers/grammar.py):

    GrammarQueue.admit (at intake)
        key = grammar_key(sampling_params)             ("json" | "regex" | "ebnf", text)
        value, cache_hit = backend.get_cached_or_future_value(key)
            cache hit:   a fresh grammar object, or an InvalidGrammarObject (fails fast)
            cache miss:  a Future -> the request waits in the grammar queue
    GrammarQueue.pop_ready (every loop iteration)
        done futures -> waiting_queue (or abort 400 when the grammar is invalid),
        older than --grammar-timeout -> abort; the key is cached as invalid
The cache keeps the --grammar-cache-size most recently used grammars.

Per step, each running request's grammar object writes its row of a packed token bitmask
(`fill_vocab_mask`); the sampler bans every token whose bit is 0 (`TokenBitmask.apply_`).
After each sampled token the scheduler calls `accept_token`; `is_terminated()` (the
grammar accepted a stop token) finishes the request with FINISH_MATCHED_TOKEN.

Bitmask layout (xgrammar's): int32 [B, ceil(V/32)], token t of row i is allowed iff
bit (t % 32) of bitmask[i, t // 32] is 1. A row of all ones (-1) allows every token.

The backend counts what structured output costs in `stats` (GrammarStats: compile, mask
fill, mask apply seconds); offline, `Engine.grammar_stats()` returns a copy.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

logger = logging.getLogger(__name__)

GrammarKey = Tuple[str, str]  # (kind, text): kind is "json", "regex" or "ebnf"
GRAMMAR_KINDS = {"json_schema": "json", "regex": "regex", "ebnf": "ebnf", "structural_tag": "structural_tag"}


def grammar_key(sampling_params: Any) -> Optional[GrammarKey]:
    """The cache key of a request's grammar, or None for an unconstrained request.
    (verify() already rejects more than one of regex / json_schema / ebnf.)"""
    import json

    for name, kind in GRAMMAR_KINDS.items():
        value = getattr(sampling_params, name, None)
        if value is None:
            continue
        if name == "json_schema" and not isinstance(value, str):
            value = json.dumps(value)  # a dict from the offline API (key order kept: it is the output order)
        return kind, value
    return None


# ---- grammar objects (one per request) ------------------------------------------------------
class BaseGrammarObject:
    """The matcher state of one request."""

    def accept_token(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""
        raise NotImplementedError

    def fill_vocab_mask(self, bitmask: torch.Tensor, idx: int) -> None:
        """Write the allowed next tokens into row `idx` of the packed bitmask."""
        raise NotImplementedError

    def is_terminated(self) -> bool:
        """The grammar is complete and accepted a stop token: the request is done."""
        raise NotImplementedError

    def copy(self) -> "BaseGrammarObject":
        """A fresh matcher (initial state) over the same compiled grammar."""
        raise NotImplementedError

    def reset_to(self, output_ids: List[int]) -> None:
        """Make the matcher state match `output_ids` (retraction keeps them): rebuild it
        from the initial state when it has accepted a different number of tokens."""
        raise NotImplementedError


class InvalidGrammarObject(BaseGrammarObject):
    """A grammar that failed to compile (or timed out). Cached, so a request with the same
    grammar fails fast; `message` names the problem and goes back to the client (400)."""

    def __init__(self, message: str):
        self.message = message

    def __repr__(self) -> str:
        return f"InvalidGrammarObject({self.message!r})"


# SGLang's name for "this grammar is invalid" (ours carries the reason; see is_invalid_grammar).
INVALID_GRAMMAR_OBJ = InvalidGrammarObject("Invalid grammar.")


def is_invalid_grammar(value: Any) -> bool:
    return isinstance(value, InvalidGrammarObject)


# ---- cost counters ----------------------------------------------------------------------------
@dataclass
class GrammarStats:
    """Cumulative cost of structured output (a perf_counter pair per call; subtract two
    snapshots for a run). On a GPU the apply time is the launch, not the kernel."""

    compile_s: float = 0.0  # compile threads: dispatch_json / regex / ebnf (the first: + tokenizer info)
    compiles: int = 0  # grammars compiled (invalid ones too)
    fill_s: float = 0.0  # scheduler thread: filling the bitmask rows of a forward
    fill_calls: int = 0  # forwards with a grammar mask
    apply_s: float = 0.0  # sampler: banning the masked logits
    apply_rows: int = 0  # grammar rows masked, summed over forwards


# ---- the per-forward mask -------------------------------------------------------------------
@dataclass
class TokenBitmask:
    """The grammar mask of one forward: the packed bitmask of every row of the batch and
    the rows that have a grammar (the others are all ones and are skipped)."""

    bitmask: torch.Tensor  # int32 [B, ceil(V/32)], CPU
    rows: List[int]
    stats: Optional[GrammarStats] = field(default=None, repr=False)  # the backend's: apply_ reports into it

    def apply_(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Set the banned logits of the grammar rows to -inf, in place."""
        if self.stats is None:
            return self._apply(logits, vocab_size)
        t0 = time.perf_counter()
        out = self._apply(logits, vocab_size)
        self.stats.apply_s += time.perf_counter() - t0
        self.stats.apply_rows += len(self.rows)
        return out

    def _apply(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        if not self.rows:
            return logits
        if logits.device.type == "cpu":
            try:  # xgrammar's CPU kernel is ~2-3x faster than the torch unpack below
                from xgrammar import apply_token_bitmask_inplace

                if logits.dtype == torch.float32 and logits.is_contiguous():
                    apply_token_bitmask_inplace(logits, self.bitmask, vocab_size=vocab_size, indices=self.rows)
                    return logits
            except ImportError:
                pass
        rows = torch.tensor(self.rows, dtype=torch.int64, device=logits.device)
        banned = unpack_banned(self.bitmask.to(logits.device, non_blocking=True).index_select(0, rows), vocab_size)
        view = logits[:, :vocab_size]
        view[rows] = view[rows].masked_fill(banned, float("-inf"))
        return logits


class DeferredTokenBitmask:
    """The grammar mask of a forward launched before the tokens of the forward in flight were
    accepted by the matchers (the overlap loop, as SGLang's `sampling_info_done`): the model
    forward runs meanwhile, and only the sampler waits here until the scheduler thread has
    processed the previous result and filled the mask (`set`), or gave up (`fail`)."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self.mask: Optional[TokenBitmask] = None  # None once set: no live grammar row was left
        self._error: Optional[BaseException] = None

    def set(self, mask: Optional[TokenBitmask]) -> None:
        self.mask = mask
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    def apply_(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError("the grammar mask of this forward was never filled") from self._error
        return logits if self.mask is None else self.mask.apply_(logits, vocab_size)


_SHIFTS: Dict[torch.device, torch.Tensor] = {}


def unpack_banned(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed int32 [R, W] bitmask -> bool [R, vocab_size], True where the token is banned."""
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: bit 31 is still right after & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size] == 0


def allocate_token_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """All-ones (every token allowed) packed bitmask, xgrammar's layout and dtype."""
    return torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32)


# ---- backends ---------------------------------------------------------------------------------
class BaseGrammarBackend:
    """Compiles grammars in a thread pool and caches the results by (kind, text)."""

    def __init__(self, vocab_size: int, max_workers: int = 2, cache_size: int = 1024):
        self.vocab_size = vocab_size
        self.executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        # (kind, text) -> compiled grammar, least recently used first (--grammar-cache-size)
        self.cache: "OrderedDict[GrammarKey, BaseGrammarObject]" = OrderedDict()
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self.stats = GrammarStats()

    # Subclasses compile; they raise ValueError (the message goes to the client) on a bad grammar.
    def dispatch_json(self, schema: str) -> BaseGrammarObject:
        raise ValueError("json_schema is not supported by this grammar backend.")

    def dispatch_regex(self, regex: str) -> BaseGrammarObject:
        raise ValueError("regex is not supported by this grammar backend.")

    def dispatch_ebnf(self, ebnf: str) -> BaseGrammarObject:
        raise ValueError("ebnf is not supported by this grammar backend.")

    def dispatch_structural_tag(self, structural_tag: str) -> BaseGrammarObject:
        raise ValueError("structural_tag is not supported by this grammar backend.")

    def _init_value_dispatch(self, key: GrammarKey) -> BaseGrammarObject:
        """Runs in the pool: compile (or take the cache), cache the result, return a fresh
        grammar object for the request. Never raises: errors become InvalidGrammarObject."""
        cached = self._cache_get(key)
        if cached is not None:
            return cached if is_invalid_grammar(cached) else cached.copy()
        kind, text = key
        t0 = time.perf_counter()
        try:
            if kind == "json":
                value = self.dispatch_json(text)
            elif kind == "regex":
                value = self.dispatch_regex(text)
            elif kind == "ebnf":
                value = self.dispatch_ebnf(text)
            elif kind == "structural_tag":
                value = self.dispatch_structural_tag(text)
            else:
                raise ValueError(f"Unknown grammar kind {kind!r}.")
        except Exception as e:  # a bad grammar must never take the scheduler down
            label = {"json": "json_schema"}.get(kind, kind)
            value = InvalidGrammarObject(f"Invalid {label}: {clean_error(e)}")
            logger.info("Grammar rejected: %s", value.message)
        with self._lock:
            self.stats.compile_s += time.perf_counter() - t0
            self.stats.compiles += 1
        # Keep an entry set meanwhile (a timeout caches the key as invalid: it stays so).
        value = self._cache_put(key, value, keep_existing=True)
        return value if is_invalid_grammar(value) else value.copy()

    def get_cached_or_future_value(self, key: GrammarKey) -> Tuple[Union[BaseGrammarObject, Future], bool]:
        """(grammar object or InvalidGrammarObject, True) on a cache hit, else (Future, False)."""
        cached = self._cache_get(key)
        if cached is not None:
            return (cached if is_invalid_grammar(cached) else cached.copy()), True
        return self.executor.submit(self._init_value_dispatch, key), False

    def set_cache(self, key: GrammarKey, value: BaseGrammarObject) -> None:
        self._cache_put(key, value, keep_existing=False)

    def _cache_get(self, key: GrammarKey) -> Optional[BaseGrammarObject]:
        with self._lock:
            value = self.cache.get(key)
            if value is not None:
                self.cache.move_to_end(key)
            return value

    def _cache_put(self, key: GrammarKey, value: BaseGrammarObject, keep_existing: bool) -> BaseGrammarObject:
        """Store (or, with keep_existing, keep what is there); the least recently used entries
        beyond cache_size go. Returns the cached value."""
        with self._lock:
            if keep_existing and key in self.cache:
                value = self.cache[key]
            self.cache[key] = value
            self.cache.move_to_end(key)
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
            return value

    def allocate_vocab_mask(self, batch_size: int) -> torch.Tensor:
        return allocate_token_bitmask(batch_size, self.vocab_size)

    def fill_token_bitmask(self, reqs: Iterable[Any], on_error: Optional[Callable[[Any, Exception], None]] = None) -> Optional[TokenBitmask]:
        """The mask of one forward over `reqs` (a batch, in row order): rows of requests
        with a live grammar are filled, the rest stay all ones. None when no row needs it.
        A grammar that fails to fill its row leaves it all ones and is reported to on_error
        (the scheduler ends that request), so one broken grammar cannot stop the batch."""
        t0 = time.perf_counter()
        reqs = list(reqs)
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and not r.finished()]
        if not rows:
            return None
        bitmask = self.allocate_vocab_mask(len(reqs))
        for i in rows:
            try:
                reqs[i].grammar.fill_vocab_mask(bitmask, i)
            except Exception as e:
                if on_error is None:
                    raise
                logger.exception("Filling the grammar mask of one request failed")
                bitmask[i] = -1
                on_error(reqs[i], e)
        self.stats.fill_s += time.perf_counter() - t0
        self.stats.fill_calls += 1
        return TokenBitmask(bitmask, rows, self.stats)

    def reset(self) -> None:
        with self._lock:
            self.cache.clear()

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def clean_error(e: BaseException) -> str:
    """xgrammar's messages start with '[time] /path/file.cc:123: '; keep what a user reads."""
    import re

    text = str(e).strip()
    text = re.sub(r"^\[[0-9:]+\]\s+\S+\.(cc|h|cpp):\d+:\s*", "", text)
    text = re.sub(r"^Check failed: \(.*?\) is false:\s*", "", text)
    return text or type(e).__name__


def grammar_unavailable_message(server_args: Any) -> str:
    if server_args.grammar_backend == "none":
        reason = "the server runs with --grammar-backend none"
    elif server_args.skip_tokenizer_init:
        reason = "the server runs with --skip-tokenizer-init (a grammar needs the tokenizer)"
    else:
        reason = "xgrammar is not installed (scripts/install.sh installs it)"
    return f"Structured output (json_schema, regex, ebnf) is not available: {reason}."
