"""Request bodies of SGLang's native API (pydantic), as FastAPI parses them and /docs shows them.

POST /generate's body becomes the runtime's GenerateReqInput. Its prompt and sampling fields are
checked by the TokenizerManager (SGLang's messages: "text must be a string...", "top_p must be
in (0, 1]"), so they are typed loosely here; their schema still says what to send.
"""

from __future__ import annotations

from typing import Annotated, Any, List, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, WithJsonSchema

from radixserve.protocol import GenerateReqInput, SessionParams
from radixserve.sampling_params import MAX_INT_PARAM, unicode_error


def _one_or_batch(item: dict) -> dict:
    return {"anyOf": [item, {"type": "array", "items": item}]}


Prompt = Annotated[Any, WithJsonSchema(_one_or_batch({"type": "string"}))]
TokenIds = Annotated[Any, WithJsonSchema(_one_or_batch({"type": "array", "items": {"type": "integer"}}))]
SamplingParamsDict = Annotated[Any, WithJsonSchema(_one_or_batch({"type": "object", "title": "SamplingParams"}))]


def lone_surrogate_error(body: Any) -> Optional[str]:
    """Where a string of a parsed JSON body (a key or a value, at any depth) holds a lone
    surrogate, which Python's JSON parser accepts from a "\\ud800" escape but which no
    tokenizer and no JSON response can take: the error message naming that field, or None.
    Iterative, so a deeply nested body cannot exhaust the stack."""
    stack: List[Tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            error = unicode_error(value, path or "The request body")
            if error is not None:
                return error
        elif isinstance(value, dict):
            for k, v in value.items():
                key_path = f"{path}.{k}" if path else str(k)
                error = unicode_error(k, f"a key of {path or 'the request body'}")
                if error is not None:
                    return error
                stack.append((key_path, v))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
    return None


class GenerateRequest(BaseModel):
    """One prompt or a batch: `text` or `input_ids` (exactly one). For a batch, `sampling_params`,
    `rid` and `return_logprob` may be lists with one entry per prompt."""

    model_config = ConfigDict(extra="ignore")

    text: Optional[Prompt] = Field(None, description="A prompt, or a list of prompts.")
    input_ids: Optional[TokenIds] = Field(None, description="Token ids, or a list of such lists.")
    sampling_params: Optional[SamplingParamsDict] = Field(
        None, description="SGLang's sampling parameters: max_new_tokens, temperature, top_p, stop, n, ...")
    rid: Optional[Union[StrictStr, List[StrictStr]]] = None
    return_logprob: Optional[Union[StrictBool, List[StrictBool]]] = None
    logprob_start_len: StrictInt = Field(-1, ge=-1, le=MAX_INT_PARAM, description="-1: no input logprobs.")
    top_logprobs_num: StrictInt = Field(0, ge=0, le=MAX_INT_PARAM)
    return_text_in_logprobs: StrictBool = False
    stream: StrictBool = False
    priority: Optional[StrictInt] = Field(None, ge=-MAX_INT_PARAM, le=MAX_INT_PARAM)
    session_params: Optional[SessionParams] = None
    # PD disaggregation: sglang-router sets these (lists for a batch) and sends the request to
    # the prefill and the decode server
    bootstrap_host: Optional[Union[StrictStr, List[StrictStr]]] = None
    bootstrap_port: Optional[Union[StrictInt, List[Optional[StrictInt]]]] = None
    bootstrap_room: Optional[Union[StrictInt, List[StrictInt]]] = None
    # --enable-lora: the adapter (its --lora-paths name), one per prompt for a batch; None = base
    lora_path: Optional[Union[StrictStr, List[Optional[StrictStr]]]] = None
    # a model that takes images: one per image placeholder of the prompt (a data URL, a file
    # under --allowed-local-media-path, an http(s) URL with --enable-media-url-fetch), or a list
    # of such lists (or nulls) for a batch
    image_data: Optional[Union[StrictStr, List[Optional[Union[StrictStr, List[StrictStr]]]]]] = Field(
        None, description="Images: data URLs (or allowed files / URLs), one per image placeholder of the prompt.")
    # --dp-size: the replica that serves it (0-based; the front end answers 400 out of range)
    data_parallel_rank: Optional[StrictInt] = None
    # --enable-custom-logit-processor: a registered processor's name; its args: sampling_params.custom_params
    custom_logit_processor: Optional[StrictStr] = None
    # with return_logprob: these ids' logprobs at each output position (checked by the front end)
    token_ids_logprob: Optional[TokenIds] = None
    # meta_info.hidden_states: the final hidden states (the prompt's last position, then each output token's)
    return_hidden_states: Union[StrictBool, List[StrictBool]] = False
    # instead of text / input_ids: the prompt's embeddings, [seq, hidden] numbers (a list of such for
    # a batch); needs --disable-radix-cache (checked by the front end, with the hidden size)
    input_embeds: Optional[List[Any]] = Field(None, description="The prompt's embeddings: [seq, hidden] numbers.")

    def to_input(self) -> GenerateReqInput:
        return GenerateReqInput(**self.model_dump())  # session_params becomes a dict, as it arrived


class AbortRequest(BaseModel):
    rid: StrictStr = Field("", description="The request to abort.")
    abort_all: StrictBool = Field(False, description="Abort every request instead.")


class TokenizeRequest(BaseModel):
    """POST /tokenize and /v1/tokenize (SGLang's shape)."""

    model: Optional[StrictStr] = None
    prompt: Union[StrictStr, List[StrictStr]] = Field(..., description="A text, or a list of texts.")
    add_special_tokens: StrictBool = True


class DetokenizeRequest(BaseModel):
    """POST /detokenize and /v1/detokenize (SGLang's shape)."""

    model: Optional[StrictStr] = None
    tokens: Union[List[StrictInt], List[List[StrictInt]]] = Field(..., description="Token ids, or a list of such lists.")
    skip_special_tokens: StrictBool = True
