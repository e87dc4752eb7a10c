"""Issue 43 item 2: stop strings in streams, fuzzed through the real scheduler, detokenizer and
front end (the offline Engine drives the served runtime's code). For many stop-string sets and
chunkings (per-request stream_interval), a streamed request's successive texts each extend the
last and end at the non-streamed request's final text, so the concatenated deltas equal it and no
chunk ever shows part of a stop string the final text trims; and the final text contains none of
the stop strings (generation stopped at the first one; SGLang's check_finished order lets the
length win when the last allowed token completes a stop string, and that stays)."""

from __future__ import annotations

import random
from typing import Any, Dict, List

import pytest

from radixserve.engine import Engine
from radixserve.managers.schedule_batch import Req
from radixserve.sampling_params import SamplingParams

NUM_CASES = 30
MAX_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def engine():
    return Engine(max_total_tokens=4096)


def _greedy(**kw: Any) -> Dict[str, Any]:
    return {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True, **kw}


def _stop_strings(rng: random.Random, text: str) -> List[str]:
    """Stops the output really meets (substrings, some sharing a prefix with each other), ones it
    nearly meets (a real prefix with another ending), and a few it never meets."""
    stops: List[str] = []
    for _ in range(rng.randint(1, 5)):
        kind = rng.random()
        if text and kind < 0.6:
            start = rng.randrange(len(text))
            stops.append(text[start:start + rng.randint(1, 8)])
        elif text and kind < 0.85:
            start = rng.randrange(len(text))
            stops.append(text[start:start + rng.randint(1, 6)] + rng.choice(["\x00", "#", "qq", "大"]))
        else:
            stops.append("".join(rng.choice("abcde xyz") for _ in range(rng.randint(1, 4))))
    # distinct, non-empty, and no U+FFFD (a decoding artifact of a split character, not text)
    return [s for s in dict.fromkeys(stops) if s.strip("\x00") and "\ufffd" not in s]


def _case(rng: random.Random, engine: Engine) -> Dict[str, Any]:
    prompt = [rng.randrange(3, 8192) for _ in range(rng.randint(2, 12))]
    plain = engine.generate(input_ids=prompt, sampling_params=_greedy(), progress=False)["text"]
    return {"prompt": prompt, "stop": _stop_strings(rng, plain), "stream_interval": rng.choice([None, 1, 2, 3, 5, 8])}


def test_streamed_text_never_shows_a_trimmed_stop_string(engine):
    rng = random.Random(43)
    stopped = 0
    for case_no in range(NUM_CASES):
        case = _case(rng, engine)
        sp = _greedy(stop=case["stop"], stream_interval=case["stream_interval"])
        final = engine.generate(input_ids=case["prompt"], sampling_params=dict(sp), progress=False)
        texts = [out["text"] for out in engine.generate(input_ids=case["prompt"], sampling_params=dict(sp), stream=True)]
        where = f"case {case_no}: {case} final={final['text']!r} streamed={texts!r}"
        assert texts and texts[-1] == final["text"], where
        for before, after in zip(texts, texts[1:]):
            assert after.startswith(before), where  # a chunk is never taken back
        # Generation stopped at the first stop string. One that ends in the token that also
        # reached max_new_tokens stays (SGLang's check order: the length comes first).
        checked = final["text"]
        if final["meta_info"]["finish_reason"]["type"] == "length":
            checked = engine.tokenizer.decode(final["output_ids"][:-1])
        assert not any(stop in checked for stop in case["stop"]), where
        stopped += final["meta_info"]["finish_reason"]["type"] == "stop"
    assert stopped >= NUM_CASES // 3  # the fuzz really exercised stop strings


def test_stream_interval_sets_the_chunk_size(engine):
    """stream_interval (SGLang's sampling parameter): a streamed request reports every that
    many tokens after its first (SGLang's 1, 1 + k, 1 + 2k, ...), whatever --stream-interval says."""
    outs = list(engine.generate(input_ids=[5, 6, 7], sampling_params=_greedy(max_new_tokens=20, stream_interval=4),
                                stream=True))
    counts = [len(o["output_ids"]) for o in outs]
    assert counts == [1, 5, 9, 13, 17, 20], counts


@pytest.mark.parametrize("value", [0, -3, 2.5, True])
def test_bad_stream_interval_is_refused_with_its_name(engine, value):
    with pytest.raises(ValueError, match="stream_interval"):
        engine.generate(input_ids=[5, 6, 7], sampling_params={"stream_interval": value})


def test_a_stop_string_spelled_in_more_tokens_than_its_own_encoding_is_found(engine):
    """The fuzz found it: "-" * 24 encodes to 2 tokens, but a model may write it as 24 "-"
    tokens; the scheduler looked at only the last 3 and never saw the stop."""
    tok = engine.tokenizer
    stop = "-" * 24
    dash = tok.encode("-", add_special_tokens=False)
    assert len(dash) == 1 and len(tok.encode(stop, add_special_tokens=False)) < len(stop)
    sp = SamplingParams(max_new_tokens=100, stop=[stop])
    sp.normalize(tok)
    req = Req("r", None, [5, 6], sp, vocab_size=engine.vocab_size, tokenizer=tok)
    for n in range(1, 25):
        req.output_ids.append(dash[0])
        req.check_finished()
        assert req.finished() == (n == 24), n
    assert req.finished_reason.to_json()["matched"] == stop
