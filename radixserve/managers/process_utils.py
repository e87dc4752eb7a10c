"""What every child process of the served runtime does first (scheduler ranks, pipeline stages,
detokenizer, DataParallelController): set up its log lines, leave SIGTERM / SIGINT to the
launcher, and never outlive it.

Why children ignore SIGTERM and SIGINT: a service manager stops a service by signalling every
process in it at once (systemd's KillMode=control-group, `kill -TERM -PGID`, Ctrl-C to the
terminal's foreground group). The launcher answers SIGTERM with a drain (requests in flight
finish, up to --graceful-shutdown-timeout) and then stops its children in order; a child that
died of the same signal at once would end that drain in a crash (a child ignores them once it
is ready; during startup a SIGTERM aborts the startup anyway). Ignoring a signal is safe only
because of the second half: the kernel kills a child the moment its launcher is gone
(PR_SET_PDEATHSIG), and a thread checks for that too where the kernel cannot."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import threading
import time
from typing import Optional

from radixserve.server_args import ServerArgs

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def configure_process_logging(server_args: ServerArgs, tag: str) -> None:
    logging.basicConfig(
        level=getattr(logging, server_args.log_level.upper(), logging.INFO),
        format=f"[%(asctime)s {tag}] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        force=True,
    )


def leave_stop_signals_to_launcher() -> None:
    """Called just before a child reports ready: from then on SIGTERM and SIGINT sent to the whole
    process group are the launcher's to handle (it drains, then stops us with SIGKILL).

    Not earlier: a SIGTERM during startup aborts the startup anyway (the launcher exits 0), and an
    ignored signal is inherited by every program a child runs meanwhile (on a first start, the C++
    kernels' compilers, for minutes); with the default action they stop with it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def launcher_pid() -> int:
    """The launcher's pid as it spawned us (multiprocessing records it before the child exists),
    not os.getppid() now: a launcher already gone would make that init's pid."""
    parent = mp.parent_process()
    return parent.pid if parent is not None and parent.pid is not None else os.getppid()


def set_parent_death_signal(sig: int) -> bool:
    """Linux: the kernel sends `sig` to this process when its parent exits, whatever this process
    is doing (blocked in C, stopped, ignoring SIGTERM). False where prctl is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_launcher(parent_pid: int, ipc_dir: Optional[str] = None) -> None:
    """Never outlive the launcher: SIGKILL from the kernel when it exits (Linux), and a thread
    that exits within a second of it otherwise (removing the socket directory it left)."""
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:  # it was gone before the death signal was armed
        _exit_orphaned(ipc_dir)
    watch_parent(parent_pid, ipc_dir)


def become_server_child(ipc_dir: Optional[str]) -> None:
    """The first call of every child's entry point (leave_stop_signals_to_launcher comes once it is
    ready). Ctrl-C is the launcher's from the start: a KeyboardInterrupt here would only print a
    traceback, the launcher stops us anyway."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_launcher(launcher_pid(), ipc_dir)


def _exit_orphaned(ipc_dir: Optional[str]) -> None:
    if ipc_dir:
        shutil.rmtree(ipc_dir, ignore_errors=True)
    os._exit(1)


def watch_parent(parent_pid: int, ipc_dir: Optional[str] = None, interval: float = 1.0) -> None:
    """Exit when the launching process is gone (the fallback where the kernel's parent-death
    signal is not available): never an orphan, and the socket directory goes too."""

    def loop() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent_pid:
                _exit_orphaned(ipc_dir)

    threading.Thread(target=loop, name="parent-watch", daemon=True).start()
