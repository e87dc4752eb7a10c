// CPU kernels for the hot path: paged decode and extend (prefill) attention, KV store, fused
// add+RMSNorm, rotary embedding, SiLU-and-mul, and a bf16 GEMM for the linear layers (AVX512_BF16, or
// AVX2 + FMA: the same packed layout, the weights widened to float32). Built
// with -march=native by torch.utils.cpp_extension (radixserve/layers/cpu_kernels.py; run by
// scripts/install.sh); the torch code those layers fall back to is the reference the tests
// compare against. AVX-512 (and for the GEMM, AVX2) paths sit beside portable loops, chosen at
// compile time.
//
// Every kernel computes in float32 and reads/writes float32, bfloat16 or float16 tensors (the bf16
// GEMM and the decode attention over a bf16 pool multiply bf16 operands on vdpbf16ps, summing in
// float32; that attention splits its float32 operands in bf16 hi + lo halves; the AVX2 GEMM widens
// its bf16 weights and multiplies in float32).
// Parallel loops run through parallel_for_dynamic (parallel.h: chunks from an atomic counter on a
// small worker pool whose regions end when the chunks are done, so a thread whose core another
// process took does not hold each region up).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "parallel.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlockTokens = 64;     // keys scored per online-softmax block
constexpr int64_t kMinSplitTokens = 128; // a split-KV chunk holds at least this many keys
constexpr int64_t kPrefetch = 4;         // K/V rows fetched ahead (slots are scattered)
constexpr int64_t kPrefetchKeys = 64;    // the block paths: K/V rows prefetched into L2 this far ahead

// --enable-deterministic-inference (layers/batch_invariant.py sets it once at start): every kernel
// whose reduction order would otherwise depend on the number of rows takes one fixed order. Today
// that is the AVX2 GEMM's register tiles (one or two rows sum even and odd k apart, more rows in
// one chain); the decode attention's split is fixed by its caller (split_tokens), not here.
bool g_batch_invariant = false;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- loads and stores in float32 -------------------------------------------------------------
inline void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void load_row(const at::BFloat16* src, float* dst, int64_t n) {
  // bfloat16 is the high half of a float32: a shift, which the compiler vectorizes.
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}

inline void load_row(const at::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)  // vcvtph2ps: 16 halves at a time (an fp16 KV cache is read per step)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#endif
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)  // vcvtph2ps on 8 (AVX2 machines): c10::Half's conversion is a scalar bit routine
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);  // round to nearest even
}

// exp(x) for x <= 0 (softmax weights), vectorizable (std::exp is a scalar libm call, which
// cost most of the decode kernel): 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, and a degree-6
// Taylor polynomial for exp(r) (relative error ~1e-7). x below -87 (and -inf) gives ~0.
inline float exp_neg(float x) {
  x = std::max(x, -87.f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln2 split in two for precision
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void axpy(float* y, float a, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

inline void scale_row(float* y, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

// float32, bfloat16, float16: the dtypes a model runs in (AT_DISPATCH would add double).
#define DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)                                         \
  [&] {                                                                              \
    switch (TYPE) {                                                                  \
      case at::kFloat: { using scalar_t = float; return __VA_ARGS__(); }             \
      case at::kBFloat16: { using scalar_t = at::BFloat16; return __VA_ARGS__(); }   \
      case at::kHalf: { using scalar_t = at::Half; return __VA_ARGS__(); }           \
      default: TORCH_CHECK(false, NAME, ": unsupported dtype ", TYPE);               \
    }                                                                                \
  }()

void check_last_dim_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dimension");
}

// The attention kernels' q/out rows and KV pool rows (a slot's heads contiguous).
void check_attention_layout(const at::Tensor& q, const at::Tensor& out, const at::Tensor& k_buf,
                            const at::Tensor& v_buf, const char* name) {
  TORCH_CHECK(q.stride(-1) == 1 && out.stride(-1) == 1, name, ": q and out must be contiguous in their last dimension");
  TORCH_CHECK(k_buf.stride(1) == k_buf.size(2) && v_buf.stride(1) == v_buf.size(2) && k_buf.stride(2) == 1 &&
                  v_buf.stride(2) == 1,
              name, ": a slot's K/V heads must be contiguous");
}

#if defined(__AVX512F__)
// ---- the decode attention block on AVX-512 (head_dim a multiple of 16) --------------------------
//
// Per block of up to 16 keys: K and V rows are converted to fp32 once; each query head's 16
// scores come from 16 vector dot products whose lanes are summed by one transpose-add tree (no
// horizontal sum per key); the softmax weights are a vector; P.V broadcasts one weight per key.
inline __m512 exp_neg_v(__m512 x) {  // exp_neg on 16 lanes; _mm512_scalef_ps does the 2^n
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// One block of the online softmax: scores s (lanes outside `valid` masked) update the running
// max m and sum l; returns the block's weights exp(s - m) (0 where masked) and sets corr, the
// factor for what was accumulated before (~0 on the first block, m = -inf). always_inline: the
// bf16 decode block ran 15 -> 21 ms (16 x 512 keys x 30 layers) when GCC kept it a call.
__attribute__((always_inline)) inline __m512 online_softmax_block(__m512 s, __mmask16 valid, float& m, float& l,
                                                                 float& corr) {
  const __m512 sv = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid, s);
  const float mb = std::max(m, _mm512_reduce_max_ps(sv));
  corr = exp_neg(m - mb);
  const __m512 pv = _mm512_maskz_mov_ps(valid, exp_neg_v(_mm512_sub_ps(sv, _mm512_set1_ps(mb))));
  l = l * corr + _mm512_reduce_add_ps(pv);
  m = mb;
  return pv;
}

// v[0..15] -> one vector whose lane j is the sum of v[j]'s lanes.
inline __m512 transpose_sum16(__m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]));
    b[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  // b[i]'s 128-bit lane L holds keys 4i..4i+3, partial over lane L: sum the four lanes.
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}
#endif

#if defined(__AVX512BF16__)
// ---- the decode attention block over a bf16 KV pool, on vdpbf16ps -----------------------------
//
// The K/V rows are read where they lie in the pool (no conversion to fp32): QK and PV run on
// vdpbf16ps, each with its float32 operand (the query, the softmax weights) split in two bf16
// halves, x = hi + lo to ~2^-17, so both products keep float32-like precision (better than
// llama.cpp, which rounds the query to bf16).
constexpr int64_t kBf16MaxChunks = 4;  // head_dim <= 128: D / 32 zmm of bf16 per row

inline __m512 bf16_lo_to_ps(__m512i x) {  // the low 16 bf16 of x, widened to fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(x)), 16));
}
inline __m512 bf16_hi_to_ps(__m512i x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(x, 1)), 16));
}

// a (elements 0..15) and b (16..31) as hi + lo bf16 halves, element order kept.
inline void split_bf16(__m512 a, __m512 b, __m512i& hi, __m512i& lo) {
  hi = (__m512i)_mm512_cvtne2ps_pbh(b, a);
  lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, bf16_hi_to_ps(hi)), _mm512_sub_ps(a, bf16_lo_to_ps(hi)));
}

// One kv head's block of n <= 16 keys: k[j] / v[j] point at key j's D bf16 (this kv head's part
// of its slot row); qhl holds the group's G query heads as hi/lo chunks [G][D/32][2]; acc/m/l
// the group's running output, max and sum. vi is scratch for the block's V, keys interleaved in
// pairs ([8][D/16] zmm: lane i of pair p = (v[2p][d], v[2p+1][d]) for d = 16c + i).
inline void attend_block16_bf16(const __m512i* qhl, const uint16_t* const* k, const uint16_t* const* v, int64_t n,
                                int64_t G, int64_t D, float* acc, float* m, float* l, __m512i* vi) {
  const int64_t kc = D / 32, vc = D / 16;
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                          5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int64_t p = 0; p < (n + 1) / 2; ++p) {  // an odd last key pairs with itself (its weight is 0)
    const uint16_t* v0 = v[2 * p];
    const uint16_t* v1 = v[std::min<int64_t>(2 * p + 1, n - 1)];
    for (int64_t c = 0; c < kc; ++c) {
      const __m512i a = _mm512_loadu_si512(v0 + 32 * c), b = _mm512_loadu_si512(v1 + 32 * c);
      vi[p * vc + 2 * c] = _mm512_permutex2var_epi16(a, lo_idx, b);
      vi[p * vc + 2 * c + 1] = _mm512_permutex2var_epi16(a, hi_idx, b);
    }
  }
  alignas(64) uint32_t phi[8], plo[8];
  for (int64_t h = 0; h < G; ++h) {
    const __m512i* qh = qhl + h * kc * 2;
    __m512 sc[16];
    for (int64_t j = 0; j < 16; ++j) {
      __m512 a = _mm512_setzero_ps();
      if (j < n)
        for (int64_t c = 0; c < kc; ++c) {
          const __m512bh kv = (__m512bh)_mm512_loadu_si512(k[j] + 32 * c);
          a = _mm512_dpbf16_ps(a, kv, (__m512bh)qh[2 * c]);
          a = _mm512_dpbf16_ps(a, kv, (__m512bh)qh[2 * c + 1]);
        }
      sc[j] = a;
    }
    float corr;
    const __m512 pv = online_softmax_block(transpose_sum16(sc), valid, m[h], l[h], corr);
    __m512i ph, pl;
    split_bf16(pv, _mm512_setzero_ps(), ph, pl);  // bf16 j of ph: weight of key j; dword p: keys 2p, 2p+1
    _mm256_store_si256(reinterpret_cast<__m256i*>(phi), _mm512_castsi512_si256(ph));
    _mm256_store_si256(reinterpret_cast<__m256i*>(plo), _mm512_castsi512_si256(pl));
    __m512 o[2 * kBf16MaxChunks];
    const __m512 cv = _mm512_set1_ps(corr);
    for (int64_t c = 0; c < vc; ++c) o[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + 16 * c), cv);
    for (int64_t p = 0; p < (n + 1) / 2; ++p) {
      const __m512bh wh = (__m512bh)_mm512_set1_epi32(static_cast<int>(phi[p]));
      const __m512bh wl = (__m512bh)_mm512_set1_epi32(static_cast<int>(plo[p]));
      for (int64_t c = 0; c < vc; ++c) {
        o[c] = _mm512_dpbf16_ps(o[c], (__m512bh)vi[p * vc + c], wh);
        o[c] = _mm512_dpbf16_ps(o[c], (__m512bh)vi[p * vc + c], wl);
      }
    }
    for (int64_t c = 0; c < vc; ++c) _mm512_storeu_ps(acc + h * D + 16 * c, o[c]);
  }
}
#endif

