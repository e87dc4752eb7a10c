"""The scheduler watchdog (seed 001 §30): on a stand-in scheduler (no process needed), then on a
real server whose scheduler hangs: the watchdog ends the server, loudly, with exit code 1."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

from conftest import ServerProcess, assert_children_gone, stream_in_background
from radixserve.managers.scheduler_pause import expects_progress
from radixserve.managers.scheduler_process import Watchdog


class StuckScheduler:
    forward_ct = 7

    def __init__(self) -> None:
        self.checks = 0  # how often the watchdog looked

    def has_work(self) -> bool:
        self.checks += 1
        return True


class IdleScheduler(StuckScheduler):
    def has_work(self) -> bool:
        super().has_work()
        return False


class ProgressingScheduler(StuckScheduler):
    """Has work all along and makes progress between any two checks."""

    def has_work(self) -> bool:
        super().has_work()
        self.forward_ct += 1
        return True


def watchdog_of(sched: StuckScheduler, **kwargs) -> Watchdog:
    return Watchdog(lambda: sched.forward_ct, lambda: expects_progress(sched.has_work(), None), **kwargs)


def checks_made(sched: StuckScheduler, n: int, timeout: float = 60) -> None:
    """Until the watchdog has looked at `sched` n times (events, not a sleep: a busy machine
    only makes this slower)."""
    deadline = time.monotonic() + timeout
    while sched.checks < n:
        assert time.monotonic() < deadline, f"the watchdog made {sched.checks} checks, not {n}"
        time.sleep(0.01)


def test_watchdog_fires_when_work_makes_no_progress(capfd, caplog):
    """No progress with work waiting: the error is logged, every thread's stack is dumped to
    stderr, then the callback runs (in this order, so once `fired` is set both are there)."""
    fired = threading.Event()
    wd = watchdog_of(StuckScheduler(), timeout=0.3, on_timeout=fired.set, period=0.05)
    with caplog.at_level(logging.ERROR, logger="radixserve.scheduler"):
        stop = wd.start()
        assert fired.wait(60)  # a deadline only
        stop.set()
    assert wd.fired
    messages = [r.getMessage() for r in caplog.records if r.name == "radixserve.scheduler"]
    assert any("Watchdog timeout" in m and "no forward progress" in m for m in messages), messages
    err = capfd.readouterr().err
    # faulthandler's dump of all threads: the watchdog thread itself is in it
    assert "(most recent call first)" in err and "in check_forever" in err, err[-2000:]


def test_watchdog_quiet_when_idle_or_progressing():
    """Checks covering several timeouts (0.2 s each, a check every 0.05 s) of an idle scheduler,
    and of a busy one that progresses: no firing."""
    for sched in (IdleScheduler(), ProgressingScheduler()):
        fired = threading.Event()
        wd = watchdog_of(sched, timeout=0.2, on_timeout=fired.set, period=0.05)
        start = time.monotonic()
        stop = wd.start()
        checks_made(sched, 20)  # 20 checks: at least 1 s, five timeouts
        while time.monotonic() - start < 5 * wd.timeout:
            time.sleep(0.05)
        stop.set()
        assert not fired.is_set() and not wd.fired, type(sched).__name__


# ---- a real server -------------------------------------------------------------------------------
WATCHDOG_TIMEOUT = 3.0


def test_watchdog_ends_a_server_whose_scheduler_hangs():
    """--tp-size 2: TP rank 1 is stopped (SIGSTOP) while a request decodes, so rank 0 waits in a
    collective that never completes: work, no progress. Rank 0's watchdog dumps the stacks and
    exits 1; the server then fails the request and exits 1, in that order, within a deadline."""
    srv = ServerProcess("--tp-size", "2", "--max-total-tokens", "2000",
                        "--watchdog-timeout", str(WATCHDOG_TIMEOUT), "--grammar-timeout", "1")
    rank1 = srv.tp_rank_pid(1)
    try:
        with srv.client() as c:
            rank0 = c.get("/get_server_info").json()["scheduler_pid"]
        thread, events = stream_in_background(
            srv, {"text": "hang", "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}})
        deadline = time.monotonic() + 60
        while len(events) < 3:  # it is decoding
            assert thread.is_alive() and time.monotonic() < deadline, events
            time.sleep(0.05)
        os.kill(rank1, signal.SIGSTOP)
        stopped = time.monotonic()
        code = srv.proc.wait(timeout=120)  # a deadline only: the watchdog waits 3 s
        took = time.monotonic() - stopped
        thread.join(30)
        log = srv.read_log()
        assert code == 1, log[-3000:]
        assert took >= WATCHDOG_TIMEOUT / 2  # it waited for its timeout (rank 0 made no progress since the stop)
        # in this order: the watchdog's error, the stacks, the launcher seeing rank 0 exit 1, the shutdown
        fired = log.index("scheduler TP0] Watchdog timeout: the scheduler has work but made no forward progress for 3 s")
        stacks = log.index("(most recent call first)", fired)
        died = log.index(f"The scheduler process (pid {rank0}) died unexpectedly (exit code 1)", stacks)
        log.index("Shut down (exit code 1).", died)
        # the request in flight ends with an error naming the cause, then [DONE]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "died unexpectedly" in error["message"], error
        assert_children_gone(srv.children)  # the stopped rank too: the server killed it
    finally:
        if srv.proc.poll() is None:
            srv.stop(signal.SIGKILL)
        try:
            os.kill(rank1, signal.SIGKILL)  # a stopped rank left behind would never exit by itself
        except ProcessLookupError:
            pass
