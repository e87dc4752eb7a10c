"""POST /v1/responses (issue 60) on the session's server, through the official openai client:
plain text (streamed and not, and the same text as /v1/chat/completions), a function call and its
follow-up with the tool's output, a json_schema format, previous_response_id served from the radix
cache, the stored responses' routes, and 400s that leave the server serving. Responses and stream
events are also validated against the openai package's types (the client itself builds them
leniently). The embedded tiny model has random weights: calls and JSON are made valid by the
grammar backend (a named tool_choice, text.format), as in test_tool_calls.py."""

from __future__ import annotations

import json
import time
from typing import List, Literal

import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from conftest import wait_idle

EVENTS = TypeAdapter(ResponseStreamEvent)
INSTRUCTIONS = "You answer in one short sentence."
QUESTION = "What is the weather in Paris?"
TIME = {
    "type": "object",
    "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_time", "description": "The time now", "parameters": TIME}]
FORECAST = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


class Forecast(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    days: int


def create(client: openai.OpenAI, model: str, **kw) -> Response:
    kw.setdefault("input", QUESTION)
    kw.setdefault("max_output_tokens", 16)
    return client.responses.create(model=model, temperature=0, **kw)


def streamed(client: openai.OpenAI, model: str, **kw) -> List[ResponseStreamEvent]:
    kw.setdefault("input", QUESTION)
    kw.setdefault("max_output_tokens", 16)
    return list(client.responses.create(model=model, temperature=0, stream=True, **kw))


def check_stream(events: List[ResponseStreamEvent]) -> Response:
    """The stream's frame: numbered from 0, created / in_progress first, completed (or incomplete)
    last, each event of a known type; returns the final response."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete"), events[-1]
    for e in events:
        EVENTS.validate_python(e.model_dump(exclude_unset=True))
    return events[-1].response


def test_plain_response_streamed_and_not_is_the_chat_routes_text(openai_client, model_name, http):
    resp = create(openai_client, model_name, instructions=INSTRUCTIONS)
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == model_name
    assert resp.status in ("completed", "incomplete")
    assert [item.type for item in resp.output] == ["message"]
    assert resp.usage.output_tokens > 0 and resp.usage.input_tokens > 0
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    chat = openai_client.chat.completions.create(
        model=model_name, temperature=0, max_tokens=16,
        messages=[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}])
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert (resp.status == "incomplete") == (chat.choices[0].finish_reason == "length")
    if resp.status == "incomplete":
        assert resp.incomplete_details.reason == "max_output_tokens"

    events = streamed(openai_client, model_name, instructions=INSTRUCTIONS)
    final = check_stream(events)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == resp.output_text == final.output_text
    done = [e for e in events if e.type == "response.output_text.done"]
    assert len(done) == 1 and done[0].text == deltas
    kinds = [e.type for e in events if not e.type.endswith(".delta")]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", f"response.{final.status}"]
    # the item's id is the same in every event and in the final response
    assert {getattr(e, "item_id", None) or e.item.id for e in events[2:-1]} == {final.output[0].id}


def test_response_json_matches_openai_types(http, model_name):
    r = http.post("/v1/responses", json={"model": model_name, "input": QUESTION, "max_output_tokens": 4,
                                         "metadata": {"k": "v"}})
    assert r.status_code == 200, r.text
    body = r.json()
    resp = Response.model_validate(body)  # strict: every required field present and typed
    assert resp.metadata == {"k": "v"} and body["store"] is True
    assert body["usage"]["input_tokens_details"]["cached_tokens"] >= 0


def test_function_call_and_its_follow_up(openai_client, model_name):
    resp = create(openai_client, model_name, tools=TOOLS, tool_choice={"type": "function", "name": "get_time"},
                  max_output_tokens=60)
    assert resp.status == "completed"
    assert [item.type for item in resp.output] == ["function_call"]
    call = resp.output[0]
    assert call.name == "get_time" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), TIME)

    # streamed: the argument deltas add up to the same call
    events = streamed(openai_client, model_name, tools=TOOLS, tool_choice={"type": "function", "name": "get_time"},
                      max_output_tokens=60)
    final = check_stream(events)
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == final.output[0].arguments == call.arguments
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [args]

    # the follow-up, two ways: the whole conversation as items, or previous_response_id + the output
    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"time": "12:00"}'}
    by_items = create(openai_client, model_name, tools=TOOLS, store=False,
                      input=[{"role": "user", "content": QUESTION}, *[o.model_dump() for o in resp.output], output])
    by_id = create(openai_client, model_name, tools=TOOLS, previous_response_id=resp.id, input=[output])
    for follow in (by_items, by_id):
        assert [item.type for item in follow.output] == ["message"], follow.output
    assert by_items.output_text == by_id.output_text  # the same conversation, so the same prompt
    assert by_items.usage.input_tokens == by_id.usage.input_tokens
    assert by_id.usage.input_tokens_details.cached_tokens > 0
    assert by_id.previous_response_id == resp.id


def test_json_schema_format_validates(openai_client, model_name):
    fmt = {"type": "json_schema", "name": "forecast", "schema": FORECAST, "strict": True}
    resp = create(openai_client, model_name, text={"format": fmt}, max_output_tokens=120)
    assert resp.status == "completed", resp
    jsonschema.validate(json.loads(resp.output_text), FORECAST)
    assert resp.text.format.type == "json_schema"
    # the client's structured-output helper sends a json_schema format and parses the answer
    parsed = openai_client.responses.parse(model=model_name, input=QUESTION, text_format=Forecast,
                                           temperature=0, max_output_tokens=120)
    assert isinstance(parsed.output_parsed, Forecast)
    # ...and its stream helper assembles the same answer from the events
    with openai_client.responses.stream(model=model_name, input=QUESTION, text_format=Forecast,
                                        temperature=0, max_output_tokens=120) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed and final.output_text == parsed.output_text


def test_second_turn_by_previous_response_id_hits_the_prefix_cache(openai_client, model_name):
    first = create(openai_client, model_name, input="Tell me about the sea, in words of one syllable.",
                   max_output_tokens=8)
    second = create(openai_client, model_name, input="And the sky?", previous_response_id=first.id,
                    max_output_tokens=8)
    # the second prompt starts with the first prompt's tokens, which the radix cache holds
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 2 > 0
    # ...and the same conversation sent whole is the same prompt
    whole = create(openai_client, model_name, store=False, max_output_tokens=8, input=[
        {"role": "user", "content": "Tell me about the sea, in words of one syllable."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And the sky?"}])
    assert whole.usage.input_tokens == second.usage.input_tokens and whole.output_text == second.output_text


def test_stored_responses_get_delete_cancel(openai_client, model_name):
    resp = create(openai_client, model_name, max_output_tokens=4)
    got = openai_client.responses.retrieve(resp.id)
    assert got.id == resp.id and got.output_text == resp.output_text and got.usage == resp.usage
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        openai_client.responses.cancel(resp.id)
    openai_client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        create(openai_client, model_name, previous_response_id=resp.id)
    unstored = create(openai_client, model_name, max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(unstored.id)


def wait_ended(client: openai.OpenAI, rid: str, timeout: float = 120) -> Response:
    deadline = time.monotonic() + timeout
    while True:
        resp = client.responses.retrieve(rid)
        if resp.status not in ("queued", "in_progress"):
            return resp
        assert time.monotonic() < deadline, resp
        time.sleep(0.1)


def test_background_response_is_polled_to_the_same_answer(openai_client, model_name):
    sync = create(openai_client, model_name, max_output_tokens=8, store=False)
    queued = create(openai_client, model_name, max_output_tokens=8, background=True)
    assert queued.status in ("queued", "in_progress") and queued.background and queued.output == []
    done = wait_ended(openai_client, queued.id)
    assert done.status == sync.status and done.output_text == sync.output_text and done.usage.output_tokens > 0
    with pytest.raises(openai.BadRequestError, match="completed|incomplete"):
        openai_client.responses.cancel(done.id)


def test_cancelling_a_background_response_aborts_it(openai_client, model_name, http):
    queued = create(openai_client, model_name, max_output_tokens=3000, background=True)
    cancelled = openai_client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.id == queued.id
    wait_idle(http)  # the generation was aborted: nothing runs
    assert openai_client.responses.retrieve(queued.id).status == "cancelled"
    assert openai_client.responses.cancel(queued.id).status == "cancelled"  # again: the same answer
    running = create(openai_client, model_name, max_output_tokens=3000, background=True)
    with pytest.raises(openai.BadRequestError, match="still"):  # no answer to continue from yet
        create(openai_client, model_name, previous_response_id=running.id)
    openai_client.responses.delete(running.id)  # deleting a running response stops it too
    wait_idle(http)
    with pytest.raises(openai.NotFoundError):  # ...and its end does not store it again
        openai_client.responses.retrieve(running.id)


@pytest.mark.parametrize("body,needle", [
    ({"input": []}, "input"),
    ({}, "input"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "file_search_call", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "not in `tools`"),
    ({"background": True, "store": False}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"previous_response_id": "nope"}, "previous_response_id"),
    ({"text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "nonsense"}}}}, "json_schema"),
    ({"tool_choice": "required"}, "needs `tools`"),
])
def test_bad_requests_are_400s_and_the_server_keeps_serving(http, model_name, body, needle):
    full = {"model": model_name, "input": QUESTION, "max_output_tokens": 4, **body}
    if not body:
        full.pop("input")  # the missing field
    for stream in (False, True):
        r = http.post("/v1/responses", json={**full, "stream": stream})
        assert r.status_code == 400, r.text
        assert needle in r.json()["error"]["message"], r.text
    ok = http.post("/v1/responses", json={"model": model_name, "input": QUESTION, "max_output_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_bad_requests_through_the_client(openai_client, model_name):
    with pytest.raises(openai.BadRequestError, match="tools\\[0\\].type"):
        create(openai_client, model_name, tools=[{"type": "web_search"}])
    with pytest.raises(openai.NotFoundError):
        create(openai_client, model_name, previous_response_id="resp_0000")
    assert create(openai_client, model_name, max_output_tokens=2).status in ("completed", "incomplete")