// ---- attention over shared K/V tiles (extend; decode over a prefix the batch shares) -----------
//
// A block of kTileKeys keys of one kv head (one vector's lanes: 16 on AVX-512, 8 on AVX2) is
// widened to float32 once: K transposed into kt [D][kTileKeys] (lanes = keys: one FMA per
// dimension gives a query's kTileKeys scores, no horizontal sums) and V into vt [kTileKeys][D].
// Every query row that attends to those keys then reads the tile, kTileRows rows at a time so that
// each kt / vt load feeds kTileRows FMAs. Per-request decode cannot do this (one query per kv head
// and G heads), so it runs ~2.5x fewer FLOPs a second than these tiles.
//
// The tile code is written once over the few vector operations below (vec_*), which map to
// AVX-512 (16 lanes) or AVX2 + FMA (8 lanes, the same algorithm and numerics).
#if defined(__AVX512F__)
#define RADIXSERVE_TILE_ATTENTION 1
using vec_f = __m512;
using vec_mask = __mmask16;  // lanes (keys) a row sees
constexpr int kTileKeys = 16;
inline vec_f vec_zero() { return _mm512_setzero_ps(); }
inline vec_f vec_set1(float x) { return _mm512_set1_ps(x); }
inline vec_f vec_load(const float* p) { return _mm512_loadu_ps(p); }
inline void vec_store(float* p, vec_f x) { _mm512_storeu_ps(p, x); }
inline vec_f vec_mul(vec_f a, vec_f b) { return _mm512_mul_ps(a, b); }
inline vec_f vec_fmadd(vec_f a, vec_f b, vec_f c) { return _mm512_fmadd_ps(a, b, c); }
inline vec_mask vec_first_lanes(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }
#elif defined(__AVX2__) && defined(__FMA__)
// (immintrin.h is included at the top for the AVX2 GEMM and tiles alike)
#define RADIXSERVE_TILE_ATTENTION 1
using vec_f = __m256;
using vec_mask = __m256;  // all-ones in the lanes (keys) a row sees
constexpr int kTileKeys = 8;
inline vec_f vec_zero() { return _mm256_setzero_ps(); }
inline vec_f vec_set1(float x) { return _mm256_set1_ps(x); }
inline vec_f vec_load(const float* p) { return _mm256_loadu_ps(p); }
inline void vec_store(float* p, vec_f x) { _mm256_storeu_ps(p, x); }
inline vec_f vec_mul(vec_f a, vec_f b) { return _mm256_mul_ps(a, b); }
inline vec_f vec_fmadd(vec_f a, vec_f b, vec_f c) { return _mm256_fmadd_ps(a, b, c); }
inline vec_mask vec_first_lanes(int64_t n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane));
}

inline float reduce_max8(__m256 x) {
  __m128 v = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  v = _mm_max_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_max_ss(v, _mm_movehdup_ps(v)));
}
inline float reduce_add8(__m256 x) {
  __m128 v = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

// v[0..7] -> one vector whose lane j is the sum of v[j]'s lanes (AVX2's transpose_sum16).
inline __m256 transpose_sum8(__m256 v[8]) {
  // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]: two rounds leave
  // keys 0-3 (then 4-7) summed within each 128-bit half; the halves are added last.
  const __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

// exp_neg on 8 lanes (the AVX-512 exp_neg_v's steps; 2^n built in the exponent bits, as the
// scalar exp_neg does, for AVX2 has no scalef).
inline __m256 exp_neg_v(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// The AVX-512 online_softmax_block on 8 lanes: scores s (lanes outside `valid` masked) update the
// running max m and sum l; returns the weights exp(s - m) (0 where masked) and sets corr.
__attribute__((always_inline)) inline __m256 online_softmax_block(__m256 s, __m256 valid, float& m, float& l,
                                                                 float& corr) {
  const __m256 sv = _mm256_blendv_ps(_mm256_set1_ps(-std::numeric_limits<float>::infinity()), s, valid);
  const float mb = std::max(m, reduce_max8(sv));
  corr = exp_neg(m - mb);
  const __m256 pv = _mm256_and_ps(valid, exp_neg_v(_mm256_sub_ps(sv, _mm256_set1_ps(mb))));
  l = l * corr + reduce_add8(pv);
  m = mb;
  return pv;
}
#endif

#if defined(RADIXSERVE_TILE_ATTENTION)
// ---- the decode attention block (one request's queries, kTileKeys keys at a time) --------------
//
// Per block of up to kTileKeys keys: K and V rows are converted to fp32 once; each query head's
// scores come from kTileKeys vector dot products whose lanes are summed by one transpose-add tree
// (no horizontal sum per key); the softmax weights are a vector; P.V broadcasts one weight per key.
inline vec_f vec_transpose_sum(vec_f v[kTileKeys]) {
#if defined(__AVX512F__)
  return transpose_sum16(v);
#else
  return transpose_sum8(v);
#endif
}

// A slot's K and V rows (all KV heads), fetched into L2.
inline void prefetch_row_l2(const void* k, const void* v, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) {
    _mm_prefetch(static_cast<const char*>(k) + o, _MM_HINT_T1);
    _mm_prefetch(static_cast<const char*>(v) + o, _MM_HINT_T1);
  }
}

// One block of n <= kTileKeys keys of one work item: kf/vf hold the block's K/V rows in fp32
// ([kTileKeys][row], row = Hkv * D; rows past n hold finite leftovers whose scores are masked);
// qf the scaled queries [H][D]; acc/m/l the running output, max and sum per head. Chunks = D /
// kTileKeys is a template argument so that the output stays in registers (a run-time count kept
// it on the stack: 1.6x slower on AVX2).
template <int64_t chunks>
void attend_block(const float* qf, const float* kf, const float* vf, int64_t n, int64_t H, int64_t G, int64_t D,
                  int64_t row, float* acc, float* m, float* l) {
  const vec_mask valid = vec_first_lanes(n);
  alignas(64) float p[kTileKeys];
  for (int64_t hq = 0; hq < H; ++hq) {
    const float* kh = kf + (hq / G) * D;
    vec_f s[kTileKeys];
    _Pragma("GCC unroll 16") for (int j = 0; j < kTileKeys; ++j) s[j] = vec_zero();
    for (int64_t c = 0; c < chunks; ++c) {  // kTileKeys independent FMA chains
      const vec_f q = vec_load(qf + hq * D + kTileKeys * c);
      _Pragma("GCC unroll 16") for (int j = 0; j < kTileKeys; ++j)
        s[j] = vec_fmadd(q, vec_load(kh + j * row + kTileKeys * c), s[j]);
    }
    float corr;
    vec_store(p, online_softmax_block(vec_transpose_sum(s), valid, m[hq], l[hq], corr));
    vec_f o[chunks];
    const vec_f cv = vec_set1(corr);
    for (int64_t c = 0; c < chunks; ++c) o[c] = vec_mul(vec_load(acc + hq * D + kTileKeys * c), cv);
    for (int64_t j = 0; j < n; ++j) {
      const vec_f pj = vec_set1(p[j]);
      const float* vj = vf + j * row + (hq / G) * D;
      for (int64_t c = 0; c < chunks; ++c) o[c] = vec_fmadd(pj, vec_load(vj + kTileKeys * c), o[c]);
    }
    for (int64_t c = 0; c < chunks; ++c) vec_store(acc + hq * D + kTileKeys * c, o[c]);
  }
}

using AttendBlockFn = void (*)(const float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                               float*, float*, float*);

// attend_block for head_dim D (a multiple of kTileKeys, at most 128), nullptr for any other.
inline AttendBlockFn attend_block_for(int64_t D) {
  if (D % kTileKeys != 0) return nullptr;
  switch (D / kTileKeys) {
    case 2: return attend_block<2>;
    case 4: return attend_block<4>;
    case 6: return attend_block<6>;
    case 8: return attend_block<8>;
    case 12: return attend_block<12>;
    case 16: return attend_block<16>;
    default: return nullptr;
  }
}

constexpr int kTileRows = 8;

// kp / vp point at the kv head's part of slot 0's row; slots[j], j < nk: the block's keys.
// Keys past nk are zeros (masked scores, zero weights).
template <typename TKV>
inline void load_kv_tile(const TKV* kp, const TKV* vp, int64_t ks0, int64_t vs0, const int32_t* slots, int64_t nk,
                         int64_t D, float* krow, float* kt, float* vt) {
  for (int64_t j = 0; j < kTileKeys; ++j) {
    if (j < nk) {
      const int64_t slot = slots[j];
      load_row(kp + slot * ks0, krow, D);
      load_row(vp + slot * vs0, vt + j * D, D);
    } else {
      std::fill(krow, krow + D, 0.f);
      std::fill(vt + j * D, vt + (j + 1) * D, 0.f);
    }
    for (int64_t d = 0; d < D; ++d) kt[d * kTileKeys + j] = krow[d];
  }
}

// Rows r < NR: q[r] the scaled query, acc[r] / *m[r] / *l[r] its running output, max and sum,
// vis[r] how many of the tile's keys it sees (causal), p scratch [NR][kTileKeys].
template <int NR>
inline void tile_rows(const float* kt, const float* vt, int64_t D, const float* const* q, float* const* acc,
                      float* const* m, float* const* l, const int64_t* vis, float* p) {
  vec_f s[NR];
  _Pragma("GCC unroll 8") for (int r = 0; r < NR; ++r) s[r] = vec_zero();
  for (int64_t d = 0; d < D; ++d) {
    const vec_f k = vec_load(kt + d * kTileKeys);
    _Pragma("GCC unroll 8") for (int r = 0; r < NR; ++r) s[r] = vec_fmadd(vec_set1(q[r][d]), k, s[r]);
  }
  float corr[NR];
  int64_t nk = 0;
  _Pragma("GCC unroll 8") for (int r = 0; r < NR; ++r) {
    vec_store(p + r * kTileKeys, online_softmax_block(s[r], vec_first_lanes(vis[r]), *m[r], *l[r], corr[r]));
    nk = std::max(nk, vis[r]);
  }
  for (int64_t c = 0; c < D; c += kTileKeys) {  // a vector of output dims (as many as a tile's keys)
    vec_f o[NR];
    _Pragma("GCC unroll 8") for (int r = 0; r < NR; ++r) o[r] = vec_mul(vec_load(acc[r] + c), vec_set1(corr[r]));
    for (int64_t j = 0; j < nk; ++j) {
      const vec_f v = vec_load(vt + j * D + c);
      _Pragma("GCC unroll 8") for (int r = 0; r < NR; ++r) o[r] = vec_fmadd(vec_set1(p[r * kTileKeys + j]), v, o[r]);
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < NR; ++r) vec_store(acc[r] + c, o[r]);
  }
}

// Queues the rows that read one tile and runs them kTileRows at a time; flush() at the tile's end.
struct TileRows {
  const float* kt;
  const float* vt;
  int64_t D;
  float* p;  // scratch [kTileRows][kTileKeys]
  const float* q[kTileRows];
  float* acc[kTileRows];
  float* m[kTileRows];
  float* l[kTileRows];
  int64_t vis[kTileRows];
  int n = 0;

  void add(const float* q_, float* acc_, float* m_, float* l_, int64_t vis_) {
    q[n] = q_, acc[n] = acc_, m[n] = m_, l[n] = l_, vis[n] = vis_;
    if (++n == kTileRows) flush();
  }
  void flush() {
    switch (n) {
      case 1: tile_rows<1>(kt, vt, D, q, acc, m, l, vis, p); break;
      case 2: tile_rows<2>(kt, vt, D, q, acc, m, l, vis, p); break;
      case 3: tile_rows<3>(kt, vt, D, q, acc, m, l, vis, p); break;
      case 4: tile_rows<4>(kt, vt, D, q, acc, m, l, vis, p); break;
      case 5: tile_rows<5>(kt, vt, D, q, acc, m, l, vis, p); break;
      case 6: tile_rows<6>(kt, vt, D, q, acc, m, l, vis, p); break;
      case 7: tile_rows<7>(kt, vt, D, q, acc, m, l, vis, p); break;
      case 8: tile_rows<8>(kt, vt, D, q, acc, m, l, vis, p); break;
      default: break;
    }
    n = 0;
  }
};

// Decode over a prefix every request of the batch shares (the same slots: one radix-tree node,
// a system prompt): keys [0, P) once for all B x G query rows of each kv head, as tiles, instead
// of once per request. Work item: (kv head, chunk of kSharedChunk keys); each writes the
// (unnormalized output, max, sum) partial of every (request, head) at slot `first` + chunk of
// part_acc [B * H][ntot][D] / part_ml [B * H][ntot][2], which the decode kernel merges.
constexpr int64_t kSharedChunk = 128;

template <typename TQ, typename TKV>
void shared_prefix_partials(const TQ* qp, int64_t qs0, int64_t qs1, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                            const TKV* kp, const TKV* vp, int64_t ks0, int64_t vs0, const int32_t* slots, int64_t P,
                            float scale, float* part_acc, float* part_ml, int64_t ntot, int64_t first) {
  const int64_t G = H / Hkv, chunks = ceil_div(P, kSharedChunk), nrows = B * G;
  radixserve::parallel_for_dynamic(Hkv * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(nrows * D), acc(nrows * D), m(nrows), l(nrows), kt(D * kTileKeys), vt(kTileKeys * D),
        krow(D);
    std::vector<float> pbuf(kTileRows * kTileKeys);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / chunks, c = item % chunks, k_begin = c * kSharedChunk;
      const int64_t k_end = std::min(P, k_begin + kSharedChunk);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < G; ++h) {
          float* dst = qf.data() + (b * G + h) * D;
          load_row(qp + b * qs0 + (g * G + h) * qs1, dst, D);
          scale_row(dst, scale, D);
        }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      TileRows rows{kt.data(), vt.data(), D, pbuf.data()};
      for (int64_t k0 = k_begin; k0 < k_end; k0 += kTileKeys) {
        const int64_t nk = std::min<int64_t>(kTileKeys, k_end - k0);
        load_kv_tile(kp + g * D, vp + g * D, ks0, vs0, slots + k0, nk, D, krow.data(), kt.data(), vt.data());
        for (int64_t r = 0; r < nrows; ++r) rows.add(qf.data() + r * D, acc.data() + r * D, &m[r], &l[r], nk);
        rows.flush();
      }
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < G; ++h) {
          const int64_t r = b * G + h, idx = (b * H + g * G + h) * ntot + first + c;
          std::memcpy(part_acc + idx * D, acc.data() + r * D, D * sizeof(float));
          part_ml[idx * 2] = m[r];
          part_ml[idx * 2 + 1] = l[r];
        }
    }
  });
}
#endif

