"""A ready child of the served runtime (managers/process_utils) leaves SIGTERM and SIGINT to
its launcher, yet never outlives it: the kernel kills it when the launcher is gone,
even while it is stopped and no thread of its own could notice (issue 58)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from radixserve.managers.process_utils import become_server_child, leave_stop_signals_to_launcher

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _child(conn) -> None:
    become_server_child(None)
    leave_stop_signals_to_launcher()  # as every child does once it is ready
    conn.send(os.getpid())
    while True:
        conn.send(conn.recv())  # echo: proof of life


def _launcher(conn) -> None:
    child = mp.get_context("spawn").Process(target=_child, args=(conn,))
    child.start()
    child.join()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except (OSError, IndexError):
        return False


def test_child_ignores_stop_signals_and_dies_with_its_launcher():
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    launcher = ctx.Process(target=_launcher, args=(theirs,))
    launcher.start()
    child = None
    try:
        assert ours.poll(120), "the child did not start"
        child = ours.recv()
        os.kill(child, signal.SIGTERM)
        os.kill(child, signal.SIGINT)
        # A signal pending before the ping is delivered before the child's read of it returns:
        # an answer means both were taken and ignored.
        ours.send("ping")
        assert ours.poll(60) and ours.recv() == "ping"
        os.kill(child, signal.SIGSTOP)  # frozen: its parent-watch thread cannot run now
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.join(30)
        deadline = time.monotonic() + 30  # a deadline only: the kernel kills it at once
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the child outlived its launcher"
    finally:
        if launcher.is_alive():
            launcher.kill()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
