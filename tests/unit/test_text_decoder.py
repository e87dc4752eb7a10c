"""The detokenizer's TextDecoder (managers/text_decoder.py): decodes as the Hugging Face tokenizer it
was made from (the embedded model's, and SmolLM2's built from its GGUF file), refuses a tokenizer
whose decode it would not reproduce, survives the trip to another process, and lets the
detokenizer run without transformers or torch."""

from __future__ import annotations

import pickle
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from radixserve.hf_transformers_utils import load_tokenizer
from radixserve.managers.detokenizer import DecodeStatus, incremental_decode
from radixserve.managers.text_decoder import TextDecoder, text_decoder_of
from radixserve.tiny_model import get_tiny_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from real_model import smollm2_gguf  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=["tiny", "smollm2_gguf"])
def tokenizer(request):
    return load_tokenizer(str(get_tiny_model_path()) if request.param == "tiny" else str(smollm2_gguf()))


def _sequences(tok, n: int, seed: int):
    rng = random.Random(seed)
    specials = tok.all_special_ids
    for _ in range(n):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        ids[rng.randrange(len(ids))] = rng.choice(specials)
        yield ids


def test_decodes_as_the_tokenizer(tokenizer):
    decoder = pickle.loads(pickle.dumps(text_decoder_of(tokenizer)))  # as the detokenizer process gets it
    assert isinstance(decoder, TextDecoder) and decoder.verified()
    text = "Hello, world! It's 3.14 -- naïve café, 東京 🙂"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert decoder.decode(ids) == tokenizer.decode(ids)
    for ids in _sequences(tokenizer, 200, seed=1):  # other sequences than the self-check's
        for skip in (True, False):
            assert decoder.decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_incremental_decode_gives_the_same_text(tokenizer):
    """The detokenizer's streaming (a token at a time, held back while a character is split)."""
    decoder = text_decoder_of(tokenizer)
    ids = tokenizer.encode("Streaming 東京 🙂 one token at a time, with café.", add_special_tokens=False)
    texts = {}
    for name, tok in (("hf", tokenizer), ("decoder", decoder)):
        status = DecodeStatus()
        texts[name] = "".join(incremental_decode(tok, status, [t], finished=i == len(ids) - 1) for i, t in enumerate(ids))
    assert texts["decoder"] == texts["hf"] == tokenizer.decode(ids)


def test_clean_up_spaces_follows_transformers(tokenizer, monkeypatch):
    """A tokenizer set to clean up spaces: transformers does it except for BPE models, and so do we."""
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    decoder = text_decoder_of(tokenizer)
    ids = tokenizer.encode("Hi . Yes , it is !", add_special_tokens=False)
    assert decoder.verified() and decoder.decode(ids) == tokenizer.decode(ids)


def test_a_tokenizer_that_decodes_otherwise_is_not_reproduced(tokenizer, monkeypatch):
    """A decode of its own: refused up front where the probe shows it, else by the check in the
    detokenizer (which then loads the tokenizer with transformers); no backend: None."""
    decoder = text_decoder_of(tokenizer)
    ids, skip, text = decoder.expected[3]
    decoder.expected[3] = (ids, skip, text + "~")  # one sample decoded otherwise than the backend does
    assert not pickle.loads(pickle.dumps(decoder)).verified()
    decode = type(tokenizer).decode
    monkeypatch.setattr(type(tokenizer), "decode", lambda self, ids, **kw: decode(self, ids, **kw).upper())
    assert text_decoder_of(tokenizer) is None
    assert text_decoder_of(SimpleNamespace(decode=tokenizer.decode)) is None  # a slow tokenizer: no backend


def test_the_detokenizer_runs_without_transformers_or_torch(tmp_path):
    decoder = text_decoder_of(load_tokenizer(str(get_tiny_model_path())))
    (tmp_path / "decoder.pkl").write_bytes(pickle.dumps(decoder))
    code = f"""
import pickle, sys
from radixserve.managers.detokenizer import DetokenizerManager
from radixserve.protocol import BatchTokenIDOutput
decoder = pickle.load(open({str(tmp_path / 'decoder.pkl')!r}, 'rb'))
assert decoder.verified()
print(decoder.decode([100, 200, 300]))
print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    text, modules = out.stdout.rstrip("\n").rsplit("\n", 1)
    assert text == decoder.decode([100, 200, 300]) and modules == "[]"
