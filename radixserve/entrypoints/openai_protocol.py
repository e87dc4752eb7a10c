"""Request bodies of the OpenAI-compatible API (pydantic), with SGLang's extra sampling fields.

Responses are built as plain dicts in serving_completions.py / serving_chat.py in OpenAI's shapes
(the integration tests validate them with the `openai` package's types). Unknown request fields
are ignored, as OpenAI-compatible servers do; wrong types give 400 with the field's name. Types
are strict, as JSON means them: `true` is not the number 1, "yes" is not a boolean.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from radixserve.sampling_params import MAX_INT_PARAM

_STRICT = ConfigDict(strict=True, extra="ignore")


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = _STRICT

    type: Literal["text", "json_object", "json_schema", "structural_tag"] = "text"
    json_schema: Optional[Dict[str, Any]] = None
    # structural_tag (SGLang's, xgrammar's): OpenAI-style structures + triggers, or xgrammar's format
    structures: Optional[List[Dict[str, Any]]] = None
    triggers: Optional[List[str]] = None
    format: Optional[Dict[str, Any]] = None

    def structural_tag(self) -> Optional[str]:
        if self.type != "structural_tag":
            return None
        return json.dumps(self.model_dump(exclude_none=True, include={"structures", "triggers", "format"}))


# Left out of the sampling params when the request does not set them: the server's defaults apply.
DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = _STRICT

    model: Optional[str] = None  # optional, as in SGLang and vLLM: the served model
    n: int = 1
    # PD disaggregation (sglang-router sets them; one per prompt for a batch of prompts)
    bootstrap_host: Optional[Union[str, List[str]]] = None
    bootstrap_port: Optional[Union[int, List[Optional[int]]]] = None
    bootstrap_room: Optional[Union[int, List[int]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, List[str]]] = None
    # None: not set, so the server's defaults apply (--sampling-defaults: OpenAI's or the model's)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    logit_bias: Optional[Dict[str, float]] = None
    user: Optional[str] = None
    # SGLang's extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[List[int]] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: Optional[str] = None
    json_schema: Optional[str] = None
    ebnf: Optional[str] = None
    stop_regex: Optional[Union[str, List[str]]] = None  # SGLang's extra: stop at a regex match
    rid: Optional[str] = None
    priority: Optional[int] = Field(None, ge=-MAX_INT_PARAM, le=MAX_INT_PARAM)
    stream_interval: Optional[int] = None  # SGLang's: a stream reports every this many tokens
    data_parallel_rank: Optional[int] = None  # --dp-size: the replica that serves it

    def sampling_params(self, max_new_tokens: Optional[int]) -> Dict[str, Any]:
        params = {
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": self.min_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "no_stop_trim": self.no_stop_trim,
            "n": self.n,
            "logit_bias": self.logit_bias,
            "sampling_seed": self.seed,
            "regex": self.regex,
            "json_schema": self.json_schema,
            "ebnf": self.ebnf,
            "stop_regex": self.stop_regex,
            "stream_interval": self.stream_interval,
        }
        return {k: v for k, v in params.items() if k not in DEFAULTED or v is not None}


class CompletionRequest(_SamplingFields):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: Optional[str] = None  # answered 400, not ignored: no fill-in-the-middle here
    best_of: Optional[int] = None  # answered 400 unless 1: use n

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: Optional[str]) -> Optional[str]:
        if suffix:
            raise ValueError("suffix is not supported (no fill-in-the-middle)")
        return suffix

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, best_of: Optional[int]) -> Optional[int]:
        if best_of not in (None, 1):
            raise ValueError("best_of is not supported; ask for n samples instead")
        return best_of

    @field_validator("prompt")
    @classmethod
    def _token_ids_in_range(cls, prompt: Any) -> Any:
        # The vocabulary check comes later (the front end's 400); echo decodes the prompt
        # before that, and the tokenizer cannot take an id outside [0, 2**32).
        rows = [prompt] if prompt and isinstance(prompt[0], int) else prompt
        for row in rows if isinstance(prompt, list) else []:
            for t in row if isinstance(row, list) else []:
                if not 0 <= t <= MAX_INT_PARAM:
                    raise ValueError(f"token ids must be in [0, {MAX_INT_PARAM}], got {t}")
        return prompt


class FunctionCall(BaseModel):
    model_config = _STRICT

    name: str
    arguments: Union[str, Dict[str, Any]] = "{}"  # OpenAI sends a JSON string; chat templates take either


class ToolCall(BaseModel):
    model_config = _STRICT

    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    model_config = _STRICT

    name: str
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(BaseModel):
    model_config = _STRICT

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(BaseModel):
    model_config = _STRICT

    class Name(BaseModel):
        model_config = _STRICT

        name: str

    type: Literal["function"] = "function"
    function: Name


UNSUPPORTED_MEDIA_PARTS = ("input_audio", "audio", "audio_url", "video", "video_url")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, List[Dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None
    tool_call_id: Optional[str] = None

    @field_validator("content")
    @classmethod
    def _text_and_image_parts_only(cls, content: Any) -> Any:
        """A part is {"type": "text", "text": "..."} or {"type": "image_url", "image_url": {"url":
        "..."}} (a model that takes no images refuses the latter when the request is served)."""
        for i, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type")
            if kind == "image_url":
                image = part.get("image_url")
                if not isinstance(image.get("url") if isinstance(image, dict) else image, str):
                    raise ValueError(f"part {i} is an image_url part without a string `image_url.url`")
                continue
            if kind in UNSUPPORTED_MEDIA_PARTS:
                raise ValueError(f"part {i} has type {kind!r}: video and audio input are not supported (images are)")
            if kind != "text":
                raise ValueError(f"part {i} has type {kind!r}: only text and image_url parts are supported")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {i} is a text part without a string `text`")
        return content

    @model_validator(mode="after")
    def _content_present(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: List[ChatMessage] = Field(min_length=1)
    # Offered to the chat template; parsed out by --tool-call-parser, or forced by the grammar
    # backend for tool_choice "required" / a named function (serving_chat.py).
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    response_format: Optional[ResponseFormat] = None
    # SGLang's extras: template variables (e.g. {"enable_thinking": false}), and whether
    # --reasoning-parser splits reasoning_content out
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    separate_reasoning: bool = True

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_template_kwargs(cls, kw: Any) -> Any:
        reserved = {"conversation", "messages", "tools", "tokenize", "add_generation_prompt",
                    "return_dict", "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs"}
        bad = sorted(reserved & set(kw or {}))
        if bad:
            raise ValueError(f"these keys are set by the server: {', '.join(bad)}")
        return kw

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> "ChatCompletionRequest":
        tc = self.tool_choice
        if tc is None or tc == "none" or tc == "auto":
            return self
        if not self.tools:
            raise ValueError("tool_choice 'required' or a named function needs `tools`")
        if isinstance(tc, NamedToolChoice) and tc.function.name not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names {tc.function.name!r}, which is not in `tools`")
        return self

    def effective_tool_choice(self) -> Union[str, NamedToolChoice]:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if not self.tools:
            return "none"
        return self.tool_choice if self.tool_choice is not None else "auto"

    def tool_call_schema(self) -> Optional[Dict[str, Any]]:
        """The JSON schema that forces a tool call: one object {"name", "arguments"} for a named
        function; for "required", a non-empty array of such objects over all the tools."""
        tc = self.effective_tool_choice()
        if not isinstance(tc, NamedToolChoice) and tc != "required":
            return None

        def call_schema(t: Tool) -> Dict[str, Any]:
            return {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    "arguments": t.function.parameters or {"type": "object"},
                },
                "required": ["name", "arguments"],
            }

        assert self.tools
        if isinstance(tc, NamedToolChoice):
            return call_schema(next(t for t in self.tools if t.function.name == tc.function.name))
        return {"type": "array", "minItems": 1, "items": {"anyOf": [call_schema(t) for t in self.tools]}}

    def grammar_json_schema(self) -> Optional[str]:
        """The JSON schema string the grammar backend enforces: SGLang's json_schema, else
        response_format's."""
        if self.json_schema is not None:
            return self.json_schema
        rf = self.response_format
        if rf is None or rf.type in ("text", "structural_tag"):
            return None
        if rf.type == "json_object":
            return json.dumps({"type": "object"})
        schema = (rf.json_schema or {}).get("schema", {"type": "object"})
        return json.dumps(schema)


def error_body(message: str, err_type: str = "BadRequestError", code: int = 400, param: Optional[str] = None) -> Dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def openai_finish_reason(reason: Optional[Dict[str, Any]]) -> Optional[str]:
    if reason is None:
        return None
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(reason.get("type", ""), "stop")


def matched_stop(reason: Optional[Dict[str, Any]]) -> Any:
    return (reason or {}).get("matched") if (reason or {}).get("type") == "stop" else None


def usage_of(outputs: List[Dict[str, Any]], n: int) -> Dict[str, Any]:
    """Prompt tokens count once per prompt (its n samples share it); completions all."""
    prompt = sum(o["meta_info"]["prompt_tokens"] for i, o in enumerate(outputs) if i % n == 0)
    cached = sum(o["meta_info"]["cached_tokens"] for i, o in enumerate(outputs) if i % n == 0)
    completion = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
