"""Two builds of the integer GGUF kernel (cpu_kernels.quant_linear) in turns in one process: the
C++ sources of a git ref (default: main) and those of this working tree, each compiled into an
extension of its own (cpu_kernels.extension_name: a name per source hash), so that load from other
processes on a shared machine lands on both alike. On benchmarks/cpu/quant_gemm.py's Qwen2.5-1.5B
shapes (random blocks, weights cycled through > 2x L3):

  - decode (M <= 16): each build's fused decode (quant_decode_fused_rows(4), AVX2) and its scratch
    decode (quant_decode_fused_rows(0)): four methods in turns;
  - prefill (M > 16: the tiles): the two builds in turns.

Prints the best of --reps rounds (the methods' order rotated each round) per method and the ratios ref / tree (> 1: the tree is faster),
and writes them to --out with the CPU model. Issue 54 (the fused decode in the tiles' float order):

    python benchmarks/cpu/quant_builds_ab.py --ref main --threads 1 --ms 1,2,4,128 \\
        --out benchmarks/cpu/quant_builds_ab_fused_order.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

import quant_gemm as qg  # noqa: E402  (this directory's: shapes, random blocks, copies, bench)
from radixserve.layers import cpu_kernels  # noqa: E402

FUSED_ROWS = 4  # the fused decode's default limit (cpu_kernels.FUSED_DECODE_ROWS_DEFAULT)


def build_from_ref(ref: str) -> ModuleType:
    """The extension built from radixserve/csrc at `ref` (a directory of its own under torch's
    extension cache, named by the sources' hash as cpu_kernels names its builds)."""
    from torch.utils.cpp_extension import _get_build_directory, load

    src = Path(tempfile.mkdtemp(prefix="quant_ab_")) / "csrc"
    src.mkdir()
    names = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", f"{ref}:radixserve/csrc"],
                           check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "-C", str(REPO), "show", f"{ref}:radixserve/csrc/{name}"], check=True,
                              capture_output=True).stdout
        (src / name).write_bytes(blob)
    sources = [src / s.name for s in cpu_kernels.SOURCES]
    name = cpu_kernels.extension_name(sources)
    build_dir = Path(_get_build_directory(name, verbose=False))
    return load(name=name, sources=[str(s) for s in sources], extra_cflags=cpu_kernels.CFLAGS,
                extra_ldflags=cpu_kernels.LDFLAGS, build_directory=str(build_dir), verbose=False)


def methods(builds: dict, x: torch.Tensor, wq: list, qtype, k: int) -> dict:
    """{method name: fn(i)} for one case: per build, fused + scratch (decode) or the tiles."""
    fns = {}
    limits = {"fused": FUSED_ROWS, "scratch": 0} if x.shape[0] <= 16 else {"tiles": 0}
    for bname, mod in builds.items():
        for path, limit in limits.items():
            def fn(i, mod=mod, limit=limit):
                mod.quant_decode_fused_rows(limit)
                return mod.quant_linear(x, wq[i % len(wq)], int(qtype), k)
            fns[f"{bname}/{path}"] = fn
    return fns


def bench_rotating(fns: dict, reps: int) -> dict:
    """{name: best ms} over `reps` rounds; each round runs every method once, the order rotated by
    one a round (no method always runs right after another's cache or frequency footprint)."""
    names = list(fns)
    times = {k: [] for k in names}
    for i in range(2):  # warm-up
        for f in fns.values():
            f(i)
    for i in range(reps):
        for name in names[i % len(names):] + names[: i % len(names)]:
            t0 = time.perf_counter()
            fns[name](i)
            times[name].append(time.perf_counter() - t0)
    return {k: min(v) * 1e3 for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", default="main", help="the git ref whose radixserve/csrc is the 'ref' build")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ms", default="1,2,4,128")
    ap.add_argument("--reps", type=int, default=12, help="rounds (M > 16: a third of them, at least 3)")
    ap.add_argument("--shapes", default="", help="comma-separated subset of: " + ",".join(s[0] for s in qg.SHAPES))
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tree = cpu_kernels.get()
    assert tree is not None and tree.has_quant_gemm(), "quant_linear is not built (AVX512-VNNI or AVX2)"
    builds = {"ref": build_from_ref(args.ref), "tree": tree}
    ms = [int(v) for v in args.ms.split(",")]
    shapes = [s for s in qg.SHAPES if not args.shapes or s[0] in args.shapes.split(",")]
    load0 = os.getloadavg()[0]
    rows = []
    print(f"{qg.cpu_model()}, isa {tree.quant_gemm_isa()}, {args.threads} thread(s), ref = {args.ref}; "
          f"best of the rounds, ms")
    for label, k, n in shapes:
        for qtype in qg.TYPES:
            data = torch.from_numpy(qg.random_blocks(qtype, n, k, seed=int(qtype)))
            wq = qg.copies(data)
            for m in ms:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                best = bench_rotating(methods(builds, x, wq, qtype, k), args.reps if m <= 16 else max(4, args.reps // 3))
                paths = sorted({name.split("/")[1] for name in best})
                ratios = {p: best[f"ref/{p}"] / best[f"tree/{p}"] for p in paths}
                if m <= 16:
                    ratios["fused_over_scratch_ref"] = best["ref/scratch"] / best["ref/fused"]
                    ratios["fused_over_scratch_tree"] = best["tree/scratch"] / best["tree/fused"]
                rows.append({"layer": label, "K": k, "N": n, "type": qtype.name, "M": m, "best_ms": best,
                             "ratios": ratios})
                times = "  ".join(f"{name} {v:.3f}" for name, v in best.items())
                print(f"{label:8} {qtype.name:5} M={m:<4} {times}  |  " +
                      "  ".join(f"{name} {v:.3f}" for name, v in ratios.items()), flush=True)
            del wq, data
    for mod in builds.values():
        mod.quant_decode_fused_rows(cpu_kernels.fused_decode_rows_from_env())
    out = {"label": "issue 54: two builds of quant_linear in turns", "ref": args.ref, "cpu": qg.cpu_model(),
           "isa": tree.quant_gemm_isa(), "threads": args.threads, "torch": torch.__version__,
           "load_average_start_end": [load0, os.getloadavg()[0]],
           "note": "ratios: ref time / tree time per path (> 1: the tree is faster); fused_over_scratch: "
           "scratch time / fused time within a build",
           "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
