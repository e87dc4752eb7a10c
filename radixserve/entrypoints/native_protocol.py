"""Request bodies of SGLang's native API (pydantic), as FastAPI parses them and /docs shows them.

POST /generate's body becomes the runtime's GenerateReqInput. Its prompt and sampling fields are
checked by the TokenizerManager (SGLang's messages: "text must be a string...", "top_p must be
in (0, 1]"), so they are typed loosely here; their schema still says what to send.
"""

from __future__ import annotations

from typing import Annotated, Any, List, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, WithJsonSchema

from radixserve.protocol import GenerateReqInput, SessionParams


def _one_or_batch(item: dict) -> dict:
    return {"anyOf": [item, {"type": "array", "items": item}]}


Prompt = Annotated[Any, WithJsonSchema(_one_or_batch({"type": "string"}))]
TokenIds = Annotated[Any, WithJsonSchema(_one_or_batch({"type": "array", "items": {"type": "integer"}}))]
SamplingParamsDict = Annotated[Any, WithJsonSchema(_one_or_batch({"type": "object", "title": "SamplingParams"}))]


class GenerateRequest(BaseModel):
    """One prompt or a batch: `text` or `input_ids` (exactly one). For a batch, `sampling_params`,
    `rid` and `return_logprob` may be lists with one entry per prompt."""

    model_config = ConfigDict(extra="ignore")

    text: Optional[Prompt] = Field(None, description="A prompt, or a list of prompts.")
    input_ids: Optional[TokenIds] = Field(None, description="Token ids, or a list of such lists.")
    sampling_params: Optional[SamplingParamsDict] = Field(
        None, description="SGLang's sampling parameters: max_new_tokens, temperature, top_p, stop, n, ...")
    rid: Optional[Union[str, List[str]]] = None
    return_logprob: Optional[Union[bool, List[bool]]] = None
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(0, ge=0)
    return_text_in_logprobs: bool = False
    stream: bool = False
    priority: Optional[int] = None
    session_params: Optional[SessionParams] = None

    def to_input(self) -> GenerateReqInput:
        return GenerateReqInput(**self.model_dump())  # session_params becomes a dict, as it arrived


class AbortRequest(BaseModel):
    rid: StrictStr = Field("", description="The request to abort.")
    abort_all: StrictBool = Field(False, description="Abort every request instead.")
