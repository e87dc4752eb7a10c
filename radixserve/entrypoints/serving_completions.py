"""POST /v1/completions (OpenAI's shape; SGLang's extra sampling fields accepted)."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Dict, List

from fastapi.responses import Response, StreamingResponse

from radixserve.entrypoints.openai_protocol import (
    CompletionRequest,
    error_body,
    matched_stop,
    openai_finish_reason,
    usage_of,
)
from radixserve.entrypoints.serving_base import (
    SSE_DONE, OutputJSONResponse, bootstrap_fields, chain_first, check_model, first_result, lora_path_of_model, peek_first, sse,
)
from radixserve.managers.tokenizer_manager import RequestError, TokenizerManager
from radixserve.protocol import GenerateReqInput


def _prompts(req: CompletionRequest) -> Dict[str, Any]:
    p = req.prompt
    if isinstance(p, str):
        return {"text": p}
    if not p:
        raise RequestError("prompt must not be empty.")
    if isinstance(p[0], str):
        return {"text": list(p)}
    return {"input_ids": list(p)}


def _prompt_texts(tm: TokenizerManager, req: CompletionRequest) -> List[str]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if isinstance(p[0], str):
        return list(p)
    rows = [p] if isinstance(p[0], int) else p
    return [tm.tokenizer.decode(r) if tm.tokenizer is not None else "" for r in rows]


def _logprobs(tm: TokenizerManager, meta: Dict[str, Any], start: int, text_offset: int,
              prompt: bool = False) -> Dict[str, Any]:
    """OpenAI's legacy logprobs of the output tokens from `start` (text_offset: where the first
    begins in the choice's text); with `prompt` (echo), the prompt's tokens first, as OpenAI,
    vLLM and SGLang return them: the first one's token_logprobs and top_logprobs entries null
    (it has no context), its text_offset 0. lm-eval's loglikelihood sums these."""
    toks = list(meta.get("input_token_logprobs") or []) if prompt else []
    tops: List[Any] = list(meta.get("input_top_logprobs") or [None] * len(toks)) if prompt else []
    prompt_len = len(toks)
    toks += meta.get("output_token_logprobs", [])[start:]
    out_tops = meta.get("output_top_logprobs")
    tops += out_tops[start:] if out_tops else []
    tokens, offsets = [], []
    offset = 0
    for j, (lp, tid, s) in enumerate(toks):
        if j == prompt_len:  # the output's tokens sit where the output's text begins
            offset = text_offset
        s = s if s is not None else tm.decode_token(tid)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
    top = [None if row is None else {(s if s is not None else tm.decode_token(t)): lp for lp, t, s in row}
           for row in tops] if out_tops is not None else None
    return {"tokens": tokens, "token_logprobs": [t[0] for t in toks], "top_logprobs": top, "text_offset": offsets}


async def serve_completions(tm: TokenizerManager, req: CompletionRequest, raw_request: Any) -> Response:
    pd = req.bootstrap_room is not None  # sglang-router picked this server (and sends "unknown" for no model)
    check_model(tm, None if pd else req.model)
    model = tm.served_model_name if pd or not req.model else req.model  # `model` is optional
    obj = GenerateReqInput(
        **_prompts(req),
        sampling_params=req.sampling_params(req.max_tokens),
        rid=req.rid,
        return_logprob=req.logprobs is not None,
        top_logprobs_num=req.logprobs or 0,
        # echo with logprobs: the prompt's logprobs too (SGLang's; max_tokens 0 gives only them)
        logprob_start_len=0 if req.echo and req.logprobs is not None else -1,
        return_text_in_logprobs=True,
        stream=req.stream,
        priority=req.priority,
        data_parallel_rank=req.data_parallel_rank,
        **bootstrap_fields(req),
        lora_path=lora_path_of_model(tm, None if pd else req.model),  # model: "adapter" / "base:adapter"
    )
    created = int(time.time())
    cid = f"cmpl-{uuid.uuid4().hex}"
    prompts = _prompt_texts(tm, req) if req.echo else []
    gen = tm.generate_request(obj, raw_request)

    if not req.stream:
        outs = await first_result(gen)
        outs = outs if isinstance(outs, list) else [outs]
        choices = []
        for i, out in enumerate(outs):
            prefix = prompts[i // req.n] if req.echo else ""
            reason = out["meta_info"]["finish_reason"]
            choices.append({
                "index": i,
                "text": prefix + out["text"],
                "logprobs": _logprobs(tm, out["meta_info"], 0, len(prefix), req.echo) if req.logprobs is not None else None,
                "finish_reason": openai_finish_reason(reason),
                "matched_stop": matched_stop(reason),
            })
        return OutputJSONResponse({
            "id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_of(outs, req.n),
            "metadata": {"weight_version": outs[0]["meta_info"]["weight_version"]},  # SGLang's
        })

    first = await peek_first(gen)

    async def stream() -> AsyncIterator[bytes]:
        sent_text: Dict[int, int] = {}
        sent_tokens: Dict[int, int] = {}
        echo_len: Dict[int, int] = {}  # the echoed prompt's length: where each choice's output begins
        finals: Dict[int, Dict[str, Any]] = {}
        try:
            async for out in chain_first(first, gen):
                idx = out.get("index", 0)
                meta = out["meta_info"]
                prefix, first_chunk = "", idx not in sent_text
                if first_chunk:
                    sent_text[idx], sent_tokens[idx] = 0, 0
                    prefix = prompts[idx // req.n] if req.echo else ""
                    echo_len[idx] = len(prefix)
                delta = prefix + out["text"][sent_text[idx]:]
                reason = meta["finish_reason"]
                logprobs = None
                if req.logprobs is not None:  # echo: the prompt's logprobs go in the first chunk
                    logprobs = _logprobs(tm, meta, sent_tokens[idx], echo_len[idx] + sent_text[idx], req.echo and first_chunk)
                    sent_tokens[idx] = len(meta.get("output_token_logprobs", []))
                sent_text[idx] = len(out["text"])
                if delta or reason is not None or (logprobs and logprobs["tokens"]):
                    yield sse({
                        "id": cid, "object": "text_completion", "created": created, "model": model,
                        "choices": [{
                            "index": idx, "text": delta, "logprobs": logprobs,
                            "finish_reason": openai_finish_reason(reason), "matched_stop": matched_stop(reason),
                        }],
                    })
                if reason is not None:
                    finals[idx] = out
            if req.stream_options and req.stream_options.include_usage:
                outs = [finals[i] for i in sorted(finals)]
                yield sse({
                    "id": cid, "object": "text_completion", "created": created, "model": model,
                    "choices": [], "usage": usage_of(outs, req.n),
                })
        except RequestError as e:
            yield sse(error_body(e.message, e.err_type, e.status_code))
        finally:
            await gen.aclose()
        yield SSE_DONE

    return StreamingResponse(stream(), media_type="text/event-stream")
