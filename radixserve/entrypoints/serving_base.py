"""Helpers shared by the HTTP routes: SSE framing, looking at a stream's first item before
answering (so a refused streaming request still gets its HTTP status), model-name checks."""

from __future__ import annotations

import json
import math
from typing import Any, AsyncIterator, Dict, Optional, Tuple

import orjson
from fastapi.responses import JSONResponse

from radixserve.managers.tokenizer_manager import ClientDisconnected, RequestError

_STREAM_END = object()


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def json_bytes(obj: Any) -> bytes:
    """JSON (UTF-8) of an output object as SGLang's server writes it, with orjson: compact, a
    logprob of -inf (a token the sampler's mask removed) written as null (JSON has no -inf;
    json.dumps would write `-Infinity`, which strict clients reject, or fail a JSONResponse with
    a 500). orjson is ~10x faster than json.dumps on a stream chunk: that was the largest Python
    cost per chunk in the HTTP process (issue 57). What orjson refuses (an int over 64 bits, a
    numpy scalar) goes through json.dumps in the same format."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:  # orjson.JSONEncodeError
        return json.dumps(_finite(obj), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def to_json(obj: Any) -> str:
    """json_bytes as a str."""
    return json_bytes(obj).decode("utf-8")


class OutputJSONResponse(JSONResponse):
    """The JSONResponse of the generation routes: non-finite floats as null (json_bytes)."""

    def render(self, content: Any) -> bytes:
        return json_bytes(content)


def sse(obj: Any) -> bytes:
    return b"data: " + json_bytes(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"

_IDS_MARK = "\x00output_ids\x00"
_IDS_SLOT = json_bytes({"output_ids": _IDS_MARK})[1:-1]  # b'"output_ids":"\\u0000output_ids\\u0000"'


class CumulativeStreamEncoder:
    """sse() for /generate's stream, byte for byte. Every chunk carries all the output_ids so far
    (SGLang's cumulative format), so encoding them is O(tokens so far) per chunk: most of the HTTP
    process's time per token in long streams (issue 57). The ids only grow, so their JSON is kept
    per sample (`index` for n > 1) and extended with the new ids alone."""

    def __init__(self) -> None:
        self._ids: Dict[Any, Tuple[int, str]] = {}  # sample index -> (ids encoded, their JSON)

    def __call__(self, out: Any) -> bytes:
        ids = out.get("output_ids") if isinstance(out, dict) else None
        if not isinstance(ids, list):
            return sse(out)
        key = out.get("index")
        n, text = self._ids.get(key, (0, ""))
        if n > len(ids):
            n, text = 0, ""
        if len(ids) > n:
            new = ",".join(map(str, ids[n:]))  # JSON writes an int as str(int)
            text = f"{text},{new}" if text else new
        self._ids[key] = (len(ids), text)
        body = json_bytes({**out, "output_ids": _IDS_MARK})
        # `"output_ids":"` cannot occur inside a JSON string (its quotes are escaped there)
        body = body.replace(_IDS_SLOT, b'"output_ids":[' + text.encode() + b"]", 1)
        return b"data: " + body + b"\n\n"


async def peek_first(gen: AsyncIterator[Any]) -> Any:
    """The stream's first item; RequestError raised by the request (400, 503...) propagates,
    so the route answers with an error status instead of a 200 stream."""
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return _STREAM_END


async def chain_first(first: Any, gen: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """The stream's items, `first` included. A client that left mid-stream (its request is
    aborted already) ends the stream quietly: what follows is written to nobody (the ASGI
    server drops it), and no error is logged for a client that merely went away."""
    if first is _STREAM_END:
        return
    yield first
    try:
        async for item in gen:
            yield item
    except ClientDisconnected:
        return


async def first_result(gen: AsyncIterator[Any]) -> Any:
    """A non-streaming request yields exactly once."""
    try:
        async for item in gen:
            return item
    finally:
        await gen.aclose()
    raise RequestError("The request produced no output.", 500, "InternalServerError")


def check_model(tm: Any, model: Optional[str]) -> None:
    if model is not None and model not in served_model_names(tm) and lora_path_of_model(tm, model) is None:
        raise RequestError(f"The model `{model}` does not exist.", 404, "NotFoundError")


def lora_path_of_model(tm: Any, model: Optional[str]) -> Optional[str]:
    """--enable-lora, as SGLang: `model: "adapter"` or `"base:adapter"` chooses a LoRA adapter
    (an unknown adapter after a served base name goes on, to be refused with 400 by name)."""
    names = getattr(getattr(tm, "frontend", None), "lora_names", None)
    if not model or names is None:
        return None
    if model in names:
        return model
    base, sep, adapter = model.rpartition(":")
    return adapter if sep and adapter and base in served_model_names(tm) else None


def served_model_names(tm: Any) -> list:
    names = [tm.served_model_name]
    if tm.server_args.model_path and tm.server_args.model_path not in names:
        names.append(tm.server_args.model_path)
    return names


def bootstrap_fields(req: Any) -> dict:
    """The PD disaggregation fields of an OpenAI request, for GenerateReqInput."""
    return {k: getattr(req, k) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")}
