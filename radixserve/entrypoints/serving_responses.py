"""POST /v1/responses (OpenAI's Responses API) on the chat path, and its stored responses:
GET / DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel.

A request becomes a ChatCompletionRequest (responses_protocol.py), which serving_chat.prepare_chat
turns into the engine's GenerateReqInput and a ChatOutput parser (reasoning, tool calls), as for
/v1/chat/completions: the same messages give the same prompt and the same text. `OutputBuilder`
turns the parser's deltas into the Responses output items (reasoning, message, function_call)
and their stream events; a whole response is the same builder fed the whole text, so a stream and
a non-streamed response agree.

    response.created, response.in_progress,
    per item: response.output_item.added, (content_part.added, *.delta..., *.done, content_part.done),
              response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed (aborted)

Stored responses (`store`, the default) keep the conversation as chat messages (input, then the
model's answer; reasoning left out as SGLang does) so that `previous_response_id` continues it: the
next prompt starts with the same tokens and the radix cache serves them (usage's
input_tokens_details.cached_tokens). The store is in memory, bounded, least recently used first out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Dict, List, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixserve.entrypoints.openai_protocol import openai_finish_reason
from radixserve.entrypoints.responses_protocol import ResponsesRequest, input_messages
from radixserve.entrypoints.serving_base import chain_first, first_result, peek_first
from radixserve.entrypoints.serving_chat import ChatOutput, prepare_chat
from radixserve.managers.tokenizer_manager import RequestError, TokenizerManager

logger = logging.getLogger("radixserve.responses")
MAX_STORED_RESPONSES = 1024  # responses kept for previous_response_id / GET; the oldest used go first


# ---- the store -----------------------------------------------------------------------------------
@dataclass
class StoredResponse:
    response: Dict[str, Any]  # the response object, as answered
    messages: List[Dict[str, Any]]  # the conversation so far as chat messages, instructions excluded


class ResponseStore:
    """Bounded in-memory store, least recently used out first (a get counts as a use). Conversations
    share their earlier messages' dicts, so a long chain of turns costs one list of references each."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES):
        assert capacity > 0
        self.capacity = capacity
        self._items: "OrderedDict[str, StoredResponse]" = OrderedDict()

    def put(self, rid: str, stored: StoredResponse) -> None:
        self._items[rid] = stored
        self._items.move_to_end(rid)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, rid: str) -> Optional[StoredResponse]:
        stored = self._items.get(rid)
        if stored is not None:
            self._items.move_to_end(rid)
        return stored

    def delete(self, rid: str) -> bool:
        return self._items.pop(rid, None) is not None

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class ResponsesState:
    """The routes' state: the stored responses, and the background generations still running."""

    store: ResponseStore = field(default_factory=ResponseStore)
    running: Dict[str, "asyncio.Task[None]"] = field(default_factory=dict)


