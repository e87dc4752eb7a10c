"""Launching the served runtime (seed 004's process diagram):

    main process:  uvicorn + FastAPI + TokenizerManager (asyncio)
    child 1:       Scheduler (model, KV pools)       run_scheduler_process
    child 2:       Detokenizer                       run_detokenizer_process

Children are started with the "spawn" method and report ready through a pipe (the scheduler
sends its pool sizes); only then is the HTTP port opened. A watcher thread waits on the
children: if one dies, the server logs which and why, fails the requests in flight, and
exits non-zero. The ZeroMQ ipc sockets live in a private temporary directory that is removed
on every exit path the launcher lives to see.

Signals: SIGTERM and SIGINT are the main process's alone, whether sent to it or to the whole
process group (systemd's KillMode=control-group, `kill -TERM -PGID`, Ctrl-C): the children
ignore them (managers/process_utils.py). SIGTERM drains (new requests get 503, the running ones
get up to --graceful-shutdown-timeout), SIGINT or a second SIGTERM stops at once; either way
the launcher then stops the children in order (Runtime.stop) and exits 0. A child that ignores
SIGTERM still never outlives the launcher: the kernel kills it when the launcher exits.
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait
from typing import Any, Dict, List, Optional, Tuple

from radixserve.server_args import PortArgs, ServerArgs

logger = logging.getLogger("radixserve.launch")

STARTUP_TIMEOUT = 600.0  # s for the children to load the model and size the pools
CHILD_STOP_TIMEOUT = 5.0
HARD_EXIT_AFTER_CHILD_DEATH = 8.0  # s for a graceful stop before the process exits anyway


class LaunchError(RuntimeError):
    pass


@dataclass
class Runtime:
    """The children of one server and where they listen."""

    server_args: ServerArgs
    port_args: PortArgs
    procs: Dict[str, Any] = field(default_factory=dict)
    ready_info: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    stopping: bool = False
    tokenizer: Any = None  # loaded once here, for the TokenizerManager (None on other nodes, or without one)

    def stop(self) -> None:
        """Stop the children in order and remove the socket directory. The children ignore
        SIGTERM (it is the launcher's), so a stop is SIGKILL: what SIGTERM's default action did
        before, as no child has state to save."""
        self.stopping = True
        for stage in self.stop_order():
            for proc in stage:
                if proc.is_alive():
                    proc.kill()
            for proc in stage:
                proc.join(CHILD_STOP_TIMEOUT)
        shutil.rmtree(self.port_args.ipc_dir, ignore_errors=True)

    def stop_order(self) -> List[List[Any]]:
        """Front to back along a request's path: the DP controller (no more routing), then every
        scheduler rank at once (they run collectives in lockstep; a rank left alone would fail in
        one and log it), then the detokenizer, then anything else."""
        def stage(name: str) -> int:
            if name == "dp_controller":
                return 0
            if name.startswith("scheduler"):  # "scheduler", "scheduler_tp1", "scheduler_dp1_tp0", ...
                return 1
            return 2 if name == "detokenizer" else 3

        stages: Dict[int, List[Any]] = {}
        for name, proc in self.procs.items():
            stages.setdefault(stage(name), []).append(proc)
        return [stages[k] for k in sorted(stages)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise LaunchError(f"Cannot bind {host}:{port}: {e.strerror or e}. Choose another --port.") from None


def launch_subprocesses(server_args: ServerArgs, should_abort: Any = lambda: False) -> Runtime:
    """Spawn the scheduler and the detokenizer and wait until both are ready."""
    from radixserve.managers.detokenizer import run_detokenizer_process
    from radixserve.managers.scheduler_process import run_scheduler_process

    if server_args.null_worker:  # issue 57: every rank gets the null worker in place of the model
        from radixserve.sim.null_worker import NullModelWorker

        run_scheduler_process = functools.partial(run_scheduler_process, make_worker=NullModelWorker)
    rt = Runtime(server_args, PortArgs.init_new())
    logger.info("IPC sockets in %s", rt.port_args.ipc_dir)
    ctx = mp.get_context("spawn")
    children = []  # (name, target, server_args, extra args)
    # --pp-size: pp x tp ranks, global rank = pp_rank * tp_size + tp_rank (SGLang's order)
    tp, pp = server_args.tp_size, server_args.pp_size
    ranks_per_node = tp * pp // server_args.nnodes
    local_ranks = range(server_args.node_rank * ranks_per_node, (server_args.node_rank + 1) * ranks_per_node)
    for dp in range(server_args.dp_size):
        group_args = server_args
        if tp * pp > 1 and (not server_args.dist_init_addr or server_args.dp_size > 1):
            # one rendezvous address per TP group (each rank would otherwise pick its own)
            group_args = server_args.replace(dist_init_addr=f"127.0.0.1:{_free_port()}")
        for g in local_ranks:
            r = g % tp
            # "scheduler" is the first group's rank 0; the others are "scheduler_dp1_tp0", "scheduler_pp1_tp0"...
            name = "scheduler" if dp == 0 and g == 0 else "scheduler" + (f"_dp{dp}" if server_args.dp_size > 1 else "") + (
                f"_pp{g // tp}" if pp > 1 else "") + f"_tp{r}"
            extra = (r, dp) if server_args.dp_size > 1 else (r, None, g // tp) if pp > 1 else (r,)
            children.append((name, run_scheduler_process, group_args, extra))
    if server_args.dp_size > 1:
        from radixserve.managers.dp_controller import run_data_parallel_controller_process

        children.append(("dp_controller", run_data_parallel_controller_process, server_args, ()))
    try:
        _start(ctx, rt, children, should_abort)
        if server_args.node_rank == 0:
            # After the schedulers are up (a model that cannot load says so first, in its own
            # words): the tokenizer, loaded once here for the TokenizerManager, and the
            # detokenizer, given a decoder made from it so it imports neither transformers nor torch.
            rt.tokenizer = _load_tokenizer(server_args)
            _start(ctx, rt, [("detokenizer", run_detokenizer_process, server_args, (_text_decoder(rt.tokenizer),))],
                   should_abort)
    except BaseException:
        rt.stop()
        raise
    return rt


def _start(ctx: Any, rt: Runtime, children: List[Tuple[str, Any, ServerArgs, tuple]], should_abort: Any) -> None:
    """Spawn the children and wait until each says it is ready."""
    pipes = {}
    for name, target, child_args, extra in children:
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=target, args=(child_args, rt.port_args, writer, *extra), name=f"radixserve-{name}")
        proc.start()
        writer.close()
        rt.procs[name], pipes[name] = proc, reader
    _wait_ready(rt, pipes, should_abort)


def _load_tokenizer(server_args: ServerArgs) -> Any:
    from radixserve.hf_transformers_utils import get_tokenizer

    try:
        return get_tokenizer(server_args)
    except Exception as e:  # LoadError: its one line; anything else: what it was
        raise LaunchError(str(e) if type(e).__name__ == "LoadError" else f"Loading the tokenizer failed: {e!r}") from None


def _text_decoder(tokenizer: Any) -> Any:
    """The detokenizer's TextDecoder, or None (no tokenizer, or none could be made: the
    detokenizer then loads the tokenizer with transformers)."""
    from radixserve.managers.text_decoder import text_decoder_of

    if tokenizer is None:
        return None
    try:
        return text_decoder_of(tokenizer)
    except Exception:
        logger.warning("No TextDecoder for this tokenizer; the detokenizer loads it with transformers", exc_info=True)
        return None


def _wait_ready(rt: Runtime, pipes: Dict[str, Any], should_abort: Any) -> None:
    import time

    deadline = time.monotonic() + STARTUP_TIMEOUT
    pending = dict(pipes)
    while pending:
        if should_abort():
            raise LaunchError("Interrupted during startup.")
        if time.monotonic() > deadline:
            raise LaunchError(f"The {', '.join(pending)} process(es) did not become ready in {STARTUP_TIMEOUT:.0f} s.")
        waitables = list(pending.values()) + [rt.procs[n].sentinel for n in pending]
        ready = mp_wait(waitables, timeout=0.5)
        for name, reader in list(pending.items()):
            proc = rt.procs[name]
            if reader in ready:
                try:
                    msg = reader.recv()
                except EOFError:
                    msg = None
                if not msg or msg.get("status") != "ready":
                    proc.join(2)
                    detail = (msg or {}).get("error", "").rstrip()
                    raise LaunchError(
                        f"The {name} process failed to start (exit code {proc.exitcode})." + (f"\n{detail}" if detail else "")
                    )
                rt.ready_info[name] = msg
                del pending[name]
            elif proc.sentinel in ready:
                proc.join(1)
                raise LaunchError(f"The {name} process died during startup (exit code {proc.exitcode}).")


def watch_children(rt: Runtime, on_death: Any) -> threading.Thread:
    """Call on_death(message) when a child exits while the server is not stopping."""

    def loop() -> None:
        sentinels = {p.sentinel: name for name, p in rt.procs.items()}
        ready = mp_wait(list(sentinels))
        if rt.stopping:
            return
        # The sentinel closes while the child is still exiting: join (not is_alive) for its code.
        name = sentinels[ready[0]]
        proc = rt.procs[name]
        proc.join(5)
        code = proc.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        on_death(f"The {name} process (pid {proc.pid}) died unexpectedly ({how}); the server is shutting down.")

    t = threading.Thread(target=loop, name="child-watch", daemon=True)
    t.start()
    return t


def _serve_follower_node(rt: Runtime, stop_requested: threading.Event) -> int:
    """Nodes other than 0 only run their TP ranks (rank 0 on node 0 talks to the world);
    they exit with the first rank that dies, or on SIGINT / SIGTERM."""
    logger.info("Node %d: TP ranks running; serving happens on node 0.", rt.server_args.node_rank)
    dead = threading.Event()
    watch_children(rt, lambda message: (logger.error("%s", message), dead.set()))
    while not stop_requested.is_set() and not dead.is_set():
        stop_requested.wait(0.5)
    return 1 if dead.is_set() else 0


def configure_logging(server_args: ServerArgs) -> None:
    logging.basicConfig(
        level=getattr(logging, server_args.log_level.upper(), logging.INFO),
        format="[%(asctime)s] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        force=True,
    )


def _uvicorn_server_class() -> Any:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's Server, but the first SIGTERM starts our drain instead of stopping at once
        (a second SIGTERM, or SIGINT, stops at once as usual)."""

        def __init__(self, config: Any, on_sigterm: Any):
            super().__init__(config)
            self.on_sigterm = on_sigterm

        def handle_exit(self, sig: int, frame: Any) -> None:
            if sig == signal.SIGTERM and self.on_sigterm is not None and not self.should_exit:
                start_drain, self.on_sigterm = self.on_sigterm, None
                start_drain()
            else:
                super().handle_exit(sig, frame)

    return DrainingServer


