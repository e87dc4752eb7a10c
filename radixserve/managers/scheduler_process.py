"""The scheduler's process in the served runtime (seed 004's diagram).

    TokenizerManager --PUSH--> [scheduler_input] PULL  Scheduler  PUSH --> [detokenizer]
                                                                  PUSH --> [tokenizer]  (replies)

`run_scheduler_process` builds the production `Scheduler` with ZeroMQ-backed `recv_fn` /
`send_fn`, reports readiness (pool sizes) through a pipe, and runs the loop. The loop polls
the socket with a timeout while there is nothing to do, so an idle server uses no CPU.
Around the loop: SGLang-style prefill / decode log lines, a watchdog thread (no forward
progress while there is work for --watchdog-timeout seconds: dump every thread's stack,
exit non-zero, the launcher takes the server down); SIGTERM / SIGINT left to the launcher, and
no orphans (process_utils.become_server_child).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, List, Optional

from radixserve.managers.dp_controller import dp_port_args
from radixserve.managers.process_utils import (become_server_child, configure_process_logging,
                                               leave_stop_signals_to_launcher)
from radixserve.managers.scheduler_dashboard import DashboardSources, SchedulerDashboard
from radixserve.managers.schedule_policy import configure_lora_admission
from radixserve.managers.loop_state import LoopState
from radixserve.protocol import BatchTokenIDOutput, GetInternalStateReqOutput, SchedulerHeartbeat, SchedulerLoad
from radixserve.server_args import PortArgs, ServerArgs

if TYPE_CHECKING:
    from radixserve.managers.scheduler_stats import SchedulerStats
    from radixserve.mem_cache.base_prefix_cache import BasePrefixCache
    from radixserve.mem_cache.kv_ledger import KVLedger

logger = logging.getLogger("radixserve.scheduler")

IDLE_POLL_MS = 500  # how long an idle loop blocks on the socket before looking around again
PEER_POLL_MS = 2  # how long the loop blocks while PD requests wait for the other server
HEARTBEAT_INTERVAL_S = 1.0  # rank 0 tells the TokenizerManager it is alive this often


def zmq_recv_drain(sock: Any) -> Callable[[], List[Any]]:
    """recv_fn: every message waiting on the PULL socket, never blocking (seed 000). Asks the
    socket's EVENTS before each receive: an empty socket (most steps) costs one getsockopt,
    not a raised and caught zmq.Again (issue 57: the loop's fixed cost per step)."""
    import zmq

    def recv() -> List[Any]:
        msgs: List[Any] = []
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                msgs.append(sock.recv_pyobj(zmq.NOBLOCK))
            except zmq.Again:  # (not expected after POLLIN)
                break
        return msgs

    return recv


@dataclass(frozen=True)
class MetricsSources:
    """What the metrics logger reads (it changes nothing): the KV ledger and tree for the token
    usage, the loop's queue and batch, the counters, and whether speculation runs."""

    ledger: KVLedger
    tree_cache: BasePrefixCache
    stats: SchedulerStats
    loop: LoopState
    max_total_num_tokens: int
    speculative: bool
    forward_ct: Callable[[], int]
    dp_rank: Callable[[], int]


class SchedulerMetricsLogger:
    """Prefill / decode log lines like SGLang's, and the numbers /get_server_info adds
    (token usage, cache hit rate, generation throughput). Reads the scheduler; changes nothing."""

    def __init__(self, sources: MetricsSources, decode_log_interval: int):
        self.sched = sources
        self.decode_log_interval = decode_log_interval
        self.num_decode_steps = 0
        self.decode_tokens_since_log = 0
        self.last_log_time = time.monotonic()
        self.gen_throughput = 0.0
        self.spec_seen = (0, 0, 0, 0)  # speculative decoding: SchedulerStats' spec_* totals at the last log
        self.spec_accept_length = 0.0  # over the last log's window (SGLang's gauges)
        self.spec_accept_rate = 0.0

    def token_usage(self) -> float:
        s = self.sched
        total = s.max_total_num_tokens
        used = total - s.ledger.available_size() - s.tree_cache.evictable_size()
        return used / total if total else 0.0

    def swa_token_usage(self) -> Optional[float]:
        """The SWA pool's share in use (None without one)."""
        info = getattr(self.sched.ledger, "get_swa_token_info", None)
        if info is None:
            return None
        st = info()
        return st["swa_used_tokens"] / st["swa_max_total_num_tokens"]

    def _usage_text(self) -> str:
        swa = self.swa_token_usage()
        return f"{self.token_usage():.2f}" + ("" if swa is None else f", swa token usage: {swa:.2f}")

    def cache_hit_rate(self) -> float:
        return self.sched.stats.cache_hit_rate

    def on_batch(self, batch: Any) -> None:
        if batch is None or batch.forward_mode is None:
            return
        s = self.sched
        if batch.forward_mode.is_decode():
            self.num_decode_steps += 1
            self.decode_tokens_since_log += batch.batch_size()
            if self.num_decode_steps % self.decode_log_interval == 0:
                now = time.monotonic()
                spec = self._spec_since_log()  # speculative decoding: several tokens per request and step
                if spec is not None:
                    self.decode_tokens_since_log = spec[1]
                    if spec[0]:
                        self.spec_accept_length = spec[1] / spec[0]
                        self.spec_accept_rate = spec[2] / spec[3] if spec[3] else 0.0
                self.gen_throughput = self.decode_tokens_since_log / max(now - self.last_log_time, 1e-6)
                self.decode_tokens_since_log, self.last_log_time = 0, now
                num_tokens = sum(r.seqlen() for r in batch.reqs)
                logger.info(
                    "Decode batch. #running-req: %d, #token: %d, token usage: %s, "
                    "gen throughput (token/s): %.2f, #queue-req: %d%s",
                    batch.batch_size(), num_tokens, self._usage_text(), self.gen_throughput, len(s.loop.waiting_queue),
                    f", accept len: {self.spec_accept_length:.2f}, accept rate: {self.spec_accept_rate:.2f}"
                    if spec is not None and spec[0] else "",
                )
            return
        decoding = set(id(r) for r in (batch.decoding_reqs or []))
        new = [(r, i) for i, r in enumerate(batch.reqs) if id(r) not in decoding]
        new_tokens = sum(batch.extend_lens[i] for _, i in new if i < len(batch.extend_lens))
        cached = sum(batch.prefix_lens[i] for _, i in new if i < len(batch.prefix_lens))
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %s, "
            "#running-req: %d, #queue-req: %d",
            len(new), new_tokens, cached, self._usage_text(), s.loop.slot.running_batch.batch_size(), len(s.loop.waiting_queue),
        )

    def _spec_since_log(self) -> Any:
        """(verify steps, tokens committed, drafts accepted, drafts proposed) since the last log
        line; None without speculation."""
        stats = self.sched.stats
        if not self.sched.speculative:
            return None
        now = (stats.spec_verify_ct, stats.spec_num_accept_tokens, stats.spec_num_correct_drafts, stats.spec_num_proposed_drafts)
        delta, self.spec_seen = tuple(a - b for a, b in zip(now, self.spec_seen)), now
        return delta

    def decorate_state(self, out: Any) -> Any:
        if isinstance(out, GetInternalStateReqOutput):
            out.internal_state.update(
                token_usage=self.token_usage(),
                **({} if self.swa_token_usage() is None else {"swa_token_usage": self.swa_token_usage()}),
                cache_hit_rate=self.cache_hit_rate(),
                gen_throughput=self.gen_throughput,
                forward_ct=self.sched.forward_ct(),
                dp_rank=self.sched.dp_rank(),  # the DP controller orders replicas' states by it
                spec_accept_length=self.spec_accept_length,  # the last decode log's window, as SGLang's gauges
                spec_accept_rate=self.spec_accept_rate,
            )
        return out


