"""Shared by the tests that start several ranks as processes (tensor / pipeline parallelism, weight
updates): a free local port, and a group of processes run to the end, each one required to exit 0,
none left behind."""

from __future__ import annotations

import random
import socket
from typing import Sequence


def free_port() -> int:
    """A local port nothing listens on, below Linux's ephemeral range (32768-60999). A port the
    kernel picks for a bind to 0 can be handed out again to another socket (a gloo connection of
    the very server about to listen there) before the server binds it: CI saw "address already in
    use" that way."""
    for _ in range(1000):
        port = random.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def run_processes(procs: Sequence, timeout: float = 240) -> None:
    """Start every process, wait for each (at most `timeout` s), assert it exited 0; kill what is
    still alive on the way out (a hung rank must not outlive the test)."""
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=timeout)
            assert p.exitcode == 0, (p.name, p.exitcode)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