// ---- paged decode attention -------------------------------------------------------------------
//
// One query per request attends to its whole sequence, whose KV slots are
//   req_to_token[req_pool_indices[b], 0 : seq_lens[b]].
// The work item is (request b, split s): every query head scores a chunk of the sequence with an
// online softmax, the G = H / Hkv heads of a group against their shared KV head, so each slot's
// K/V row (all KV heads, contiguous) is read once (GQA without repeating K/V, no gather copy). With few requests the sequence is split (flash
// decoding) so that every thread has work; a second pass merges the splits.
template <typename TQ, typename TKV>
void decode_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                           const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                           const at::Tensor& seq_lens, double scale, int64_t shared_len, int64_t split_tokens) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_buf.size(1), G = H / Hkv;
  const TQ* qp = q.data_ptr<TQ>();
  const TKV* kp = k_buf.data_ptr<TKV>();
  const TKV* vp = v_buf.data_ptr<TKV>();
  TQ* op = out.data_ptr<TQ>();
  const int32_t* r2t = req_to_token.data_ptr<int32_t>();
  const int64_t* rows = req_pool_indices.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t ks0 = k_buf.stride(0), vs0 = v_buf.stride(0);  // a slot's heads are contiguous
  const int64_t r2t_s0 = req_to_token.stride(0);

  // Keys [0, shared_len) are shared by every request (shared_prefix_partials); this loop takes
  // [shared_len, len).
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) max_len = std::max(max_len, lens[b] - shared_len);
  const int64_t items = B;
  const int64_t want = 4 * static_cast<int64_t>(at::get_num_threads());
  int64_t nsplit = 1;
  if (split_tokens > 0)  // batch-invariant: split s is keys [s * split_tokens, (s + 1) * split_tokens) of every request
    nsplit = std::max<int64_t>(1, ceil_div(max_len, split_tokens));
  else if (items < want)
    nsplit = std::max<int64_t>(1, std::min(ceil_div(want, items), ceil_div(max_len, kMinSplitTokens)));
  // Keys [t0, t1) of split sp of a request of len keys: an even share of its own keys, or (fixed
  // split) the split's absolute positions, empty past the request's end.
  auto split_span = [&](int64_t len, int64_t sp) -> std::pair<int64_t, int64_t> {
    const int64_t chunk = split_tokens > 0 ? split_tokens : ceil_div(len - shared_len, nsplit);
    const int64_t t0 = std::min(len, shared_len + sp * chunk);
    return {t0, std::min(len, t0 + chunk)};
  };
#if defined(RADIXSERVE_TILE_ATTENTION)
  const int64_t shared_chunks = shared_len > 0 ? ceil_div(shared_len, kSharedChunk) : 0;
#else
  const int64_t shared_chunks = 0;
#endif
  const int64_t ntot = nsplit + shared_chunks;

  // Partials (splits, then shared chunks): acc [B, H, ntot, D] and (max, sum) [B, H, ntot, 2], float32.
  std::vector<float> part_acc(ntot > 1 ? B * H * ntot * D : 0);
  std::vector<float> part_ml(ntot > 1 ? B * H * ntot * 2 : 0);
#if defined(RADIXSERVE_TILE_ATTENTION)
  if (shared_chunks > 0)
    shared_prefix_partials(qp, qs0, qs1, B, H, Hkv, D, kp, vp, ks0, vs0, r2t + rows[0] * r2t_s0, shared_len,
                           static_cast<float>(scale), part_acc.data(), part_ml.data(), ntot, nsplit);
#endif
  const float neg_inf = -std::numeric_limits<float>::infinity();
#if defined(RADIXSERVE_TILE_ATTENTION)
  const AttendBlockFn attend_block_fn = attend_block_for(D);  // the block path; nullptr: the loop below
  const bool fast = attend_block_fn != nullptr;
  const int64_t row_bytes = Hkv * D * static_cast<int64_t>(sizeof(TKV));
#else
  const bool fast = false;
#endif
#if defined(__AVX512BF16__)
  // a bf16 pool: vdpbf16ps on the rows in place (attend_block16_bf16)
  const bool fast_bf16 = std::is_same<TKV, at::BFloat16>::value && D % 32 == 0 && D / 32 <= kBf16MaxChunks;
#else
  const bool fast_bf16 = false;
#endif

  radixserve::parallel_for_dynamic(B * nsplit, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), acc(H * D), m(H), l(H), s(H * kBlockTokens), row(Hkv * D);
    std::vector<float> kf(fast ? kTileKeys * Hkv * D : 0), vf(fast ? kTileKeys * Hkv * D : 0);
#if defined(__AVX512BF16__)
    std::vector<__m512i> qhl(fast_bf16 ? H * (D / 32) * 2 : 0), vi(fast_bf16 ? 8 * (D / 16) : 0);
#endif
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / nsplit, sp = w % nsplit;
      const auto [t0, t1] = split_span(lens[b], sp);
      const int32_t* slots = r2t + rows[b] * r2t_s0;
      for (int64_t hq = 0; hq < H; ++hq) {
        load_row(qp + b * qs0 + hq * qs1, qf.data() + hq * D, D);
        scale_row(qf.data() + hq * D, static_cast<float>(scale), D);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), 0.f);
      int64_t t_done = t0;  // keys the block paths attended to (all of them when one runs)
      // the slot of key t0 + i of item w + 1 (in this thread's range), -1 past it
      auto slot_of_next_item = [&](int64_t w_, int64_t i) -> int64_t {
        if (w_ + 1 >= end) return -1;
        const int64_t b2 = (w_ + 1) / nsplit;
        const auto [u0, u1] = split_span(lens[b2], (w_ + 1) % nsplit);
        return u0 + i < u1 ? static_cast<int64_t>(r2t[rows[b2] * r2t_s0 + u0 + i]) : -1;
      };
#if defined(__AVX512BF16__)
      if (fast_bf16) {
        for (int64_t g = 0; g < Hkv; ++g)
          for (int64_t h = 0; h < G; ++h)
            for (int64_t c = 0; c < D / 32; ++c) {
              const float* qr = qf.data() + (g * G + h) * D + 32 * c;
              split_bf16(_mm512_loadu_ps(qr), _mm512_loadu_ps(qr + 16), qhl[((g * G + h) * (D / 32) + c) * 2],
                         qhl[((g * G + h) * (D / 32) + c) * 2 + 1]);
            }
        const uint16_t* kb = reinterpret_cast<const uint16_t*>(kp);
        const uint16_t* vb = reinterpret_cast<const uint16_t*>(vp);
        const uint16_t* kr[16];
        const uint16_t* vr[16];
        for (int64_t tb = t0; tb < t1; tb += 16) {
          const int64_t n = std::min<int64_t>(16, t1 - tb);
          // Into L2, kPrefetchKeys keys ahead, on into the next work item's keys: measured 13.9 /
          // 16.5 ms against 19.8 / 18.7 (into L1, the next block, this item only) at 16 x 512 keys x
          // 30 layers, bf16 / fp16 pool.
          for (int64_t j = tb + kPrefetchKeys; j < tb + kPrefetchKeys + 16; ++j) {
            const int64_t slot = j < t1 ? slots[j] : slot_of_next_item(w, j - t1);
            if (slot < 0) break;
            prefetch_row_l2(kp + slot * ks0, vp + slot * vs0, row_bytes);
          }
          for (int64_t g = 0; g < Hkv; ++g) {
            for (int64_t j = 0; j < n; ++j) {
              kr[j] = kb + static_cast<int64_t>(slots[tb + j]) * ks0 + g * D;
              vr[j] = vb + static_cast<int64_t>(slots[tb + j]) * vs0 + g * D;
            }
            attend_block16_bf16(qhl.data() + g * G * (D / 32) * 2, kr, vr, n, G, D, acc.data() + g * G * D,
                                m.data() + g * G, l.data() + g * G, vi.data());
          }
        }
        t_done = t1;
      }
#endif
#if defined(RADIXSERVE_TILE_ATTENTION)
      if (fast && t_done < t1) {
        for (int64_t tb = t0; tb < t1; tb += kTileKeys) {
          const int64_t n = std::min<int64_t>(kTileKeys, t1 - tb);
          for (int64_t j = tb + kPrefetchKeys; j < tb + kPrefetchKeys + kTileKeys; ++j) {  // as the bf16 path does
            const int64_t slot = j < t1 ? slots[j] : slot_of_next_item(w, j - t1);
            if (slot < 0) break;
            prefetch_row_l2(kp + slot * ks0, vp + slot * vs0, row_bytes);
          }
          for (int64_t j = 0; j < n; ++j) {
            const int64_t slot = slots[tb + j];
            load_row(kp + slot * ks0, kf.data() + j * Hkv * D, Hkv * D);
            load_row(vp + slot * vs0, vf.data() + j * Hkv * D, Hkv * D);
          }
          attend_block_fn(qf.data(), kf.data(), vf.data(), n, H, G, D, Hkv * D, acc.data(), m.data(), l.data());
        }
        t_done = t1;
      }
