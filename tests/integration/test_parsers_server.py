"""`--tool-call-parser` and `--reasoning-parser` on a real server, through the openai client,
streamed and not. The tiny model's text is chosen with a `regex` constraint (every character is
forced), so the parsers see exactly one known text: a server with the flags must turn it into
reasoning_content, content and tool_calls; the same text with the parsing turned off per request
comes back verbatim, and a server parsing another format leaves it as text."""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import openai
import pytest

from conftest import ServerProcess, assert_children_gone


@dataclass(frozen=True)
class Format:
    flags: Tuple[str, ...]
    text: str  # what the model is made to write
    reasoning: str
    content: str
    calls: Tuple[Tuple[str, Dict[str, Any]], ...]  # (function name, arguments)


FORMATS = {
    "hermes+qwen3": Format(
        ("--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"),
        '<think>The user wants the weather.</think>\n\nChecking.<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
        "The user wants the weather.", "Checking.", (("get_weather", {"city": "Paris", "days": 3}),)),
    # deepseek-r1: no <think> needed (its template opens it); mistral: a JSON list of calls
    "mistral+deepseek-r1": Format(
        ("--tool-call-parser", "mistral", "--reasoning-parser", "deepseek-r1"),
        'The user wants the time.</think>\n\nLet me look.[TOOL_CALLS] [{"name": "get_time", "arguments": '
        '{"tz": "UTC"}}, {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}]',
        "The user wants the time.", "Let me look.",
        (("get_time", {"tz": "UTC"}), ("get_weather", {"city": "Oslo", "days": 2}))),
}
# Each server given the other format's text: the reasoning split its own parser makes, and the
# rest as content, tool-call markup included; no tool_calls.
OTHER = {
    "hermes+qwen3": ("", FORMATS["mistral+deepseek-r1"].text),  # no <think> at the start: all content
    "mistral+deepseek-r1": ("The user wants the weather.", FORMATS["hermes+qwen3"].text.split("</think>\n\n")[1]),
}

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}},
]
MESSAGES = [{"role": "user", "content": "What's the weather in Paris, and the time?"}]


def forcing(text: str) -> str:
    """A regex that matches `text` only."""
    return "".join("\\" + ch if ch in "\\.^$*+?{}[]()|" else ch for ch in text)


@pytest.fixture(scope="module", params=list(FORMATS))
def fmt_server(request):
    fmt = FORMATS[request.param]
    srv = ServerProcess("--max-total-tokens", "4000", *fmt.flags)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield request.param, fmt, client
    assert srv.stop(signal.SIGTERM) == 0, srv.read_log()[-3000:]
    assert_children_gone(srv.children)


def create(client: openai.OpenAI, text: str, **kw):
    model = client.models.list().data[0].id
    extra = {"regex": forcing(text), **kw.pop("extra_body", {})}
    return client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, temperature=0,
                                          max_tokens=len(text) + 16, extra_body=extra, **kw)


def calls_of(tool_calls) -> List[Tuple[str, Dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls or []]


def test_without_parsing_the_text_comes_back_verbatim(fmt_server):
    """The control: with no tools offered and separate_reasoning off, the model's forced text
    is the message content, character for character."""
    _, fmt, client = fmt_server
    resp = create(client, fmt.text, tool_choice="none", extra_body={"separate_reasoning": False})
    choice = resp.choices[0]
    assert choice.message.content == fmt.text
    assert not choice.message.tool_calls and getattr(choice.message, "reasoning_content", None) is None
    assert choice.finish_reason == "stop"


def test_parsed_message(fmt_server):
    _, fmt, client = fmt_server
    choice = create(client, fmt.text).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.reasoning_content == fmt.reasoning
    assert choice.message.content == fmt.content
    assert calls_of(choice.message.tool_calls) == list(fmt.calls)
    ids = [c.id for c in choice.message.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids)
    assert all(c.type == "function" for c in choice.message.tool_calls)


def test_parsed_stream(fmt_server):
    """Streamed: reasoning deltas, then content deltas, then each call (its first delta with id
    and name, then arguments); they add up to the non-streamed message."""
    _, fmt, client = fmt_server
    kinds: List[str] = []
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in create(client, fmt.text, stream=True):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        finish = choice.finish_reason or finish
        if getattr(delta, "reasoning_content", None):
            reasoning += delta.reasoning_content
            kinds.append("reasoning")
        if delta.content:
            content += delta.content
            kinds.append("content")
        for tc in delta.tool_calls or []:
            if tc.id is not None:
                assert tc.index not in calls and tc.type == "function" and tc.function.name
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.function.name is None
            calls[tc.index]["arguments"] += tc.function.arguments or ""
            kinds.append("tool")
    assert finish == "tool_calls"
    assert (reasoning, content) == (fmt.reasoning, fmt.content)
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == list(fmt.calls)
    assert all(c["id"].startswith("call_") for c in calls.values())
    order = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
    assert order == ["reasoning", "content", "tool"], kinds


def test_another_format_stays_text(fmt_server):
    """The flag's parser, not any parser: the other server's format is not taken for calls."""
    name, _, client = fmt_server
    other = next(f for n, f in FORMATS.items() if n != name)
    reasoning, content = OTHER[name]
    for stream in (False, True):
        if not stream:
            choice = create(client, other.text).choices[0]
            got = (getattr(choice.message, "reasoning_content", None) or "", choice.message.content,
                   choice.message.tool_calls, choice.finish_reason)
        else:
            r, c, tools, finish = "", "", [], None
            for chunk in create(client, other.text, stream=True):
                if chunk.choices:
                    d = chunk.choices[0].delta
                    r += getattr(d, "reasoning_content", None) or ""
                    c += d.content or ""
                    tools += d.tool_calls or []
                    finish = chunk.choices[0].finish_reason or finish
            got = (r, c, tools or None, finish)
        assert got == (reasoning, content, None, "stop"), (stream, got)


RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's flat shape


def test_responses_route_parses_alike(fmt_server):
    """POST /v1/responses (issue 60) on the same parsers: a reasoning item, a message, and one
    function_call item per call, streamed and not; the stream's deltas add up to the items."""
    _, fmt, client = fmt_server
    model = client.models.list().data[0].id
    kw = dict(model=model, input=MESSAGES, tools=RESPONSES_TOOLS, temperature=0,
              max_output_tokens=len(fmt.text) + 16, extra_body={"regex": forcing(fmt.text)})
    resp = client.responses.create(**kw)
    assert resp.status == "completed"
    assert [o.type for o in resp.output] == ["reasoning", "message"] + ["function_call"] * len(fmt.calls)
    assert resp.output[0].content[0].text == fmt.reasoning and resp.output[0].summary == []
    assert resp.output_text == fmt.content
    assert [(o.name, json.loads(o.arguments)) for o in resp.output[2:]] == list(fmt.calls)
    assert all(o.call_id.startswith("call_") for o in resp.output[2:])
    assert resp.usage.output_tokens_details.reasoning_tokens > 0

    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == fmt.reasoning
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == fmt.content
    args: Dict[int, str] = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            args[e.output_index] = args.get(e.output_index, "") + e.delta
    assert [json.loads(a) for _, a in sorted(args.items())] == [c[1] for c in fmt.calls]
    assert [o.type for o in final.output] == [o.type for o in resp.output]
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == [o.type for o in resp.output]
