"""TokenizerManager: the main process's side of the served runtime (asyncio).

The RequestFrontend does the request work shared with the offline Engine (tokenize, validate
SamplingParams -> 400, fan `n > 1` and batches out into one TokenizedGenerateReqInput per
sample, build outputs). This class sends those to the scheduler over ZeroMQ and waits on a
per-request asyncio.Event that `handle_output` sets when the detokenizer's BatchStrOutput brings
new text. A request whose client went away is aborted (AbortReq: the scheduler frees its KV):
a ClientWatch per HTTP request hears the ASGI `http.disconnect` and wakes its waiters.
It also keeps the Prometheus metrics (managers/metrics.py).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Dict, List, Optional, Union

from radixserve.hf_transformers_utils import get_tokenizer, load_sampling_defaults, resolve_model_path
from radixserve.managers.admin_requests import TokenizerAdmin
from radixserve.managers.client_watch import ClientWatch
from radixserve.managers.dashboard_history import RequestTimeline
from radixserve.managers.detokenizer import DETOKENIZE_ERROR
from radixserve.managers.embedding_frontend import EmbeddingFrontend, EmbeddingReqState, check_request_kind
from radixserve.managers.metrics import TokenizerMetrics
from radixserve.managers.request_frontend import (
    ReqState,
    RequestError,
    RequestFrontend,
    hidden_states_refusal,
    input_embeds_refusal,
    is_single,
    token_ids_logprob_refusal,
)
from radixserve.managers.session import SessionError
from radixserve.managers.tokenizer_update_weights import TokenizerUpdateWeights
from radixserve.multimodal.image_loader import MediaLimits
from radixserve.multimodal.processor import build_multimodal_processor
from radixserve.protocol import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchStrOutput,
    BatchTokenizedEmbeddingReqInput,
    BatchTokenizedGenerateReqInput,
    CloseSessionReqInput,
    EmbeddingReqInput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetInternalStateReq,
    HealthCheckOutput,
    OpenSessionReqInput,
    SchedulerHeartbeat,
)
from radixserve.sampling_params import SamplingParams
from radixserve.server_args import PortArgs, ServerArgs

logger = logging.getLogger("radixserve.tokenizer_manager")

__all__ = ["ClientDisconnected", "RequestError", "TokenizerManager", "TokenizerMetrics"]

RPC_TIMEOUT = 60.0  # s to wait for the scheduler's reply to flush / state requests
RESEND_INTERVAL = 0.05  # s between tries to send control messages the full socket refused
DRAIN_BATCH = 64  # messages from the detokenizer handled per event-loop turn (the streams get theirs)


class ServerStatus(enum.Enum):
    """SGLang's: Starting until the warm-up request is answered (entrypoints/warmup.py), then Up;
    /health answers 503 while Starting."""

    Starting = "Starting"
    Up = "Up"


class ClientDisconnected(Exception):
    """The client went away while its request ran; the request was aborted."""


class _Communicator:
    """Request/reply exchanges with the scheduler (flush, state): each query gets an id its
    reply echoes, so a late reply to a query that timed out never answers the next one."""

    def __init__(self, send: Any):
        self._send = send
        self._futures: Dict[str, asyncio.Future] = {}

    async def __call__(self, obj: Any, timeout: float = RPC_TIMEOUT) -> Any:
        obj.query_id = uuid.uuid4().hex
        fut = self._futures[obj.query_id] = asyncio.get_running_loop().create_future()
        try:
            self._send(obj)
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise RequestError("The scheduler did not answer in time.", 503, "ServiceUnavailable") from None
        finally:
            self._futures.pop(obj.query_id, None)

    def handle(self, out: Any) -> None:
        fut = self._futures.get(out.query_id)
        if fut is not None and not fut.done():
            fut.set_result(out)


class TokenizerManager:
    """The main process's side of the served runtime: the RequestFrontend (tokenize, validate,
    outputs) plus asyncio and ZeroMQ: it sends requests to the scheduler and wakes each
    request's waiter when the detokenizer's BatchStrOutput brings news."""

    def __init__(self, server_args: ServerArgs, port_args: PortArgs, model_info: Dict[str, Any], tokenizer: Any = None):
        self.server_args = server_args
        self.port_args = port_args
        self.model_path = resolve_model_path(server_args)
        self.served_model_name = server_args.served_model_name or server_args.model_path or "radixserve-tiny-qwen3"
        self.tokenizer = tokenizer if tokenizer is not None else get_tokenizer(server_args)  # the launcher's, if loaded
        self.model_info = model_info
        self.context_len: int = model_info["context_len"]
        self.vocab_size: int = model_info["vocab_size"]
        self.frontend = RequestFrontend(self.tokenizer, self.context_len, self.vocab_size, load_sampling_defaults(server_args))
        self.frontend.lora_names = set(server_args.lora_paths) if server_args.enable_lora else None
        # images: the model's own image processor, run in the tokenize executor (off the loop)
        self.frontend.mm_processor = build_multimodal_processor(self.model_path, MediaLimits.from_server_args(server_args))
        self.frontend.dp_size = server_args.dp_size
        self.frontend.allow_auto_truncate = server_args.allow_auto_truncate
        self.frontend.enable_custom_logit_processor = server_args.enable_custom_logit_processor
        self.frontend.token_ids_logprob_refusal = token_ids_logprob_refusal(server_args)
        self.frontend.hidden_states_refusal = hidden_states_refusal(server_args)
        self.frontend.input_embeds_refusal = input_embeds_refusal(server_args, model_info.get("architecture"))
        self.frontend.hidden_size = model_info.get("hidden_size")
        self.embeddings = EmbeddingFrontend(self.frontend, model_info.get("hidden_size"))
        self.weight_updates = TokenizerUpdateWeights(self)  # update_weights_* and weight_version
        self.rid_to_state: Dict[str, ReqState] = self.frontend.rid_to_state
        self.sessions = self.frontend.sessions
        self.sessions.ttl = server_args.session_timeout
        self.metrics = TokenizerMetrics(server_args.speculative_num_draft_tokens if server_args.speculative_algorithm else None,
                                       model_name=self.served_model_name)
        self.admin = TokenizerAdmin(self)  # memory release, pause, profiling (admin_requests.py)
        self.timeline = RequestTimeline()  # the /dashboard page's plots (dashboard_history.py)
        self.dead_reason: Optional[str] = None  # set when a child process died
        self.draining = False  # SIGTERM: finish what runs, refuse what comes (503)
        self.server_status = ServerStatus.Starting  # Up once the warm-up request is answered
        self.created_time = int(time.time())
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._unsent: List[Any] = []  # control messages waiting for room on the socket
        self._resend_scheduled = False
        # Tokenizing (and decoding logprob texts) off the event loop, one at a time: a huge
        # prompt does not stall /health, and the tokenizer is never used by two threads.
        self._tokenize_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixserve-tokenize")
        # /health_generate probes in flight: rid -> a future set when the scheduler proves alive
        self._health_waiters: Dict[str, asyncio.Future] = {}
        now = time.monotonic()
        self.last_heartbeat: Dict[int, float] = {r: now for r in range(server_args.dp_size)}

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the sockets and start receiving (inside the server's event loop)."""
        import zmq

        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.Context(1)
        self.recv_from_detokenizer = self._ctx.socket(zmq.PULL)
        self.recv_from_detokenizer.bind(self.port_args.tokenizer_ipc_name)
        self.send_to_scheduler = self._ctx.socket(zmq.PUSH)
        self.send_to_scheduler.setsockopt(zmq.SNDHWM, self.server_args.zmq_hwm)
        self.send_to_scheduler.connect(self.port_args.scheduler_input_ipc_name)
        self.communicator = _Communicator(self._send)
        # SGLang awaits a zmq.asyncio recv per message (its handle_loop); a reader on the socket's
        # FD that takes every waiting message at once spares a future and a task wake-up each
        # (issue 57: ~10% of the HTTP process's time per token at 16 streams).
        self._recv_fd = self.recv_from_detokenizer.getsockopt(zmq.FD)
        self._loop.add_reader(self._recv_fd, self.drain_detokenizer)
        self.drain_detokenizer()  # what came before the reader was added

    async def close(self) -> None:
        if getattr(self, "_recv_fd", None) is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._recv_fd)
            self._recv_fd = None
        for name in ("recv_from_detokenizer", "send_to_scheduler"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=0)

    def _send_request(self, obj: Any) -> None:
        """A new request: refused with 503 when --zmq-hwm messages already wait (the scheduler
        is not keeping up), instead of blocking the event loop."""
        import zmq

        try:
            self.send_to_scheduler.send_pyobj(obj, zmq.NOBLOCK)
        except zmq.Again:
            raise RequestError("The server is overloaded: the scheduler's queue is full.", 503, "ServiceUnavailable") from None

    def _send(self, obj: Any) -> None:
        """A control message (abort, flush, state): never dropped; if the socket is full it
        is sent as soon as there is room, without blocking the event loop."""
        self._unsent.append(obj)
        self._flush_unsent()

    def _flush_unsent(self) -> None:
        import zmq

        while self._unsent:
            try:
                self.send_to_scheduler.send_pyobj(self._unsent[0], zmq.NOBLOCK)
            except zmq.Again:
                if self._loop is not None and not self._resend_scheduled:  # one retry timer at a time
                    self._resend_scheduled = True
                    self._loop.call_later(RESEND_INTERVAL, self._retry_unsent)
                return
            self._unsent.pop(0)

    def _retry_unsent(self) -> None:
        self._resend_scheduled = False
        self._flush_unsent()

    def drain_detokenizer(self) -> None:
        """Handle the messages waiting from the detokenizer. The socket's FD only signals that
        something changed (edge-triggered), so it is read until EVENTS shows nothing more; after
        DRAIN_BATCH messages the rest waits for the next turn of the event loop."""
        import zmq

        sock = self.recv_from_detokenizer
        for _ in range(DRAIN_BATCH):
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            try:
                obj = sock.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return
            except Exception:  # a message that does not unpickle: the next ones still count
                logger.exception("Cannot read a message from the detokenizer")
                continue
            self.handle_output(obj)
        self._loop.call_soon(self.drain_detokenizer)

    def handle_output(self, obj: Any) -> None:
        """One message from the detokenizer (outputs, replies, heartbeats), by type."""
        try:
            if isinstance(obj, BatchStrOutput):
                self._handle_batch_output(obj)
            elif isinstance(obj, BatchEmbeddingOutput):
                self._handle_batch_embedding_output(obj)
            elif isinstance(obj, HealthCheckOutput):
                self._health_check_passed(obj.rid)
            elif hasattr(obj, "query_id"):  # a reply to a control query (flush, state, pause, ...)
                self.communicator.handle(obj)
            elif isinstance(obj, SchedulerHeartbeat):
                self.last_heartbeat[obj.dp_rank] = time.monotonic()
            else:
                logger.warning("Unexpected message from the runtime: %s", type(obj).__name__)
        except Exception:
            logger.exception("Error while handling %s", type(obj).__name__)

    def fail_all(self, message: str, status_code: int = 500, err_type: str = "InternalServerError") -> None:
        """A child process died (or the drain ran out): end every waiting request with an
        error (thread-safe)."""
        self.dead_reason = message

        def fail() -> None:
            for state in self.frontend.fail_all(message, status_code, err_type):
                state.event.set()

        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fail)

    def _handle_batch_output(self, out: BatchStrOutput) -> None:
        now = time.monotonic()
        self._health_check_passed()  # any output since a probe began proves the runtime moves (SGLang)
        for state, num_new in self.frontend.handle_batch_output(out):
            self.timeline.on_update(state, num_new, now)  # before metrics.on_update sets first/last token times
            self.metrics.on_update(state, num_new, now)
            if (state.finished_reason or {}).get("err_type") == DETOKENIZE_ERROR:
                self.abort_request(state.rid)  # the scheduler still runs it: free its KV
            state.event.set()

    def _handle_batch_embedding_output(self, out: BatchEmbeddingOutput) -> None:
        now = time.monotonic()
        for state in self.embeddings.handle_batch_embedding_output(out):
            self.metrics.on_update(state, 0, now)
            state.event.set()

    def make_output(self, state: ReqState) -> Dict[str, Any]:
        if isinstance(state, EmbeddingReqState):
            return self.embeddings.make_output(state)
        return self.frontend.make_output(state)

    def decode_token(self, token_id: int) -> str:
        return self.frontend.decode_token(token_id)

    # ---- requests -------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise RequestError(self.dead_reason, 503, "ServiceUnavailable")
        if self.draining:
            raise RequestError("The server is shutting down.", 503, "ServiceUnavailable")

    def health_problem(self) -> Optional[str]:
        """Why /health should answer 503 (a dead child, shutting down, still starting, a scheduler
        whose loop stopped turning), or None."""
        if self.dead_reason is not None:
            return self.dead_reason
        if self.draining:
            return "The server is shutting down."
        if self.server_status is not ServerStatus.Up:
            return "The server is starting: its warm-up request has not finished."
        age = time.monotonic() - min(self.last_heartbeat.values())
        # An update from disk holds the scheduler's loop while it reads the checkpoint (generation
        # waits, as documented): a busy scheduler, not a dead one; a dead process still reports
        # through dead_reason. (A distributed update waits on a trainer: no grace there.)
        if age > self.server_args.health_check_timeout and not self.weight_updates.loading_from_disk:
            return f"The scheduler has not reported for {age:.0f} s (--health-check-timeout)."
        return None

    def start_draining(self) -> None:
        """SIGTERM: /health turns 503, new requests get 503, running ones go on."""
        self.draining = True

    def num_in_flight(self) -> int:
        return len(self.rid_to_state)

    async def tokenize_texts(self, texts: List[str], add_special_tokens: bool = True) -> List[List[int]]:
        """/tokenize: token ids of each text (off the event loop)."""
        if self.tokenizer is None:
            raise RequestError("This server runs with --skip-tokenizer-init: it has no tokenizer.")
        return await self._loop.run_in_executor(
            self._tokenize_executor, lambda: [list(self.tokenizer.encode(t, add_special_tokens=add_special_tokens)) for t in texts])

    async def detokenize(self, ids_lists: List[List[int]], skip_special_tokens: bool = True) -> List[str]:
        """/detokenize: the text of each list of token ids (off the event loop)."""
        if self.tokenizer is None:
            raise RequestError("This server runs with --skip-tokenizer-init: it has no tokenizer.")
        for ids in ids_lists:
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise RequestError(f"Token ids must be in [0, {self.vocab_size}).")
        return await self._loop.run_in_executor(
            self._tokenize_executor, lambda: [self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) for ids in ids_lists])

    async def apply_chat_template(self, messages: List[Dict[str, Any]], add_generation_prompt: bool = True,
                                  tools: Optional[List[Dict[str, Any]]] = None,
                                  template_kwargs: Optional[Dict[str, Any]] = None) -> List[int]:
        """The chat prompt's token ids, rendered and tokenized off the event loop. `tools` (OpenAI's
        tool list) and `template_kwargs` (e.g. enable_thinking) go to the template as variables."""
        return await self._loop.run_in_executor(self._tokenize_executor, self._apply_chat_template,
                                                messages, add_generation_prompt, tools, template_kwargs or {})

    def _apply_chat_template(self, messages: List[Dict[str, Any]], add_generation_prompt: bool,
                             tools: Optional[List[Dict[str, Any]]], template_kwargs: Dict[str, Any]) -> List[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("This model has no chat template; use /v1/completions.")
        try:
            prompt = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                        add_generation_prompt=add_generation_prompt, **template_kwargs)
        except Exception as e:  # a template that rejects these messages (roles, content types)
            raise RequestError(f"Cannot apply the chat template to these messages: {e}") from None
        return list(self.tokenizer.encode(prompt, add_special_tokens=False))

    def make_sampling_params(self, d: Optional[Dict[str, Any]]) -> SamplingParams:
        return self.frontend.make_sampling_params(d)

    async def generate_request(self, obj: Union[GenerateReqInput, EmbeddingReqInput], request: Any = None) -> AsyncIterator[Any]:
        """_generate_request under the model_update_lock's reader side: a weight update waits for
        it to end, and it waits for an update in progress (tokenizer_update_weights.py)."""
        async with self.weight_updates.model_update_lock.reader_lock():
            gen = self._generate_request(obj, request)
            try:
                async for out in gen:
                    yield out
            finally:
                await gen.aclose()

    async def _generate_request(self, obj: Union[GenerateReqInput, EmbeddingReqInput], request: Any = None) -> AsyncIterator[Any]:
        """Streaming: yields an output dict per update (with "index" when there are several
        samples). Otherwise yields once: one output dict, or a list for a batch or n > 1.
        Raises RequestError for a refused request (400 / 503 ...). An EmbeddingReqInput (on an
        --is-embedding server) yields one {"embedding", "meta_info"} dict, or a list for a batch."""
        self._check_alive()
        check_request_kind(self.server_args.is_embedding, isinstance(obj, EmbeddingReqInput))
        if isinstance(obj, EmbeddingReqInput):
            yield await self._embedding_request(obj, request)
            return
        prepared = await self._loop.run_in_executor(self._tokenize_executor, self.frontend.prepare, obj)
        reqs = prepared[0]
        limit = self.server_args.max_concurrent_requests
        if len(self.rid_to_state) + len(reqs) > limit:
            raise RequestError(f"Too many requests in flight (--max-concurrent-requests {limit}); retry later.",
                               503, "ServiceUnavailable")
        self.frontend.register(obj, *prepared)
        states = [self.rid_to_state[r.rid] for r in reqs]
        single = len(reqs) == 1 and is_single(obj)
        watch = ClientWatch.of(request, [s.event for s in states])
        try:
            self._send_request(reqs[0] if len(reqs) == 1 else BatchTokenizedGenerateReqInput(reqs))
            if obj.stream:
                if len(states) == 1:
                    async for out in self._wait_one_request(states[0], watch):
                        if not single:
                            out["index"] = 0
                        yield out
                else:
                    async for out in self._merge_streams(states, watch):
                        yield out
            else:
                if len(states) == 1:
                    final = None
                    async for final in self._wait_one_request(states[0], watch):
                        pass
                    yield final if single else [final]
                else:
                    tasks = [asyncio.create_task(self._final_output(s, watch)) for s in states]
                    try:
                        results = await asyncio.gather(*tasks)
                    finally:  # one failed: stop waiting for the others (they are aborted below)
                        for t in tasks:
                            t.cancel()
                    yield list(results)
        finally:
            if watch is not None:
                watch.close()
            for s in states:
                if not s.finished:
                    self.abort_request(s.rid)
                self.rid_to_state.pop(s.rid, None)

    async def _embedding_request(self, obj: EmbeddingReqInput, request: Any) -> Any:
        """Prefill only: each prompt's result comes once, when it is done (no streaming)."""
        reqs, single = await self._loop.run_in_executor(self._tokenize_executor, self.embeddings.prepare, obj)
        limit = self.server_args.max_concurrent_requests
        if len(self.rid_to_state) + len(reqs) > limit:
            raise RequestError(f"Too many requests in flight (--max-concurrent-requests {limit}); retry later.",
                               503, "ServiceUnavailable")
        states = self.embeddings.register(reqs)
        tasks: List[asyncio.Task] = []
        watch = ClientWatch.of(request, [s.event for s in states])
        try:
            self._send_request(reqs[0] if len(reqs) == 1 else BatchTokenizedEmbeddingReqInput(reqs))
            tasks = [asyncio.create_task(self._final_output(s, watch)) for s in states]
            results = await asyncio.gather(*tasks)
        finally:  # one failed: stop waiting for the others, abort what still runs
            if watch is not None:
                watch.close()
            for t in tasks:
                t.cancel()
            for s in states:
                if not s.finished:
                    self.abort_request(s.rid)
                self.rid_to_state.pop(s.rid, None)
        return results[0] if single else list(results)

    async def _final_output(self, state: ReqState, watch: Optional[ClientWatch]) -> Dict[str, Any]:
        final = None
        async for final in self._wait_one_request(state, watch):
            pass
        return final

    async def _merge_streams(self, states: List[ReqState], watch: Optional[ClientWatch]) -> AsyncIterator[Dict[str, Any]]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, state: ReqState) -> None:
            try:
                async for out in self._wait_one_request(state, watch):
                    out["index"] = index
                    await queue.put(out)
            except BaseException as e:  # forwarded to the consumer
                await queue.put(e)
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(states)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    async def _wait_one_request(self, state: ReqState, watch: Optional[ClientWatch]) -> AsyncIterator[Dict[str, Any]]:
        """Yield the output after every update of this request; its end raises on an error.
        A client that went away (the watch wakes the state's event), or --request-timeout
        running out, aborts the request."""
        timeout = self.server_args.request_timeout
        while True:
            if not state.event.is_set():  # news already waiting (a busy loop): no wait at all
                if timeout is None:  # no timer per wake-up: the watch wakes us when the client leaves
                    await state.event.wait()
                else:
                    try:
                        await asyncio.wait_for(state.event.wait(), timeout=max(state.created + timeout - time.monotonic(), 0.0))
                    except asyncio.TimeoutError:
                        pass
            self._check_client_and_deadline(state, watch, timeout)
            if not state.event.is_set():
                continue
            state.event.clear()
            if state.finished:
                reason = state.finished_reason or {}
                if reason.get("type") == "abort" and reason.get("status_code"):
                    raise RequestError(reason.get("message", "aborted"), int(reason["status_code"]),
                                       reason.get("err_type") or "BadRequestError")
                if state.return_text_in_logprobs:  # a token text per logprob: off the event loop
                    yield await self._loop.run_in_executor(self._tokenize_executor, self.make_output, state)
                else:
                    yield self.make_output(state)
                return
            if state.stream:
                yield self.make_output(state)

    def _check_client_and_deadline(self, state: ReqState, watch: Optional[ClientWatch], timeout: Optional[float]) -> None:
        """Abort the request if its client went away or --request-timeout ran out."""
        if watch is not None and watch.gone:
            self.metrics.num_disconnect_aborts += 1
            self.abort_request(state.rid)
            logger.info("Client disconnected: aborted request %s", state.rid)
            raise ClientDisconnected(state.rid)
        if timeout is not None and time.monotonic() - state.created >= timeout:
            self.abort_request(state.rid)
            raise RequestError(f"The request did not finish within {timeout:g} s (--request-timeout).", 504, "Timeout")

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort a request (and the samples of an n > 1 request with this rid)."""
        if abort_all:
            self._send(AbortReq(abort_all=True))
            return
        for r in self.frontend.abort_targets(rid):
            self._send(AbortReq(rid=r))

    # ---- control --------------------------------------------------------------------------------
    async def flush_cache(self) -> FlushCacheReqOutput:
        self._check_alive()
        return await self.communicator(FlushCacheReqInput())

    async def get_internal_state(self, with_dashboard: bool = False) -> Dict[str, Any]:
        """The scheduler's state (per DP replica in dp_states); with_dashboard adds each replica's
        "dashboard" snapshot (managers/scheduler_dashboard.py)."""
        if self.dead_reason is not None:
            raise RequestError(self.dead_reason, 503, "ServiceUnavailable")
        out = await self.communicator(GetInternalStateReq(with_dashboard=with_dashboard))
        st = dict(out.internal_state)
        self.metrics.set_scheduler_state(st)
        return st

    def open_session(self, obj: OpenSessionReqInput) -> str:
        self.sessions.expire(self.server_args.session_timeout)
        limit = self.server_args.max_sessions
        if len(self.sessions) >= limit:
            raise RequestError(f"Too many open sessions (--max-sessions {limit}); close one first.", 503, "ServiceUnavailable")
        try:
            return self.sessions.open(obj, uuid.uuid4().hex)
        except SessionError as e:
            raise RequestError(str(e)) from None

    def close_session(self, obj: CloseSessionReqInput) -> None:
        try:
            self.sessions.close(obj)
        except SessionError as e:
            raise RequestError(str(e)) from None

    def _health_check_passed(self, rid: Optional[str] = None) -> None:
        """The probe `rid` (None: every probe in flight) has its proof of life."""
        for key in ([rid] if rid is not None else list(self._health_waiters)):
            fut = self._health_waiters.get(key)
            if fut is not None and not fut.done():
                fut.set_result(True)

    async def health_generate(self) -> bool:
        """SGLang's /health_generate: a one-token generation, marked as a health check. An idle
        scheduler runs it; a busy one does not queue it behind its work but answers after its
        next batch's results (HealthCheckOutput). Any output that arrives meanwhile proves the
        same. Nothing within --health-check-timeout: False (a dead or hung runtime)."""
        rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"
        if self.server_args.is_embedding:  # an embedding server embeds instead (SGLang's too)
            obj: Any = EmbeddingReqInput(input_ids=[0], rid=rid)
        else:
            obj = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0}, rid=rid,
                                   is_health_check=True)
        alive = self._health_waiters[rid] = self._loop.create_future()
        generation = asyncio.ensure_future(self._health_generation(obj))
        try:
            done, _ = await asyncio.wait({generation, alive}, timeout=self.server_args.health_check_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            return alive in done or (generation in done and generation.result())
        finally:
            self._health_waiters.pop(rid, None)
            generation.cancel()  # its generator aborts the request if the scheduler runs it

    async def _health_generation(self, obj: Any) -> bool:
        gen = self.generate_request(obj)
        try:
            async for out in gen:
                return bool(out["meta_info"]["finish_reason"])
            return False
        except RequestError:
            return False
        finally:
            await gen.aclose()