# ---- output items and their events ---------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """ChatOutput deltas -> Responses output items, and the stream events that build them.

    Events come without sequence_number (the route numbers them). One item is open at a time:
    reasoning text, then the message, then each function call, in the order the parsers give them.
    Whitespace before any message text is held back: before a tool call it is dropped (the chat
    route gives such content as null), otherwise it opens the message when text follows or at the end.
    """

    def __init__(self) -> None:
        self.items: List[Dict[str, Any]] = []
        self._open: Optional[Dict[str, Any]] = None
        self._held = ""

    # -- feeding
    def feed(self, deltas: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        events: List[Dict[str, Any]] = []
        for d in deltas:
            if d.get("reasoning_content"):
                events += self._reasoning(d["reasoning_content"])
            if d.get("content"):
                events += self._content(d["content"])
            for call in d.get("tool_calls") or []:
                events += self._tool_call(call)
        return events

    def finish(self, incomplete: bool) -> List[Dict[str, Any]]:
        """Closes the open item; a response without a message or a call gets an empty message."""
        events: List[Dict[str, Any]] = []
        has_call = any(i["type"] == "function_call" for i in self.items)
        if self._held and not has_call:
            events += self._content("", flush=True)
        if not has_call and not any(i["type"] == "message" for i in self.items):
            events += self._open_message()
        status = "incomplete" if incomplete else "completed"
        return events + self._close(status)

    # -- items
    def _reasoning(self, text: str) -> List[Dict[str, Any]]:
        events: List[Dict[str, Any]] = []
        if self._open is None or self._open["type"] != "reasoning":
            events += self._close()
            item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            events += self._add(item, {"type": "reasoning_text", "text": ""})
        item = self._open
        assert item is not None
        item["content"][0]["text"] += text
        return events + [self._at(item, "response.reasoning_text.delta", content_index=0, delta=text)]

    def _content(self, text: str, flush: bool = False) -> List[Dict[str, Any]]:
        events: List[Dict[str, Any]] = []
        if self._open is None or self._open["type"] != "message":
            if not (self._held + text).strip() and not flush:
                self._held += text
                return []
            text, self._held = self._held + text, ""
            events += self._close() + self._open_message()
        item = self._open
        assert item is not None
        if text:
            item["content"][0]["text"] += text
            events.append(self._at(item, "response.output_text.delta", content_index=0, delta=text, logprobs=[]))
        return events

    def _open_message(self) -> List[Dict[str, Any]]:
        item = {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        return self._add(item, {"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def _tool_call(self, call: Dict[str, Any]) -> List[Dict[str, Any]]:
        events: List[Dict[str, Any]] = []
        fn = call["function"]
        if "id" in call:  # a call's first delta
            self._held = ""
            events += self._close()
            item = {"id": _new_id("fc"), "type": "function_call", "call_id": call["id"], "name": fn["name"],
                    "arguments": "", "status": "in_progress"}
            events += self._add(item, None)
        item = self._open
        assert item is not None and item["type"] == "function_call"
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            events.append(self._at(item, "response.function_call_arguments.delta", delta=fn["arguments"]))
        return events

    def _add(self, item: Dict[str, Any], part: Optional[Dict[str, Any]]) -> List[Dict[str, Any]]:
        self.items.append(item)
        self._open = item
        events = [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": _copy(item)}]
        if part is not None:
            item["content"].append(part)
            events.append(self._at(item, "response.content_part.added", content_index=0, part=_copy(part)))
        return events

    def _close(self, status: str = "completed") -> List[Dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        events: List[Dict[str, Any]] = []
        if item["type"] == "function_call":
            events.append(self._at(item, "response.function_call_arguments.done", name=item["name"],
                                   arguments=item["arguments"]))
        else:
            part = item["content"][0]
            done = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events.append(self._at(item, done, content_index=0, text=part["text"], **extra))
            events.append(self._at(item, "response.content_part.done", content_index=0, part=_copy(part)))
        item["status"] = status
        events.append({"type": "response.output_item.done", "output_index": self.items.index(item), "item": _copy(item)})
        return events

    def _at(self, item: Dict[str, Any], kind: str, **fields: Any) -> Dict[str, Any]:
        return {"type": kind, "item_id": item["id"], "output_index": self.items.index(item), **fields}

    # -- the conversation, for the next turn
    def assistant_message(self) -> Dict[str, Any]:
        """The answer as a chat message (reasoning left out)."""
        text = "".join(p["text"] for i in self.items if i["type"] == "message" for p in i["content"])
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        message: Dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            message["tool_calls"] = calls
        return message


def _copy(obj: Dict[str, Any]) -> Dict[str, Any]:
    """A snapshot for an event (the item keeps growing after it is sent)."""
    return {k: ([_copy(x) if isinstance(x, dict) else x for x in v] if isinstance(v, list) else v)
            for k, v in obj.items()}


# ---- the response object -------------------------------------------------------------------------
@dataclass
class ResponseHead:
    """What a response echoes of its request, whatever its status."""

    id: str
    model: str
    created_at: int
    req: ResponsesRequest
    tools: List[Dict[str, Any]] = field(default_factory=list)

    def body(self, status: str, output: List[Dict[str, Any]], usage: Optional[Dict[str, Any]] = None,
             incomplete_reason: Optional[str] = None, error: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        req = self.req
        tool_choice: Any = req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") else req.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": status, "output": output, "usage": usage, "error": error,
            "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p,
            "tools": self.tools, "tool_choice": tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls,
            "text": {"format": req.text.format.echo() if req.text else {"type": "text"}},
            "reasoning": req.reasoning.model_dump() if req.reasoning else None,
            "previous_response_id": req.previous_response_id, "store": req.store,
            "metadata": req.metadata or {}, "user": req.user, "truncation": "disabled", "background": req.background,
            "completed_at": int(time.time()) if status == "completed" else None,
        }


def _usage(meta: Dict[str, Any], reasoning_tokens: int) -> Dict[str, Any]:
    prompt, cached, completion = meta["prompt_tokens"], meta["cached_tokens"], meta["completion_tokens"]
    return {
        "input_tokens": prompt,
        # the radix cache keeps every prompt token it did not already hold: those are "written"
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": prompt - cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt + completion,
    }


async def _reasoning_tokens(tm: TokenizerManager, builder: OutputBuilder) -> int:
    text = "".join(p["text"] for i in builder.items if i["type"] == "reasoning" for p in i["content"])
    return len((await tm.tokenize_texts([text], add_special_tokens=False))[0]) if text else 0


def _ending(reason: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The engine's finish reason -> the response's status, incomplete_reason, error."""
    finish = openai_finish_reason(reason)
    if finish == "length":
        return {"status": "incomplete", "incomplete_reason": "max_output_tokens"}
    if finish == "abort":
        message = (reason or {}).get("message") or "The request was aborted."
        return {"status": "failed", "error": {"code": "server_error", "message": message}}
    return {"status": "completed"}