#endif
      for (int64_t tb = t_done; tb < t1; tb += kBlockTokens) {
        const int64_t n = std::min(kBlockTokens, t1 - tb);
        for (int64_t j = 0; j < n; ++j) {  // scores of every query head against key tb + j
          if (j + kPrefetch < n) __builtin_prefetch(kp + static_cast<int64_t>(slots[tb + j + kPrefetch]) * ks0);
          load_row(kp + static_cast<int64_t>(slots[tb + j]) * ks0, row.data(), Hkv * D);
          for (int64_t hq = 0; hq < H; ++hq)
            s[hq * kBlockTokens + j] = dot(qf.data() + hq * D, row.data() + (hq / G) * D, D);
        }
        for (int64_t hq = 0; hq < H; ++hq) {  // online softmax: rescale what came before
          float* sh = s.data() + hq * kBlockTokens;
          float mb = m[hq];
          for (int64_t j = 0; j < n; ++j) mb = std::max(mb, sh[j]);
          const float corr = exp_neg(m[hq] - mb);  // ~0 on the first block (m = -inf)
          l[hq] *= corr;
          scale_row(acc.data() + hq * D, corr, D);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < n; ++j) {
            sh[j] = exp_neg(sh[j] - mb);
            sum += sh[j];
          }
          l[hq] += sum;
          m[hq] = mb;
        }
        for (int64_t j = 0; j < n; ++j) {
          if (j + kPrefetch < n) __builtin_prefetch(vp + static_cast<int64_t>(slots[tb + j + kPrefetch]) * vs0);
          load_row(vp + static_cast<int64_t>(slots[tb + j]) * vs0, row.data(), Hkv * D);
          for (int64_t hq = 0; hq < H; ++hq)
            axpy(acc.data() + hq * D, s[hq * kBlockTokens + j], row.data() + (hq / G) * D, D);
        }
      }
      for (int64_t hq = 0; hq < H; ++hq) {
        if (ntot == 1) {
          scale_row(acc.data() + hq * D, 1.f / l[hq], D);
          store_row(acc.data() + hq * D, op + b * os0 + hq * os1, D);
        } else {
          const int64_t idx = (b * H + hq) * ntot + sp;
          std::memcpy(part_acc.data() + idx * D, acc.data() + hq * D, D * sizeof(float));
          part_ml[idx * 2] = m[hq];
          part_ml[idx * 2 + 1] = l[hq];
        }
      }
    }
  });
  if (ntot == 1) return;

  radixserve::parallel_for_dynamic(B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> res(D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const float* ml = part_ml.data() + bh * ntot * 2;
      float mx = neg_inf;
      for (int64_t sp = 0; sp < ntot; ++sp) mx = std::max(mx, ml[sp * 2]);
      std::fill(res.begin(), res.end(), 0.f);
      float total = 0.f;
      for (int64_t sp = 0; sp < ntot; ++sp) {
        if (ml[sp * 2 + 1] == 0.f) continue;  // an empty split (its request is short)
        const float w = std::exp(ml[sp * 2] - mx);
        total += ml[sp * 2 + 1] * w;
        axpy(res.data(), w, part_acc.data() + (bh * ntot + sp) * D, D);
      }
      scale_row(res.data(), 1.f / total, D);
      const int64_t b = bh / H, head = bh % H;
      store_row(res.data(), op + b * os0 + head * os1, D);
    }
  });
}

void decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                      const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                      double scale, int64_t shared_prefix_len, int64_t split_tokens) {
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3 && out.sizes() == q.sizes(),
              "decode_attention: q/out [B, H, D], k_buf/v_buf [slots, Hkv, D]");
  TORCH_CHECK(q.size(1) % k_buf.size(1) == 0, "decode_attention: heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(2) == k_buf.size(2) && v_buf.sizes() == k_buf.sizes(), "decode_attention: head_dim mismatch");
  TORCH_CHECK(q.scalar_type() == out.scalar_type() && v_buf.scalar_type() == k_buf.scalar_type(),
              "decode_attention: q and out must share a dtype, and so must the K and V pools");
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.stride(1) == 1, "req_to_token: int32, rows contiguous");
  TORCH_CHECK(req_pool_indices.scalar_type() == at::kLong && req_pool_indices.is_contiguous() &&
                  seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous() &&
                  seq_lens.numel() == q.size(0) && req_pool_indices.numel() == q.size(0),
              "decode_attention: req_pool_indices / seq_lens: contiguous int64 [B]");
#if !defined(RADIXSERVE_TILE_ATTENTION)
  TORCH_CHECK(shared_prefix_len == 0, "decode_attention: shared_prefix_len needs the AVX-512 or AVX2 build");
#endif
  // Every request's first shared_prefix_len slots are the same (the caller checked) and it has
  // at least one key of its own past them.
  TORCH_CHECK(shared_prefix_len >= 0 && (shared_prefix_len == 0 ||
                  seq_lens.min().item<int64_t>() > shared_prefix_len),
              "decode_attention: shared_prefix_len must be below every sequence length");
  TORCH_CHECK(shared_prefix_len == 0 || q.size(2) % 16 == 0,
              "decode_attention: a shared prefix needs head_dim a multiple of 16");
  TORCH_CHECK(split_tokens >= 0 && (split_tokens == 0 || shared_prefix_len == 0),
              "decode_attention: split_tokens >= 0 (0: adaptive), and a fixed split reads no shared prefix apart");
  check_attention_layout(q, out, k_buf, v_buf, "decode_attention");
  // q in the activations' dtype, the KV pool in --kv-cache-dtype (float32 q over a bf16 pool on
  // the CPU's bf16 mode): each row is widened to float32 as it is read.
  DISPATCH_FLOAT_TYPES(q.scalar_type(), "decode_attention", [&] {
    using q_t = scalar_t;
    DISPATCH_FLOAT_TYPES(k_buf.scalar_type(), "decode_attention", [&] {
      decode_attention_impl<q_t, scalar_t>(out, q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, scale,
                                           shared_prefix_len, split_tokens);
    });
  });
}

// ---- extend (prefill) attention over the paged pool --------------------------------------------
//
// New token i of request r sits at position prefix_r + i and attends to the request's keys
// 0 .. prefix_r + i, read in place through req_to_token (the batch's new K/V are stored first: a
// new token sees its neighbours as the cache holds them, as decode will). float32 math, like the
// decode kernel: the pool's rows are widened once per block.
//
// Work item: (request, block of kExtTokens new tokens, kv head): each block of 16 keys becomes a
// tile (load_kv_tile) that serves the item's tokens x G heads (TileRows). Items go round-robin
// to the threads: causal blocks differ in cost.
#if defined(RADIXSERVE_TILE_ATTENTION)
constexpr int64_t kExtTokens = 64;  // new tokens per work item: they share each K/V tile

bool has_extend_attention() { return true; }

template <typename TQ, typename TKV>
void extend_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                           const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                           const at::Tensor& prefix_lens, const at::Tensor& extend_lens, const at::Tensor& q_starts,
                           double scale) {
  const int64_t R = req_pool_indices.size(0), H = q.size(1), D = q.size(2), Hkv = k_buf.size(1), G = H / Hkv;
  const TQ* qp = q.data_ptr<TQ>();
  TQ* op = out.data_ptr<TQ>();
  const TKV* kp = k_buf.data_ptr<TKV>();
  const TKV* vp = v_buf.data_ptr<TKV>();
  const int32_t* r2t = req_to_token.data_ptr<int32_t>();
  const int64_t *pool_rows = req_pool_indices.data_ptr<int64_t>(), *pre = prefix_lens.data_ptr<int64_t>();
  const int64_t *ext = extend_lens.data_ptr<int64_t>(), *qs = q_starts.data_ptr<int64_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t ks0 = k_buf.stride(0), vs0 = v_buf.stride(0), r2t_s0 = req_to_token.stride(0);
  std::vector<std::array<int64_t, 3>> items;  // (request, first new token, kv head)
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i0 = 0; i0 < ext[r]; i0 += kExtTokens)
      for (int64_t g = 0; g < Hkv; ++g) items.push_back({r, i0, g});
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Items from an atomic counter (their costs differ: a later chunk of a request sees more keys).
  radixserve::parallel_for_dynamic(static_cast<int64_t>(items.size()), 1, [&](int64_t i_begin, int64_t i_end) {
    const int64_t nrows = kExtTokens * G;  // (token, head) rows of an item: row = token * G + head
    std::vector<float> qf(nrows * D), acc(nrows * D), m(nrows), l(nrows), kt(D * kTileKeys), vt(kTileKeys * D),
        krow(D);
    std::vector<float> pbuf(kTileRows * kTileKeys);
    TileRows rows{kt.data(), vt.data(), D, pbuf.data()};
    for (int64_t it = i_begin; it < i_end; ++it) {
      const int64_t r = items[it][0], i0 = items[it][1], g = items[it][2];
      const int64_t nq = std::min<int64_t>(kExtTokens, ext[r] - i0), p0 = pre[r] + i0, nkeys = p0 + nq;
      const int32_t* slots = r2t + pool_rows[r] * r2t_s0;
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t h = 0; h < G; ++h) {
          float* dst = qf.data() + (i * G + h) * D;
          load_row(qp + (qs[r] + i0 + i) * qs0 + (g * G + h) * qs1, dst, D);
          scale_row(dst, static_cast<float>(scale), D);
        }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t k0 = 0; k0 < nkeys; k0 += kTileKeys) {
        const int64_t nk = std::min<int64_t>(kTileKeys, nkeys - k0);
        load_kv_tile(kp + g * D, vp + g * D, ks0, vs0, slots + k0, nk, D, krow.data(), kt.data(), vt.data());
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t visible = std::min<int64_t>(nk, p0 + i - k0 + 1);  // causal: keys <= its position
          if (visible <= 0) continue;
          for (int64_t h = 0; h < G; ++h) {
            const int64_t row = i * G + h;
            rows.add(qf.data() + row * D, acc.data() + row * D, &m[row], &l[row], visible);
          }
        }
        rows.flush();
      }
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t h = 0; h < G; ++h) {
          float* a = acc.data() + (i * G + h) * D;
          scale_row(a, 1.f / l[i * G + h], D);
          store_row(a, op + (qs[r] + i0 + i) * os0 + (g * G + h) * os1, D);
        }
    }
  });
}

void extend_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                      const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& prefix_lens,
                      const at::Tensor& extend_lens, const at::Tensor& q_starts, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && out.sizes() == q.sizes() && v_buf.sizes() == k_buf.sizes(),
              "extend_attention: q/out [T, H, D], k_buf/v_buf [slots, Hkv, D]");
  TORCH_CHECK(q.size(1) % k_buf.size(1) == 0 && q.size(2) == k_buf.size(2) && q.size(2) % 16 == 0,
              "extend_attention: heads a multiple of KV heads, head_dim a multiple of 16");
  TORCH_CHECK(q.scalar_type() == out.scalar_type() && v_buf.scalar_type() == k_buf.scalar_type(),
              "extend_attention: q and out must share a dtype, and so must the K and V pools");
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.stride(1) == 1, "req_to_token: int32, rows contiguous");
  for (const at::Tensor* t : {&req_pool_indices, &prefix_lens, &extend_lens, &q_starts})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == req_pool_indices.numel(),
                "extend_attention: req_pool_indices / prefix_lens / extend_lens / q_starts: contiguous int64 [R]");
  check_attention_layout(q, out, k_buf, v_buf, "extend_attention");
  DISPATCH_FLOAT_TYPES(q.scalar_type(), "extend_attention", [&] {
    using q_t = scalar_t;
    DISPATCH_FLOAT_TYPES(k_buf.scalar_type(), "extend_attention", [&] {
      extend_attention_impl<q_t, scalar_t>(out, q, k_buf, v_buf, req_to_token, req_pool_indices, prefix_lens,
                                           extend_lens, q_starts, scale);
    });
  });
}
#else
bool has_extend_attention() { return false; }
void extend_attention(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double) {
  TORCH_CHECK(false, "extend_attention: built without AVX-512 or AVX2");
}
#endif

