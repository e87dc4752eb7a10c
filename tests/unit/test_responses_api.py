"""The Responses API's pure parts (issue 60): input items -> chat messages, parser deltas -> output
items and stream events (validated with the openai package's own types), the bounded store. The
route on a real server, through the openai client, is in tests/integration/test_responses_server.py."""

from __future__ import annotations

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from radixserve.entrypoints.responses_protocol import ResponsesRequest, input_messages
from radixserve.entrypoints.serving_responses import OutputBuilder, ResponseHead, ResponseStore, StoredResponse
from radixserve.managers.tokenizer_manager import RequestError

EVENTS = TypeAdapter(ResponseStreamEvent)


def test_string_input_is_one_user_message():
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]


def test_items_become_chat_messages():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "in Oslo?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]},
    ]
    assert input_messages(items) == [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
    ]


def test_a_call_without_a_message_before_it_is_its_own_assistant_turn():
    items = [{"role": "user", "content": "x"},
             {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]
    assert input_messages(items)[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


@pytest.mark.parametrize("items,needle", [
    ([{"role": "robot", "content": "x"}], "input[0].role"),
    ([{"role": "user", "content": 3}], "input[0].content"),
    ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "input[0].content[0].type"),
    ([{"role": "user", "content": "x"}, {"type": "function_call", "name": "f", "arguments": "{}"}], "input[1].call_id"),
    ([{"type": "function_call_output", "call_id": "c"}], "input[0].output"),
    ([{"type": "web_search_call"}], "input[0].type"),
])
def test_bad_items_are_refused_by_place(items, needle):
    with pytest.raises(RequestError) as e:
        input_messages(items)
    assert needle in e.value.message and e.value.status_code == 400


@pytest.mark.parametrize("extra,needle", [
    ({"background": True, "store": False}, "background"),
    ({"background": True, "stream": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
])
def test_unsupported_fields_are_named(extra, needle):
    req = ResponsesRequest.model_validate({"input": "x", **extra})
    with pytest.raises(RequestError) as e:
        req.refuse_unsupported()
    assert needle in e.value.message


def test_off_values_of_unsupported_fields_pass():
    ResponsesRequest.model_validate({"input": "x", "background": False, "include": [], "truncation": "disabled"}).refuse_unsupported()


def test_chat_request_carries_the_fields():
    req = ResponsesRequest.model_validate({
        "input": "x", "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0.0, "top_p": 0.5,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": True}},
        "reasoning": {"effort": "low"},
    })
    chat = req.chat_request([{"role": "user", "content": "before"}], input_messages(req.input))
    assert [m.role for m in chat.messages] == ["system", "user", "user"]
    assert chat.messages[0].content == "Be brief." and chat.max_completion_tokens == 7
    assert (chat.temperature, chat.top_p) == (0.0, 0.5)
    assert chat.tools[0].function.name == "f" and chat.tool_choice.function.name == "f"
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema["schema"] == {"type": "object"}
    assert chat.chat_template_kwargs == {"reasoning_effort": "low"}


@pytest.mark.parametrize("body,needle", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}, "not in `tools`"),
])
def test_bad_tools_are_refused(body, needle):
    req = ResponsesRequest.model_validate({"input": "x", **body})
    with pytest.raises(RequestError) as e:
        req.function_tools()
    assert needle in e.value.message


def _events(builder_steps):
    events = []
    for e in builder_steps:
        events.append({**e, "sequence_number": len(events)})
    return [EVENTS.validate_python(e) for e in events]


def test_builder_items_and_events_match_openai_types():
    b = OutputBuilder()
    raw = b.feed([{"reasoning_content": "Think"}, {"reasoning_content": "ing."}, {"content": "\n\n"},
                  {"content": "Hello"}, {"content": " world"},
                  {"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": ""}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": '{"x": 1}'}}]}])
    raw += b.finish(incomplete=False)
    events = _events(raw)
    kinds = [e.type for e in events]
    assert kinds == [
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
    ]
    assert [i["type"] for i in b.items] == ["reasoning", "message", "function_call"]
    assert b.items[1]["content"][0]["text"] == "\n\nHello world"  # held whitespace opens with the text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "\n\nHello world"
    assert b.items[2]["arguments"] == '{"x": 1}' and b.items[2]["call_id"] == "call_a"
    assert all(i["status"] == "completed" for i in b.items)
    # the output item "added" is a snapshot: it does not grow with later deltas
    assert events[7].item.content == [] and events[0].item.content == []
    head = ResponseHead("resp_1", "m", 0, ResponsesRequest.model_validate({"input": "x"}))
    Response.model_validate(head.body("completed", b.items))
    assert b.assistant_message() == {"role": "assistant", "content": "\n\nHello world", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}


def test_whitespace_before_a_call_is_dropped_and_no_empty_message_is_made():
    b = OutputBuilder()
    b.feed([{"content": "  "}, {"tool_calls": [{"index": 0, "id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}])
    b.finish(incomplete=False)
    assert [i["type"] for i in b.items] == ["function_call"]


def test_an_empty_answer_is_an_empty_message_and_length_marks_it_incomplete():
    b = OutputBuilder()
    events = _events(b.finish(incomplete=True))
    assert [i["type"] for i in b.items] == ["message"] and b.items[0]["content"][0]["text"] == ""
    assert b.items[0]["status"] == "incomplete" and events[-1].type == "response.output_item.done"


def test_store_is_bounded_least_recently_used_out():
    store = ResponseStore(capacity=2)
    for rid in ("a", "b"):
        store.put(rid, StoredResponse({"id": rid}, []))
    assert store.get("a") is not None  # a is now the most recently used
    store.put("c", StoredResponse({"id": "c"}, []))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert store.delete("a") and not store.delete("a") and len(store) == 1
