"""create_grammar_backend: the backend --grammar-backend names. Apart from the backends, so
that base_grammar_backend.py (which they subclass) imports none of them: no import cycle."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, Iterable, Optional

from radixserve.constrained.base_grammar_backend import BaseGrammarBackend
from radixserve.constrained.xgrammar_backend import XGrammarGrammarBackend  # imports xgrammar lazily

logger = logging.getLogger(__name__)


def create_grammar_backend(server_args: Any, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> Optional[BaseGrammarBackend]:
    """The backend named by --grammar-backend, or None ("none", no tokenizer, or xgrammar
    not installed: grammar requests then finish with a 400 that says why)."""
    name = server_args.grammar_backend
    if name == "none":
        return None
    if name != "xgrammar":
        raise ValueError(f"Invalid grammar backend: {name!r}")
    if tokenizer is None:
        logger.info("No tokenizer (--skip-tokenizer-init): structured output is off.")
        return None
    if importlib.util.find_spec("xgrammar") is None:
        logger.warning("xgrammar is not installed: requests with json_schema / regex / ebnf will be rejected "
                       "(scripts/install.sh installs it).")
        return None
    return XGrammarGrammarBackend(
        tokenizer, vocab_size, eos_token_ids,
        whitespace_pattern=server_args.constrained_json_whitespace_pattern,
        cache_size=server_args.grammar_cache_size,
    )