class Watchdog:
    """Seed 001 §30: while the scheduler has work, forward_ct must move within `timeout` s.
    Otherwise log every thread's stack and call `on_timeout` (the process exits non-zero)."""

    def __init__(self, forward_ct: Callable[[], int], expects_progress: Callable[[], bool], timeout: float,
                 on_timeout: Callable[[], None], period: Optional[float] = None):
        self.forward_ct, self.expects_progress = forward_ct, expects_progress  # read from the watchdog's thread
        self.timeout = timeout
        self.on_timeout = on_timeout
        self.period = period if period is not None else min(timeout / 2, 5.0)
        self.fired = False

    def check_forever(self, stop: threading.Event) -> None:
        last_ct, last_change = self.forward_ct(), time.monotonic()
        while not stop.wait(self.period):
            ct = self.forward_ct()
            if ct != last_ct or not self.expects_progress():  # idle, or paused on purpose
                last_ct, last_change = ct, time.monotonic()
                continue
            if time.monotonic() - last_change > self.timeout:
                logger.error(
                    "Watchdog timeout: the scheduler has work but made no forward progress for %.0f s "
                    "(--watchdog-timeout). Stacks of all threads follow; the server exits.",
                    self.timeout,
                )
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                self.fired = True
                self.on_timeout()
                return

    def start(self) -> threading.Event:
        stop = threading.Event()
        threading.Thread(target=self.check_forever, args=(stop,), name="watchdog", daemon=True).start()
        return stop


