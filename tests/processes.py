"""Shared by the tests that start several ranks as processes (tensor / pipeline parallelism, weight
updates): a free local port, and a group of processes run to the end, each one required to exit 0,
none left behind."""

from __future__ import annotations

import socket
from typing import Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