// ---- store K and V of new tokens at their slots: k_buf[loc[i]] = k[i], v_buf[loc[i]] = v[i] -----
void store_kv(at::Tensor k_buf, at::Tensor v_buf, const at::Tensor& loc_in, const at::Tensor& k_in,
              const at::Tensor& v_in) {
  const at::Tensor loc = loc_in.to(at::kLong).contiguous();
  const at::Tensor k = k_in.to(k_buf.scalar_type()).contiguous(), v = v_in.to(v_buf.scalar_type()).contiguous();
  const int64_t n = loc.numel(), row = k_buf.stride(0), slots = k_buf.size(0);
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous() && v_buf.sizes() == k_buf.sizes(), "store_kv: pool buffers");
  TORCH_CHECK(k.numel() == n * row && v.numel() == n * row, "store_kv: one [heads, head_dim] row per slot");
  const int64_t* lp = loc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(lp[i] >= 0 && lp[i] < slots, "store_kv: slot ", lp[i], " out of range");
  const int64_t bytes = row * k.element_size();
  char *kb = static_cast<char*>(k_buf.data_ptr()), *vb = static_cast<char*>(v_buf.data_ptr());
  const char *ks = static_cast<const char*>(k.data_ptr()), *vs = static_cast<const char*>(v.data_ptr());
  radixserve::parallel_for_dynamic(n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(kb + lp[i] * bytes, ks + i * bytes, bytes);
      std::memcpy(vb + lp[i] * bytes, vs + i * bytes, bytes);
    }
  });
}

// ---- RMSNorm, with the residual add fused --------------------------------------------------
//
// With a residual: s = x + residual (rounded to x's dtype, as the torch path adds), returns
// (rmsnorm(s) * weight, s). Without: (rmsnorm(x) * weight, undefined). Rows of x: [..., N].
template <typename T>
void rmsnorm_impl(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps,
                  at::Tensor& out, at::Tensor* res_out) {
  const int64_t N = x.size(-1), rows = x.numel() / N;
  const T* xp = x.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  T* sp = res_out ? res_out->data_ptr<T>() : nullptr;
  std::vector<float> w(N);
  if (weight.scalar_type() == x.scalar_type() && weight.is_contiguous()) {
    load_row(weight.data_ptr<T>(), w.data(), N);  // the usual case: no tensor made per call
  } else {
    const at::Tensor wf = weight.to(at::kFloat).contiguous();
    std::memcpy(w.data(), wf.data_ptr<float>(), N * sizeof(float));
  }
  radixserve::parallel_for_dynamic(rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> a(N), r(N);
    for (int64_t i = begin; i < end; ++i) {
      load_row(xp + i * N, a.data(), N);
      if (rp) {
        load_row(rp + i * N, r.data(), N);
        for (int64_t j = 0; j < N; ++j) a[j] = static_cast<float>(static_cast<T>(a[j] + r[j]));
        store_row(a.data(), sp + i * N, N);
      }
      const float inv = 1.f / std::sqrt(dot(a.data(), a.data(), N) / N + static_cast<float>(eps));
#pragma omp simd
      for (int64_t j = 0; j < N; ++j) a[j] = a[j] * inv * w[j];
      store_row(a.data(), op + i * N, N);
    }
  });
}

std::vector<at::Tensor> fused_add_rmsnorm(const at::Tensor& x_in, const c10::optional<at::Tensor>& residual_in,
                                          const at::Tensor& weight, double eps) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(weight.numel() == x.size(-1), "rmsnorm: weight size must equal the last dim");
  at::Tensor out = at::empty_like(x);
  at::Tensor residual, res_out;
  if (residual_in.has_value()) {
    residual = residual_in->contiguous();
    TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(), "rmsnorm: residual like x");
    res_out = at::empty_like(x);
  }
  DISPATCH_FLOAT_TYPES(x.scalar_type(), "fused_add_rmsnorm", [&] {
    rmsnorm_impl<scalar_t>(x, residual.defined() ? &residual : nullptr, weight, eps, out,
                           res_out.defined() ? &res_out : nullptr);
  });
  if (res_out.defined()) return {out, res_out};
  return {out};
}

// ---- rotary embedding (neox style: the two halves of the rotary dims rotate together) -------
//
// x [T, heads, head_dim] (any token/head strides), cos/sin [max_position, rotary_dim] float32
// with each half repeated; returns a contiguous rotated copy. Dims past rotary_dim pass through.
template <typename T>
void rotary_impl(const at::Tensor& x, const int64_t* pos, const float* cos, const float* sin, int64_t cs_stride,
                 int64_t rotary_dim, at::Tensor& out) {
  const int64_t Tn = x.size(0), Hn = x.size(1), D = x.size(2), half = rotary_dim / 2;
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  radixserve::parallel_for_dynamic(Tn * Hn, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> a(D), o(D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / Hn, h = i % Hn;
      const float* c = cos + pos[t] * cs_stride;
      const float* s = sin + pos[t] * cs_stride;
      load_row(xp + t * xs0 + h * xs1, a.data(), D);
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        o[j] = a[j] * c[j] - a[j + half] * s[j];
        o[j + half] = a[j + half] * c[j + half] + a[j] * s[j + half];
      }
      for (int64_t j = rotary_dim; j < D; ++j) o[j] = a[j];
      store_row(o.data(), op + i * D, D);
    }
  });
}

std::vector<at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& cos, const at::Tensor& sin, int64_t rotary_dim) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2), "rotary: q/k [T, heads, D]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(1) == rotary_dim,
              "rotary: cos/sin contiguous float32 [max_position, rotary_dim]");
  TORCH_CHECK(rotary_dim % 2 == 0 && rotary_dim <= q.size(2), "rotary: bad rotary_dim");
  check_last_dim_contiguous(q, "rotary q");
  check_last_dim_contiguous(k, "rotary k");
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == q.size(0), "rotary: one position per token");
  if (pos.numel() > 0) {
    const int64_t lo = pos.min().item<int64_t>(), hi = pos.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < cos.size(0), "rotary: position ", hi, " outside the table of ", cos.size(0));
  }
  at::Tensor q_out = at::empty(q.sizes(), q.options()), k_out = at::empty(k.sizes(), k.options());
  DISPATCH_FLOAT_TYPES(q.scalar_type(), "rotary_embedding", [&] {
    rotary_impl<scalar_t>(q, pos.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(), rotary_dim,
                          rotary_dim, q_out);
    rotary_impl<scalar_t>(k, pos.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(), rotary_dim,
                          rotary_dim, k_out);
  });
  return {q_out, k_out};
}

// ---- SiLU-and-mul: out = silu(x[:, :d]) * x[:, d:] ---------------------------------------------
// g[j] = silu(g[j]) * u[j], sigmoid from exp(-|g|) <= 1 (in range of exp_neg). On vectors of
// exp_neg_v: GCC left the scalar loop unvectorized (nearbyint, the bit cast), 6x slower than
// torch's silu * mul at 262 x 8960 (5% of a Qwen2.5-1.5B prefill).
inline void silu_mul_row(float* g, const float* u, int64_t d) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 sign = _mm512_set1_ps(-0.f), one = _mm512_set1_ps(1.f);
  for (; j + 16 <= d; j += 16) {
    const __m512 gv = _mm512_loadu_ps(g + j);
    const __m512 e = exp_neg_v(_mm512_or_ps(gv, sign));  // -|g|
    const __m512 num = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_GE_OQ), one);
    _mm512_storeu_ps(g + j, _mm512_mul_ps(_mm512_mul_ps(gv, _mm512_div_ps(num, _mm512_add_ps(one, e))),
                                          _mm512_loadu_ps(u + j)));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 sign = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f);
  for (; j + 8 <= d; j += 8) {
    const __m256 gv = _mm256_loadu_ps(g + j);
    const __m256 e = exp_neg_v(_mm256_or_ps(gv, sign));  // -|g|
    const __m256 num = _mm256_blendv_ps(e, one, _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_GE_OQ));
    _mm256_storeu_ps(g + j, _mm256_mul_ps(_mm256_mul_ps(gv, _mm256_div_ps(num, _mm256_add_ps(one, e))),
                                          _mm256_loadu_ps(u + j)));
  }
#endif
  for (; j < d; ++j) {
    const float e = exp_neg(-std::fabs(g[j]));
    g[j] = g[j] * ((g[j] >= 0.f ? 1.f : e) / (1.f + e)) * u[j];
  }
}

template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t d = out.size(-1), rows = out.numel() / d;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  radixserve::parallel_for_dynamic(rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> g(d), u(d);
    for (int64_t i = begin; i < end; ++i) {
      load_row(xp + i * 2 * d, g.data(), d);
      load_row(xp + i * 2 * d + d, u.data(), d);
      silu_mul_row(g.data(), u.data(), d);
      store_row(g.data(), op + i * d, d);
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x_in) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.size(-1) % 2 == 0, "silu_and_mul: last dim must be even");
  auto sizes = x.sizes().vec();
  sizes.back() /= 2;
  at::Tensor out = at::empty(sizes, x.options());
  DISPATCH_FLOAT_TYPES(x.scalar_type(), "silu_and_mul",
                                  [&] { silu_and_mul_impl<scalar_t>(x, out); });
  return out;
}

// ---- for tests: how many times parallel_for_dynamic visits each of n items (each must be 1) ----
at::Tensor parallel_for_visits(int64_t n, int64_t grain) {
  at::Tensor counts = at::zeros({n}, at::kInt);
  int32_t* c = counts.data_ptr<int32_t>();
  radixserve::parallel_for_dynamic(n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
#pragma omp atomic
      c[i] += 1;
    }
  });
  return counts;
}

// ---- the division of parallel_for_dynamic, and test hooks for it (parallel.h) ------------------
void set_parallel_division(const std::string& name) {
  if (name == "pool") {
    radixserve::set_division(radixserve::Division::kPool);
  } else if (name == "omp") {
    radixserve::set_division(radixserve::Division::kOmp);
  } else if (name == "static") {
    radixserve::set_division(radixserve::Division::kStatic);
  } else {
    TORCH_CHECK(false, "set_parallel_division: expected 'pool', 'omp' or 'static', got '", name, "'");
  }
}

std::string parallel_division() {
  switch (radixserve::division()) {
    case radixserve::Division::kPool: return "pool";
    case radixserve::Division::kOmp: return "omp";
    default: return "static";
  }
}

