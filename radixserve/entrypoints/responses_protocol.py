"""The request body of POST /v1/responses (OpenAI's Responses API), and its translation into the
chat request the engine already serves (serving_responses.py generates from that).

The Responses API's input is a list of items: messages (`{"role", "content"}`, content a string
or `input_text` / `input_image` / `output_text` parts), `function_call` items (an earlier call of
the model) and `function_call_output` items (the tool's answer, by `call_id`); `reasoning` items
that a client passes back are dropped, as SGLang and vLLM do. They become chat messages: a
function_call joins the assistant message before it as a `tool_calls` entry, an output becomes a
`tool` message. Fields this server cannot honour are refused with a 400 that names them
(`UNSUPPORTED`); unknown fields are ignored, as on the other OpenAI routes.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from radixserve.entrypoints.openai_protocol import ChatCompletionRequest
from radixserve.managers.tokenizer_manager import RequestError
from radixserve.sampling_params import MAX_INT_PARAM

_STRICT = ConfigDict(strict=True, extra="ignore")


class TextFormat(BaseModel):
    """`text.format`: plain text, JSON mode, or a JSON schema the grammar backend enforces."""

    model_config = _STRICT

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(default=None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None

    def response_format(self) -> Optional[Dict[str, Any]]:
        """The chat route's response_format for this format."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {
            "name": self.name or "response", "schema": self.schema_ or {"type": "object"}, "strict": self.strict}}

    def echo(self) -> Dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(BaseModel):
    model_config = _STRICT

    format: TextFormat = Field(default_factory=TextFormat)
    verbosity: Optional[Literal["low", "medium", "high"]] = None


class FunctionTool(BaseModel):
    """A Responses function tool: flat (`name` beside `type`), not nested under `function` as in chat."""

    model_config = _STRICT

    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None

    def chat_tool(self) -> Dict[str, Any]:
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters, "strict": self.strict}
        return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


class FunctionToolChoice(BaseModel):
    model_config = _STRICT

    type: Literal["function"]
    name: str


class ReasoningConfig(BaseModel):
    model_config = _STRICT

    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None  # accepted; no summaries are made


