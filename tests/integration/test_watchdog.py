"""The scheduler watchdog (seed 001 §30), on a stand-in scheduler: no process needed."""

from __future__ import annotations

import logging
import threading
import time

from radixserve.managers.scheduler_process import Watchdog


class StuckScheduler:
    forward_ct = 7

    def has_work(self) -> bool:
        return True


class IdleScheduler(StuckScheduler):
    def has_work(self) -> bool:
        return False


def test_watchdog_fires_when_work_makes_no_progress(capfd, caplog):
    """No progress with work waiting: the error is logged, every thread's stack is dumped to
    stderr, then the callback runs (in this order, so once `fired` is set both are there)."""
    fired = threading.Event()
    wd = Watchdog(StuckScheduler(), timeout=0.3, on_timeout=fired.set, period=0.05)
    with caplog.at_level(logging.ERROR, logger="radixserve.scheduler"):
        stop = wd.start()
        assert fired.wait(5)
        stop.set()
    assert wd.fired
    messages = [r.getMessage() for r in caplog.records if r.name == "radixserve.scheduler"]
    assert any("Watchdog timeout" in m and "no forward progress" in m for m in messages), messages
    err = capfd.readouterr().err
    # faulthandler's dump of all threads: the watchdog thread itself is in it
    assert "(most recent call first)" in err and "in check_forever" in err, err[-2000:]


def test_watchdog_quiet_when_idle():
    fired = threading.Event()
    stop = Watchdog(IdleScheduler(), timeout=0.2, on_timeout=fired.set, period=0.05).start()
    time.sleep(0.6)
    stop.set()
    assert not fired.is_set()
