"""radixserve: a readable SGLang-style LLM serving engine."""

# The OpenMP threads' wait policy, first (before anything imports torch): omp_wait.py.
from radixserve.omp_wait import LIBGOMP_WAIT_SHORT, OMP_SPINCOUNT  # noqa: F401

__version__ = "0.1.0"


def __getattr__(name: str):
    """`radixserve.Engine`, as `sglang.Engine`: imported on first use, so `import radixserve`
    stays light (no torch) for the CLI's argument parsing."""
    if name == "Engine":
        from radixserve.engine import Engine

        return Engine
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
