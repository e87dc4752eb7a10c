"""The HTTP server: SGLang's native API and the OpenAI-compatible API on one FastAPI app.

Native:  POST /generate, GET /health, GET /health_generate, GET /get_model_info,
         GET /get_server_info, GET|POST /flush_cache, POST /abort_request, POST /open_session,
         POST /close_session, GET /metrics
OpenAI:  POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id}
Responses (serving_responses.py): POST /v1/responses, GET|DELETE /v1/responses/{id},
         POST /v1/responses/{id}/cancel
Embeddings (--is-embedding, serving_embedding.py): POST /encode, POST /v1/embeddings
Weights (http_weights.py): POST /update_weights_from_disk, /update_weights_from_tensor,
         /init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group,
         /update_weight_version, GET|POST /get_weights_by_name, GET /get_weight_version
Memory, pause, profiling (http_admin.py): /release_memory_occupation, /resume_memory_occupation,
         /pause_generation, /continue_generation, /start_profile, /stop_profile,
         /clear_hicache_storage_backend (HiCache's storage tier), /set_internal_state (run-time settings)
Live view (http_dashboard.py): GET /dashboard (the page), GET /dashboard/state (its data, an operations route)
Docs:    GET /docs (Swagger UI), GET /openapi.json

Request bodies are typed models (native_protocol.py, openai_protocol.py) that FastAPI parses and
validates; they are JSON only (415 otherwise): nothing from the network is unpickled. Every error
a client can cause is JSON `{"error": {"message": ...}}` with its status (400, 401, 404, 413,
415, 503), made by the exception handlers below; /v1 routes add OpenAI's `type` / `param` /
`code`.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Coroutine, Dict, FrozenSet, List

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve.entrypoints.admin_auth import ADMIN_PATHS, AdminKeyMiddleware
from radixserve.entrypoints.http_admin import add_admin_routes
from radixserve.entrypoints.http_dashboard import DASHBOARD_PAGE_PATHS, add_dashboard_routes
from radixserve.entrypoints.http_weights import add_weight_update_routes
from radixserve.entrypoints.native_protocol import (
    AbortRequest, DetokenizeRequest, GenerateRequest, TokenizeRequest, lone_surrogate_error,
)
from radixserve.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest, error_body
from radixserve.entrypoints.serving_base import (
    SSE_DONE,
    CumulativeStreamEncoder,
    OutputJSONResponse,
    chain_first,
    check_model,
    first_result,
    peek_first,
    sse,
)
from radixserve.entrypoints.serving_chat import serve_chat
from radixserve.entrypoints.serving_completions import serve_completions
from radixserve.entrypoints.serving_embedding import add_embedding_routes
from radixserve.entrypoints.serving_responses import add_responses_routes
from radixserve.managers.tokenizer_manager import ClientDisconnected, RequestError, TokenizerManager
from radixserve.protocol import CloseSessionReqInput, OpenSessionReqInput

logger = logging.getLogger("radixserve.http_server")

_HTTP_ERROR_TYPES = {404: "NotFoundError", 405: "MethodNotAllowed", 413: "RequestEntityTooLarge"}
_NOT_AN_OBJECT = {"model_attributes_type", "model_type", "dataclass_type", "dict_type"}


# ---- errors ------------------------------------------------------------------------------------
def error_response(message: str, status: int = 400, err_type: str = "BadRequestError", openai: bool = False) -> JSONResponse:
    body = error_body(message, err_type, status) if openai else {"error": {"message": message}}
    return JSONResponse(body, status_code=status)


def _is_openai(request: Request) -> bool:
    return request.url.path.startswith("/v1/")


def _validation_line(err: Dict[str, Any]) -> str:
    """One FastAPI validation error as a line a client can act on ("max_tokens: Input should...")."""
    loc = tuple(err.get("loc", ()))
    kind = err.get("type")
    if kind == "json_invalid":  # loc is ("body", position)
        where = f" (at char {loc[1]})" if len(loc) > 1 else ""
        return f"Malformed JSON in the request body: {err.get('ctx', {}).get('error', '')}{where}"
    field = ".".join(str(x) for x in (loc[1:] if loc[:1] == ("body",) else loc))
    if not field and kind == "missing":
        return "The request body is empty: send a JSON object."
    if not field and kind in _NOT_AN_OBJECT:
        return "The request body must be a JSON object."
    return f"{field}: {err.get('msg')}" if field else str(err.get("msg"))


def add_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc.message, exc.status_code, exc.err_type, _is_openai(request))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message = "; ".join(_validation_line(e) for e in exc.errors())
        return error_response(message, 400, "BadRequestError", _is_openai(request))  # OpenAI's 400, not 422

    @app.exception_handler(StarletteHTTPException)
    async def http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err_type = _HTTP_ERROR_TYPES.get(exc.status_code, "BadRequestError")
        return error_response(str(exc.detail), exc.status_code, err_type, _is_openai(request))

    @app.exception_handler(ClientDisconnected)
    async def client_disconnected(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        # A bug: answer JSON; Starlette re-raises it afterwards, so uvicorn logs the traceback.
        message = f"Internal server error: {type(exc).__name__}: {exc}"
        return error_response(message, 500, "InternalServerError", _is_openai(request))


# ---- JSON bodies only --------------------------------------------------------------------------
class JsonBodyRequest(Request):
    """Clear 400s for bodies that json.loads cannot take, which FastAPI would report as
    "There was an error parsing the body", and for strings holding a lone surrogate (a
    "\\ud800" escape json.loads accepts but no tokenizer or JSON response can take)."""

    async def json(self) -> Any:
        try:
            obj = await super().json()
        except RecursionError:  # the parser recurses once per level of nesting
            raise StarletteHTTPException(400, "The JSON in the request body is nested too deeply.") from None
        except UnicodeDecodeError as e:
            raise StarletteHTTPException(400, f"Malformed JSON in the request body: {e}") from None
        except ValueError as e:  # e.g. an integer of thousands of digits
            raise StarletteHTTPException(400, f"Malformed JSON in the request body: {e}") from None
        body = await self.body()  # (cached by Starlette: no second read)
        if b"\\ud" in body or b"\\uD" in body:  # a \uD800-\uDFFF escape: paired, or a lone surrogate?
            error = lone_surrogate_error(obj)
            if error is not None:
                raise StarletteHTTPException(400, error)
        return obj


class JsonBodyRoute(APIRoute):
    """Every route takes its body as application/json only (415 otherwise). A page on another
    origin can POST a form or text/plain without a CORS preflight, never JSON: so such a page
    cannot make the server generate or abort. Checked before FastAPI parses the body."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def json_body_handler(request: Request) -> Response:
            request = JsonBodyRequest(request.scope, request.receive)
            await _refuse_non_json_body(request)
            return await handler(request)

        return json_body_handler


