"""The floors a CPU GEMM kernel is held to on this machine: the peak multiply-accumulate rates of
the instruction mixes the kernels use, measured with register-only loops (no memory), on 1 and on
all threads, and the memory bandwidth a decode step streams weights at.

  int8 (AVX2)         vpmaddubsw + vpmaddwd + vpaddd: 32 u8 x s8 products per triple (llama.cpp's
                      and the engine's AVX2 integer dot product)
  int8 (AVX512-VNNI)  vpdpbusd: 64 products per instruction (where the CPU has it)
  f32 FMA             vfmadd231ps: 8 (AVX2) or 16 (AVX-512) products per instruction
  bf16 (AVX512_BF16)  vdpbf16ps: 32 products per instruction (where the CPU has it)
  memory              a read of 512 MiB (torch sum over float32), GB/s

Rates are in G multiply-accumulates per second x 2 (GFLOPS / GOPS, as GEMM figures are quoted).

    python benchmarks/cpu/peak_rates.py --out benchmarks/cpu/peak_rates.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from radixserve.layers.gemm_select import cpu_model  # noqa: E402

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>

// Each loop keeps ACC independent accumulators in registers so that the instructions' throughput,
// not their latency, bounds it. Returns multiply-accumulates done per thread.
template <typename F>
double run(int threads, int64_t iters, F body) {
  double t0 = omp_get_wtime();
  #pragma omp parallel num_threads(threads)
  { body(iters); }
  return omp_get_wtime() - t0;
}

#define ACC 8
int64_t sink = 0;

double int8_avx2(int threads, int64_t iters) {
#if defined(__AVX2__)
  // In inline assembly: from the intrinsics GCC spilled 3 of the 8 accumulators to the stack, and
  // their store-to-load round trip every iteration held the loop to ~2/3 of the rate (137 instead
  // of ~205 G ops/s a thread on Zen 3; issue 54 session 11). 8 triples an iteration, 8 accumulators
  // (ymm0-7), the products in ymm8-11, the operands in ymm12-14.
  return run(threads, iters, [](int64_t n) {
#define RS_TRIPLE(T, ACCUM) "vpmaddubsw %%ymm13, %%ymm12, " T "\n\t vpmaddwd %%ymm14, " T ", " T "\n\t vpaddd " T ", " ACCUM ", " ACCUM "\n\t"
    int64_t left = n;
    __asm__ volatile(
        "vpcmpeqb %%ymm12, %%ymm12, %%ymm12\n\t vpabsb %%ymm12, %%ymm12\n\t"  // bytes 1
        "vmovdqa %%ymm12, %%ymm13\n\t vpsrlw $8, %%ymm12, %%ymm14\n\t"        // int16 ones
        "vpxor %%ymm0, %%ymm0, %%ymm0\n\t vmovdqa %%ymm0, %%ymm1\n\t vmovdqa %%ymm0, %%ymm2\n\t vmovdqa %%ymm0, %%ymm3\n\t"
        "vmovdqa %%ymm0, %%ymm4\n\t vmovdqa %%ymm0, %%ymm5\n\t vmovdqa %%ymm0, %%ymm6\n\t vmovdqa %%ymm0, %%ymm7\n\t"
        "1:\n\t"
        RS_TRIPLE("%%ymm8", "%%ymm0") RS_TRIPLE("%%ymm9", "%%ymm1") RS_TRIPLE("%%ymm10", "%%ymm2") RS_TRIPLE("%%ymm11", "%%ymm3")
        RS_TRIPLE("%%ymm8", "%%ymm4") RS_TRIPLE("%%ymm9", "%%ymm5") RS_TRIPLE("%%ymm10", "%%ymm6") RS_TRIPLE("%%ymm11", "%%ymm7")
        "dec %0\n\t jnz 1b\n\t vzeroupper\n\t"
        : "+r"(left)
        :
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
          "xmm12", "xmm13", "xmm14", "cc");
#undef RS_TRIPLE
  });
#else
  return -1;
#endif
}

double int8_vnni(int threads, int64_t iters) {
#if defined(__AVX512VNNI__)
  return run(threads, iters, [](int64_t n) {
    __m512i acc[ACC], a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
    for (int i = 0; i < ACC; ++i) acc[i] = _mm512_setzero_si512();
    for (int64_t k = 0; k < n; ++k)
#pragma GCC unroll 8
      for (int i = 0; i < ACC; ++i) { acc[i] = _mm512_dpbusd_epi32(acc[i], a, b); __asm__("" : "+v"(a)); }
    int64_t s = 0;
    for (int i = 0; i < ACC; ++i) s += _mm512_reduce_add_epi32(acc[i]);
    #pragma omp atomic
    sink += s;
  });
#else
  return -1;
#endif
}

double f32_fma(int threads, int64_t iters) {
  return run(threads, iters, [](int64_t n) {
#if defined(__AVX512F__)
    __m512 acc[ACC], a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.9999f);
    for (int i = 0; i < ACC; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < n; ++k)
#pragma GCC unroll 8
      for (int i = 0; i < ACC; ++i) { acc[i] = _mm512_fmadd_ps(a, b, acc[i]); __asm__("" : "+v"(a)); }
    float s = 0;
    for (int i = 0; i < ACC; ++i) s += _mm512_reduce_add_ps(acc[i]);
#else
    __m256 acc[ACC], a = _mm256_set1_ps(1.0001f), b = _mm256_set1_ps(0.9999f);
    for (int i = 0; i < ACC; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < n; ++k)
#pragma GCC unroll 8
      for (int i = 0; i < ACC; ++i) { acc[i] = _mm256_fmadd_ps(a, b, acc[i]); __asm__("" : "+x"(a)); }
    float s = 0;
    for (int i = 0; i < ACC; ++i) s += _mm256_cvtss_f32(acc[i]);
#endif
    #pragma omp atomic
    sink += (int64_t)s;
  });
}

double bf16_dp(int threads, int64_t iters) {
#if defined(__AVX512BF16__)
  return run(threads, iters, [](int64_t n) {
    __m512 acc[ACC];
    __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3f80);
    for (int i = 0; i < ACC; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < n; ++k)
#pragma GCC unroll 8
      for (int i = 0; i < ACC; ++i) { acc[i] = _mm512_dpbf16_ps(acc[i], a, b); __asm__("" : "+v"(a)); }
    float s = 0;
    for (int i = 0; i < ACC; ++i) s += _mm512_reduce_add_ps(acc[i]);
    #pragma omp atomic
    sink += (int64_t)s;
  });
#else
  return -1;
#endif
}

// multiply-accumulates per (iteration x accumulator) of each loop
int64_t macs(const std::string& name) {
  if (name == "int8_avx2") return 32;
  if (name == "int8_vnni") return 64;
  if (name == "bf16_dp") return 32;
#if defined(__AVX512F__)
  return 16;
#else
  return 8;
#endif
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_avx2", &int8_avx2); m.def("int8_vnni", &int8_vnni); m.def("f32_fma", &f32_fma);
  m.def("bf16_dp", &bf16_dp); m.def("macs", &macs);
}
"""

