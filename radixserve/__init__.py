"""radixserve: a readable SGLang-style LLM serving engine."""

# OpenMP threads are left with libgomp's default wait policy (spin a little, then sleep). On a
# 2-core CPU the forward's threads must wake at once for each of a decode step's ~300 parallel
# regions: OMP_WAIT_POLICY=PASSIVE (sleep at once) made a served decode step 1.5x slower, ACTIVE
# (spin forever) 4x, by starving the server's other processes (benchmarks/NOTES.md).
# An OMP_WAIT_POLICY in the environment still applies.

__version__ = "0.1.0"


def __getattr__(name: str):
    """`radixserve.Engine`, as `sglang.Engine`: imported on first use, so `import radixserve`
    stays light (no torch) for the CLI's argument parsing."""
    if name == "Engine":
        from radixserve.engine import Engine

        return Engine
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