// For tests: the thread ids that ran chunks of a region of n items (one item a chunk). Each
// thread's first chunk waits (up to timeout_s) until `wait_for` distinct threads have started
// one, so that a test sees every thread of the region take part.
std::vector<int64_t> parallel_thread_ids(int64_t n, int64_t wait_for, double timeout_s) {
  std::vector<std::atomic<int>> seen(64);
  std::atomic<int> distinct{0};
  std::atomic<bool> bad_id{false};
  const int64_t nthreads = at::get_num_threads();
  radixserve::parallel_for_dynamic(n, 1, [&](int64_t, int64_t) {
    const int id = at::get_thread_num();
    if (id < 0 || id >= nthreads || id >= 64) {
      bad_id = true;
      return;
    }
    if (seen[id].fetch_add(1) == 0) {
      distinct.fetch_add(1);
      const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
      while (distinct.load() < wait_for && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  });
  TORCH_CHECK(!bad_id.load(), "parallel_thread_ids: at::get_thread_num() outside [0, get_num_threads())");
  std::vector<int64_t> ids;
  for (int i = 0; i < 64; ++i)
    if (seen[i].load() > 0) ids.push_back(i);
  return ids;
}

// For tests: a region of n items whose item `bad` throws.
void parallel_for_throw(int64_t n, int64_t grain, int64_t bad) {
  radixserve::parallel_for_dynamic(n, grain, [&](int64_t begin, int64_t end) {
    if (begin <= bad && bad < end) throw std::runtime_error("parallel_for_throw: item " + std::to_string(bad));
  });
}

// ---- small-batch bf16 linear layers: y = x @ W^T on AVX512_BF16 or AVX2 + FMA -------------------
//
// A decode step multiplies a few rows of activations by every weight matrix once: it is bound by
// streaming the weights, and torch's bf16 GEMM reached ~25 GB/s of this machine's ~90 there. The
// weight is repacked once, at load, into blocks of 16 output rows whose K dimension is
// interleaved in pairs ([N/16][K/2][16][2]): one 64-byte load then feeds one vdpbf16ps per
// activation row (16 outputs x a pair of K), with a broadcast pair of x, and every output keeps
// its own fp32 lane: no horizontal sums. Activations are tiled kMr (kMrPrefill) rows at a time.
//
// Two instruction sets, one layout and one driver (bf16_linear, the MoE kernels below): each
// defines gemm_tile (a register tile: a few rows of x times a tile of packed blocks), its tile
// sizes, and GemmX, the x operand the tile reads:
//   AVX512_BF16  vdpbf16ps: float32 x is rounded to bf16 (nearest even) as the dot products'
//                operand, as llama.cpp does for its BF16 weights; fp32 sums.
//   AVX2 + FMA   no bf16 dot product: a 32-bit lane of the packed weight (one output's K pair) is
//                widened to float32 by a shift (even k) and a mask (odd k) and multiplied in
//                float32 with x as it is: float32 x stays float32 (free here, and closer to
//                float32 than bf16 operands), bf16 x is widened once.
// has_avx512_bf16() tells the two apart (the tests' references, the LM head's refine).
#if defined(__AVX512BF16__)
constexpr int64_t kBlockN = 16;  // outputs per packed block (one zmm of fp32 accumulators)
constexpr int64_t kTileBlocks = 2;
// Activation rows per register tile: 2 x kMr accumulators. Decode sizes take 12: at 8 (the
// first choice) M = 16 took two passes over the weights, the second re-reading from cache what
// the first had waited on memory for (SmolLM2's matrices at M = 8 / 12 / 16 / 32: 12.0 / 14.0 /
// 17.3 / 27.6 ms at 8, 11.6 / 11.9 / 14.3 / 24.9 at 12; 14 no better). Prefill keeps the 8 it
// had: a 16 x 512 prefill's GEMMs measured within this machine's noise of each other (4.6-5.2 s).
constexpr int64_t kMr = 12, kMrPrefill = 8;
constexpr int64_t kPrefetchPairs = 32;  // weight lines fetched ahead in each block's stream
constexpr int64_t kMBlock = 64;  // up to this many rows, a work item takes them all
constexpr int64_t kPanelBytes = 512 << 10;  // prefill: weight bytes a work item walks for its rows (half an L2)
constexpr bool kHasAvx512Bf16 = true;
using GemmX = uint16_t;  // the dot products' x operand: bf16

inline void round_row_bf16(const float* src, uint16_t* dst, int64_t n) {  // nearest even
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = i + 16 <= n ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm256_mask_storeu_epi16(dst + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + i)));
  }
}
inline void to_gemm_x(const float* src, GemmX* dst, int64_t n) { round_row_bf16(src, dst, n); }
inline void to_gemm_x(const at::BFloat16* src, GemmX* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(GemmX)); }

inline uint32_t lanes_at_least(const float* v, float t) {  // bit i: v[i] >= t, for 16 lanes
  return _mm512_cmp_ps_mask(_mm512_loadu_ps(v), _mm512_set1_ps(t), _CMP_GE_OQ);
}

// y: float32 (out_f32: the accumulators as they are) or bf16 (rounded once, to nearest even).
template <int MR, int NB = kTileBlocks>  // NB: packed blocks per tile (blocks <= NB of them at run time)
inline void gemm_tile(const uint16_t* x, int64_t x_stride, const uint16_t* wp, int64_t k2, int64_t blocks,
                      const float* bias, void* y, bool out_f32, int64_t y_stride, int64_t n0, int64_t N) {
  __m512 acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int64_t t = 0; t < NB; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t block_stride = k2 * kBlockN * 2;
  for (int64_t k = 0; k < k2; ++k) {
    __m512bh w[NB];
    for (int64_t t = 0; t < blocks; ++t) {
      _mm_prefetch(reinterpret_cast<const char*>(wp + t * block_stride + (k + kPrefetchPairs) * kBlockN * 2), _MM_HINT_T0);
      w[t] = (__m512bh)_mm512_loadu_si512(wp + t * block_stride + k * kBlockN * 2);
    }
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * x_stride + 2 * k, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int64_t t = 0; t < blocks; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], xb, w[t]);
    }
  }
  for (int64_t t = 0; t < blocks; ++t) {
    const int64_t n = n0 + t * kBlockN, valid = std::min<int64_t>(kBlockN, N - n);
    const __mmask16 mask = valid >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) {
      const __m512 out = _mm512_add_ps(acc[r][t], b);
      if (out_f32)
        _mm512_mask_storeu_ps(static_cast<float*>(y) + r * y_stride + n, mask, out);
      else
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + r * y_stride + n, mask, (__m256i)_mm512_cvtneps_pbh(out));
    }
  }
}

using TileFn = void (*)(const GemmX*, int64_t, const uint16_t*, int64_t, int64_t, const float*, void*, bool, int64_t,
                        int64_t, int64_t);
constexpr TileFn kTiles[kMr + 1] = {nullptr,         gemm_tile<1>, gemm_tile<2>, gemm_tile<3>, gemm_tile<4>,
                                    gemm_tile<5>, gemm_tile<6>, gemm_tile<7>, gemm_tile<8>, gemm_tile<9>, gemm_tile<10>, gemm_tile<11>, gemm_tile<12>};
// Every output lane sums its K pairs in one chain, in order, whatever the tile's rows: already
// batch-invariant, so the batch-invariant mode takes the same tiles.
inline const TileFn* tile_fns(bool = false) { return kTiles; }

// y [M, N] (float32, or bf16: out_f32 false) = x [M, K] @ the packed weight^T + bias.
void gemm_rows(const GemmX* xp, int64_t M, int64_t K, const at::Tensor& wp, int64_t N, const float* bp, at::Tensor& y) {
  const bool out_f32 = y.scalar_type() == at::kFloat;
  const int64_t k2 = wp.size(1);
  const uint16_t* wpp = reinterpret_cast<const uint16_t*>(wp.data_ptr());
  char* yp = static_cast<char*>(y.data_ptr());
  const int64_t y_row_bytes = N * y.element_size();
  // Decode sizes (M <= kMBlock): a work item is a tile of outputs for every row, so each weight
  // is read from memory once per call and stays in cache across the row tiles. Longer inputs
  // (prefill): a work item is a panel of tiles (~kPanelBytes of weight: it stays in L2) for one
  // row tile, row tiles fastest, so the weight is read from memory once per call and each row
  // tile of x (a few KiB) is re-read from cache. (Row tiles outermost streamed the whole weight
  // once per 8 rows: memory-bound for a weight beyond the L3, 2x oneDNN's time at Qwen2.5-1.5B's
  // gate/up, benchmarks/NOTES.md.)
  const int64_t tile_blocks = kTileBlocks, tiles = ceil_div(wp.size(0), tile_blocks);
  const int64_t tile_bytes = tile_blocks * k2 * kBlockN * 2 * 2;
  const bool decode = M <= kMBlock;
  const int64_t mr_max = decode ? kMr : kMrPrefill, m_step = decode ? M : kMrPrefill, row_tiles = ceil_div(M, m_step);
  const int64_t panel = decode ? 1 : std::max<int64_t>(1, kPanelBytes / tile_bytes);
  const int64_t panels = ceil_div(tiles, panel), items = decode ? tiles * row_tiles : panels * row_tiles;
  radixserve::parallel_for_dynamic(items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row_tile = decode ? item / tiles : item % row_tiles;
      const int64_t t0 = decode ? item % tiles : (item / row_tiles) * panel, t1 = decode ? t0 + 1 : std::min(tiles, t0 + panel);
      const int64_t m_begin = row_tile * m_step, m_end = std::min(M, m_begin + m_step);
      for (int64_t tile = t0; tile < t1; ++tile) {
        const int64_t b0 = tile * tile_blocks, blocks = std::min(tile_blocks, wp.size(0) - b0), n0 = b0 * kBlockN;
        if (n0 >= N) continue;
        const uint16_t* w_tile = wpp + b0 * k2 * kBlockN * 2;
        for (int64_t m0 = m_begin; m0 < m_end; m0 += mr_max) {
          const int64_t mr = std::min(mr_max, m_end - m0);
          tile_fns()[mr](xp + m0 * K, K, w_tile, k2, blocks, bp, yp + m0 * y_row_bytes, out_f32, N, n0, N);
        }
      }
    }
  });
}
#define RADIXSERVE_BF16_GEMM 1
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kBlockN = 16;  // outputs per packed block (two ymm of fp32 accumulators)
// One block per tile: a row's accumulators are 2 ymm, and the block's widened weights (4 ymm: even
// and odd k of both halves) stay in registers across the tile's rows, within AVX2's 16 ymm.
constexpr int64_t kTileBlocks = 1;
// Rows per register tile: 2 x kMr accumulators + 4 weights + 1 broadcast x (<= 16 ymm). gemm_rows
// splits a work item's rows evenly over its register tiles (16 rows: 4 x 4, not 5 + 5 + 5 + 1).
constexpr int64_t kMr = 5;
constexpr int64_t kPrefetchPairs = 32;  // weight lines fetched ahead in the block's stream
constexpr int64_t kMBlock = 64;  // rows a work item takes (decode: all of them)
// gemm_rows walks K in chunks of this many pairs: a chunk of a block (16 KiB) and of the rows of x
// stay in L1 / L2 while the register tiles take turns on them. Whole rows did not: at K = 8960 and
// 16 rows, x (560 KiB) and the block (280 KiB) spilled L2, 4x the time of K = 1536 per FLOP.
constexpr int64_t kChunkPairs = 256;
constexpr bool kHasAvx512Bf16 = false;
using GemmX = float;  // the dot products' x operand: float32

inline void to_gemm_x(const float* src, GemmX* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(GemmX)); }
inline void to_gemm_x(const at::BFloat16* src, GemmX* dst, int64_t n) { load_row(src, dst, n); }

inline uint32_t lanes_at_least(const float* v, float t) {  // bit i: v[i] >= t, for 16 lanes
  const __m256 tv = _mm256_set1_ps(t);
  const uint32_t lo = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v), tv, _CMP_GE_OQ));
  const uint32_t hi = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + 8), tv, _CMP_GE_OQ));
  return lo | hi << 8;
}

// One packed block (16 outputs) for MR rows of float32 x. A lane of the packed weight is one
// output's K pair: the even k (low half) widens by a shift, the odd k (high half) by a mask.
// y: float32 (out_f32) or bf16 (rounded once, to nearest even). `blocks` is always 1 here. ACC:
// add to float32 y (the sums of earlier K chunks; gemm_rows) instead of overwriting it.
template <int MR, bool ACC = false, bool ONE_CHAIN = false>
inline void gemm_tile(const float* x, int64_t x_stride, const uint16_t* wp, int64_t k2, int64_t /*blocks*/,
                      const float* bias, void* y, bool out_f32, int64_t y_stride, int64_t n0, int64_t N) {
  // One or two rows: even and odd k sum apart (more independent FMA chains than FMA latency
  // needs); more rows have enough chains in one set. ONE_CHAIN (batch-invariant mode): one set
  // whatever MR, so an output's sum does not depend on how many rows share its tile. Every loop
  // over the accumulators is unrolled (constant indices): one indexed at run time puts them in
  // memory, stored on every k.
  constexpr int S = MR <= 2 && !ONE_CHAIN ? 2 : 1;
  __m256 acc[MR][S][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int s = 0; s < S; ++s) acc[r][s][0] = acc[r][s][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t k = 0; k < k2; ++k) {
    const uint16_t* wk = wp + k * kBlockN * 2;
    _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchPairs * kBlockN * 2), _MM_HINT_T0);
    __m256 even[2], odd[2];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // outputs 8h .. 8h + 7
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + h * 16));
      even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      odd[h] = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const float* xr = x + r * x_stride + 2 * k;
      const __m256 xe = _mm256_broadcast_ss(xr);
      acc[r][0][0] = _mm256_fmadd_ps(xe, even[0], acc[r][0][0]);
      acc[r][0][1] = _mm256_fmadd_ps(xe, even[1], acc[r][0][1]);
      const __m256 xo = _mm256_broadcast_ss(xr + 1);
      acc[r][S - 1][0] = _mm256_fmadd_ps(xo, odd[0], acc[r][S - 1][0]);
      acc[r][S - 1][1] = _mm256_fmadd_ps(xo, odd[1], acc[r][S - 1][1]);
    }
  }
  const int64_t valid = std::min<int64_t>(kBlockN, N - n0);
  alignas(32) float b[kBlockN] = {};
  if (bias) std::memcpy(b, bias + n0, valid * sizeof(float));
  alignas(32) float out[MR][kBlockN];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256 v = _mm256_add_ps(acc[r][0][h], _mm256_load_ps(b + 8 * h));
      if (S == 2) v = _mm256_add_ps(v, acc[r][S - 1][h]);
      _mm256_store_ps(out[r] + 8 * h, v);
    }
  for (int r = 0; r < MR; ++r) {
    if (ACC) {
      float* yr = static_cast<float*>(y) + r * y_stride + n0;
      for (int64_t i = 0; i < valid; ++i) yr[i] += out[r][i];
    } else if (out_f32) {
      std::memcpy(static_cast<float*>(y) + r * y_stride + n0, out[r], valid * sizeof(float));
    } else {
      at::BFloat16* yr = static_cast<at::BFloat16*>(y) + r * y_stride + n0;
      for (int64_t i = 0; i < valid; ++i) yr[i] = static_cast<at::BFloat16>(out[r][i]);  // nearest even
    }
  }
}