LOOPS = {"int8_avx2": "int8 (AVX2 maddubs+madd)", "int8_vnni": "int8 (AVX512-VNNI)",
         "f32_fma": "f32 FMA", "bf16_dp": "bf16 (AVX512_BF16)"}
ACC = 8


def measure_loop(mod, name: str, threads: int, iters: int) -> float:
    """G ops a second (2 per multiply-accumulate), best of 3; -1 where the CPU lacks the instruction."""
    fn = getattr(mod, name)
    best = float("inf")
    for _ in range(3):
        t = fn(threads, iters)
        if t < 0:
            return -1.0
        best = min(best, t)
    return 2 * mod.macs(name) * ACC * iters * threads / best / 1e9


def bandwidth_gbs(threads: int) -> float:
    torch.set_num_threads(threads)
    x = torch.ones(128 << 20, dtype=torch.float32)  # 512 MiB
    x.sum()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20_000_000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    mod = load_inline("radixserve_peak_rates_v2", cpp_sources=SOURCE, extra_cflags=["-O3", "-march=native", "-fopenmp"],
                      extra_ldflags=["-fopenmp"], verbose=False)
    threads = sorted({1, torch.get_num_threads()})
    rows = []
    for name, label in LOOPS.items():
        for t in threads:
            rate = measure_loop(mod, name, t, args.iters)
            if rate > 0:
                rows.append({"what": label, "threads": t, "gops": round(rate, 1)})
    for t in threads:
        rows.append({"what": "memory read (GB/s)", "threads": t, "gops": round(bandwidth_gbs(t), 1)})
    print(f"CPU: {cpu_model()} ({platform.machine()}), torch {torch.__version__}")
    print(f"| {'what':28} | threads | G ops/s |\n|{'-' * 30}|---------|---------|")
    for r in rows:
        print(f"| {r['what']:28} | {r['threads']:7} | {r['gops']:7.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"cpu": cpu_model(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