# ---- the routes ----------------------------------------------------------------------------------
async def serve_responses(tm: TokenizerManager, state: ResponsesState, req: ResponsesRequest, raw_request: Any) -> Response:
    req.refuse_unsupported()
    store = state.store
    history: List[Dict[str, Any]] = []
    if req.previous_response_id is not None:
        previous = _stored(store, req.previous_response_id, "previous_response_id")
        if previous.response["status"] in ("queued", "in_progress"):
            raise RequestError(f"previous_response_id: the response {req.previous_response_id!r} is still "
                               f"{previous.response['status']}; continue it once it has ended.")
        history = previous.messages
    new_messages = input_messages(req.input)
    chat_req = req.chat_request(history, new_messages)
    prepared = await prepare_chat(tm, chat_req)
    head = ResponseHead(_new_id("resp"), prepared.model, int(time.time()), req,
                        [t.model_dump(exclude_none=True) for t in req.function_tools()])
    prepared.obj.rid = head.id
    # a background response has no client to wait for it: it runs until done or cancelled
    gen = tm.generate_request(prepared.obj, None if req.background else raw_request)
    output, builder = prepared.new_output(), OutputBuilder()

    async def finish(out: Dict[str, Any]) -> Dict[str, Any]:
        """The response of a finished generation (stored when asked); its last events go to the builder."""
        ending = _ending(out["meta_info"]["finish_reason"])
        usage = _usage(out["meta_info"], await _reasoning_tokens(tm, builder))
        body = head.body(output=builder.items, usage=usage, **ending)
        if req.store and not _cancelled(store, head.id):
            store.put(head.id, StoredResponse(body, history + new_messages + [builder.assistant_message()]))
        return body

    async def whole() -> Dict[str, Any]:
        out = await first_result(gen)
        builder.feed(output.feed(out["text"]) + output.finish())
        builder.finish(incomplete=_ending(out["meta_info"]["finish_reason"])["status"] == "incomplete")
        return await finish(out)

    if req.background:
        queued = head.body("queued", [])
        store.put(head.id, StoredResponse(queued, history + new_messages))
        task = asyncio.create_task(_run_background(store, head, whole))
        state.running[head.id] = task
        task.add_done_callback(lambda _: state.running.pop(head.id, None))
        return JSONResponse(queued)
    if not req.stream:
        return JSONResponse(await whole())
    first = await peek_first(gen)
    return StreamingResponse(_stream(head, first, gen, output, builder, finish), media_type="text/event-stream")


def _cancelled(store: ResponseStore, rid: str) -> bool:
    stored = store.get(rid)
    return stored is not None and stored.response["status"] == "cancelled"


