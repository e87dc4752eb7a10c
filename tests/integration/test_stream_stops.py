"""Issue 43 item 2 through a real server: streamed deltas with stop strings add up to the
non-streamed text (OpenAI completions and SGLang's /generate), per-request stream_interval sets
the chunking, and a bad stream_interval is a 400 naming the field. (The fuzz over many stop sets
and chunkings runs in-process: tests/unit/test_stop_strings_stream.py.)"""

from __future__ import annotations

import json

from conftest import greedy

PROMPT = [3894, 7952, 5248, 1234, 2346]


def _stops_from(text: str) -> list:
    """Stops the output meets: a late substring and a prefix of it with another ending."""
    mid = len(text) // 2
    while "\ufffd" in text[mid:mid + 3]:  # a split character's stand-in is not text to match
        mid += 1
    return [text[mid:mid + 3], text[mid - 4:mid - 2] + "#"]


def test_completion_stream_deltas_equal_the_final_text(http, openai_client, model_name):
    plain = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": greedy(24, ignore_eos=True)}).json()
    stops = _stops_from(plain["text"])
    final = openai_client.completions.create(model=model_name, prompt=PROMPT, max_tokens=24, temperature=0, stop=stops)
    deltas = [c.choices[0].text for c in openai_client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=24, temperature=0, stop=stops, stream=True)]
    assert "".join(deltas) == final.choices[0].text
    assert final.choices[0].finish_reason == "stop"
    assert not any(stop in final.choices[0].text for stop in stops)


def test_generate_stream_interval_and_stops(http):
    plain = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": greedy(24, ignore_eos=True)}).json()
    sp = greedy(24, ignore_eos=True, stop=_stops_from(plain["text"]), stream_interval=3)
    final = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp}).json()
    with http.stream("POST", "/generate", json={"input_ids": PROMPT, "sampling_params": sp, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and texts[-1] == final["text"]
    counts = [len(e["output_ids"]) for e in events]
    assert counts[:-1] == list(range(1, counts[-1], 3))[: len(counts) - 1]  # 1, 4, 7, ... then the end


def test_bad_stream_interval_is_400(http):
    r = http.post("/generate", json={"text": "x", "sampling_params": {"stream_interval": 0}})
    assert r.status_code == 400 and "stream_interval" in r.json()["error"]["message"]