def run_scheduler_process(
    server_args: ServerArgs, port_args: PortArgs, pipe: Any, tp_rank: int = 0, dp_rank: Optional[int] = None,
    pp_rank: int = 0, make_worker: Optional[Any] = None,
) -> None:
    """Process entry: build the Scheduler on ZeroMQ, report ready, loop until killed.
    With --tp-size N there are N of these; rank 0 owns the sockets and broadcasts what it
    receives (Scheduler.recv_requests), the other ranks follow in lockstep. With --pp-size P,
    the first stage's ranks run the Scheduler and the later stages' ranks a PPStage."""
    become_server_child(port_args.ipc_dir)  # never outlive the launcher
    if pp_rank > 0:
        return run_pp_stage_process(server_args, port_args, pipe, tp_rank, pp_rank)
    tag = "scheduler" if server_args.tp_size == 1 else f"scheduler TP{tp_rank}"
    if server_args.pp_size > 1:
        tag = f"scheduler PP0 TP{tp_rank}"
    if dp_rank is not None:  # a replica behind the DataParallelController
        tag = f"scheduler DP{dp_rank}" + (f" TP{tp_rank}" if server_args.tp_size > 1 else "")
        port_args = dp_port_args(port_args, dp_rank)
    configure_process_logging(server_args, tag)
    recv_sock = None
    try:
        import zmq

        from radixserve.managers.scheduler import Scheduler
        from radixserve.managers.scheduler_builder import build_scheduler_parts

        holder: dict = {}
        recv_fn: Callable[[], List[Any]] = lambda: []
        send_fn: Callable[[Any], None] = lambda obj: None
        if tp_rank == 0:
            ctx = zmq.Context(2)
            recv_sock = ctx.socket(zmq.PULL)
            recv_sock.bind(port_args.scheduler_input_ipc_name)
            to_detokenizer = ctx.socket(zmq.PUSH)
            to_detokenizer.setsockopt(zmq.SNDHWM, 0)
            to_detokenizer.connect(port_args.detokenizer_ipc_name)
            to_tokenizer = ctx.socket(zmq.PUSH)
            to_tokenizer.setsockopt(zmq.SNDHWM, 0)
            to_tokenizer.connect(port_args.tokenizer_ipc_name)
            recv_fn = zmq_recv_drain(recv_sock)

            def send_fn(obj: Any) -> None:
                # Token outputs go through the detokenizer; replies (flush, state) straight back.
                if isinstance(obj, BatchTokenIDOutput):
                    to_detokenizer.send_pyobj(obj)
                else:
                    to_tokenizer.send_pyobj(holder["dashboard"].decorate_state(holder["metrics"].decorate_state(obj)))

        parts = build_scheduler_parts(server_args, tp_rank, server_args.tp_size,  # the model loads here
                                      make_worker=make_worker)
        scheduler = Scheduler(server_args, recv_fn=recv_fn, send_fn=send_fn, tp_rank=tp_rank, tp_size=server_args.tp_size,
                              parts=parts)
        configure_lora_admission(scheduler.policy, server_args)
        holder["metrics"] = metrics = SchedulerMetricsLogger(MetricsSources(
            scheduler.ledger, scheduler.tree_cache, scheduler.stats, scheduler.loop, scheduler.max_total_num_tokens,
            scheduler.spec_worker is not None, lambda: scheduler.forward_ct, lambda: scheduler.profiler.dp_rank or 0),
            server_args.decode_log_interval)
        holder["dashboard"] = dashboard = SchedulerDashboard(DashboardSources(
            scheduler.ledger, scheduler.tree_cache, scheduler.stats, scheduler.loop, scheduler.max_total_num_tokens))
        scheduler.profiler.dp_rank = dp_rank  # in its trace files' names
    except Exception as e:  # a model path that cannot load (LoadError): its one-line message, no traceback
        pipe.send({"status": "error", "error": str(e) if type(e).__name__ in ("LoadError", "LoRAError") else traceback.format_exc()})
        raise SystemExit(1)

    leave_stop_signals_to_launcher()  # from now on SIGTERM / SIGINT are the launcher's
    pipe.send({
        "status": "ready",
        "pid": os.getpid(),
        "tp_rank": tp_rank,
        "max_total_num_tokens": scheduler.max_total_num_tokens,
        "max_running_requests": scheduler.max_running_requests,
        "context_len": scheduler.context_len,
        "vocab_size": scheduler.vocab_size,
        "hidden_size": scheduler.model_config.hidden_size,  # what /v1/embeddings' `dimensions` may ask
        "architecture": scheduler.model_config.architecture,  # which models take input_embeds
        "device": str(scheduler.device),
    })
    Watchdog(lambda: scheduler.forward_ct, scheduler.expects_progress, server_args.watchdog_timeout,
             lambda: os._exit(1)).start()

    poller = None
    if recv_sock is not None:
        poller = zmq.Poller()
        poller.register(recv_sock, zmq.POLLIN)
    last_load, last_heartbeat = None, 0.0
    count_tokens = server_args.load_balance_method == "minimum_tokens"  # else a report per step
    try:
        while True:
            scheduler.process_input_requests(scheduler.recv_requests())
            step_start = time.perf_counter()
            batch = scheduler.run_step()
            if tp_rank == 0:
                metrics.on_batch(batch)
                dashboard.on_step(batch, time.perf_counter() - step_start)
                if time.monotonic() - last_heartbeat >= HEARTBEAT_INTERVAL_S:  # /health reads it
                    send_fn(SchedulerHeartbeat(dp_rank or 0))
                    last_heartbeat = time.monotonic()
                if dp_rank is not None:  # shortest_queue / minimum_tokens routing need each replica's load
                    load = replica_load(scheduler.loop, dp_rank, count_tokens)
                    if load != last_load:
                        send_fn(load)
                        last_load = load
            if poller is not None and batch is None and not scheduler.expects_progress():
                # Idle: block until a message arrives. Other TP ranks wait in the broadcast.
                # PD: a handshake or a transfer can end any moment (on the KVManager's thread).
                poller.poll(PEER_POLL_MS if scheduler.waiting_on_peer() else IDLE_POLL_MS)
    except Exception:
        logger.error("Scheduler hit an exception:\n%s", traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)


