"""The scheduler watchdog (seed 001 §30), on a stand-in scheduler: no process needed."""

from __future__ import annotations

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


def test_watchdog_fires_when_work_makes_no_progress(capfd):
    fired = threading.Event()
    wd = Watchdog(StuckScheduler(), timeout=0.3, on_timeout=fired.set, period=0.05)
    stop = wd.start()
    assert fired.wait(5)
    stop.set()
    assert "Watchdog timeout" in capfd.readouterr().err or wd.fired


def test_watchdog_quiet_when_idle():
    fired = threading.Event()
    stop = Watchdog(IdleScheduler(), timeout=0.2, on_timeout=fired.set, period=0.05).start()
    time.sleep(0.6)
    stop.set()
    assert not fired.is_set()