# Responses fields this server does not implement: refused (400, naming the field) when set to
# anything but the value that means "off". Conversation objects, prompt templates and file inputs
# need storage this server does not keep.
UNSUPPORTED: Dict[str, Any] = {
    "conversation": (None,),
    "prompt": (None,),
    "include": (None, []),
    "top_logprobs": (None, 0),
    "truncation": (None, "disabled"),
    "max_tool_calls": (None,),
    "context_management": (None,),
}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # extras: checked against UNSUPPORTED

    model: Optional[str] = None
    input: Union[str, List[Dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1, le=MAX_INT_PARAM)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: bool = False
    tools: Optional[List[Dict[str, Any]]] = None  # validated item by item (tools[i]), see function_tools()
    tool_choice: Optional[Union[Literal["none", "auto", "required"], FunctionToolChoice]] = None
    parallel_tool_calls: bool = True
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    store: bool = True
    background: bool = False  # answer at once with a queued response; poll GET, or cancel
    previous_response_id: Optional[str] = None
    metadata: Optional[Dict[str, str]] = None
    user: Optional[str] = None
    # SGLang's sampling extras, as on the chat route
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: Optional[Union[str, List[str]]] = None
    seed: Optional[int] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    priority: Optional[int] = Field(None, ge=-MAX_INT_PARAM, le=MAX_INT_PARAM)
    # SGLang's: templates that take it (e.g. {"enable_thinking": false}); `reasoning.effort` adds
    # reasoning_effort to it, as vLLM does
    chat_template_kwargs: Optional[Dict[str, Any]] = None

    @field_validator("input")
    @classmethod
    def _input_not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("input is an empty list: give a string or at least one item")
        return value

    def refuse_unsupported(self) -> None:
        if self.background and not self.store:
            raise RequestError("background: a background response must be stored (store: true), as OpenAI's.")
        if self.background and self.stream:
            raise RequestError("background: streaming a background response is not supported here; "
                               "poll GET /v1/responses/{id} instead.")
        for name, off in UNSUPPORTED.items():
            value = (self.model_extra or {}).get(name)
            if value not in off:
                raise RequestError(f"{name} is not supported by this server (got {value!r}).")

    def function_tools(self) -> List[FunctionTool]:
        tools = []
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise RequestError(f"tools[{i}].type: only function tools are supported (got {kind!r}).")
            try:
                tools.append(FunctionTool.model_validate(tool))
            except ValidationError as e:
                raise RequestError(f"tools[{i}]: {_first_error(e)}") from None
        if isinstance(self.tool_choice, FunctionToolChoice) and self.tool_choice.name not in {t.name for t in tools}:
            raise RequestError(f"tool_choice names {self.tool_choice.name!r}, which is not in `tools`.")
        return tools

    def chat_request(self, history: List[Dict[str, Any]], new_messages: List[Dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request that generates this response: `instructions` as the system message,
        then the stored conversation of previous_response_id, then this request's input."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        tools = self.function_tools()
        template_kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning is not None and self.reasoning.effort is not None:
            template_kwargs.setdefault("reasoning_effort", self.reasoning.effort)
        tool_choice: Any = self.tool_choice
        if isinstance(tool_choice, FunctionToolChoice):
            tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
        body = {
            "model": self.model, "messages": system + history + new_messages, "stream": self.stream,
            "max_completion_tokens": self.max_output_tokens,
            "tools": [t.chat_tool() for t in tools] or None, "tool_choice": tool_choice,
            "response_format": self.text.format.response_format() if self.text else None,
            "chat_template_kwargs": template_kwargs or None,
            **{k: getattr(self, k) for k in (
                "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty", "stop", "seed", "regex", "ebnf", "priority", "user")},
        }
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            raise RequestError(_first_error(e)) from None


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(x) for x in err.get("loc", ()))
    return f"{where}: {err.get('msg')}" if where else str(err.get("msg"))


# ---- input items -> chat messages ----------------------------------------------------------------
_ROLES = ("user", "system", "developer", "assistant")


def input_messages(input_: Union[str, List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """A Responses `input` as chat messages; RequestError naming `input[i]...` for a bad item."""
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}]
    messages: List[Dict[str, Any]] = []
    for i, item in enumerate(input_):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function", "function": {
                "name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":  # a call on its own: an assistant turn of calls
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, (str, list)):
                raise RequestError(f"{where}.output: a function_call_output needs `output` (a string or text parts).")
            content = output if isinstance(output, str) else _text_parts(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": content})
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning: not shown to the model again (SGLang, vLLM)
        else:
            raise RequestError(f"{where}.type: {kind!r} items are not supported "
                               "(message, function_call, function_call_output and reasoning are).")
    return messages


def _string(item: Dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestError(f"{where}.{key}: a string is required (got {type(value).__name__}).")
    return value


def _message(item: Dict[str, Any], where: str) -> Dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise RequestError(f"{where}.role: must be one of {', '.join(_ROLES)} (got {role!r}).")
    content = item.get("content")
    if isinstance(content, list):
        content = _content_parts(content, f"{where}.content")
    elif not isinstance(content, str):
        raise RequestError(f"{where}.content: a string or a list of content parts is required.")
    return {"role": role, "content": content}


def _content_parts(parts: List[Any], where: str) -> Union[str, List[Dict[str, Any]]]:
    """Text parts join into one string (every chat template takes that); with an image the parts
    stay a list in the chat route's shape."""
    out: List[Dict[str, Any]] = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal"):
            text = part.get("refusal" if kind == "refusal" else "text")
            if not isinstance(text, str):
                raise RequestError(f"{where}[{j}].text: a string is required.")
            out.append({"type": "text", "text": text})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise RequestError(f"{where}[{j}].image_url: a URL or data URL string is required (file_id is not supported).")
            out.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise RequestError(f"{where}[{j}].type: {kind!r} parts are not supported (input_text, output_text and input_image are).")
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out)
    return out


def _text_parts(parts: List[Any], where: str) -> str:
    content = _content_parts(parts, where)
    if not isinstance(content, str):
        raise RequestError(f"{where}: a function_call_output takes text parts only.")
    return content
