"""Tool calls through /v1/chat/completions on the embedded tiny model (random weights): the
grammar backend forces tool_choice "required" / a named function, so the calls are valid JSON of
each function's schema even from a model that knows nothing. The parser path (hermes tags in
free text) is unit-tested on fixed outputs in tests/unit/test_parsers.py."""

from __future__ import annotations

import json

import jsonschema
import pytest

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What's the weather in Paris?"}]


def chat(http, model_name, **kw):
    body = {"model": model_name, "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 120, **kw}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def check_calls(calls):
    assert calls
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        args = json.loads(call["function"]["arguments"])
        jsonschema.validate(args, SCHEMAS[call["function"]["name"]])


def test_named_tool_choice(http, model_name):
    named = {"type": "function", "function": {"name": "get_weather"}}
    resp = chat(http, model_name, tool_choice=named)
    choice = resp["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    check_calls(calls)
    assert choice["message"]["content"] is None


def test_required_tool_choice(http, model_name):
    choice = chat(http, model_name, tool_choice="required")["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    check_calls(choice["message"]["tool_calls"])


def test_openai_client_types(openai_client, model_name):
    resp = openai_client.chat.completions.create(
        model=model_name, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    call = resp.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time" and resp.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), TIME)


def test_tool_choice_none_is_plain_text(http, model_name):
    choice = chat(http, model_name, tool_choice="none", max_tokens=8)["choices"][0]
    assert "tool_calls" not in choice["message"] and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")


def test_tool_result_follow_up_is_accepted(http, model_name):
    named = {"type": "function", "function": {"name": "get_time"}}
    first = chat(http, model_name, tool_choice=named)["choices"][0]["message"]
    follow = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": first["tool_calls"]},
        {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": '{"time": "12:00"}'},
    ]
    choice = chat(http, model_name, messages=follow, max_tokens=8)["choices"][0]
    assert isinstance(choice["message"]["content"], str)


def test_streamed_tool_call_assembles_to_the_same_call(http, model_name):
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = chat(http, model_name, tool_choice=named)["choices"][0]["message"]["tool_calls"]
    body = {"model": model_name, "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 120,
            "tool_choice": named, "stream": True}
    calls, finish = {}, None
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            finish = choice["finish_reason"] or finish
            for tc in choice["delta"].get("tool_calls") or []:
                if "id" in tc:  # a call's first delta
                    assert tc["function"]["name"] and tc["type"] == "function"
                    calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole]


@pytest.mark.parametrize("body,needle", [
    ({"tool_choice": "required", "tools": None}, "needs `tools`"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in `tools`"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"chat_template_kwargs": {"tokenize": True}}, "set by the server"),
])
def test_refused_tool_requests(http, model_name, body, needle):
    full = {"model": model_name, "messages": MESSAGES, "tools": TOOLS, **body}
    r = http.post("/v1/chat/completions", json=full)
    assert r.status_code == 400 and needle in r.text, r.text


def test_chat_template_kwargs_pass_through(http, model_name):
    choice = chat(http, model_name, chat_template_kwargs={"enable_thinking": False}, max_tokens=4)["choices"][0]
    assert isinstance(choice["message"]["content"], str)