def _set_status(store: ResponseStore, rid: str, status: str, **fields: Any) -> None:
    stored = store.get(rid)
    if stored is not None and stored.response["status"] != "cancelled":
        stored.response = {**stored.response, "status": status, **fields}


async def _run_background(store: ResponseStore, head: ResponseHead, whole: Callable[[], Any]) -> None:
    """A background response: in_progress while it generates, then stored as it ends; a refused
    request (a prompt too long, ...) is stored as failed with the reason."""
    _set_status(store, head.id, "in_progress")
    try:
        await whole()
    except RequestError as e:
        code = "invalid_prompt" if e.status_code == 400 else "server_error"
        _set_status(store, head.id, "failed", error={"code": code, "message": e.message})
    except Exception as e:  # a bug: the response says so instead of staying in_progress forever
        logger.exception("background response %s failed", head.id)
        _set_status(store, head.id, "failed", error={"code": "server_error", "message": f"{type(e).__name__}: {e}"})


async def _stream(head: ResponseHead, first: Any, gen: Any, output: ChatOutput, builder: OutputBuilder,
                  finish: Callable[[Dict[str, Any]], Any]) -> AsyncIterator[bytes]:
    seq = 0

    def event(obj: Dict[str, Any]) -> bytes:
        nonlocal seq
        obj = {**obj, "sequence_number": seq}
        seq += 1
        return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n".encode("utf-8")

    yield event({"type": "response.created", "response": head.body("in_progress", [])})
    yield event({"type": "response.in_progress", "response": head.body("in_progress", [])})
    sent = 0
    try:
        async for out in chain_first(first, gen):
            reason = out["meta_info"]["finish_reason"]
            deltas = output.feed(out["text"][sent:])
            sent = len(out["text"])
            if reason is not None:
                deltas += output.finish()
            for e in builder.feed(deltas):
                yield event(e)
            if reason is not None:
                status = _ending(reason)["status"]
                for e in builder.finish(incomplete=status == "incomplete"):
                    yield event(e)
                body = await finish(out)
                kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
                yield event({"type": kind, "response": body})
    except RequestError as e:
        yield event({"type": "error", "code": str(e.status_code), "message": e.message, "param": None})
    finally:
        await gen.aclose()


def _stored(store: ResponseStore, rid: str, param: str) -> StoredResponse:
    if not rid.startswith("resp_"):
        raise RequestError(f"{param}: invalid response id {rid!r}; ids begin with 'resp_'.")
    stored = store.get(rid)
    if stored is None:
        raise RequestError(f"{param}: no stored response with id {rid!r} (not stored, deleted, or evicted).",
                           404, "NotFoundError")
    return stored


def add_responses_routes(app: FastAPI, tm: TokenizerManager, state: Optional[ResponsesState] = None) -> ResponsesState:
    state = state if state is not None else ResponsesState()
    store = state.store

    @app.post("/v1/responses")
    async def v1_responses(body: ResponsesRequest, request: Request) -> Response:
        return await serve_responses(tm, state, body, request)

    @app.get("/v1/responses/{response_id}")
    async def v1_get_response(response_id: str) -> Dict[str, Any]:
        return _stored(store, response_id, "response_id").response

    @app.delete("/v1/responses/{response_id}")
    async def v1_delete_response(response_id: str) -> Dict[str, Any]:
        _stored(store, response_id, "response_id")
        if response_id in state.running:  # deleting a running response stops it
            tm.abort_request(response_id)
        store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def v1_cancel_response(response_id: str) -> Dict[str, Any]:
        """Only a background response can be cancelled (OpenAI, SGLang): a queued or running one
        is aborted and marked cancelled; cancelling it again answers the same."""
        stored = _stored(store, response_id, "response_id")
        if not stored.response.get("background"):
            raise RequestError("Cannot cancel a synchronous response.")
        status = stored.response["status"]
        if status in ("queued", "in_progress"):
            tm.abort_request(response_id)
            stored.response = {**stored.response, "status": "cancelled"}
        elif status != "cancelled":
            raise RequestError(f"Cannot cancel a response that is {status}.")
        return stored.response

    return state