using TileFn = void (*)(const GemmX*, int64_t, const uint16_t*, int64_t, int64_t, const float*, void*, bool, int64_t,
                        int64_t, int64_t);
constexpr TileFn kTiles[kMr + 1] = {nullptr, gemm_tile<1>, gemm_tile<2>, gemm_tile<3>, gemm_tile<4>, gemm_tile<5>};
constexpr TileFn kTilesAcc[kMr + 1] = {nullptr, gemm_tile<1, true>, gemm_tile<2, true>, gemm_tile<3, true>,
                                       gemm_tile<4, true>, gemm_tile<5, true>};
constexpr TileFn kTilesOne[kMr + 1] = {nullptr, gemm_tile<1, false, true>, gemm_tile<2, false, true>,
                                       gemm_tile<3, false, true>, gemm_tile<4, false, true>, gemm_tile<5, false, true>};
constexpr TileFn kTilesAccOne[kMr + 1] = {nullptr, gemm_tile<1, true, true>, gemm_tile<2, true, true>,
                                          gemm_tile<3, true, true>, gemm_tile<4, true, true>, gemm_tile<5, true, true>};
// The register tiles a call uses: batch-invariant mode takes the one-chain ones.
inline const TileFn* tile_fns(bool acc = false) {
  if (g_batch_invariant) return acc ? kTilesAccOne : kTilesOne;
  return acc ? kTilesAcc : kTiles;
}

// y [M, N] (float32, or bf16) = x [M, K] @ the packed weight^T + bias. A work item is one block of
// 16 outputs for up to kMBlock rows (consecutive items: the same rows, the next block), walking K
// in kChunkPairs chunks: the first chunk writes its sums, the next ones add theirs, the last the
// bias. A chunk of the block (16 KiB, in L1) serves every register tile of the rows in turn, and
// the rows' chunk of x (<= 128 KiB) stays in L2 across blocks; a weight is read from memory once
// per kMBlock rows. (Prefill as on AVX-512, a panel of blocks per 5-row tile re-read from L2, ran
// at half this one's FLOP rate here.) A bf16 y is summed in a float32 one and rounded at the end.
void gemm_rows(const GemmX* xp, int64_t M, int64_t K, const at::Tensor& wp, int64_t N, const float* bp, at::Tensor& y_out) {
  at::Tensor y = y_out.scalar_type() == at::kFloat ? y_out : at::empty(y_out.sizes(), y_out.options().dtype(at::kFloat));
  const int64_t k2 = wp.size(1), tiles = wp.size(0);
  const uint16_t* wpp = reinterpret_cast<const uint16_t*>(wp.data_ptr());
  float* yp = y.data_ptr<float>();
  const int64_t row_blocks = ceil_div(M, kMBlock);
  radixserve::parallel_for_dynamic(tiles * row_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t tile = item % tiles, m_begin = item / tiles * kMBlock, n0 = tile * kBlockN;
      if (n0 >= N) continue;
      const int64_t rows = std::min(M, m_begin + kMBlock) - m_begin, groups = ceil_div(rows, kMr);
      for (int64_t c0 = 0; c0 < k2; c0 += kChunkPairs) {
        const int64_t pairs = std::min(kChunkPairs, k2 - c0);
        const TileFn* fns = tile_fns(c0 != 0);
        const float* bias = c0 + pairs == k2 ? bp : nullptr;
        const uint16_t* w_chunk = wpp + (tile * k2 + c0) * kBlockN * 2;
        for (int64_t g = 0, m0 = m_begin; g < groups; ++g) {
          const int64_t mr = rows / groups + (g < rows % groups);
          fns[mr](xp + m0 * K + 2 * c0, K, w_chunk, pairs, 1, bias, yp + m0 * N, true, N, n0, N);
          m0 += mr;
        }
      }
    }
  });
  if (!y.is_same(y_out)) y_out.copy_(y);  // rounded to nearest even
}
#define RADIXSERVE_BF16_GEMM 1
#endif

#if defined(RADIXSERVE_BF16_GEMM)
bool has_bf16_gemm() { return true; }
bool has_avx512_bf16() { return kHasAvx512Bf16; }

at::Tensor pack_bf16_weight(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == at::kBFloat16, "pack_bf16_weight: a [N, K] bf16 weight");
  const at::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1), nb = ceil_div(N, kBlockN), k2 = ceil_div(K, 2);
  at::Tensor out = at::zeros({nb, k2, kBlockN, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  radixserve::parallel_for_dynamic(nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t i = 0; i < kBlockN && b * kBlockN + i < N; ++i) {
        const uint16_t* row = src + (b * kBlockN + i) * K;
        for (int64_t k = 0; k < K; ++k) dst[((b * k2 + k / 2) * kBlockN + i) * 2 + k % 2] = row[k];
      }
  });
  return out;
}

// x: float32 or bf16; y comes back in x's dtype. Float32 activations (the CPU's bf16 mode: bf16
// weights, float32 activations) are rounded to bf16 (nearest even) only as the operand of the dot
// products on AVX512_BF16, as llama.cpp does for its BF16 weights, and used as they are on AVX2;
// the fp32 sums are returned unrounded.
at::Tensor bf16_linear(const at::Tensor& x_in, const at::Tensor& wp, int64_t N, const c10::optional<at::Tensor>& bias_in) {
  const bool out_f32 = x_in.scalar_type() == at::kFloat;
  TORCH_CHECK((out_f32 || x_in.scalar_type() == at::kBFloat16) && wp.scalar_type() == at::kBFloat16 && wp.dim() == 4,
              "bf16_linear: float32 or bf16 activations and a weight from pack_bf16_weight");
  const int64_t k2 = wp.size(1), K = x_in.size(-1);
  TORCH_CHECK(K % 2 == 0 && K / 2 == k2 && wp.size(0) * kBlockN >= N, "bf16_linear: shapes do not match");
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  at::Tensor y = at::empty({M, N}, x_in.options());
  at::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) bias = bias_in->to(at::kFloat).contiguous();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  // The GEMM's x operand: x itself where its dtype is GemmX, else converted once here (no tensor
  // made per call): float32 x rounded to bf16 on AVX512_BF16, bf16 x widened on AVX2.
  const bool x_is_operand = out_f32 == std::is_same<GemmX, float>::value;
  std::vector<GemmX> x_conv(x_is_operand ? 0 : M * K);
  if (!x_is_operand) {
    radixserve::parallel_for_dynamic(M, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        if (out_f32)
          to_gemm_x(x.data_ptr<float>() + r * K, x_conv.data() + r * K, K);
        else
          to_gemm_x(x.data_ptr<at::BFloat16>() + r * K, x_conv.data() + r * K, K);
      }
    });
  }
  const GemmX* xp = x_is_operand ? static_cast<const GemmX*>(x.data_ptr()) : x_conv.data();
  gemm_rows(xp, M, K, wp, N, bp, y);
  return y.view(sizes);
}

// ---- the LM head's largest logits again, from float32 hidden states ----------------------------
//
// bf16_linear rounds float32 activations to bf16 on AVX512_BF16; for the LM head that error lands
// on the logits themselves. Per row: the k largest logits (a min-heap fed only by the 16-lane
// blocks that hold a value above its smallest) are recomputed as float32 hidden . widened bf16
// weight row. In place. (On AVX2 the GEMM's logits are float32 sums of float32 products already.)
void refine_top_logits(at::Tensor logits, const at::Tensor& hidden_in, const at::Tensor& weight, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "refine_top_logits: contiguous float32 logits [M, V]");
  const at::Tensor hidden = hidden_in.to(at::kFloat).contiguous();
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  hidden.dim() == 2 && hidden.size(0) == logits.size(0) && hidden.size(1) == weight.size(1) &&
                  weight.size(0) >= logits.size(1),
              "refine_top_logits: hidden [M, H] and a contiguous bf16 weight [>= V, H]");
  const int64_t M = logits.size(0), V = logits.size(1), H = hidden.size(1);
  k = std::min(k, V);
  if (k <= 0) return;
  float* lp = logits.data_ptr<float>();
  const float* hp = hidden.data_ptr<float>();
  const at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
  radixserve::parallel_for_dynamic(M, 1, [&](int64_t r0, int64_t r1) {
    std::vector<std::pair<float, int64_t>> heap;  // (value, index), smallest value on top
    std::vector<float> row(H);
    const auto greater = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) { return a > b; };
    for (int64_t r = r0; r < r1; ++r) {
      float* l = lp + r * V;
      heap.clear();
      const auto offer = [&](int64_t i) {
        if (static_cast<int64_t>(heap.size()) < k) {
          heap.emplace_back(l[i], -i);  // -i: among equal values the lower index ranks higher
          std::push_heap(heap.begin(), heap.end(), greater);
        } else if (std::make_pair(l[i], -i) > heap.front()) {
          std::pop_heap(heap.begin(), heap.end(), greater);
          heap.back() = {l[i], -i};
          std::push_heap(heap.begin(), heap.end(), greater);
        }
      };
      int64_t i = 0;
      for (; i < k; ++i) offer(i);
      for (; i + 16 <= V; i += 16) {
        for (uint32_t hit = lanes_at_least(l + i, heap.front().first); hit; hit &= hit - 1) offer(i + __builtin_ctz(hit));
      }
      for (; i < V; ++i) offer(i);
      const float* h = hp + r * H;
      for (const auto& e : heap) {
        load_row(wp - e.second * H, row.data(), H);
        l[-e.second] = dot(h, row.data(), H);
      }
    }
  });
}

// ---- the experts of a mixture-of-experts layer on the packed bf16 weights -----------------------
//
// A step's (token, k) pairs are grouped by expert; each expert the step uses then runs gate/up
// (its fused w13), SiLU * up and down once over all of its tokens, on the gemm_tile of bf16_linear
// (float32 activations rounded to bf16 only as the dot products' operand on AVX512_BF16, float32 on
// AVX2; fp32 sums): the dense path's numerics. The torch loop in layers/moe.py calls bf16_linear per expert instead, five
// dispatches and a gather/scatter per expert; here gate/up is one parallel region over every
// (expert, row chunk, output tile), so a decode step's 8 experts share all threads, and down is one
// over output tiles, each adding every expert's routing-weighted rows into its own columns of the
// output in float32 (no atomics, no [pairs, hidden] buffer).
struct MoeChunk {
  int64_t expert, row0, rows;  // rows [row0, row0 + rows) of the expert-sorted pairs
};