def http_stack() -> Tuple[str, str]:
    """uvicorn's (loop, http): uvloop and httptools, an event loop and an HTTP parser in C, as
    SGLang's server runs (dependencies: issue 57 measured the pure-Python h11 and asyncio path as
    a large part of the HTTP process's time per streamed chunk); asyncio and h11 where either is
    missing (uvloop has no Windows build), with a warning."""
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    try:
        import httptools  # noqa: F401

        http = "httptools"
    except ImportError:
        http = "h11"
    if (loop, http) != ("uvloop", "httptools"):
        logger.warning("HTTP server on %s + %s: install uvloop and httptools (radixserve's dependencies) "
                       "for less CPU per streamed token.", loop, http)
    return loop, http


def uvicorn_config(app: Any, server_args: ServerArgs) -> Any:
    import uvicorn

    loop, http = http_stack()
    return uvicorn.Config(
        app, host=server_args.host, port=server_args.port, log_level=server_args.log_level.lower(),
        timeout_keep_alive=5, timeout_graceful_shutdown=3, lifespan="on", loop=loop, http=http,
    )


def _start_warmup(server_args: ServerArgs, server: Any, tm: Any, state: Dict[str, Any], stopping: Any) -> threading.Thread:
    """SGLang's warm-up thread (entrypoints/warmup.py): once uvicorn listens, one short request
    through the HTTP path; /health is 503 until it is answered. If it fails, the server stops
    with exit code 1."""
    from radixserve.entrypoints.warmup import wait_and_warmup

    def on_failure(message: str) -> None:
        logger.error("%s", message)
        state["exit_code"] = 1
        server.should_exit = True

    t = threading.Thread(target=wait_and_warmup, args=(server_args, tm, lambda: server.started, stopping, on_failure),
                         name="warmup", daemon=True)
    t.start()
    return t


