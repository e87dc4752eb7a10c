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
