#!/usr/bin/env python3
"""Train the embedded tiny model's byte-level BPE tokenizer, offline.

The committed ``radixserve/assets/tiny_qwen3/tokenizer.json`` was made by this script
(the other files there, tokenizer_config.json with the ChatML chat template and the
model configs, are written by hand). It needs no network: the corpus is text that is
already on the machine. Same inputs, same file: the corpus order is fixed and the BPE
trainer breaks ties deterministically (two runs give byte-identical output).

Pre-tokenization is Qwen2/Qwen3's: a regex split (digits one by one) then byte-level
(add_prefix_space=False); no normalizer, so decode(encode(s)) == s for every string.

Corpus (gathered in a fixed, sorted order; each source has a byte budget so the whole
corpus is about 23 MB and training takes ~5 s on 2 cores):

    source                                         budget    why
    /work/shared/seeds/*.txt (Chinese + Python)    x12 reps  the serving docs: CJK merges
    <stdlib>/test/cjkencodings/*-utf8.txt          x12 reps  more CJK / Japanese / Korean
    <stdlib>/**/*.py (no site-packages, no tests)  12 MB     code: indentation, identifiers
    <stdlib>/test/**/*.py                          2 MB      more code, odd literals
    /usr/share/doc/** (txt, md, rst, copyright,    7 MB      English prose
      README, changelog.gz), de-duplicated,
      first 24 KB of each file

Sources that are missing on a machine are skipped, so the script runs anywhere, but the
vocabulary then differs: the committed file is the reference, regenerate it only on
purpose.

Layout of the vocabulary (8192 ids in all):

    0            <|endoftext|>   (end of document, also the pad token)
    1            <|im_start|>
    2            <|im_end|>
    3 .. 258     the 256 byte symbols of the byte-level alphabet
    259 .. 8191  learned merges

Usage:
    python scripts/train_tokenizer.py [--out radixserve/assets/tiny_qwen3] [--dry-run]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import sys
import sysconfig
import time
from pathlib import Path
from typing import Iterator

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 8192
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# The Qwen2/Qwen3 pre-tokenization regex (GPT-4 style, but digits are split one by one).
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

MB = 1 << 20
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "radixserve" / "assets" / "tiny_qwen3"
SEEDS_DIR = Path("/work/shared/seeds")
DOC_DIR = Path("/usr/share/doc")

CJK_REPEATS = 12          # upweight the little CJK text there is, so it gets merges
PER_FILE_CAP = 256 * 1024  # no single file dominates a source
DOC_FILE_CAP = 24 * 1024   # docs: the head of each file (changelogs are long)
DOC_SUFFIXES = {".txt", ".md", ".rst"}
DOC_NAMES = {"copyright", "README", "NEWS", "AUTHORS", "changelog.gz", "changelog.Debian.gz", "NEWS.gz"}


def _read_text(path: Path, cap: int = PER_FILE_CAP) -> str | None:
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None
    return text[:cap]


def _sorted_files(root: Path, pattern: str, exclude: tuple[Path, ...] = ()) -> list[Path]:
    if not root.is_dir():
        return []
    files = []
    for p in root.rglob(pattern):
        if not p.is_file() or p.is_symlink():
            continue
        if any(ex in p.parents for ex in exclude):
            continue
        files.append(p)
    return sorted(files, key=lambda p: p.as_posix())


def _budgeted(files: list[Path], budget_bytes: int, seen: set[bytes], cap: int = PER_FILE_CAP) -> Iterator[str]:
    """Yield file texts in order until budget_bytes (UTF-8) are used; skip duplicates."""
    used = 0
    for path in files:
        text = _read_text(path, cap)
        if not text or not text.strip():
            continue
        digest = hashlib.sha256(text.encode("utf-8")).digest()
        if digest in seen:
            continue
        seen.add(digest)
        size = len(text.encode("utf-8"))
        if used + size > budget_bytes:
            continue
        used += size
        yield text


def corpus_sources() -> list[tuple[str, list[str]]]:
    """(name, [documents]) for each source, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    site = Path(sysconfig.get_paths()["purelib"])
    seen: set[bytes] = set()

    seeds = [t for p in _sorted_files(SEEDS_DIR, "*.txt") if (t := _read_text(p))]
    cjk = [t for p in _sorted_files(stdlib / "test" / "cjkencodings", "*-utf8.txt") if (t := _read_text(p))]
    code = list(_budgeted(_sorted_files(stdlib, "*.py", exclude=(site, stdlib / "test")), 12 * MB, seen))
    tests = list(_budgeted(_sorted_files(stdlib / "test", "*.py"), 2 * MB, seen))
    # Docs: many packages, a little of each (changelogs are long and repetitive). The
    # order is sorted by a hash of the path, so the budget is spread over the alphabet.
    doc_files = sorted(
        (p for p in _sorted_files(DOC_DIR, "*") if p.suffix in DOC_SUFFIXES or p.name in DOC_NAMES),
        key=lambda p: hashlib.sha256(p.as_posix().encode()).hexdigest(),
    )
    docs = list(_budgeted(doc_files, 7 * MB, seen, cap=DOC_FILE_CAP))
    return [
        ("seeds (x%d)" % CJK_REPEATS, seeds * CJK_REPEATS),
        ("cjkencodings (x%d)" % CJK_REPEATS, cjk * CJK_REPEATS),
        ("stdlib code", code),
        ("stdlib tests", tests),
        ("/usr/share/doc", docs),
    ]


def build_tokenizer() -> tuple[Tokenizer, trainers.BpeTrainer]:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    # No normalizer: decode(encode(text)) == text for every string, byte for byte.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    return tok, trainer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory to write tokenizer.json into")
    ap.add_argument("--dry-run", action="store_true", help="print corpus statistics only")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    sources = corpus_sources()
    documents: list[str] = []
    for name, docs in sources:
        size = sum(len(d.encode("utf-8")) for d in docs)
        print(f"  {name:<24} {len(docs):6d} docs {size / MB:7.2f} MB")
        documents.extend(docs)
    total = sum(len(d.encode("utf-8")) for d in documents)
    print(f"corpus: {len(documents)} docs, {total / MB:.2f} MB, "
          f"sha256 {hashlib.sha256(''.join(documents).encode()).hexdigest()[:16]} "
          f"(gathered in {time.perf_counter() - t0:.1f}s)")
    if args.dry_run:
        return 0

    tok, trainer = build_tokenizer()
    t1 = time.perf_counter()
    tok.train_from_iterator(documents, trainer=trainer, length=len(documents))
    print(f"trained in {time.perf_counter() - t1:.1f}s, vocab {tok.get_vocab_size()}")

    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "tokenizer.json"
    tok.save(str(path), pretty=False)
    print(f"wrote {path} ({path.stat().st_size} bytes, "
          f"sha256 {hashlib.sha256(path.read_bytes()).hexdigest()[:16]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
