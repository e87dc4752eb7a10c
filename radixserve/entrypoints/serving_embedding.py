"""Embedding routes, for a server started with --is-embedding (a generation server answers them
with 400, and an embedding server answers /generate and the completion routes with 400):

    POST /encode          SGLang's native route: `text` or `input_ids`, one or a batch ->
                          {"embedding": [...], "meta_info": {...}} (a list for a batch)
    POST /v1/embeddings   OpenAI's: `input` a string, strings, token ids or lists of them;
                          `encoding_format` float or base64; `dimensions` only the hidden size
                          (these models cannot truncate); `usage.prompt_tokens`
"""

from __future__ import annotations

import base64
from typing import Any, Dict, List, Literal, Optional, Union

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from radixserve.entrypoints.native_protocol import Prompt, TokenIds
from radixserve.entrypoints.serving_base import check_model, first_result
from radixserve.managers.tokenizer_manager import RequestError, TokenizerManager
from radixserve.protocol import EmbeddingReqInput
from radixserve.sampling_params import MAX_INT_PARAM


class EncodeRequest(BaseModel):
    """One prompt or a batch: `text` or `input_ids` (exactly one)."""

    model_config = ConfigDict(extra="ignore")

    text: Optional[Prompt] = Field(None, description="A prompt, or a list of prompts.")
    input_ids: Optional[TokenIds] = Field(None, description="Token ids, or a list of such lists.")
    rid: Optional[Union[StrictStr, List[StrictStr]]] = None
    dimensions: Optional[StrictInt] = Field(None, description="Only the model's hidden size (no truncation).")
    priority: Optional[StrictInt] = Field(None, ge=-MAX_INT_PARAM, le=MAX_INT_PARAM)

    def to_input(self) -> EmbeddingReqInput:
        return EmbeddingReqInput(**self.model_dump())


class EmbeddingRequest(BaseModel):
    """OpenAI's POST /v1/embeddings body."""

    model_config = ConfigDict(extra="ignore")

    input: Union[StrictStr, List[StrictStr], List[StrictInt], List[List[StrictInt]]] = Field(
        description="A text, a list of texts, token ids, or a list of lists of token ids.")
    model: Optional[StrictStr] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[StrictInt] = None
    user: Optional[StrictStr] = None


def _prompt_fields(inp: Any) -> Dict[str, Any]:
    """EmbeddingReqInput's text / input_ids for an OpenAI `input`; SGLang's checks and messages."""
    if isinstance(inp, str):
        if not inp.strip():
            raise RequestError("Input cannot be empty or whitespace only.")
        return {"text": inp}
    if not inp:
        raise RequestError("Input cannot be empty.")
    if isinstance(inp[0], str):
        for i, item in enumerate(inp):
            if not item.strip():
                raise RequestError(f"Input at index {i} cannot be empty or whitespace only.")
        return {"text": list(inp)}
    if isinstance(inp[0], list):
        for i, item in enumerate(inp):
            if not item:
                raise RequestError(f"Input at index {i} cannot be empty.")
        return {"input_ids": [list(x) for x in inp]}
    return {"input_ids": list(inp)}


def _encode_vector(vector: List[float], encoding_format: str) -> Union[List[float], str]:
    """base64: the little-endian float32 bytes, which the openai client decodes with numpy."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def add_embedding_routes(app: FastAPI, tm: TokenizerManager) -> None:
    @app.post("/encode")
    async def encode(body: EncodeRequest, request: Request) -> JSONResponse:
        """The embedding of a prompt (a list of them for a batch)."""
        return JSONResponse(await first_result(tm.generate_request(body.to_input(), request)))

    @app.post("/v1/embeddings")
    async def v1_embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
        check_model(tm, body.model)
        obj = EmbeddingReqInput(**_prompt_fields(body.input), dimensions=body.dimensions)
        outs = await first_result(tm.generate_request(obj, request))
        outs = outs if isinstance(outs, list) else [outs]
        prompt_tokens = sum(out["meta_info"]["prompt_tokens"] for out in outs)
        return JSONResponse({
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": _encode_vector(out["embedding"], body.encoding_format)}
                     for i, out in enumerate(outs)],
            "model": body.model or tm.served_model_name,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        })
