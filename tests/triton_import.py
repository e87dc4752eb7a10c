"""Import triton, if anything will, the way the CPU's Triton tests need it: with TRITON_INTERPRET
set while triton.language is first imported. Triton's own @triton.jit helpers (tl.sum, tl.cdiv,
...) become interpreted functions only if the variable is set then, and a kernel interpreted on
the CPU (tests/unit's Triton modules) cannot call compiled ones ("Cannot call @triton.jit'd
outside of the scope of a kernel"). Reference test modules import transformers models whose
modeling imports triton (Qwen3.5's), at collection, before the unit modules set the variable.
Not on a GPU run (RADIXSERVE_TEST_DEVICE=cuda): there the kernels are compiled. Not named test_*."""

import os
import sys


def import_triton_interpreted() -> None:
    if os.environ.get("RADIXSERVE_TEST_DEVICE", "").strip().lower() == "cuda" or "triton" in sys.modules:
        return
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    except ImportError:  # no triton: nothing to get wrong
        pass
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before
