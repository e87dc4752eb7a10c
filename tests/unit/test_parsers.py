"""Tool-call and reasoning parsers: fixed strings per format, and streaming in random chunk
sizes gives the one-shot result."""

from __future__ import annotations

import json
import random
from typing import List, Tuple

import pytest

from radixserve.entrypoints.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, ToolCall, calls_of

W = ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "c"}))
T = ToolCall("get_time", json.dumps({"tz": "UTC"}))


def chunks(text: str, rng: random.Random) -> List[str]:
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        out.append(text[i:i + n])
        i += n
    return out


def streamed_tools(name: str, text: str, seed: int) -> Tuple[str, List[ToolCall]]:
    p = TOOL_CALL_PARSERS[name]()
    normal, deltas = "", []
    for c in chunks(text, random.Random(seed)):
        n, d = p.feed(c)
        normal += n
        deltas += d
    n, d = p.finish()
    # the first delta of each call carries its name, the later ones only arguments
    first = {}
    for x in deltas + d:
        if x.index not in first:
            first[x.index] = x
            assert x.name is not None
        else:
            assert x.name is None
    return normal + n, calls_of(deltas + d)


TOOL_CASES = [
    # (parser, model text, normal text, calls)
    ("hermes", 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
     "Let me check.", [W]),
    ("qwen25", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>', "\n", [W, T]),
    ("hermes", "no tools here, just <tool text", "no tools here, just <tool text", []),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {oops}}</tool_call> after',
     '<tool_call>{"name": "get_weather", "arguments": {oops}}</tool_call> after', []),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}', "", [T]),  # unterminated, valid
    ("hermes", "ends with a marker <tool_call>", "ends with a marker <tool_call>", []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}', "", [W]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
     '{"name": "get_time", "parameters": {"tz": "UTC"}}', "", [W, T]),
    ("llama3", 'Hi {"name": "x", "parameters": {}}', 'Hi {"name": "x", "parameters": {}}', []),
    ("llama3", '{"name": "get_weather", "parameters": {"city": ', '{"name": "get_weather", "parameters": {"city": ', []),
    ("llama3", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3", 'Sure. <|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}} done', "Sure. done", [T]),
    ("llama3", "<|python_tag|>", "<|python_tag|>", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
     '{"name": "get_time", "arguments": {"tz": "UTC"}}]', "", [W, T]),
    ("mistral", 'ok [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"', 'ok [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"', []),
    ("mistral", "[TOOL_CALLS] [1, 2]", "[TOOL_CALLS] [1, 2]", []),
    ("mistral", "plain [TOOL text", "plain [TOOL text", []),
]


@pytest.mark.parametrize("name,text,normal,calls", TOOL_CASES)
def test_tool_call_formats(name, text, normal, calls):
    got_normal, got_calls = TOOL_CALL_PARSERS[name].parse(text)
    assert got_normal == normal
    assert got_calls == calls
    for seed in range(20):
        assert streamed_tools(name, text, seed) == (got_normal, got_calls)


def test_arguments_are_json_strings():
    _, calls = TOOL_CALL_PARSERS["hermes"].parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert calls == [ToolCall("f", '{"a": 1}')]


def test_text_is_held_only_while_it_may_open_a_call():
    p = TOOL_CALL_PARSERS["hermes"]()
    assert p.feed("Hello <tool") == ("Hello ", [])
    assert p.feed("box>") == ("<toolbox>", [])
    n, d = p.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert n == "" and [x.name for x in d] == ["f", None] and d[1].arguments == "{}"


REASONING_CASES = [
    ("deepseek-r1", "<think>I should add.</think>\n\nThe answer is 4.", "I should add.", "The answer is 4."),
    ("deepseek-r1", "I should add.</think>The answer is 4.", "I should add.", "The answer is 4."),
    ("deepseek-r1", "still thinking <", "still thinking <", ""),
    ("qwen3", "<think>\nhmm\n</think>\n\nHello!", "hmm\n", "Hello!"),
    ("qwen3", "Hello, no thinking.", "", "Hello, no thinking."),
    ("qwen3", "<think>unfinished", "unfinished", ""),
    ("qwen3", "<thin>", "", "<thin>"),
    ("qwen3", "", "", ""),
]


