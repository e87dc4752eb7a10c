"""TokenizerManager: the main process's side of the served runtime (asyncio).

For each HTTP request it tokenizes, validates the SamplingParams (ValueError -> 400), fans
`n > 1` and batches out into one TokenizedGenerateReqInput per sample, sends them to the
scheduler over ZeroMQ, and waits on a per-request asyncio.Event that `handle_loop` sets when
the detokenizer's BatchStrOutput brings new text. A request whose client went away is
aborted (AbortReq: the scheduler frees its KV). It also keeps the Prometheus metrics and the
sessions (a session continues a conversation from a previous request's tokens, so the radix
cache serves that prefix).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from radixserve.protocol import (
    AbortReq,
    BatchStrOutput,
    BatchTokenizedGenerateReqInput,
    CloseSessionReqInput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    OpenSessionReqInput,
    SessionParams,
    TokenizedGenerateReqInput,
)
from radixserve.sampling_params import SamplingParams, context_length_error
from radixserve.server_args import PortArgs, ServerArgs

logger = logging.getLogger("radixserve.tokenizer_manager")

DISCONNECT_CHECK_INTERVAL = 2.0  # s between "is the client still there?" checks while waiting
RPC_TIMEOUT = 60.0  # s to wait for the scheduler's reply to flush / state requests
HEALTH_CHECK_TIMEOUT = 20.0


class ClientDisconnected(Exception):
    """The client went away while its request ran; the request was aborted."""


class RequestError(Exception):
    """A request the server refuses: becomes an HTTP error with this status code."""

    def __init__(self, message: str, status_code: int = 400, err_type: str = "BadRequestError"):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.err_type = err_type


_LOGPROB_KEYS = ("input_token_logprobs_val", "input_token_logprobs_idx", "output_token_logprobs_val", "output_token_logprobs_idx", "output_top_logprobs_val", "output_top_logprobs_idx")


@dataclass
class ReqState:
    rid: str
    input_ids: List[int]
    sampling_params: SamplingParams
    stream: bool
    return_logprob: bool
    top_logprobs_num: int
    return_text_in_logprobs: bool
    parent_rid: Optional[str] = None
    session_id: Optional[str] = None
    created: float = field(default_factory=time.monotonic)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    text: str = ""
    output_ids: List[int] = field(default_factory=list)
    finished_reason: Optional[Dict[str, Any]] = None
    finished: bool = False
    cached_tokens: int = 0
    completion_tokens: int = 0
    retraction_count: int = 0
    first_token_time: Optional[float] = None
    last_time: Optional[float] = None
    logprobs: Dict[str, list] = field(default_factory=lambda: {k: [] for k in _LOGPROB_KEYS})


@dataclass
class _Session:
    session_id: str
    capacity_of_str_len: int
    tokens: Dict[str, List[int]] = field(default_factory=dict)  # rid -> its input + output ids
    last_rid: Optional[str] = None


class _Communicator:
    """One request/reply exchange with the scheduler at a time (its replies carry no id)."""

    def __init__(self, send: Any):
        self._send = send
        self._lock = asyncio.Lock()
        self._fut: Optional[asyncio.Future] = None

    async def __call__(self, obj: Any, timeout: float = RPC_TIMEOUT) -> Any:
        async with self._lock:
            self._fut = asyncio.get_running_loop().create_future()
            self._send(obj)
            try:
                return await asyncio.wait_for(self._fut, timeout)
            except asyncio.TimeoutError:
                raise RequestError("The scheduler did not answer in time.", 503, "ServiceUnavailable") from None
            finally:
                self._fut = None

    def handle(self, out: Any) -> None:
        if self._fut is not None and not self._fut.done():
            self._fut.set_result(out)


class TokenizerMetrics:
    """Prometheus metrics in a registry of their own (SGLang's names, radixserve: prefix)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        p = "radixserve:"
        self.num_running_reqs = Gauge(p + "num_running_reqs", "Requests in the running batch.", registry=r)
        self.num_queue_reqs = Gauge(p + "num_queue_reqs", "Requests in the waiting queue.", registry=r)
        self.token_usage = Gauge(p + "token_usage", "Fraction of the KV pool held by requests.", registry=r)
        self.cache_hit_rate = Gauge(p + "cache_hit_rate", "Prompt tokens served from the prefix cache / all prompt tokens.", registry=r)
        self.gen_throughput = Gauge(p + "gen_throughput", "Decode throughput (tokens/s) at the last decode log.", registry=r)
        self.prompt_tokens_total = Counter(p + "prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens_total = Counter(p + "generation_tokens", "Generated tokens of finished requests.", registry=r)
        self.cached_tokens_total = Counter(p + "cached_tokens", "Prompt tokens served from the prefix cache.", registry=r)
        self.num_requests_total = Counter(p + "num_requests", "Finished requests.", registry=r)
        self.num_aborted_requests_total = Counter(p + "num_aborted_requests", "Requests that ended aborted.", registry=r)
        self.time_to_first_token = Histogram(
            p + "time_to_first_token_seconds", "Time to first token.", registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160),
        )
        self.inter_token_latency = Histogram(
            p + "inter_token_latency_seconds", "Time between output tokens.", registry=r,
            buckets=(0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5),
        )
        self.e2e_request_latency = Histogram(
            p + "e2e_request_latency_seconds", "Request latency, arrival to last token.", registry=r,
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320),
        )
        self.num_disconnect_aborts = 0

    def set_scheduler_state(self, st: Dict[str, Any]) -> None:
        self.num_running_reqs.set(st.get("num_running_reqs", 0))
        self.num_queue_reqs.set(st.get("num_waiting_reqs", 0))
        self.token_usage.set(st.get("token_usage", 0.0))
        self.cache_hit_rate.set(st.get("cache_hit_rate", 0.0))
        self.gen_throughput.set(st.get("gen_throughput", 0.0))

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def stop_holdback(text: str, stops: List[str]) -> int:
    """Length of the longest end of `text` that could be the start of a stop string: a stream
    holds it back, since a stop string is trimmed off the final text."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold


class TokenizerManager:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs, model_info: Dict[str, Any]):
        from radixserve.managers.scheduler import load_tokenizer, resolve_model_path

        self.server_args = server_args
        self.port_args = port_args
        self.model_path = resolve_model_path(server_args)
        self.served_model_name = server_args.served_model_name or server_args.model_path or "radixserve-tiny-qwen3"
        self.tokenizer = None if server_args.skip_tokenizer_init else load_tokenizer(server_args.tokenizer_path or self.model_path)
        self.model_info = model_info
        self.context_len: int = model_info["context_len"]
        self.vocab_size: int = model_info["vocab_size"]
        self.rid_to_state: Dict[str, ReqState] = {}
        self.sessions: Dict[str, _Session] = {}
        self.metrics = TokenizerMetrics()
        self.dead_reason: Optional[str] = None  # set when a child process died
        self.created_time = int(time.time())
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the sockets and start receiving (inside the server's event loop)."""
        import zmq
        import zmq.asyncio

        self._loop = asyncio.get_running_loop()
        self._actx = zmq.asyncio.Context(1)
        self.recv_from_detokenizer = self._actx.socket(zmq.PULL)
        self.recv_from_detokenizer.bind(self.port_args.tokenizer_ipc_name)
        self._ctx = zmq.Context(1)
        self.send_to_scheduler = self._ctx.socket(zmq.PUSH)
        self.send_to_scheduler.setsockopt(zmq.SNDHWM, 0)
        self.send_to_scheduler.connect(self.port_args.scheduler_input_ipc_name)
        self.flush_cache_communicator = _Communicator(self._send)
        self.internal_state_communicator = _Communicator(self._send)
        self._recv_task = asyncio.create_task(self.handle_loop())

    async def close(self) -> None:
        task = getattr(self, "_recv_task", None)
        if task is not None:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        for name in ("recv_from_detokenizer", "send_to_scheduler"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=0)

    def _send(self, obj: Any) -> None:
        self.send_to_scheduler.send_pyobj(obj)

    async def handle_loop(self) -> None:
        while True:
            obj = await self.recv_from_detokenizer.recv_pyobj()
            try:
                if isinstance(obj, BatchStrOutput):
                    self._handle_batch_output(obj)
                elif isinstance(obj, FlushCacheReqOutput):
                    self.flush_cache_communicator.handle(obj)
                elif isinstance(obj, GetInternalStateReqOutput):
                    self.internal_state_communicator.handle(obj)
                else:
                    logger.warning("Unexpected message from the runtime: %s", type(obj).__name__)
            except Exception:
                logger.exception("Error while handling %s", type(obj).__name__)

    def fail_all(self, message: str) -> None:
        """A child process died: end every waiting request with an error (thread-safe)."""
        self.dead_reason = message

        def fail() -> None:
            for state in list(self.rid_to_state.values()):
                if not state.finished:
                    state.finished_reason = {"type": "abort", "message": message, "status_code": 500, "err_type": "InternalServerError"}
                    state.finished = True
                    state.event.set()

        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fail)

    # ---- outputs --------------------------------------------------------------------------------
    def _handle_batch_output(self, out: BatchStrOutput) -> None:
        now = time.monotonic()
        m = self.metrics
        for i, rid in enumerate(out.rids):
            state = self.rid_to_state.get(rid)
            if state is None or state.finished:
                continue
            new_ids = out.output_ids[i]
            state.text = state.text[: out.text_offsets[i]] + out.output_strs[i]
            state.output_ids.extend(new_ids)
            state.completion_tokens = out.completion_tokens[i]
            state.cached_tokens = out.cached_tokens[i]
            if i < len(out.retraction_counts):
                state.retraction_count = out.retraction_counts[i]
            if state.return_logprob:
                for key in _LOGPROB_KEYS:
                    state.logprobs[key].extend(getattr(out, key)[i])
            if new_ids:
                if state.first_token_time is None:
                    state.first_token_time = now
                    m.time_to_first_token.observe(now - state.created)
                elif state.last_time is not None:
                    m.inter_token_latency.observe((now - state.last_time) / len(new_ids))
                state.last_time = now
            reason = out.finished_reasons[i]
            if reason is not None:
                state.finished_reason = reason
                state.finished = True
                m.num_requests_total.inc()
                m.prompt_tokens_total.inc(len(state.input_ids))
                m.generation_tokens_total.inc(state.completion_tokens)
                m.cached_tokens_total.inc(state.cached_tokens)
                m.e2e_request_latency.observe(now - state.created)
                if reason.get("type") == "abort":
                    m.num_aborted_requests_total.inc()
                self._record_session(state)
            state.event.set()

    def _record_session(self, state: ReqState) -> None:
        session = self.sessions.get(state.session_id) if state.session_id else None
        if session is None or (state.finished_reason or {}).get("type") == "abort":
            return
        session.tokens[state.rid] = list(state.input_ids) + list(state.output_ids)
        session.last_rid = state.rid

    def make_output(self, state: ReqState) -> Dict[str, Any]:
        """SGLang's output of /generate: cumulative text, output_ids, meta_info."""
        text = state.text
        sp = state.sampling_params
        if not state.finished and sp.stop_strs and not sp.no_stop_trim:
            text = text[: len(text) - stop_holdback(text, sp.stop_strs)]
        meta: Dict[str, Any] = {
            "id": state.rid,
            "finish_reason": _public_finish_reason(state.finished_reason) if state.finished else None,
            "prompt_tokens": len(state.input_ids),
            "completion_tokens": state.completion_tokens,
            "cached_tokens": state.cached_tokens,
            "e2e_latency": time.monotonic() - state.created,
        }
        if state.retraction_count:
            meta["retraction_count"] = state.retraction_count
        if state.return_logprob:
            lp = state.logprobs
            meta["output_token_logprobs"] = self._logprob_triples(
                lp["output_token_logprobs_val"], lp["output_token_logprobs_idx"], state.return_text_in_logprobs
            )
            if lp["input_token_logprobs_idx"]:
                meta["input_token_logprobs"] = self._logprob_triples(
                    lp["input_token_logprobs_val"], lp["input_token_logprobs_idx"], state.return_text_in_logprobs
                )
            if state.top_logprobs_num > 0:
                meta["output_top_logprobs"] = [
                    self._logprob_triples(v, ix, state.return_text_in_logprobs)
                    for v, ix in zip(lp["output_top_logprobs_val"], lp["output_top_logprobs_idx"])
                ]
        return {"text": text, "output_ids": list(state.output_ids), "meta_info": meta}

    def _logprob_triples(self, vals: List[float], ids: List[int], with_text: bool) -> List[list]:
        texts = [self.decode_token(t) for t in ids] if with_text else [None] * len(ids)
        return [[None if v is None else float(v), int(t), s] for v, t, s in zip(vals, ids, texts)]

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([int(token_id)]) if self.tokenizer is not None else ""

    # ---- requests -------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise RequestError(self.dead_reason, 503, "ServiceUnavailable")

    def _encode(self, text: str) -> List[int]:
        if self.tokenizer is None:
            raise RequestError("This server runs with --skip-tokenizer-init: send input_ids, not text.")
        return list(self.tokenizer.encode(text))

    def apply_chat_template(self, messages: List[Dict[str, Any]], add_generation_prompt: bool = True) -> List[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("This model has no chat template; use /v1/completions.")
        try:
            prompt = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # a template that rejects these messages (roles, content types)
            raise RequestError(f"Cannot apply the chat template to these messages: {e}") from None
        return list(self.tokenizer.encode(prompt, add_special_tokens=False))

    def make_sampling_params(self, d: Optional[Dict[str, Any]]) -> SamplingParams:
        """Validate a sampling_params dict: unknown names, wrong types and values out of range
        raise RequestError with SGLang's messages."""
        if d is not None and not isinstance(d, dict):
            raise RequestError(f"sampling_params must be an object, got {type(d).__name__}.")
        try:
            SamplingParams.from_dict(d)  # unknown names
            sp = _sampling_params_adapter().validate_python(dict(d or {}))
            sp.verify(self.vocab_size)  # before normalize(), which makes temperature < eps greedy
            sp.normalize(self.tokenizer)
        except ValueError as e:
            raise RequestError(_validation_message(e, "sampling_params")) from None
        return sp

    def _tokenize(self, obj: GenerateReqInput) -> Tuple[List[TokenizedGenerateReqInput], Dict[str, str]]:
        """One TokenizedGenerateReqInput per (prompt, sample), in output order; and the rid each
        sample of an n > 1 request was made from."""
        if (obj.text is None) == (obj.input_ids is None):
            raise RequestError("Either text or input_ids should be provided (exactly one of them).")
        if obj.text is not None:
            if isinstance(obj.text, str):
                texts: List[Optional[str]] = [obj.text]
                is_batch = False
            elif isinstance(obj.text, list) and all(isinstance(t, str) for t in obj.text):
                texts, is_batch = list(obj.text), True
            else:
                raise RequestError("text must be a string or a list of strings.")
            ids_list = [self._encode(t) for t in texts]
        else:
            ids = obj.input_ids
            if not isinstance(ids, list):
                raise RequestError("input_ids must be a list of token ids or a list of such lists.")
            if ids and all(isinstance(x, list) for x in ids):
                ids_list, is_batch = [list(x) for x in ids], True
            else:
                ids_list, is_batch = [list(ids)], False
            for row in ids_list:
                if not all(isinstance(t, int) and not isinstance(t, bool) for t in row):
                    raise RequestError("input_ids must contain integers.")
            texts = [None] * len(ids_list)
        num = len(ids_list)
        if num == 0:
            raise RequestError("The batch is empty.")

        def per_prompt(value: Any, name: str, default: Any) -> List[Any]:
            if isinstance(value, list) and (is_batch or name == "sampling_params"):
                if len(value) != num:
                    raise RequestError(f"{name} has {len(value)} entries for {num} prompts.")
                return value
            if is_batch and name == "rid" and value is not None:
                raise RequestError("rid must be a list with one entry per prompt for a batch.")
            return [default if value is None else value] * num

        sp_dicts = per_prompt(obj.sampling_params, "sampling_params", None)
        rids = per_prompt(obj.rid, "rid", None)
        return_logprobs = per_prompt(obj.return_logprob, "return_logprob", False)
        for rid in rids:
            if rid is not None and not isinstance(rid, str):
                raise RequestError("rid must be a string.")
        if not isinstance(obj.top_logprobs_num, int) or obj.top_logprobs_num < 0:
            raise RequestError("top_logprobs_num must be a non-negative integer.")

        session: Optional[_Session] = None
        if obj.session_params is not None:
            ids_list, session = self._apply_session(obj.session_params, ids_list, is_batch)

        reqs: List[TokenizedGenerateReqInput] = []
        parents: Dict[str, str] = {}
        batch_rids: set = set()  # two outputs of one batch could not share one request state
        for text, ids, sp_dict, rid, ret_lp in zip(texts, ids_list, sp_dicts, rids, return_logprobs):
            sp = self.make_sampling_params(sp_dict)
            error = context_length_error(len(ids), (sp_dict or {}).get("max_new_tokens"), self.context_len)
            if error is not None:
                raise RequestError(error)
            n = sp.n
            if n > 1 and session is not None:
                raise RequestError("n > 1 cannot continue a session.")
            base = rid or uuid.uuid4().hex
            for j in range(n):
                sub_rid = base if n == 1 else f"{base}-{j}"
                if sub_rid in self.rid_to_state:
                    raise RequestError(f"Duplicate request id: {sub_rid!r} is still running.")
                if sub_rid in batch_rids:
                    raise RequestError(f"Duplicate request id: {sub_rid!r} appears twice in this batch.")
                batch_rids.add(sub_rid)
                sub_sp = dataclasses.replace(sp, n=1) if n > 1 else sp
                reqs.append(TokenizedGenerateReqInput(
                    sub_rid, text, list(ids), sub_sp, return_logprob=bool(ret_lp),
                    logprob_start_len=obj.logprob_start_len, top_logprobs_num=obj.top_logprobs_num,
                    stream=bool(obj.stream), priority=obj.priority,
                ))
                if n > 1:
                    parents[sub_rid] = base
        return reqs, parents

    def _apply_session(self, params: Any, ids_list: List[List[int]], is_batch: bool) -> Tuple[List[List[int]], _Session]:
        if is_batch:
            raise RequestError("session_params takes a single prompt.")
        try:
            sp = params if isinstance(params, SessionParams) else SessionParams(**dict(params))
        except TypeError as e:
            raise RequestError(f"Bad session_params: {e}") from None
        session = self.sessions.get(sp.id)
        if session is None:
            raise RequestError(f"Session {sp.id!r} does not exist (open it with /open_session).")
        context: List[int] = []
        prev = sp.rid or session.last_rid
        if prev is not None:
            if prev not in session.tokens:
                raise RequestError(f"Request {prev!r} is not a finished request of session {sp.id!r}.")
            context = session.tokens[prev]
            if sp.offset is not None and sp.offset >= 0:
                context = context[: sp.offset]
        return [context + ids_list[0]], session

    async def generate_request(self, obj: GenerateReqInput, request: Any = None) -> AsyncIterator[Any]:
        """Streaming: yields an output dict per update (with "index" when there are several
        samples). Otherwise yields once: one output dict, or a list for a batch or n > 1.
        Raises RequestError for a refused request (400 / 503 ...)."""
        self._check_alive()
        reqs, parents = self._tokenize(obj)
        session_id = None
        if obj.session_params is not None:
            session_id = (obj.session_params.id if isinstance(obj.session_params, SessionParams)
                          else dict(obj.session_params).get("id"))
        states = []
        for r in reqs:
            state = ReqState(
                r.rid, r.input_ids, r.sampling_params, r.stream, r.return_logprob, r.top_logprobs_num,
                bool(obj.return_text_in_logprobs), parent_rid=parents.get(r.rid), session_id=session_id,
            )
            self.rid_to_state[r.rid] = state
            states.append(state)
        self._send(reqs[0] if len(reqs) == 1 else BatchTokenizedGenerateReqInput(reqs))
        single = len(reqs) == 1 and not isinstance(obj.text, list) and not (
            isinstance(obj.input_ids, list) and obj.input_ids and isinstance(obj.input_ids[0], list)
        )
        try:
            if obj.stream:
                if len(states) == 1:
                    async for out in self._wait_one_request(states[0], request):
                        if not single:
                            out["index"] = 0
                        yield out
                else:
                    async for out in self._merge_streams(states, request):
                        yield out
            else:
                if len(states) == 1:
                    final = None
                    async for final in self._wait_one_request(states[0], request):
                        pass
                    yield final if single else [final]
                else:
                    tasks = [asyncio.create_task(self._final_output(s, request)) for s in states]
                    try:
                        results = await asyncio.gather(*tasks)
                    finally:  # one failed: stop waiting for the others (they are aborted below)
                        for t in tasks:
                            t.cancel()
                    yield list(results)
        finally:
            for s in states:
                if not s.finished:
                    self.abort_request(s.rid)
                self.rid_to_state.pop(s.rid, None)

    async def _final_output(self, state: ReqState, request: Any) -> Dict[str, Any]:
        final = None
        async for final in self._wait_one_request(state, request):
            pass
        return final

    async def _merge_streams(self, states: List[ReqState], request: Any) -> AsyncIterator[Dict[str, Any]]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, state: ReqState) -> None:
            try:
                async for out in self._wait_one_request(state, request):
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

    async def _wait_one_request(self, state: ReqState, request: Any) -> AsyncIterator[Dict[str, Any]]:
        """Yield the output after every update of this request; its end raises on an error."""
        while True:
            try:
                await asyncio.wait_for(state.event.wait(), timeout=DISCONNECT_CHECK_INTERVAL)
            except asyncio.TimeoutError:
                if request is not None and await request.is_disconnected():
                    self.metrics.num_disconnect_aborts += 1
                    self.abort_request(state.rid)
                    logger.info("Client disconnected: aborted request %s", state.rid)
                    raise ClientDisconnected(state.rid)
                continue
            state.event.clear()
            if state.finished:
                reason = state.finished_reason or {}
                if reason.get("type") == "abort" and reason.get("status_code"):
                    raise RequestError(reason.get("message", "aborted"), int(reason["status_code"]),
                                       reason.get("err_type") or "BadRequestError")
                yield self.make_output(state)
                return
            if state.stream:
                yield self.make_output(state)

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort a request (and the samples of an n > 1 request with this rid)."""
        if abort_all:
            self._send(AbortReq(abort_all=True))
            return
        targets = [rid] if rid in self.rid_to_state else []
        targets += [r for r, s in self.rid_to_state.items() if s.parent_rid == rid and r != rid]
        for r in targets or [rid]:
            self._send(AbortReq(rid=r))

    # ---- control --------------------------------------------------------------------------------
    async def flush_cache(self) -> FlushCacheReqOutput:
        self._check_alive()
        return await self.flush_cache_communicator(FlushCacheReqInput())

    async def get_internal_state(self) -> Dict[str, Any]:
        self._check_alive()
        out = await self.internal_state_communicator(GetInternalStateReq())
        st = dict(out.internal_state)
        self.metrics.set_scheduler_state(st)
        return st

    def open_session(self, obj: OpenSessionReqInput) -> str:
        sid = obj.session_id or uuid.uuid4().hex
        if sid in self.sessions:
            raise RequestError(f"Session {sid!r} is already open.")
        self.sessions[sid] = _Session(sid, obj.capacity_of_str_len)
        return sid

    def close_session(self, obj: CloseSessionReqInput) -> None:
        if self.sessions.pop(obj.session_id, None) is None:
            raise RequestError(f"Session {obj.session_id!r} does not exist.")

    async def health_generate(self) -> bool:
        """A real one-token generation (SGLang's /health_generate)."""
        obj = GenerateReqInput(
            input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0},
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
        )

        async def run() -> bool:
            gen = self.generate_request(obj)
            try:
                async for out in gen:
                    return bool(out["meta_info"]["finish_reason"])
                return False
            finally:
                await gen.aclose()

        try:
            return await asyncio.wait_for(run(), HEALTH_CHECK_TIMEOUT)
        except (asyncio.TimeoutError, RequestError):
            return False


def _public_finish_reason(reason: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """SGLang's shapes: {"type": "stop", "matched": ..} / {"type": "length", "length": N} /
    {"type": "abort", "message": ..} (no internal fields left empty)."""
    if reason is None:
        return None
    return {k: v for k, v in reason.items() if v is not None}


_ADAPTER = None


def _sampling_params_adapter() -> Any:
    global _ADAPTER
    if _ADAPTER is None:
        from pydantic import TypeAdapter

        _ADAPTER = TypeAdapter(SamplingParams)
    return _ADAPTER


def _validation_message(e: Exception, where: str) -> str:
    """A pydantic ValidationError as one readable line; other ValueErrors as they are."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        parts = []
        for err in errors():
            loc = ".".join(str(x) for x in err.get("loc", ()))
            parts.append(f"{where}.{loc}: {err.get('msg')}" if loc else f"{where}: {err.get('msg')}")
        return "; ".join(parts)
    return str(e)