def launch_server(server_args: ServerArgs) -> int:
    """Run the server until SIGINT / SIGTERM (exit code 0) or a child's death (1)."""
    DrainingServer = _uvicorn_server_class()
    from radixserve.entrypoints.http_server import create_app
    from radixserve.managers.tokenizer_manager import TokenizerManager

    configure_logging(server_args)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints every stack
    check_port_free(server_args.host, server_args.port)

    stop_requested = threading.Event()
    state: Dict[str, Any] = {"exit_code": 0, "server": None}

    def on_signal(signum: int, frame: Any) -> None:  # until uvicorn runs (it has its own then)
        stop_requested.set()
        if state["server"] is not None:
            state["server"].should_exit = True

    def drain_then_stop(server: Any, tm: Any) -> None:
        """SIGTERM: /health and new requests get 503; requests in flight get up to
        --graceful-shutdown-timeout to finish; then the server stops (exit code 0)."""
        tm.start_draining()
        deadline = time.monotonic() + server_args.graceful_shutdown_timeout
        logger.info("SIGTERM: draining %d request(s) in flight (up to %gs).", tm.num_in_flight(),
                    server_args.graceful_shutdown_timeout)
        while tm.num_in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        if tm.num_in_flight():
            logger.warning("Graceful shutdown timeout: %d request(s) still running are cut off.", tm.num_in_flight())
            # each gets a 503 (an error event, then [DONE], when streamed), not a cut connection
            tm.fail_all(f"The server shut down before this request finished "
                        f"(--graceful-shutdown-timeout {server_args.graceful_shutdown_timeout:g}s).",
                        status_code=503, err_type="ServiceUnavailable")
        server.should_exit = True

    old_handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    rt: Optional[Runtime] = None
    try:
        try:
            rt = launch_subprocesses(server_args, should_abort=stop_requested.is_set)
        except LaunchError as e:
            if stop_requested.is_set():
                return 0
            logger.error("%s", e)
            return 1
        if server_args.node_rank > 0:
            return _serve_follower_node(rt, stop_requested)
        sched = rt.ready_info["scheduler"]
        logger.info(
            "Scheduler ready (pid %s): max_total_num_tokens=%d, max_running_requests=%d, context_len=%d, device=%s",
            sched["pid"], sched["max_total_num_tokens"], sched["max_running_requests"], sched["context_len"], sched["device"],
        )
        tm = TokenizerManager(server_args, rt.port_args, sched, rt.tokenizer)
        app = create_app(tm)
        config = uvicorn_config(app, server_args)
        server = DrainingServer(config, on_sigterm=lambda: threading.Thread(
            target=drain_then_stop, args=(server, tm), daemon=True).start())
        state["server"] = server

        def on_child_death(message: str) -> None:
            logger.error("%s", message)
            state["exit_code"] = 1
            tm.fail_all(message)
            server.should_exit = True

            def hard_exit() -> None:  # the graceful stop hung: go anyway, leaving nothing behind
                logger.error("Graceful shutdown timed out; exiting.")
                rt.stop()
                os._exit(1)

            timer = threading.Timer(HARD_EXIT_AFTER_CHILD_DEATH, hard_exit)
            timer.daemon = True
            timer.start()

        watch_children(rt, on_child_death)
        if stop_requested.is_set():
            return 0
        logger.info("Serving %s on http://%s:%d", tm.served_model_name, server_args.host, server_args.port)
        run_ended = threading.Event()
        _start_warmup(server_args, server, tm, state, stopping=lambda: (
            run_ended.is_set() or server.should_exit or stop_requested.is_set() or tm.draining or tm.dead_reason is not None))
        try:
            server.run()
        except SystemExit as e:  # uvicorn exits when it cannot start (port taken meanwhile)
            if e.code:
                state["exit_code"] = 1
        finally:
            run_ended.set()
        if not server.started and state["exit_code"] == 0 and not stop_requested.is_set():
            state["exit_code"] = 1
        return state["exit_code"]
    finally:
        if rt is not None:
            rt.stop()
            logger.info("Shut down (exit code %d).", state["exit_code"])
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