@pytest.mark.parametrize("name,text,reasoning,content", REASONING_CASES)
def test_reasoning_formats(name, text, reasoning, content):
    assert REASONING_PARSERS[name].parse(text) == (reasoning, content)
    for seed in range(20):
        p = REASONING_PARSERS[name]()
        r, c = "", ""
        for ch in chunks(text, random.Random(seed)) + [None]:
            dr, dc = p.finish() if ch is None else p.feed(ch)
            r, c = r + dr, c + dc
        assert (r, c) == (reasoning, content)


# ---- the chat route's response building on a fixed model output ----------------------------

from radixserve.entrypoints.serving_chat import ChatOutput, chat_message  # noqa: E402
from radixserve.server_args import REASONING_PARSERS as REASONING_NAMES  # noqa: E402
from radixserve.server_args import TOOL_CALL_PARSERS as TOOL_NAMES  # noqa: E402

STOP = {"type": "stop", "matched": 151645}
MODEL_TEXT = ('<think>The user wants the weather.</think>\n\nChecking.'
              '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call>')


def test_flag_names_match_the_parsers():
    assert set(TOOL_NAMES) == set(TOOL_CALL_PARSERS) and set(REASONING_NAMES) == set(REASONING_PARSERS)


def test_chat_message_with_both_parsers():
    msg, finish = chat_message(MODEL_TEXT, STOP, ChatOutput("hermes", "qwen3"))
    assert finish == "tool_calls"
    assert msg["reasoning_content"] == "The user wants the weather."
    assert msg["content"] == "Checking."
    [call] = msg["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": W.arguments}


def test_chat_message_without_parsers_is_the_text():
    msg, finish = chat_message(MODEL_TEXT, STOP, ChatOutput())
    assert msg == {"role": "assistant", "content": MODEL_TEXT} and finish == "stop"
    msg, finish = chat_message(MODEL_TEXT, {"type": "length", "length": 9}, ChatOutput("hermes"))
    assert finish == "length" and msg["tool_calls"]  # a call parsed, but the output was cut


def test_streamed_chat_deltas_assemble_to_the_message():
    full, _ = chat_message(MODEL_TEXT, STOP, ChatOutput("hermes", "qwen3"))
    for seed in range(10):
        out = ChatOutput("hermes", "qwen3")
        deltas = [d for c in chunks(MODEL_TEXT, random.Random(seed)) for d in out.feed(c)] + out.finish()
        content = "".join(d.get("content", "") for d in deltas)
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        calls: dict = {}
        for d in deltas:
            for tc in d.get("tool_calls", []):
                if "id" in tc:
                    calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": ""}
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
        assert (content, reasoning) == (full["content"], full["reasoning_content"])
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", W.arguments)]


def test_forced_tool_call_json():
    msg, finish = chat_message('[{"name": "get_time", "arguments": {"tz": "UTC"}}]', STOP, ChatOutput(forced_tools=True))
    assert finish == "tool_calls" and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "get_time", "arguments": T.arguments}
    msg, finish = chat_message('{"name": "get_time", "argu', {"type": "length", "length": 5}, ChatOutput(forced_tools=True))
    assert finish == "length" and msg["content"] == '{"name": "get_time", "argu' and "tool_calls" not in msg


PIECES = {
    "hermes": ["Hi ", "<tool_call>", "</tool_call>", '{"name": "f", "arguments": {"a": 1}}', "<tool", "{", "}", "\n", "x"],
    "llama3": ["<|python_tag|>", '{"name": "f", "parameters": {"a": 1}}', ";", " ", "{", "}", "text", "<|py"],
    "mistral": ["[TOOL_CALLS]", ' [{"name": "f", "arguments": {}}]', "[", "]", "{", " ok", "[TOOL"],
}


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral"])
def test_random_texts_stream_like_one_shot(name):
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice(PIECES[name]) for _ in range(rng.randint(0, 8)))
        assert streamed_tools(name, text, rng.randint(0, 10**6)) == TOOL_CALL_PARSERS[name].parse(text), text


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_random_reasoning_texts_stream_like_one_shot(name):
    rng = random.Random(3)
    pieces = ["<think>", "</think>", "<thi", "</", " ", "\n", "abc", "<"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        p, r, c = REASONING_PARSERS[name](), "", ""
        for ch in chunks(text, rng) + [None]:
            dr, dc = p.finish() if ch is None else p.feed(ch)
            r, c = r + dr, c + dc
        assert (r, c) == REASONING_PARSERS[name].parse(text), text
