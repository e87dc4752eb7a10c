"""Issue 57: /generate's stream encodes the cumulative output_ids incrementally
(CumulativeStreamEncoder); its bytes must be exactly those of sse(), chunk after chunk, for
interleaved samples (n > 1), text that looks like the ids' slot, and a list that shrinks."""

from __future__ import annotations

import random

from radixserve.entrypoints.serving_base import CumulativeStreamEncoder, sse


def test_bytes_equal_sse_for_growing_interleaved_streams():
    rng = random.Random(0)
    encode = CumulativeStreamEncoder()
    ids = {0: [], 1: []}
    texts = ['"output_ids": "\x00output_ids\x00"', "héllo \\ \n", "\x00output_ids\x00", ""]
    for step in range(60):
        index = rng.randint(0, 1)
        ids[index] += [rng.randint(0, 150000) for _ in range(rng.randint(0, 3))]
        out = {"text": rng.choice(texts), "output_ids": list(ids[index]),
               "meta_info": {"id": "r", "completion_tokens": len(ids[index]), "finish_reason": None}, "index": index}
        assert encode(out) == sse(out), step


def test_a_shorter_list_and_other_objects_fall_back_to_plain_encoding():
    encode = CumulativeStreamEncoder()
    assert encode({"text": "a", "output_ids": [1, 2, 3], "meta_info": {}}) == sse({"text": "a", "output_ids": [1, 2, 3], "meta_info": {}})
    out = {"text": "b", "output_ids": [7], "meta_info": {}}
    assert encode(out) == sse(out)
    err = {"error": {"message": "x", "code": 400}}
    assert encode(err) == sse(err)


def test_non_finite_logprobs_are_null_as_sglang_writes_them():
    """A logprob of -inf (a token the sampler's mask removed) is null in every output route's JSON,
    as SGLang's orjson writes it: not `-Infinity` (invalid JSON) in a stream, not a 500 in a
    JSONResponse (json.dumps with allow_nan=False raises on it)."""
    import json

    from radixserve.entrypoints.serving_base import OutputJSONResponse

    out = {"text": "a", "output_ids": [1, 2],
           "meta_info": {"output_top_logprobs": [[(-0.1, 1, "a"), (float("-inf"), 2, "b")]],
                         "score": float("nan")}}
    want = {"text": "a", "output_ids": [1, 2],
            "meta_info": {"output_top_logprobs": [[[-0.1, 1, "a"], [None, 2, "b"]]], "score": None}}
    for body in (sse(out), CumulativeStreamEncoder()(out)):
        assert b"Infinity" not in body and b"NaN" not in body
        assert json.loads(body[len(b"data: "):]) == want
    assert json.loads(OutputJSONResponse(out).body) == want
