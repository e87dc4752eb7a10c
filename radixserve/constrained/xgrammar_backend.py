"""The xgrammar backend: JSON schema, regex and EBNF grammars compiled against the
tokenizer's vocabulary; one GrammarMatcher per request fills its row of the token bitmask.

xgrammar is imported on the first compile (in the compile pool), not at server start, so a
server that never sees a grammar pays nothing for it.

JSON whitespace: a schema grammar that allows any whitespace between tokens lets a weak
model pad its JSON with spaces and newlines until max_new_tokens. By default we compile
schemas compact (no whitespace, separators "," and ":"). --constrained-json-whitespace-pattern
REGEX (SGLang's flag) allows whitespace that matches REGEX wherever JSON allows whitespace.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import Any, Iterable, List, Optional

import torch

from radixserve.constrained.base_grammar_backend import (
    BaseGrammarBackend,
    BaseGrammarObject,
    clean_error,
)

logger = logging.getLogger(__name__)

# The JSON separators of a compact grammar (json.dumps(..., separators=(",", ":"))).
COMPACT_SEPARATORS = (",", ":")
# How xgrammar's JSON-schema EBNF (any_whitespace=True) writes "any whitespace".
_XGRAMMAR_ANY_WHITESPACE = "[ \\n\\r\\t]*"


class XGrammarGrammar(BaseGrammarObject):
    def __init__(self, matcher: Any, ctx: Any):
        self.matcher = matcher
        self.ctx = ctx  # the CompiledGrammar (shared, read-only)
        self.num_accepted = 0  # tokens accepted since the initial state

    def accept_token(self, token: int) -> bool:
        ok = self.matcher.accept_token(int(token))
        if ok:
            self.num_accepted += 1
        return ok

    def fill_vocab_mask(self, bitmask: torch.Tensor, idx: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, idx)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def copy(self) -> "XGrammarGrammar":
        import xgrammar as xgr

        return XGrammarGrammar(xgr.GrammarMatcher(self.ctx), self.ctx)

    def reset_to(self, output_ids: List[int]) -> None:
        if self.num_accepted == len(output_ids):
            return
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(self.ctx)
        self.num_accepted = 0
        for t in output_ids:
            if not self.accept_token(t):
                break

    def __repr__(self) -> str:
        return f"XGrammarGrammar(accepted={self.num_accepted}, terminated={self.is_terminated()})"


class XGrammarGrammarBackend(BaseGrammarBackend):
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int] = (),
        whitespace_pattern: Optional[str] = None,
        max_workers: int = 2,
        cache_size: int = 1024,
    ):
        super().__init__(vocab_size, max_workers, cache_size)
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(set(int(t) for t in eos_token_ids))
        self.whitespace_pattern = whitespace_pattern
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()

    # ---- setup (first compile) ------------------------------------------------------------
    @property
    def compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                self._compiler = xgr.GrammarCompiler(self._tokenizer_info(xgr), max_threads=2)
            return self._compiler

    def _tokenizer_info(self, xgr: Any) -> Any:
        """TokenizerInfo over the MODEL's vocabulary (config vocab_size: the logits' width;
        ids the tokenizer does not have are never allowed). The stop tokens are the model's
        EOS ids: after a complete match only they are allowed, and accepting one terminates
        the grammar. The tokenizer's other special tokens (<|im_start|>...) are marked as
        such, so a grammar never emits them as literal text (detokenization would drop them)."""
        stop = self.eos_token_ids or None
        info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop)
        specials = set(getattr(self.tokenizer, "all_special_ids", []) or []) - set(info.stop_token_ids)
        specials = {t for t in specials if 0 <= t < self.vocab_size}
        if not specials:
            return info
        vocab = [""] * self.vocab_size
        for token, idx in self.tokenizer.get_vocab().items():
            if 0 <= idx < self.vocab_size and idx not in specials:
                vocab[idx] = token  # an empty entry is a special token for xgrammar
        return xgr.TokenizerInfo(
            vocab, info.vocab_type, vocab_size=self.vocab_size,
            stop_token_ids=info.stop_token_ids, add_prefix_space=info.add_prefix_space,
        )

    def _from_context(self, ctx: Any) -> XGrammarGrammar:
        import xgrammar as xgr

        return XGrammarGrammar(xgr.GrammarMatcher(ctx), ctx)

    # ---- compile ------------------------------------------------------------------------------
    def dispatch_json(self, schema: str) -> XGrammarGrammar:
        try:
            json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the schema is not valid JSON ({e})") from None
        if self.whitespace_pattern is None:
            ctx = self.compiler.compile_json_schema(schema, any_whitespace=False, separators=COMPACT_SEPARATORS)
        else:
            ctx = self.compiler.compile_grammar(self.json_schema_ebnf(schema))
        return self._from_context(ctx)

    def dispatch_regex(self, regex: str) -> XGrammarGrammar:
        return self._from_context(self.compiler.compile_regex(regex))

    def dispatch_ebnf(self, ebnf: str) -> XGrammarGrammar:
        return self._from_context(self.compiler.compile_grammar(ebnf, root_rule_name="root"))

    def dispatch_structural_tag(self, structural_tag: str) -> XGrammarGrammar:
        """SGLang's two shapes: xgrammar's own {"type": "structural_tag", "format": {...}}, or
        the OpenAI-style {"structures": [{"begin", "schema", "end"}], "triggers": [...]} (free text
        until a trigger begins, then one of the structures: how tool calls are constrained)."""
        import xgrammar as xgr

        try:
            spec = json.loads(structural_tag)
        except json.JSONDecodeError as e:
            raise ValueError(f"the structural tag is not valid JSON ({e})") from None
        if not isinstance(spec, dict):
            raise ValueError("the structural tag must be a JSON object")
        if "format" in spec:
            return self._from_context(self.compiler.compile_structural_tag(json.dumps({"type": "structural_tag", **spec})))
        structures, triggers = spec.get("structures"), spec.get("triggers")
        if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers:
            raise ValueError("a structural tag needs 'format', or non-empty 'structures' and 'triggers' lists")
        try:
            tags = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                    for s in structures]
        except (KeyError, TypeError) as e:
            raise ValueError(f"each structure needs 'begin', 'schema' and 'end' ({clean_error(e)})") from None
        return self._from_context(self.compiler.compile_structural_tag(tags, triggers))

    def json_schema_ebnf(self, schema: str) -> str:
        """The schema's EBNF with every 'any whitespace' replaced by the whitespace pattern
        (xgrammar's regex converter turns the pattern into rules, renamed ws_*)."""
        import xgrammar as xgr

        ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=True))
        try:
            ws_ebnf = str(xgr.Grammar.from_regex(self.whitespace_pattern))
        except Exception as e:  # the server's flag is wrong, not the request's schema
            raise ValueError(f"the server's --constrained-json-whitespace-pattern is not a valid regex ({clean_error(e)})") from None
        ws = _rename_rules(ws_ebnf, "root", "json_ws")
        return ebnf.replace(_XGRAMMAR_ANY_WHITESPACE, "json_ws") + "\n" + ws

    def reset(self) -> None:
        super().reset()
        if self._compiler is not None:
            self._compiler.clear_cache()


def _rename_rules(ebnf: str, old_root: str, new_root: str) -> str:
    """Rename rule `old_root` and its helpers `old_root_N` to `new_root[_N]`, outside of
    string literals and character classes."""
    out: List[str] = []
    token = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|\b' + re.escape(old_root) + r"(_\d+)?\b")
    pos = 0
    for m in token.finditer(ebnf):
        out.append(ebnf[pos : m.start()])
        text = m.group(0)
        out.append(text if text[0] in '"[' else new_root + (m.group(1) or ""))
        pos = m.end()
    out.append(ebnf[pos:])
    return "".join(out)
