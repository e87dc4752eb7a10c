"""What the detokenizer process needs of the tokenizer: decode, through the `tokenizers` library.

The main process loads the Hugging Face tokenizer (transformers, which imports torch) anyway. It
hands the detokenizer a TextDecoder made from it: the fast tokenizer's backend as JSON, whether
transformers cleans up spaces after decoding, and a sample of decodes to check itself against.
The detokenizer then imports neither transformers nor torch (about 300 MB less resident memory
per server on a 150k-token vocabulary). A tokenizer without a `tokenizers` backend gets None, and
a TextDecoder that fails its check is not used: the detokenizer loads the tokenizer with
transformers, as before.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

SELF_CHECK_SEQUENCES = 64  # random id sequences a TextDecoder must decode as the tokenizer did


def clean_up_tokenization(text: str) -> str:
    """transformers' PreTrainedTokenizerBase.clean_up_tokenization (the same replacements)."""
    return (text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",").replace(" ' ", "'")
            .replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s").replace(" 've", "'ve").replace(" 're", "'re"))


@dataclass
class TextDecoder:
    backend_json: str  # tokenizers.Tokenizer.to_str() of the fast tokenizer
    clean_up_spaces: bool  # transformers' decision for this tokenizer (never for BPE, by default)
    # (ids, skip_special_tokens, the text the tokenizer decoded them to): checked by verified()
    expected: List[Tuple[List[int], bool, str]] = field(default_factory=list)
    _backend: Any = field(default=None, repr=False, compare=False)

    def decode(self, ids: List[int], skip_special_tokens: bool = False, **_ignored: Any) -> str:
        """As the fast tokenizer's decode (spaces_between_special_tokens does not apply to it)."""
        if self._backend is None:
            from tokenizers import Tokenizer

            self._backend = Tokenizer.from_str(self.backend_json)
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.clean_up_spaces else text

    def verified(self) -> bool:
        """Whether it decodes the sample as the tokenizer did (a tokenizer class with a decode of
        its own shows here). Run where it is used: building the backend in the main process too
        would hold a second copy of the vocabulary there (~100 MB for a 150k-token one)."""
        try:
            return all(self.decode(ids, skip_special_tokens=skip) == text for ids, skip, text in self.expected)
        except Exception:  # a backend this tokenizers version cannot read: the caller falls back
            return False

    def __getstate__(self) -> dict:  # sent to the detokenizer process: the JSON, not the backend
        return {**self.__dict__, "_backend": None}


def text_decoder_of(tokenizer: Any) -> Optional[TextDecoder]:
    """A TextDecoder for `tokenizer`, with the sample it must decode alike (random id sequences,
    special tokens among them, both ways of skip_special_tokens); None without a `tokenizers`
    backend, or where the tokenizer's decode is neither the backend's nor that cleaned up."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    # Whether this tokenizer cleans up spaces after the backend (transformers' versions differ on
    # BPE models): read off a text made of what the clean-up changes.
    probe = tokenizer.encode("a . b , c ! d ? e 's f 're", add_special_tokens=False)
    raw, decoded = backend.decode(probe, skip_special_tokens=False), tokenizer.decode(probe)
    if decoded not in (raw, clean_up_tokenization(raw)):
        return None
    clean = decoded != raw
    rng = random.Random(0)
    vocab = len(tokenizer)
    specials = list(getattr(tokenizer, "all_special_ids", []) or [])
    expected = []
    for _ in range(SELF_CHECK_SEQUENCES):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 24))]
        if specials:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        expected += [(ids, skip, tokenizer.decode(ids, skip_special_tokens=skip)) for skip in (True, False)]
    return TextDecoder(backend.to_str(), clean, expected)
