"""The HTTP server: SGLang's native API and the OpenAI-compatible API on one FastAPI app.

Native:  POST /generate, GET /health, GET /health_generate, GET /get_model_info,
         GET /get_server_info, POST /flush_cache, POST /abort_request, POST /open_session,
         POST /close_session, GET /metrics
OpenAI:  POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id}

Every error a client can cause is JSON `{"error": {"message": ...}}` with its status (400,
401, 404, 413, 503); OpenAI routes add OpenAI's `type` / `param` / `code`. Bodies are parsed
as JSON only: nothing from the network is unpickled.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Dict

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import TypeAdapter, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve.entrypoints.openai_protocol import error_body
from radixserve.entrypoints.serving_base import (
    SSE_DONE,
    chain_first,
    first_result,
    peek_first,
    served_model_names,
    sse,
)
from radixserve.entrypoints.serving_chat import serve_chat
from radixserve.entrypoints.serving_completions import serve_completions
from radixserve.managers.tokenizer_manager import (
    ClientDisconnected,
    RequestError,
    TokenizerManager,
    _validation_message,
)
from radixserve.protocol import CloseSessionReqInput, GenerateReqInput, OpenSessionReqInput

logger = logging.getLogger("radixserve.http_server")

_GENERATE_ADAPTER = TypeAdapter(GenerateReqInput)


# ---- errors ------------------------------------------------------------------------------------
def error_response(message: str, status: int = 400, err_type: str = "BadRequestError", openai: bool = False) -> JSONResponse:
    body = error_body(message, err_type, status) if openai else {"error": {"message": message}}
    return JSONResponse(body, status_code=status)


async def read_json(request: Request) -> Dict[str, Any]:
    # JSON bodies only: a browser page cannot send application/json cross-site without a CORS
    # preflight, so this also refuses a form or text/plain POST from another origin (415).
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    body = await request.body()
    if body and media_type != "application/json":
        raise RequestError(
            f"Send the body as application/json (Content-Type was {media_type or 'missing'!r}).",
            status_code=415, err_type="UnsupportedMediaType",
        )
    if not body:
        raise RequestError("The request body is empty: send a JSON object.")
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"Malformed JSON in the request body: {e}") from None
    except RecursionError:  # the parser recurses once per level of nesting
        raise RequestError("The JSON in the request body is nested too deeply.") from None
    if not isinstance(obj, dict):
        raise RequestError("The request body must be a JSON object.")
    return obj


async def handle_errors(fn: Callable[[], Any], openai: bool = False) -> Response:
    """Run a route; turn what a client can cause into its status and message."""
    try:
        return await fn()
    except RequestError as e:
        return error_response(e.message, e.status_code, e.err_type, openai)
    except ValidationError as e:
        return error_response(_validation_message(e, "body").replace("body.", ""), 400, "BadRequestError", openai)
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as e:  # a bug: log it, answer JSON, keep serving
        logger.exception("Error while handling a request")
        return error_response(f"Internal server error: {type(e).__name__}: {e}", 500, "InternalServerError", openai)


# ---- middleware (pure ASGI, so streams are not buffered) ---------------------------------------
class _BodyTooLarge(Exception):
    pass


class BodySizeLimitMiddleware:
    """413 for a body over the limit, by Content-Length or while it arrives (chunked)."""

    def __init__(self, app: Any, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        received = 0
        started = False

        async def limited_receive() -> Dict[str, Any]:
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge()
            return msg

        async def tracking_send(msg: Dict[str, Any]) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Dict[str, Any], receive: Callable, send: Callable) -> None:
        msg = f"The request body is larger than {self.max_bytes} bytes (--max-request-body-bytes)."
        await error_response(msg, 413, "RequestEntityTooLarge")(scope, receive, send)


class ApiKeyMiddleware:
    """With --api-key, every route but /health needs `Authorization: Bearer KEY` (401)."""

    def __init__(self, app: Any, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("path") == "/health" or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        got = dict(scope.get("headers") or []).get(b"authorization", b"")
        if not hmac.compare_digest(got, self.expected):
            resp = JSONResponse(error_body("Unauthorized: send 'Authorization: Bearer <api key>'.", "AuthenticationError", 401), 401)
            return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


# ---- the app -----------------------------------------------------------------------------------
def create_app(tm: TokenizerManager) -> FastAPI:
    args = tm.server_args

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await tm.start()
        yield
        await tm.close()

    app = FastAPI(title="radixserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tokenizer_manager = tm

    @app.exception_handler(StarletteHTTPException)
    async def http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        openai = request.url.path.startswith("/v1/")
        return error_response(str(exc.detail), exc.status_code, "NotFoundError" if exc.status_code == 404 else "BadRequestError", openai)

    # -- health and info
    @app.get("/health")
    async def health() -> Response:
        if tm.dead_reason:
            return error_response(tm.dead_reason, 503, "ServiceUnavailable")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        ok = tm.dead_reason is None and await tm.health_generate()
        return Response(status_code=200) if ok else error_response("The health check generation failed.", 503, "ServiceUnavailable")

    @app.get("/get_model_info")
    async def get_model_info() -> Dict[str, Any]:
        return {
            "model_path": tm.model_path,
            "tokenizer_path": args.tokenizer_path or tm.model_path,
            "served_model_name": tm.served_model_name,
            "is_generation": True,
            "context_length": tm.context_len,
            "vocab_size": tm.vocab_size,
        }

    @app.get("/get_server_info")
    async def get_server_info() -> Response:
        async def run() -> Response:
            st = await tm.get_internal_state()
            info = {k: v for k, v in dataclasses.asdict(args).items() if k != "api_key"}
            info.update(
                internal_states=st.pop("dp_states", None) or [st],  # one per DP replica, as SGLang
                num_running_reqs=st.get("num_running_reqs", 0),
                num_queue_reqs=st.get("num_waiting_reqs", 0),
                token_usage=st.get("token_usage", 0.0),
                cache_hit_rate=st.get("cache_hit_rate", 0.0),
                gen_throughput=st.get("gen_throughput", 0.0),
                max_total_num_tokens=st.get("max_total_num_tokens"),
                tokenizer_manager={
                    "num_pending_reqs": len(tm.rid_to_state),
                    "num_disconnect_aborts": tm.metrics.num_disconnect_aborts,
                    "num_open_sessions": len(tm.sessions),
                },
                scheduler_pid=tm.model_info.get("pid"),
                version=_version(),
            )
            return JSONResponse(info)

        return await handle_errors(run)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            await tm.get_internal_state()  # refreshes the scheduler gauges
        except RequestError:
            pass
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(tm.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # -- control
    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        async def run() -> Response:
            out = await tm.flush_cache()
            msg = "Cache flushed." if out.success else (out.message or "Cache not flushed.")
            return JSONResponse({"success": out.success, "message": msg}, status_code=200 if out.success else 400)

        return await handle_errors(run)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        async def run() -> Response:
            body = await read_json(request)
            rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
            if not isinstance(rid, str) or not isinstance(abort_all, bool) or not (rid or abort_all):
                raise RequestError("Give rid (a string) or abort_all: true.")
            tm.abort_request(rid, abort_all=abort_all)
            return Response(status_code=200)

        return await handle_errors(run)

    @app.post("/open_session")
    async def open_session(request: Request) -> Response:
        async def run() -> Response:
            body = await read_json(request)
            obj = _parse_dataclass(OpenSessionReqInput, body)
            return JSONResponse(tm.open_session(obj))

        return await handle_errors(run)

    @app.post("/close_session")
    async def close_session(request: Request) -> Response:
        async def run() -> Response:
            body = await read_json(request)
            tm.close_session(_parse_dataclass(CloseSessionReqInput, body))
            return Response(status_code=200)

        return await handle_errors(run)

    # -- generation
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        async def run() -> Response:
            body = await read_json(request)
            obj = _GENERATE_ADAPTER.validate_python(body)
            gen = tm.generate_request(obj, request)
            if not obj.stream:
                return JSONResponse(await first_result(gen))
            first = await peek_first(gen)

            async def stream() -> AsyncIterator[bytes]:
                try:
                    async for out in chain_first(first, gen):
                        yield sse(out)
                except RequestError as e:
                    yield sse({"error": {"message": e.message, "code": e.status_code}})
                finally:
                    await gen.aclose()
                yield SSE_DONE

            return StreamingResponse(stream(), media_type="text/event-stream")

        return await handle_errors(run)

    @app.post("/v1/completions")
    async def v1_completions(request: Request) -> Response:
        async def run() -> Response:
            return await serve_completions(tm, await read_json(request), request)

        return await handle_errors(run, openai=True)

    @app.post("/v1/chat/completions")
    async def v1_chat_completions(request: Request) -> Response:
        async def run() -> Response:
            return await serve_chat(tm, await read_json(request), request)

        return await handle_errors(run, openai=True)

    def model_card(name: str) -> Dict[str, Any]:
        return {"id": name, "object": "model", "created": tm.created_time, "owned_by": "radixserve",
                "root": tm.model_path, "max_model_len": tm.context_len}

    @app.get("/v1/models")
    async def v1_models() -> Dict[str, Any]:
        return {"object": "list", "data": [model_card(tm.served_model_name)]}

    @app.get("/v1/models/{model_id:path}")
    async def v1_model(model_id: str) -> Response:
        if model_id not in served_model_names(tm):
            return error_response(f"The model `{model_id}` does not exist.", 404, "NotFoundError", openai=True)
        return JSONResponse(model_card(model_id))

    wrapped: Any = app
    if args.api_key:
        wrapped = ApiKeyMiddleware(wrapped, args.api_key)
    wrapped = BodySizeLimitMiddleware(wrapped, args.max_request_body_bytes)
    return _Outer(wrapped, app)


class _Outer:
    """The ASGI entry: our middlewares around the FastAPI app; attribute access goes to the app."""

    def __init__(self, asgi: Any, app: FastAPI):
        self._asgi, self.app = asgi, app

    async def __call__(self, scope: Dict[str, Any], receive: Callable, send: Callable) -> None:
        await self._asgi(scope, receive, send)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)


def _parse_dataclass(cls: Any, body: Dict[str, Any]) -> Any:
    try:
        return TypeAdapter(cls).validate_python(body)
    except ValidationError as e:
        raise RequestError(_validation_message(e, "body").replace("body.", "")) from None


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("radixserve")
    except Exception:
        return "unknown"
