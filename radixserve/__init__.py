"""radixserve: a readable SGLang-style LLM serving engine."""

import os as _os

# The OpenMP threads' wait policy (issue 54). A forward is hundreds of parallel regions, and at the
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
if _os.environ.get("RADIXSERVE_OMP_DEFAULTS", "1") != "0" and not (
        "OMP_WAIT_POLICY" in _os.environ or "GOMP_SPINCOUNT" in _os.environ):
    _os.environ["GOMP_SPINCOUNT"] = OMP_SPINCOUNT

__version__ = "0.1.0"


def __getattr__(name: str):
    """`radixserve.Engine`, as `sglang.Engine`: imported on first use, so `import radixserve`
    stays light (no torch) for the CLI's argument parsing."""
    if name == "Engine":
        from radixserve.engine import Engine

        return Engine
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
