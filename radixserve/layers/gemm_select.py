"""Kernels chosen by measurement (issue 54): which GEMM multiplies a matrix, decided by timing the
candidates on this machine, not by its CPU flags.

The same GGUF blocks can be multiplied three ways on a CPU (layers/quantization/gguf.py), the
first in two ways at decode sizes:

  int8         the C++ integer kernel: x quantized to 8 bits per block, integer dot products
               (AVX512-VNNI or AVX2), float32 sums; llama.cpp's numerics
  int8_fused   the same kernel (same bits) with its fused decode for up to 16 rows of x (AVX2:
               each block unpacked in registers per 4 rows of x, not once into L1 for all);
               which of the two wins at 5-16 rows depends on the shape and the CPU
  int8_i16     the same kernel with int16-sum tiles for 13+ rows of x (Q4_K, AVX2): a
               super-block's 8 products summed in int16 and scaled once, not 8 times (other
               float rounding of the same integers); fewer rows run int8's decode
  onednn_bf16  a tile of the blocks dequantized to bf16, x rounded to bf16, torch's oneDNN GEMM
  f32          a tile of the blocks dequantized to float32, torch's float32 GEMM (MKL / oneDNN)

Which is fastest depends on the machine far more than on its flags: the bf16 prefill path that
was 1.4x the integer kernel on one AVX512_BF16 Xeon was 0.6x float32 on another with the same
flags (oneDNN's bf16 GEMM at 168 GFLOPS against float32's 269), and on an AVX2-only CPU oneDNN
emulates bf16 at a tenth of float32's rate. So at start each distinct matrix shape (type, K, N)
is timed at a few row counts (ROW_BUCKETS: decode sizes and prefill sizes) on the model's own
weights, every candidate in turn, and a call with M rows takes the winner of the smallest bucket
>= M. The timings are cached per machine (CPU model, threads, kernel build) in
$RADIXSERVE_CACHE_DIR/gemm_select.json, so a restart measures nothing. `--cpu-gemm-path` forces
one path wherever a matrix can take it.

Every candidate sums in float32 and keeps the accuracy the issue asks for (the integer path is
llama.cpp's own; bf16 rounds x as llama.cpp's BF16 does; f32 is exact), so speed alone decides.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import platform
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

logger = logging.getLogger(__name__)

PATHS = ("int8", "int8_fused", "int8_i16", "onednn_bf16", "f32")
# Rows of x timed. A call with M rows takes the choice of the smallest bucket >= M (the last for more).
ROW_BUCKETS = (1, 8, 16, 64, 256)
TIMED_MAX_ROWS = 4096  # a matrix is timed on at most this many of its output rows (time ~ rows)
REPS = 3  # timed calls per candidate after one untimed; the best counts
GIVE_UP_RATIO = 3.0  # a candidate this much slower than the best so far after one call is not repeated


@dataclass(frozen=True)
class GemmShape:
    """A matrix as the kernels see it: its storage kind (a ggml type name) and [N, K]."""

    kind: str
    k: int
    n: int

    def key(self) -> str:
        return f"{self.kind}:{self.k}x{self.n}"


def bucket_index(rows: int) -> int:
    return min(bisect.bisect_left(ROW_BUCKETS, rows), len(ROW_BUCKETS) - 1)


@dataclass
class GemmPlan:
    """The path per (shape, row bucket). `forced`: --cpu-gemm-path other than auto."""

    choices: Dict[Tuple[GemmShape, int], str] = field(default_factory=dict)
    forced: Optional[str] = None

    def path(self, shape: GemmShape, rows: int, available: Sequence[str]) -> str:
        """The path for a call of `rows` rows; a shape never measured takes the first available."""
        if self.forced in available:
            return self.forced
        choice = self.choices.get((shape, bucket_index(rows)))
        return choice if choice in available else available[0]


# One plan per process: the model runner sets it after loading (select_paths); the kernels read it.
_plan = GemmPlan()


def current_plan() -> GemmPlan:
    return _plan


def set_plan(plan: GemmPlan) -> None:
    global _plan
    _plan = plan


# ---- measuring ----------------------------------------------------------------------------------

# (path, call, give_up_s) -> seconds one call takes; give_up_s: a first timed call slower than this
# may stop the timing there (the candidate has lost anyway)
Timer = Callable[[str, Callable[[], object], float], float]


def best_time(path: str, call: Callable[[], object], give_up_s: float = float("inf")) -> float:
    """One untimed call (first-use costs), then the best of REPS timed ones."""
    call()
    best = float("inf")
    for _ in range(REPS):
        t = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t)
        if best > give_up_s:
            break
    return best


def measure(candidates: Mapping[str, Callable[[], object]], timer: Timer) -> Dict[str, float]:
    """Seconds per call of each candidate, in turn. One far slower than the best so far (the bf16
    path emulated on an AVX2 CPU costs ~10x) is timed once, not REPS times."""
    times: Dict[str, float] = {}
    for path, call in candidates.items():
        limit = GIVE_UP_RATIO * min(times.values()) if times else float("inf")
        times[path] = timer(path, call, limit)
    return times


# ---- the cache ----------------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


TIMING = "streamed"  # how the candidates are timed (gguf.gemm_candidates); a new way retires old timings


def machine_key(build: str) -> str:
    """What a timing depends on besides the shape: the CPU, the threads, the kernels, torch, and
    how it was timed."""
    return f"{cpu_model()}|threads={torch.get_num_threads()}|{build}|torch={torch.__version__}|{TIMING}"


def cache_path() -> Path:
    root = os.environ.get("RADIXSERVE_CACHE_DIR") or Path.home() / ".cache" / "radixserve"
    return Path(root) / "gemm_select.json"


def load_cache(path: Path) -> Dict[str, Dict[str, float]]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def save_cache(path: Path, entries: Dict[str, Dict[str, float]]) -> None:
    """Merged with what another process wrote meanwhile; replaced atomically (never half-written)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = {**load_cache(path), **entries}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".gemm_select.")
        with os.fdopen(fd, "w") as f:
            json.dump(merged, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: measure again next time
        logger.warning("could not cache the GEMM timings in %s: %s", path, e)


# ---- choosing -----------------------------------------------------------------------------------

# (shape, rows) -> {path: a call of that path on x of `rows` rows}
CandidateFactory = Callable[[GemmShape, int], Dict[str, Callable[[], object]]]


@dataclass
class Selection:
    plan: GemmPlan
    times: Dict[Tuple[GemmShape, int], Dict[str, float]]
    measured_s: float  # time spent measuring now (0: all from the cache)


def select_paths(shapes: Iterable[GemmShape], candidates: CandidateFactory, build: str,
                 forced: Optional[str] = None, timer: Timer = best_time,
                 cache: Optional[Path] = None) -> Selection:
    """Time every candidate path of every shape at every row bucket (or read the cached times) and
    choose the fastest; the plan answers GemmPlan.path at run time."""
    plan = GemmPlan(forced=forced if forced not in (None, "auto") else None)
    entries = load_cache(cache) if cache is not None else {}
    prefix = machine_key(build)
    new: Dict[str, Dict[str, float]] = {}
    times: Dict[Tuple[GemmShape, int], Dict[str, float]] = {}
    t0 = time.perf_counter()
    for shape in sorted(set(shapes), key=lambda s: (s.kind, s.k, s.n)):
        for b, rows in enumerate(ROW_BUCKETS):
            key = f"{prefix}|{shape.key()}|rows={rows}"
            measured = entries.get(key)
            if measured is None:
                calls = candidates(shape, rows)
                if len(calls) < 2:  # nothing to choose between
                    continue
                measured = measure(calls, timer)
                new[key] = measured
            times[(shape, b)] = measured
            plan.choices[(shape, b)] = min(measured, key=measured.get)
    if new and cache is not None:
        save_cache(cache, new)
    return Selection(plan, times, time.perf_counter() - t0 if new else 0.0)


def summarize(selection: Selection) -> List[str]:
    """A log line per row bucket: what each bucket chose, and the times of its largest matrix."""
    lines = []
    for b, rows in enumerate(ROW_BUCKETS):
        entries = [(s, t) for (s, bb), t in selection.times.items() if bb == b]
        if not entries:
            continue
        counts: Dict[str, int] = {}
        for s, _ in entries:
            path = selection.plan.choices[(s, b)]
            counts[path] = counts.get(path, 0) + 1
        shape, t = max(entries, key=lambda e: e[0].k * e[0].n)
        detail = ", ".join(f"{p} {v * 1e3:.2f} ms" for p, v in sorted(t.items(), key=lambda kv: kv[1]))
        lo = 1 if b == 0 else ROW_BUCKETS[b - 1] + 1
        span = f"{lo}+" if b == len(ROW_BUCKETS) - 1 else (f"{lo}-{rows}" if lo < rows else f"{rows}")
        chosen = ", ".join(f"{p} x{n}" for p, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        lines.append(f"rows {span}: {chosen} (at {rows} rows, {shape.key()}: {detail})")
    return lines
