"""Stopped the way service managers stop it (issue 58): systemd's default KillMode=control-group
and `kill -TERM -PGID` send SIGTERM to every process of the server at once. The children leave
it to the main process, which drains as for a SIGTERM to itself alone: a running 2000-token
stream goes on until it finishes or --graceful-shutdown-timeout runs out (then a 503 error
naming the flag ends it), the exit code is 0 and no process of the server is left. With
`--tp-size 2` and `--dp-size 2` too (more scheduler ranks, a DataParallelController). A long
timeout shows the stream finishing; a short one shows it cut."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import List, Optional, Set

import openai
import pytest

from conftest import ServerProcess, assert_children_gone

SHORT, LONG = 3, 600  # --graceful-shutdown-timeout: the stream is cut / it finishes
MAX_TOKENS = 2000


def process_group_members(pgid: int) -> Set[int]:
    """Every live (non-zombie) process in process group `pgid`, from /proc."""
    members = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # the fields after the parenthesised command: state, ppid, pgrp, ...
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.add(int(stat.parent.name))
    return members


class CompletionStream:
    """A streamed /v1/completions through the official client, read on a thread: the chunks as
    they arrive, and how it ended (a finish_reason, or the error the client raised)."""

    def __init__(self, srv: ServerProcess, model: str):
        self.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        self.model = model
        self.chunks: List[object] = []
        self.finish_reason: Optional[str] = None
        self.completion_tokens: Optional[int] = None
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        try:
            stream = self.client.completions.create(
                model=self.model, prompt="Keep streaming", max_tokens=MAX_TOKENS, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            for chunk in stream:
                self.chunks.append(chunk)
                if chunk.choices and chunk.choices[0].finish_reason:
                    self.finish_reason = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    self.completion_tokens = chunk.usage.completion_tokens
        except Exception as e:  # the 503 error event of a drain that ran out, or anything unexpected
            self.error = e

    def wait_for_chunks(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while len(self.chunks) < n:
            assert self.thread.is_alive(), (self.error, self.chunks[-1:])
            assert time.monotonic() < deadline, "the stream did not start"
            time.sleep(0.05)


@pytest.mark.parametrize("target, graceful_timeout, args", [
    ("group", LONG, ()),
    ("main", SHORT, ()),
    ("group", SHORT, ("--tp-size", "2")),
    ("group", SHORT, ("--dp-size", "2")),
], ids=["group_finishes", "main_only_cut", "group_tp2_cut", "group_dp2_cut"])
def test_sigterm_drains_the_stream_and_exits_0(target, graceful_timeout, args):
    srv = ServerProcess("--max-total-tokens", "3000", "--graceful-shutdown-timeout", str(graceful_timeout), *args,
                        start_new_session=True)
    pgid = srv.proc.pid
    try:
        assert os.getpgid(srv.proc.pid) == pgid
        members = process_group_members(pgid)
        assert set(srv.children) <= members and len(members) > 2, (members, srv.children)
        with srv.client() as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
        stream = CompletionStream(srv, model)
        stream.wait_for_chunks(3)
        at_signal = len(stream.chunks)
        if target == "group":
            os.killpg(pgid, signal.SIGTERM)  # what systemd and `kill -TERM -PGID` do
        else:
            srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(timeout=graceful_timeout + 120)  # a deadline only
        stream.thread.join(30)
        log = srv.read_log()
        assert code == 0, log[-3000:]
        assert "SIGTERM: draining 1 request(s) in flight" in log, log[-3000:]
        assert "died unexpectedly" not in log and "Traceback" not in log, log[-3000:]
        assert "Shut down (exit code 0)." in log
        # the stream went on after the signal, then finished or was cut by the drain's timeout
        assert len(stream.chunks) > at_signal, (at_signal, stream.error)
        if stream.error is None:  # it finished (the long drain; a short one on a fast machine too)
            assert stream.finish_reason == "length" and stream.completion_tokens == MAX_TOKENS
        else:
            assert graceful_timeout == SHORT, repr(stream.error)
            assert isinstance(stream.error, openai.APIError), repr(stream.error)
            assert "--graceful-shutdown-timeout" in str(stream.error), repr(stream.error)
            assert "Graceful shutdown timeout: 1 request(s) still running are cut off." in log
        # nothing of the server is left: not its children, nothing else in its process group
        assert_children_gone(sorted(members - {srv.proc.pid}))
        assert not process_group_members(pgid)
        assert srv.ipc_dir and not os.path.exists(srv.ipc_dir)
    finally:
        if srv.proc.poll() is None:
            srv.stop(signal.SIGKILL)
        for pid in process_group_members(pgid):  # a child the fix would have left behind
            os.kill(pid, signal.SIGKILL)