// y[rows of each chunk] = x[those rows] @ W_expert^T, float32 out, for every chunk and output tile.
void moe_grouped_gemm(const GemmX* x, int64_t K, const uint16_t* w, int64_t nb, int64_t k2,
                      const std::vector<MoeChunk>& chunks, float* y, int64_t N) {
  const int64_t tiles = ceil_div(nb, kTileBlocks), expert_stride = nb * k2 * kBlockN * 2;
  const int64_t items = static_cast<int64_t>(chunks.size()) * tiles;
  radixserve::parallel_for_dynamic(items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const MoeChunk& c = chunks[item / tiles];
      const int64_t b0 = (item % tiles) * kTileBlocks, blocks = std::min(kTileBlocks, nb - b0), n0 = b0 * kBlockN;
      if (n0 >= N) continue;
      const uint16_t* w_tile = w + c.expert * expert_stride + b0 * k2 * kBlockN * 2;
      for (int64_t m0 = 0; m0 < c.rows; m0 += kMr) {
        const int64_t r = c.row0 + m0, mr = std::min(kMr, c.rows - m0);
        tile_fns()[mr](x + r * K, K, w_tile, k2, blocks, nullptr, y + r * N, true, N, n0, N);
      }
    }
  });
}

// out[token of each row] += its routing weight * (act row @ W2_expert^T), for every chunk. A work
// item owns a tile of output columns across all chunks, so no two threads add to the same
// element, and each element sums its experts in ascending order (the torch loop's order) with no
// [pairs, hidden] buffer of the experts' outputs.
void moe_down_accumulate(const GemmX* act, int64_t K, const uint16_t* w, int64_t nb, int64_t k2,
                         const std::vector<MoeChunk>& chunks, const int64_t* pair_token, const float* pair_weight,
                         float* out, int64_t N) {
  const int64_t tiles = ceil_div(nb, kTileBlocks), expert_stride = nb * k2 * kBlockN * 2;
  radixserve::parallel_for_dynamic(tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> y(kMr * N);  // a register tile's rows; only this item's columns are used
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t b0 = tile * kTileBlocks, blocks = std::min(kTileBlocks, nb - b0), n0 = b0 * kBlockN;
      const int64_t n1 = std::min(N, n0 + blocks * kBlockN);
      if (n0 >= N) continue;
      for (const MoeChunk& c : chunks) {
        const uint16_t* w_tile = w + c.expert * expert_stride + b0 * k2 * kBlockN * 2;
        for (int64_t m0 = 0; m0 < c.rows; m0 += kMr) {
          const int64_t r = c.row0 + m0, mr = std::min(kMr, c.rows - m0);
          tile_fns()[mr](act + r * K, K, w_tile, k2, blocks, nullptr, y.data(), true, N, n0, N);
          for (int64_t i = 0; i < mr; ++i)
            axpy(out + pair_token[r + i] * N + n0, pair_weight[r + i], y.data() + i * N + n0, n1 - n0);
        }
      }
    }
  });
}

// x [M, H] float32; w13 [E][2I/16][H/2][16][2] and w2 [E][H/16][I/2][16][2] (pack_bf16_weight of
// each expert, stacked); topk_weights [M, k] float32 and topk_ids [M, k] int, -1 for a pair to skip
// (an expert another --ep-size rank holds). Returns [M, H] float32.
at::Tensor fused_moe_bf16(const at::Tensor& x_in, const at::Tensor& w13, const at::Tensor& w2,
                          const at::Tensor& topk_weights_in, const at::Tensor& topk_ids_in, int64_t inter) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "fused_moe_bf16: float32 x [M, H]");
  TORCH_CHECK(w13.dim() == 5 && w2.dim() == 5 && w13.scalar_type() == at::kBFloat16 && w2.scalar_type() == at::kBFloat16 &&
                  w13.is_contiguous() && w2.is_contiguous(),
              "fused_moe_bf16: contiguous stacked packed bf16 weights [E, N/16, K/2, 16, 2]");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), H = x.size(1), E = w13.size(0), k2_13 = w13.size(2), k2_2 = w2.size(2);
  TORCH_CHECK(H % 2 == 0 && inter % 2 == 0 && k2_13 * 2 == H && k2_2 * 2 == inter && w2.size(0) == E &&
                  w13.size(1) * kBlockN >= 2 * inter && w2.size(1) * kBlockN >= H,
              "fused_moe_bf16: shapes do not match (even hidden and intermediate sizes)");
  const at::Tensor ids = topk_ids_in.to(at::kLong).contiguous(), tw = topk_weights_in.to(at::kFloat).contiguous();
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == M && tw.sizes() == ids.sizes(), "fused_moe_bf16: topk [M, k]");
  const int64_t topk = ids.size(1), P = M * topk;
  at::Tensor out = at::zeros({M, H}, x.options());
  if (P == 0) return out;
  const int64_t* idp = ids.data_ptr<int64_t>();

  // Group the pairs by expert (a counting sort, stable: tokens stay in order within an expert).
  std::vector<int64_t> offset(E + 1, 0), pair_token(P);
  std::vector<float> pair_weight(P);
  const float* twp = tw.data_ptr<float>();
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(idp[p] >= -1 && idp[p] < E, "fused_moe_bf16: expert id ", idp[p], " outside [-1, ", E, ")");
    if (idp[p] >= 0) ++offset[idp[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) offset[e + 1] += offset[e];
  const int64_t used = offset[E];  // pairs of this rank's experts, grouped in [0, used)
  std::vector<int64_t> fill(offset.begin(), offset.end() - 1);
  for (int64_t p = 0; p < P; ++p) {
    if (idp[p] < 0) continue;
    const int64_t s = fill[idp[p]]++;
    pair_token[s] = p / topk;
    pair_weight[s] = twp[p];
  }
  std::vector<MoeChunk> chunks;  // experts with no tokens get none: their weights are never read
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = offset[e]; r < offset[e + 1]; r += kMBlock) chunks.push_back({e, r, std::min(kMBlock, offset[e + 1] - r)});

  // The GEMM operand of gate/up: each pair's token row, converted once (to_gemm_x).
  std::vector<GemmX> xs(P * H), act(P * inter);
  std::vector<float> h13(P * 2 * inter);
  const float* xp = x.data_ptr<float>();
  radixserve::parallel_for_dynamic(used, 16, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) to_gemm_x(xp + pair_token[s] * H, xs.data() + s * H, H);
  });
  moe_grouped_gemm(xs.data(), H, reinterpret_cast<const uint16_t*>(w13.data_ptr()), w13.size(1), k2_13, chunks,
                   h13.data(), 2 * inter);
  radixserve::parallel_for_dynamic(used, 16, [&](int64_t s0, int64_t s1) {
    std::vector<float> a(inter);
    for (int64_t s = s0; s < s1; ++s) {
      const float* g = h13.data() + s * 2 * inter;
      std::copy(g, g + inter, a.data());
      silu_mul_row(a.data(), g + inter, inter);  // as silu_and_mul
      to_gemm_x(a.data(), act.data() + s * inter, inter);
    }
  });
  moe_down_accumulate(act.data(), inter, reinterpret_cast<const uint16_t*>(w2.data_ptr()), w2.size(1), k2_2, chunks,
                      pair_token.data(), pair_weight.data(), out.data_ptr<float>(), H);
  return out;
}
#else
bool has_bf16_gemm() { return false; }
bool has_avx512_bf16() { return false; }
void refine_top_logits(at::Tensor, const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "built without AVX512_BF16 or AVX2 + FMA");
}
at::Tensor pack_bf16_weight(const at::Tensor&) { TORCH_CHECK(false, "built without AVX512_BF16 or AVX2 + FMA"); }
at::Tensor bf16_linear(const at::Tensor&, const at::Tensor&, int64_t, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "built without AVX512_BF16 or AVX2 + FMA");
}
at::Tensor fused_moe_bf16(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          int64_t) {
  TORCH_CHECK(false, "built without AVX512_BF16 or AVX2 + FMA");
}
#endif

}  // namespace

void register_lora_kernels(pybind11::module_& m);  // lora_kernels.cpp
void register_quant_kernels(pybind11::module_& m);  // quant_kernels.cpp
void register_gdn_kernels(pybind11::module_& m);  // gdn_kernels.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention (writes out)", py::arg("out"), py::arg("q"),
        py::arg("k_buf"), py::arg("v_buf"), py::arg("req_to_token"), py::arg("req_pool_indices"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("shared_prefix_len") = 0, py::arg("split_tokens") = 0);
  m.def("set_batch_invariant", [](bool on) { g_batch_invariant = on; },
        "--enable-deterministic-inference: the GEMMs take one reduction order whatever the row count");
  m.def("batch_invariant", [] { return g_batch_invariant; }, "whether set_batch_invariant(True) was called");
  m.def("has_extend_attention", &has_extend_attention, "whether extend_attention is built (AVX-512)");
  m.def("extend_attention", &extend_attention, "causal extend attention over the paged KV pool (writes out)");
  m.def("store_kv", &store_kv, "write new tokens' K/V rows at their KV-pool slots");
  m.def("fused_add_rmsnorm", &fused_add_rmsnorm, "RMSNorm with an optional fused residual add");
  m.def("rotary_embedding", &rotary_embedding, "neox-style rotary embedding of q and k");
  m.def("has_bf16_gemm", &has_bf16_gemm, "whether bf16_linear and the MoE kernel are built (AVX512_BF16, or AVX2 + FMA)");
  m.def("has_avx512_bf16", &has_avx512_bf16,
        "whether built with AVX512_BF16 (vdpbf16ps): bf16_linear then rounds float32 activations to bf16, and decode "
        "over a bf16 pool splits q in two bf16 halves; on AVX2 float32 activations stay float32");
  m.def("pack_bf16_weight", &pack_bf16_weight, "repack a [N, K] bf16 weight for bf16_linear");
  m.def("bf16_linear", &bf16_linear, "y = x @ W^T (+ bias) with a packed bf16 weight", py::arg("x"), py::arg("packed"),
        py::arg("out_features"), py::arg("bias") = py::none());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("parallel_for_visits", &parallel_for_visits, "visits per item of parallel_for_dynamic (tests)",
        py::call_guard<py::gil_scoped_release>());
  m.def("set_parallel_division", &set_parallel_division,
        "parallel_for_dynamic's division: 'pool' (default), 'omp' (OpenMP region, to compare) or 'static'");
  m.def("parallel_division", &parallel_division, "parallel_for_dynamic's division now");
  m.def("parallel_thread_ids", &parallel_thread_ids, "thread ids that ran a region's chunks (tests)",
        py::call_guard<py::gil_scoped_release>());
  m.def("parallel_for_throw", &parallel_for_throw, "a region whose item `bad` throws (tests)",
        py::call_guard<py::gil_scoped_release>());
  m.def("parallel_test_hold", &radixserve::test_hold_thread,
        "tests: thread `id` blocks on entering its next region until parallel_test_release()");
  m.def("parallel_test_release", &radixserve::test_release_thread, "tests: release the held thread");
  m.def("parallel_test_held", &radixserve::test_thread_held, "tests: whether a thread is held now");
  m.def("refine_top_logits", &refine_top_logits, "recompute each row's k largest logits from float32 hidden states");
  m.def("fused_moe_bf16", &fused_moe_bf16, "a MoE layer's experts over their routed tokens, packed bf16 weights",
        py::arg("x"), py::arg("w13"), py::arg("w2"), py::arg("topk_weights"), py::arg("topk_ids"), py::arg("inter"));
  register_lora_kernels(m);
  register_quant_kernels(m);
  register_gdn_kernels(m);
}