def replica_load(loop: LoopState, dp_rank: int, count_tokens: bool) -> SchedulerLoad:
    """What a replica tells the DataParallelController: its requests, and with minimum_tokens
    routing its tokens (KV held by running requests plus the prompts waiting)."""
    running = loop.running_batch.reqs
    num_reqs = len(loop.waiting_queue) + len(running)
    if not count_tokens:
        return SchedulerLoad(dp_rank, num_reqs)
    num_tokens = sum(r.seqlen() for r in running) + sum(len(r.origin_input_ids) for r in loop.waiting_queue)
    return SchedulerLoad(dp_rank, num_reqs, num_tokens)


def run_pp_stage_process(server_args: ServerArgs, port_args: PortArgs, pipe: Any, tp_rank: int, pp_rank: int) -> None:
    """A pipeline stage after the first (managers/scheduler_pp.py): no sockets, it only hears
    from the stage before. A receive that fails (a dead neighbour) or times out exits non-zero."""
    configure_process_logging(server_args, f"scheduler PP{pp_rank} TP{tp_rank}")
    try:
        from radixserve.hf_transformers_utils import resolve_model_path
        from radixserve.managers.scheduler_pp import PPStage
        from radixserve.models.model_config import ModelConfig

        stage = PPStage(server_args, ModelConfig.from_pretrained(resolve_model_path(server_args)), tp_rank, pp_rank)
    except Exception as e:
        pipe.send({"status": "error", "error": str(e) if type(e).__name__ == "LoadError" else traceback.format_exc()})
        raise SystemExit(1)
    leave_stop_signals_to_launcher()  # from now on SIGTERM / SIGINT are the launcher's
    pipe.send({"status": "ready", "pid": os.getpid(), "tp_rank": tp_rank, "pp_rank": pp_rank})
    logger.info("Pipeline stage %d ready (pid %d): layers %s", pp_rank, os.getpid(), stage.layer_range)
    try:
        stage.run()
        stage.shutdown()
    except Exception:
        logger.error("Pipeline stage %d hit an exception:\n%s", pp_rank, traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
