"""The OpenMP threads' wait policy (issue 54), set at `import radixserve` before torch loads
libgomp (radixserve/__init__.py imports this module first; standard library only)."""

import os as _os
from typing import Mapping

# A forward is hundreds of parallel regions, and at the
# end of each a thread that finished its share waits for the others: libgomp's default spins
# 300000 pause instructions first (~8 ms on Zen 3) and only then sleeps. When another process
# takes a core, the thread that waits spins on the core the late thread needs, region after
# region: a 2-core machine with one busy process ran a prompt ~6x slower than quiet (llama.cpp
# ~2.5x). A short spin keeps what spinning is for (a thread catches the next region, microseconds
# later, without a futex wake-up) and gives the core up soon when the others are late.
# OMP_WAIT_POLICY=PASSIVE (no spin) made a served decode step 1.5x slower on a quiet machine
# (benchmarks/NOTES.md), ACTIVE (spin for minutes) 4x. Measured: benchmarks/cpu/contention*.json.
# libgomp reads these when torch loads it, so this is set at import, before torch, and the
# engine's processes (spawned) inherit it. A user's OMP_WAIT_POLICY / GOMP_SPINCOUNT applies
# instead; RADIXSERVE_OMP_DEFAULTS=0 sets nothing.
OMP_SPINCOUNT = "1000"
SHORT_SPIN_MAX = 10000  # a GOMP_SPINCOUNT up to this counts as short (contention*.json: 10000 still served)


def _libgomp_loaded() -> bool:
    """Whether libgomp is mapped into this process already (Linux; elsewhere: no)."""
    try:
        with open("/proc/self/maps") as f:
            return any("libgomp" in line for line in f)
    except OSError:
        return False


def _wait_is_short(env: Mapping[str, str]) -> bool:
    """Whether OpenMP settings in `env` make waiting threads give their core up soon."""
    if env.get("OMP_WAIT_POLICY", "").strip().lower() == "passive":
        return True
    spin = env.get("GOMP_SPINCOUNT", "").strip()
    return spin.isdigit() and int(spin) <= SHORT_SPIN_MAX


# Whether this process's libgomp waits briefly (the settings above reached it), or keeps its
# default spin: torch imported before radixserve, with neither variable set. The C++ kernels'
# worker pool needs the short wait (an OpenMP thread spinning for ms after each torch op holds the
# core the pool's worker needs: 185 vs 208 tok/s offline), so without it they divide their work on
# OpenMP's own threads (layers/cpu_kernels.py: leave_the_pool).
if "OMP_WAIT_POLICY" in _os.environ or "GOMP_SPINCOUNT" in _os.environ:  # the user's settings
    LIBGOMP_WAIT_SHORT = _wait_is_short(_os.environ)
elif _os.environ.get("RADIXSERVE_OMP_DEFAULTS", "1") == "0":  # opted out: libgomp's default spin
    LIBGOMP_WAIT_SHORT = False
else:
    LIBGOMP_WAIT_SHORT = not _libgomp_loaded()  # ours reaches a libgomp loaded later, and every child
    _os.environ["GOMP_SPINCOUNT"] = OMP_SPINCOUNT
