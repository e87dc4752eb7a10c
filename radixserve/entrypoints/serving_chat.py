"""POST /v1/chat/completions: the tokenizer's chat template, then the same generation path."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Optional

from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixserve.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    error_body,
    matched_stop,
    openai_finish_reason,
    usage_of,
)
from radixserve.entrypoints.serving_base import SSE_DONE, chain_first, check_model, first_result, peek_first, sse
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


async def serve_chat(tm: TokenizerManager, req: ChatCompletionRequest, raw_request: Any) -> Response:
    check_model(tm, req.model)
    if req.top_logprobs and not req.logprobs:
        raise RequestError("top_logprobs needs logprobs set to true.")
    messages: List[Dict[str, Any]] = [m.model_dump(exclude_none=True) for m in req.messages]
    input_ids = await tm.apply_chat_template(messages)
    max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    sp = req.sampling_params(max_new)
    sp["json_schema"] = req.grammar_json_schema()
    obj = GenerateReqInput(
        input_ids=input_ids, sampling_params=sp, rid=req.rid, return_logprob=req.logprobs,
        top_logprobs_num=req.top_logprobs or 0, return_text_in_logprobs=True, stream=req.stream,
        priority=req.priority,
    )
    created = int(time.time())
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    gen = tm.generate_request(obj, raw_request)

    if not req.stream:
        outs = await first_result(gen)
        outs = outs if isinstance(outs, list) else [outs]
        choices = []
        for i, out in enumerate(outs):
            reason = out["meta_info"]["finish_reason"]
            choices.append({
                "index": i,
                "message": {"role": "assistant", "content": out["text"]},
                "logprobs": _logprobs(tm, out["meta_info"], 0) if req.logprobs else None,
                "finish_reason": openai_finish_reason(reason),
                "matched_stop": matched_stop(reason),
            })
        return JSONResponse({
            "id": cid, "object": "chat.completion", "created": created, "model": req.model,
            "choices": choices, "usage": usage_of(outs, req.n),
        })

    first = await peek_first(gen)

    def chunk(idx: int, delta: Dict[str, Any], reason: Any = None, logprobs: Any = None) -> bytes:
        return sse({
            "id": cid, "object": "chat.completion.chunk", "created": created, "model": req.model,
            "choices": [{
                "index": idx, "delta": delta, "logprobs": logprobs,
                "finish_reason": openai_finish_reason(reason), "matched_stop": matched_stop(reason),
            }],
        })

    async def stream() -> AsyncIterator[bytes]:
        sent_text: Dict[int, int] = {}
        sent_tokens: Dict[int, int] = {}
        finals: Dict[int, Dict[str, Any]] = {}
        try:
            async for out in chain_first(first, gen):
                idx = out.get("index", 0)
                meta = out["meta_info"]
                if idx not in sent_text:
                    sent_text[idx], sent_tokens[idx] = 0, 0
                    yield chunk(idx, {"role": "assistant", "content": ""})
                delta = out["text"][sent_text[idx]:]
                sent_text[idx] = len(out["text"])
                logprobs = None
                if req.logprobs:
                    logprobs = _logprobs(tm, meta, sent_tokens[idx])
                    sent_tokens[idx] = len(meta.get("output_token_logprobs", []))
                if delta or (logprobs and logprobs["content"]):
                    yield chunk(idx, {"content": delta}, None, logprobs)
                reason = meta["finish_reason"]
                if reason is not None:
                    finals[idx] = out
                    yield chunk(idx, {}, reason)
            if req.stream_options and req.stream_options.include_usage:
                outs = [finals[i] for i in sorted(finals)]
                yield sse({
                    "id": cid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                    "choices": [], "usage": usage_of(outs, req.n),
                })
        except RequestError as e:
            yield sse(error_body(e.message, e.err_type, e.status_code))
        finally:
            await gen.aclose()
        yield SSE_DONE

    return StreamingResponse(stream(), media_type="text/event-stream")
