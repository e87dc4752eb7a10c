"""POST /v1/chat/completions: the tokenizer's chat template, then the same generation path.

The model's text becomes the message through `ChatOutput` (reasoning parser, then tool-call
parser, or the JSON of a grammar-forced tool call), the same object for a whole text and for a
stream, so both answer alike.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Tuple

from fastapi.responses import Response, StreamingResponse

from radixserve.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    NamedToolChoice,
    error_body,
    matched_stop,
    openai_finish_reason,
    usage_of,
)
from radixserve.entrypoints.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, ToolCall, ToolCallDelta
from radixserve.entrypoints.parsers.tool_call import as_tool_call
from radixserve.entrypoints.serving_base import (
    SSE_DONE, OutputJSONResponse, bootstrap_fields, chain_first, check_model, first_result, lora_path_of_model, peek_first, sse,
)
from radixserve.managers.tokenizer_manager import RequestError, TokenizerManager
from radixserve.protocol import GenerateReqInput


def _token_entry(tm: TokenizerManager, lp: float, tid: int, s: Optional[str]) -> Dict[str, Any]:
    s = s if s is not None else tm.decode_token(tid)
    return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}


def _logprobs(tm: TokenizerManager, meta: Dict[str, Any], start: int) -> Dict[str, Any]:
    toks = meta.get("output_token_logprobs", [])[start:]
    tops = (meta.get("output_top_logprobs") or [])[start:]
    content = []
    for i, (lp, tid, s) in enumerate(toks):
        entry = _token_entry(tm, lp, tid, s)
        entry["top_logprobs"] = [_token_entry(tm, *t) for t in tops[i]] if i < len(tops) else []
        content.append(entry)
    return {"content": content}


class ChatOutput:
    """One choice's text -> OpenAI delta dicts ({"content"}, {"reasoning_content"}, {"tool_calls"}).

    `tool_parser`: a --tool-call-parser name (None: no parsing). `forced_tools`: the output is the
    grammar-forced JSON of tool_call_schema(), turned into calls at the end (no parser needed).
    """

    def __init__(self, tool_parser: Optional[str] = None, reasoning_parser: Optional[str] = None,
                 forced_tools: bool = False):
        self.forced_tools = forced_tools
        # a forced call starts at the first token: there is no reasoning to split off
        self._reasoning = REASONING_PARSERS[reasoning_parser]() if reasoning_parser and not forced_tools else None
        self._tools = TOOL_CALL_PARSERS[tool_parser]() if tool_parser and not forced_tools else None
        self._forced_text = ""
        self._ids: Dict[int, str] = {}
        self.tool_calls: List[Dict[str, Any]] = []  # the whole calls, for the final message

    def feed(self, text: str) -> List[Dict[str, Any]]:
        return self._step(text, final=False)

    def finish(self) -> List[Dict[str, Any]]:
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> List[Dict[str, Any]]:
        if self.forced_tools:
            self._forced_text += text
            return self._forced_calls() if final else []
        out: List[Dict[str, Any]] = []
        if self._reasoning is not None:
            reasoning, text = self._reasoning.finish() if final else self._reasoning.feed(text)
            if reasoning:
                out.append({"reasoning_content": reasoning})
        tool_deltas: List[ToolCallDelta] = []
        if self._tools is not None:
            n1, d1 = self._tools.feed(text) if text else ("", [])
            n2, d2 = self._tools.finish() if final else ("", [])
            text, tool_deltas = n1 + n2, d1 + d2
        if text:
            out.append({"content": text})
        out += [self._tool_delta(d) for d in tool_deltas]
        return out

    def _tool_delta(self, d: ToolCallDelta) -> Dict[str, Any]:
        entry: Dict[str, Any] = {"index": d.index, "function": {"arguments": d.arguments}}
        if d.name is not None:  # a call's first delta: its id, type and name
            self._ids[d.index] = f"call_{uuid.uuid4().hex[:24]}"
            entry = {"index": d.index, "id": self._ids[d.index], "type": "function",
                     "function": {"name": d.name, "arguments": d.arguments}}
            self.tool_calls.append({"id": self._ids[d.index], "type": "function",
                                    "function": {"name": d.name, "arguments": ""}})
        self.tool_calls[d.index]["function"]["arguments"] += d.arguments
        return {"tool_calls": [entry]}

    def _forced_calls(self) -> List[Dict[str, Any]]:
        try:
            obj = json.loads(self._forced_text)
        except ValueError:
            obj = None  # cut short (max_tokens): the text is given back as content
        items = obj if isinstance(obj, list) else [obj]
        calls = [as_tool_call(o) for o in items]
        if obj is None or not calls or any(c is None for c in calls):
            return [{"content": self._forced_text}] if self._forced_text else []
        out: List[Dict[str, Any]] = []
        for i, c in enumerate(calls):
            assert isinstance(c, ToolCall)
            out += [self._tool_delta(ToolCallDelta(i, name=c.name)), self._tool_delta(ToolCallDelta(i, arguments=c.arguments))]
        return out


def chat_message(text: str, reason: Optional[Dict[str, Any]], output: ChatOutput) -> Tuple[Dict[str, Any], Optional[str]]:
    """A whole output -> (the choice's message, its OpenAI finish_reason)."""
    deltas = output.feed(text) + output.finish()
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    message: Dict[str, Any] = {"role": "assistant", "content": content}
    if output.tool_calls:
        message["content"] = content if content.strip() else None
        message["tool_calls"] = output.tool_calls
    if reasoning:
        message["reasoning_content"] = reasoning
    return message, finish_reason_of(reason, output)


def finish_reason_of(reason: Optional[Dict[str, Any]], output: ChatOutput) -> Optional[str]:
    r = openai_finish_reason(reason)
    return "tool_calls" if r == "stop" and output.tool_calls else r


def _chat_images(messages: List[Dict[str, Any]]) -> Tuple[List[str], List[str]]:
    """(each image_url part's URL, where it is: "messages[i].content[j]"), in prompt order; the
    parts become {"type": "image"} for the template (transformers' convention), which places the
    model's image placeholder there."""
    urls, labels = [], []
    for i, m in enumerate(messages):
        content = m.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if part.get("type") == "image_url":
                image = part["image_url"]
                urls.append(image["url"] if isinstance(image, dict) else image)
                labels.append(f"messages[{i}].content[{j}]")
                content[j] = {"type": "image"}
    return urls, labels


def _template_messages(req: ChatCompletionRequest) -> List[Dict[str, Any]]:
    """Messages for the chat template. Earlier assistant tool calls get their arguments as
    objects: templates (Qwen, Llama) serialize them themselves."""
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    for m in messages:
        for call in m.get("tool_calls") or []:
            args = call["function"].get("arguments")
            if isinstance(args, str):
                try:
                    call["function"]["arguments"] = json.loads(args)
                except ValueError:
                    pass  # leave it as it came; the template decides
    return messages


def _output_factory(tm: TokenizerManager, req: ChatCompletionRequest) -> Any:
    choice = req.effective_tool_choice()
    forced = isinstance(choice, NamedToolChoice) or choice == "required"
    tool_parser = tm.server_args.tool_call_parser if choice == "auto" else None
    reasoning = tm.server_args.reasoning_parser if req.separate_reasoning else None
    return lambda: ChatOutput(tool_parser, reasoning, forced)


@dataclass
class PreparedChat:
    """A chat request made ready for the engine: what serve_chat and the Responses route
    (serving_responses.py) both generate from."""

    obj: GenerateReqInput
    model: str  # the name answered in the response
    new_output: Callable[[], ChatOutput]  # one per choice: parses its text into deltas


async def prepare_chat(tm: TokenizerManager, req: ChatCompletionRequest) -> PreparedChat:
    """Checks, the chat template, the sampling params (grammar of response_format or of a forced
    tool call) and the output parsers of a chat request; RequestError (400) for a bad one."""
    pd = req.bootstrap_room is not None  # sglang-router picked this server (and sends "unknown" for no model)
    check_model(tm, None if pd else req.model)
    model = tm.served_model_name if pd or not req.model else req.model  # `model` is optional
    if req.top_logprobs and not req.logprobs:
        raise RequestError("top_logprobs needs logprobs set to true.")
    choice = req.effective_tool_choice()
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and choice != "none" else None
    messages = _template_messages(req)
    image_urls, image_labels = _chat_images(messages)
    input_ids = await tm.apply_chat_template(messages, tools=tools, template_kwargs=req.chat_template_kwargs)
    max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    sp = req.sampling_params(max_new)
    sp["json_schema"] = req.grammar_json_schema()
    if req.response_format is not None and req.response_format.structural_tag() is not None:
        sp["structural_tag"] = req.response_format.structural_tag()
    forced_schema = req.tool_call_schema()
    if forced_schema is not None:
        if any(sp.get(k) is not None for k in ("json_schema", "regex", "ebnf", "structural_tag")):
            raise RequestError("tool_choice 'required' or a named function constrains the output; "
                               "it cannot be combined with response_format, json_schema, regex or ebnf.")
        sp["json_schema"] = json.dumps(forced_schema)
    obj = GenerateReqInput(
        input_ids=input_ids, sampling_params=sp, rid=req.rid, return_logprob=req.logprobs,
        top_logprobs_num=req.top_logprobs or 0, return_text_in_logprobs=True, stream=req.stream,
        priority=req.priority, data_parallel_rank=req.data_parallel_rank, **bootstrap_fields(req),
        lora_path=lora_path_of_model(tm, None if pd else req.model),  # model: "adapter" / "base:adapter"
        image_data=image_urls or None, image_labels=image_labels or None,
    )
    return PreparedChat(obj, model, _output_factory(tm, req))


async def serve_chat(tm: TokenizerManager, req: ChatCompletionRequest, raw_request: Any) -> Response:
    prepared = await prepare_chat(tm, req)
    obj, model, new_output = prepared.obj, prepared.model, prepared.new_output
    created = int(time.time())
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    gen = tm.generate_request(obj, raw_request)

    if not req.stream:
        outs = await first_result(gen)
        outs = outs if isinstance(outs, list) else [outs]
        choices = []
        for i, out in enumerate(outs):
            reason = out["meta_info"]["finish_reason"]
            message, finish = chat_message(out["text"], reason, new_output())
            choices.append({
                "index": i,
                "message": message,
                "logprobs": _logprobs(tm, out["meta_info"], 0) if req.logprobs else None,
                "finish_reason": finish,
                "matched_stop": matched_stop(reason),
            })
        return OutputJSONResponse({
            "id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_of(outs, req.n),
            "metadata": {"weight_version": outs[0]["meta_info"]["weight_version"]},  # SGLang's
        })

    first = await peek_first(gen)

    def chunk(idx: int, delta: Dict[str, Any], reason: Any = None, logprobs: Any = None,
              finish: Optional[str] = None) -> bytes:
        return sse({
            "id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{
                "index": idx, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish or openai_finish_reason(reason), "matched_stop": matched_stop(reason),
            }],
        })

    async def stream() -> AsyncIterator[bytes]:
        sent_text: Dict[int, int] = {}
        sent_tokens: Dict[int, int] = {}
        finals: Dict[int, Dict[str, Any]] = {}
        outputs: Dict[int, ChatOutput] = {}
        try:
            async for out in chain_first(first, gen):
                idx = out.get("index", 0)
                meta = out["meta_info"]
                if idx not in sent_text:
                    sent_text[idx], sent_tokens[idx], outputs[idx] = 0, 0, new_output()
                    yield chunk(idx, {"role": "assistant", "content": ""})
                output = outputs[idx]
                reason = meta["finish_reason"]
                deltas = output.feed(out["text"][sent_text[idx]:])
                sent_text[idx] = len(out["text"])
                if reason is not None:
                    deltas += output.finish()
                logprobs = None
                if req.logprobs:
                    logprobs = _logprobs(tm, meta, sent_tokens[idx])
                    sent_tokens[idx] = len(meta.get("output_token_logprobs", []))
                    if not deltas and logprobs["content"]:  # text held by a parser: logprobs go now
                        deltas = [{"content": ""}]
                for i, delta in enumerate(deltas):
                    yield chunk(idx, delta, None, logprobs if i == 0 else None)
                if reason is not None:
                    finals[idx] = out
                    yield chunk(idx, {}, reason, finish=finish_reason_of(reason, output))
            if req.stream_options and req.stream_options.include_usage:
                outs = [finals[i] for i in sorted(finals)]
                yield sse({
                    "id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [], "usage": usage_of(outs, req.n),
                })
        except RequestError as e:
            yield sse(error_body(e.message, e.err_type, e.status_code))
        finally:
            await gen.aclose()
        yield SSE_DONE

    return StreamingResponse(stream(), media_type="text/event-stream")