async def _refuse_non_json_body(request: Request) -> None:
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json" and await request.body():
        raise RequestError(
            f"Send the body as application/json (Content-Type was {media_type or 'missing'!r}).",
            status_code=415, err_type="UnsupportedMediaType",
        )


# ---- middleware (pure ASGI, so streams are not buffered) ---------------------------------------
class BodySizeLimitMiddleware:
    """413 for a body over the limit, by Content-Length or while it arrives (chunked)."""

    def __init__(self, app: Any, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes
        self.message = f"The request body is larger than {max_bytes} bytes (--max-request-body-bytes)."

    async def __call__(self, scope: Dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await error_response(self.message, 413, "RequestEntityTooLarge")(scope, receive, send)
        received = 0

        async def limited_receive() -> Dict[str, Any]:
            # raised where the route reads the body: the app's HTTPException handler answers 413
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_bytes:
                    raise StarletteHTTPException(413, self.message)
            return msg

        await self.app(scope, limited_receive, send)


class ApiKeyMiddleware:
    """With --api-key, every route but /health (and `exempt` ones) needs `Authorization: Bearer KEY` (401)."""

    def __init__(self, app: Any, api_key: str, exempt: FrozenSet[str] = frozenset()):
        self.app, self.expected, self.exempt = app, f"Bearer {api_key}".encode(), exempt

    async def __call__(self, scope: Dict[str, Any], receive: Callable, send: Callable) -> None:
        if (scope["type"] != "http" or scope.get("path") == "/health" or scope.get("method") == "OPTIONS"
                or scope.get("path") in self.exempt):
            return await self.app(scope, receive, send)
        got = dict(scope.get("headers") or []).get(b"authorization", b"")
        if not hmac.compare_digest(got, self.expected):
            resp = JSONResponse(error_body("Unauthorized: send 'Authorization: Bearer <api key>'.", "AuthenticationError", 401), 401)
            return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


# ---- the app -----------------------------------------------------------------------------------
def create_app(tm: TokenizerManager) -> Any:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await tm.start()
        yield
        await tm.close()

    app = FastAPI(title="radixserve", version=_version(), lifespan=lifespan, redoc_url=None)
    app.router.route_class = JsonBodyRoute  # before any route is added
    app.state.tokenizer_manager = tm
    add_exception_handlers(app)
    add_native_routes(app, tm)
    add_openai_routes(app, tm)
    add_embedding_routes(app, tm)  # /encode, /v1/embeddings
    add_responses_routes(app, tm)  # /v1/responses (serving_responses.py)
    add_weight_update_routes(app, tm)  # /update_weights_from_disk, ... (http_weights.py)
    add_admin_routes(app, tm)  # memory release, pause, profiling (http_admin.py)
    add_dashboard_routes(app, tm)  # /dashboard and its data (http_dashboard.py)

    wrapped: Any = AdminKeyMiddleware(app, tm.server_args.admin_api_key, tm.server_args.host)
    if tm.server_args.api_key:
        # with an admin key the operations routes take that one instead (AdminKeyMiddleware)
        # the dashboard's page and files hold no data, and a browser opening a page sends no key
        wrapped = ApiKeyMiddleware(wrapped, tm.server_args.api_key,
                                   exempt=(ADMIN_PATHS if tm.server_args.admin_api_key else frozenset()) | DASHBOARD_PAGE_PATHS)
    wrapped = BodySizeLimitMiddleware(wrapped, tm.server_args.max_request_body_bytes)
    return _Outer(wrapped, app)


def add_native_routes(app: FastAPI, tm: TokenizerManager) -> None:
    args = tm.server_args

    # -- health and info
    @app.get("/health")
    async def health() -> Response:
        """200 while every process is up, the scheduler's loop turns (its heartbeat is recent)
        and the server is not shutting down; 503 with the reason otherwise."""
        problem = tm.health_problem()
        if problem is not None:
            raise RequestError(problem, 503, "ServiceUnavailable")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """A one-token generation marked as a health check: a busy scheduler answers it from its loop
        after its next batch instead of queueing it (TokenizerManager.health_generate)."""
        problem = tm.health_problem()
        if problem is not None:
            raise RequestError(problem, 503, "ServiceUnavailable")
        if not await tm.health_generate():
            raise RequestError("The health check generation failed.", 503, "ServiceUnavailable")
        return Response(status_code=200)

    @app.get("/get_model_info")
    @app.get("/model_info")  # SGLang's newer name; sglang-router asks it first
    async def get_model_info() -> Dict[str, Any]:
        return {
            "model_path": tm.model_path,
            "tokenizer_path": args.tokenizer_path or tm.model_path,
            "served_model_name": tm.served_model_name,
            "is_generation": not args.is_embedding,
            "context_length": tm.context_len,
            "vocab_size": tm.vocab_size,
        }

    # -- tokenizer (SGLang's /tokenize and /detokenize, also under /v1/)
    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(body: TokenizeRequest) -> Dict[str, Any]:
        texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        ids = await tm.tokenize_texts(texts, body.add_special_tokens)
        single = isinstance(body.prompt, str)
        return {"tokens": ids[0] if single else ids, "count": len(ids[0]) if single else [len(x) for x in ids],
                "max_model_len": tm.context_len}

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Dict[str, Any]:
        single = not body.tokens or isinstance(body.tokens[0], int)
        texts = await tm.detokenize([body.tokens] if single else body.tokens, body.skip_special_tokens)
        return {"text": texts[0] if single else texts}

    @app.get("/get_server_info")
    @app.get("/server_info")  # sglang-router names its workers' model from this
    async def get_server_info() -> Dict[str, Any]:
        st = await tm.get_internal_state()
        info = {k: v for k, v in dataclasses.asdict(args).items() if k not in ("api_key", "admin_api_key")}
        info.update(
            model_path=tm.model_path,  # resolved (the flag is None for the embedded model)
            served_model_name=tm.served_model_name,
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
            paused=st.get("paused", False), released_memory_tags=st.get("released_memory_tags", []),
            version=_version(),
        )
        return info

    @app.get("/get_load")
    async def get_load() -> List[Dict[str, Any]]:
        """One entry per DP replica (sglang-router's power_of_two policy sums num_tokens)."""
        st = await tm.get_internal_state()
        return [{
            "dp_rank": i,
            "num_reqs": s.get("num_running_reqs", 0) + s.get("num_waiting_reqs", 0),
            "num_waiting_reqs": s.get("num_waiting_reqs", 0),
            "num_tokens": s.get("max_total_num_tokens", 0) - s.get("available_tokens", 0) - s.get("evictable_tokens", 0),
        } for i, s in enumerate(st.get("dp_states") or [st])]

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text format."""
        try:
            await tm.get_internal_state()  # refreshes the scheduler gauges
        except RequestError:
            pass
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(tm.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # -- control
    @app.get("/flush_cache")
    @app.post("/flush_cache")
    async def flush_cache() -> JSONResponse:
        """Empty the radix cache (refused while requests run)."""
        out = await tm.flush_cache()
        msg = "Cache flushed." if out.success else (out.message or "Cache not flushed.")
        return JSONResponse({"success": out.success, "message": msg}, status_code=200 if out.success else 400)

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest) -> Response:
        if not (body.rid or body.abort_all):
            raise RequestError("Give rid (a string) or abort_all: true.")
        tm.abort_request(body.rid, abort_all=body.abort_all)
        return Response(status_code=200)

    @app.post("/open_session")
    async def open_session(body: OpenSessionReqInput) -> str:
        """Returns the session id, for `session_params.id` of /generate."""
        return tm.open_session(body)

    @app.post("/close_session")
    async def close_session(body: CloseSessionReqInput) -> Response:
        tm.close_session(body)
        return Response(status_code=200)

    # -- generation
    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        """One output object, a list for a batch or n > 1, or with `stream` server-sent events."""
        obj = body.to_input()
        gen = tm.generate_request(obj, request)
        if not obj.stream:
            return OutputJSONResponse(await first_result(gen))
        first = await peek_first(gen)  # a refused request still gets its status, not a 200 stream

        async def stream() -> AsyncIterator[bytes]:
            encode = CumulativeStreamEncoder()  # sse(), without re-encoding every id per chunk
            try:
                async for out in chain_first(first, gen):
                    yield encode(out)
            except RequestError as e:
                yield sse({"error": {"message": e.message, "code": e.status_code}})
            finally:
                await gen.aclose()
            yield SSE_DONE

        return StreamingResponse(stream(), media_type="text/event-stream")


def add_openai_routes(app: FastAPI, tm: TokenizerManager) -> None:
    @app.post("/v1/completions")
    async def v1_completions(body: CompletionRequest, request: Request) -> Response:
        return await serve_completions(tm, body, request)

    @app.post("/v1/chat/completions")
    async def v1_chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serve_chat(tm, body, request)

    def model_card(name: str) -> Dict[str, Any]:
        return {"id": name, "object": "model", "created": tm.created_time, "owned_by": "radixserve",
                "root": tm.model_path, "max_model_len": tm.context_len}

    @app.get("/v1/models")
    async def v1_models() -> Dict[str, Any]:
        adapters = [{**model_card(name), "root": path, "parent": tm.served_model_name}  # --enable-lora, as SGLang
                    for name, path in (tm.server_args.lora_paths or {}).items()] if tm.server_args.enable_lora else []
        return {"object": "list", "data": [model_card(tm.served_model_name), *adapters]}

    @app.get("/v1/models/{model_id:path}")
    async def v1_model(model_id: str) -> Dict[str, Any]:
        check_model(tm, model_id)
        return model_card(model_id)


class _Outer:
    """The ASGI entry: our middlewares around the FastAPI app; attribute access goes to the app."""

    def __init__(self, asgi: Any, app: FastAPI):
        self._asgi, self.app = asgi, app

    async def __call__(self, scope: Dict[str, Any], receive: Callable, send: Callable) -> None:
        await self._asgi(scope, receive, send)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("radixserve")
    except Exception:
        return "unknown"
