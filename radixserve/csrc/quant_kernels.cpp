// GGUF-quantized linear layers on the CPU (issue 38): y = x @ dequantize(W)^T with W kept in its
// GGUF blocks, computed the way llama.cpp does it: every row of x quantized to 8 bits per block
// (once per call, into a scratch buffer), then integer dot products of the weight's unsigned
// 4/5/6/8-bit values with the signed 8-bit activations, scaled by the blocks' float scales and
// summed in float32. Two builds of the same numerics (quant_gemm_isa() says which one runs):
//   - AVX512-VNNI (vpdpbusd; the sections below up to "AVX2"), 64-byte vectors;
//   - AVX2 + FMA + F16C (vpmaddubsw + vpmaddwd; the "AVX2" section), 32-byte vectors: the same
//     activation quantization, the same exact int32 sums per block / super-block, the same
//     offset / min terms (except Q8_0, whose signed products need no offset there: llama.cpp's
//     sign trick), so the results differ only in the order of the float32 additions.
// Without either, has_quant_gemm() is false and quant_linear refuses. quant_dequantize_f32 (and,
// without AVX-512, quant_dequantize_bf16) is portable code built on every ISA.
//
// Supported ggml types (ids): Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8 (blocks of 32) and Q4_K=12,
// Q5_K=13, Q6_K=14 (super-blocks of 256). The bit layouts are those of the gguf package's
// dequantize_blocks (= ggml's block_q4_0 ... block_q6_K); weight is uint8 [N, row_bytes], each row
// the GGUF bytes of one output row (row_bytes = K / block * type_size; rows may be a strided view).
//
// Activations (the reference in tests/unit/test_quant_kernels.py repeats this exactly):
//   - 32-block types: per 32 values amax, d = amax / 127, q = rint(x * (127 / amax)) (round half
//     to even; q = 0 where amax = 0), and the block's sum of q (llama.cpp's Q8_0 / Q8_1 with a
//     float32 d).
//   - K-quants: the same per 256 values (llama.cpp's Q8_K), with the sums of q per 16 values.
// Weights (the AVX-512 build; the AVX2 one is described at its section): the unsigned values
// (Q4: 0..15, Q5: 0..31, Q6_K: 0..63, Q8_0: w + 128 in 0..255) are vpdpbusd's unsigned operand,
// the activations the signed one. The constant parts (offsets -8, -16, -32, -128, and the mins
// of Q4_1 / Q5_1 / Q4_K / Q5_K) are not in the integer products: they are  sum over blocks (or sub-blocks) of  wmin[slot] * (d_a * sum(q_a))[slot], a float dot
// product of a per-weight-row vector (-off * d, or the min) with a per-activation-row vector,
// added at the end. The K-quants' integer sub-block scales multiply the vpdpbusd lanes (each
// lane is 4 products, |lane| < 2^15) with vpdpwssd, so a super-block is one int32 accumulator,
// scaled once by d_w * d_a.
//
// Structure, parallel over output rows (parallel_for_dynamic of parallel.h on its worker pool:
// chunks of rows from an atomic counter, so a thread whose core another process took holds no
// region up; the AVX2 build is the same with 8-lane vectors, 4 rows of x per decode pass and K
// chunks of 2048 values):
//   - decode (M <= 16 rows of x; AVX2: 12): each thread streams its chunks of weight rows once, in order (software
//     prefetch 8 KiB ahead); each unit (a group of 4 blocks, or a super-block) is unpacked once
//     into uint8 lanes in an L1 scratch and used for 8 rows of x at a time (a second group of 8
//     re-unpacks the row from L1, not from memory). M = 16 thus reads the weights once, like M = 1.
//   - AVX2 only, decode of M <= quant_decode_fused_rows() (4) rows of x (issue 54): fused, each
//     block unpacked in registers and dotted at once (no scratch; see "Fused decode" below).
// Every path of a build sums an output in one float order (the prefill tiles'; AVX2: see "The
// float order" below), so a row of x gets the same bits at any row count.
//   - prefill: tiles of 4 output rows; for a block of up to MC rows of x (their quantized bytes
//     held in L2) the tile's rows are unpacked chunk by chunk of K (2048 values) into an L1 buffer,
//     once, and used for every row of x in the block: register blocks of 2 weight rows x 4 rows
//     of x, float32 x16 accumulators; at the tile's end each row of x gets its 4 outputs
//     (horizontal sums + the offset / min terms) in one store. Each weight chunk is unpacked once
//     per MC rows of x (MC: 32 .. 256 by K).
// Registered into the cpu_kernels extension by register_quant_kernels (cpu_kernels.cpp).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "parallel.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define RADIXSERVE_QUANT_GEMM 1
#define RADIXSERVE_QUANT_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RADIXSERVE_QUANT_GEMM 1
#define RADIXSERVE_QUANT_AVX2 1
#include <immintrin.h>
#endif

namespace {

enum : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct QInfo {
  int64_t id;
  int64_t block;  // values per block
  int64_t bytes;  // bytes per block
};

constexpr QInfo kTypes[] = {{Q4_0, 32, 18}, {Q4_1, 32, 20}, {Q5_0, 32, 22}, {Q5_1, 32, 24},
                            {Q8_0, 32, 34}, {Q4_K, 256, 144}, {Q5_K, 256, 176}, {Q6_K, 256, 210}};

const QInfo* find_type(int64_t id) {
  for (const auto& t : kTypes)
    if (t.id == id) return &t;
  return nullptr;
}

#if defined(RADIXSERVE_QUANT_AVX512) || defined(RADIXSERVE_QUANT_AVX2)

// ---- byte-level helpers both builds share -----------------------------------------------------
inline uint16_t ld16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline uint32_t ld32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline float h2f(const uint8_t* p) { return _cvtsh_ss(ld16(p)); }

// Q4_K / Q5_K: the 12 bytes at p (after d, dmin) hold eight 6-bit scales and eight 6-bit mins;
// out bytes 0..7 = the scales, 8..15 = the mins (ggml's get_scale_min_k4, for all 8 at once).
inline void k_scales_mins(const uint8_t* p, uint32_t utmp[4]) {
  std::memcpy(utmp, p, 12);
  constexpr uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
  utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4);
  const uint32_t uaux = utmp[1] & kmask1;
  utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4);
  utmp[2] = uaux;
  utmp[0] &= kmask1;
}

#endif

#if defined(RADIXSERVE_QUANT_AVX512)

constexpr int64_t NT = 4;      // output rows per tile (unpacked together)
constexpr int64_t kDecodeRows = 16;  // up to this many rows of x: the decode path
constexpr int64_t UC32 = 16;   // 32-block types: groups of 4 blocks per K chunk (2048 values)
constexpr int64_t UCK = 8;     // K-quants: super-blocks per K chunk (2048 values)

// A loaded vector kept in a register: stops the compiler from folding the load into every
// instruction that uses it (each use would load it again; the loads are the bottleneck).
template <typename V>
inline V in_reg(V v) {
  __asm__("" : "+v"(v));
  return v;
}
inline __m128i ld128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256i ld256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 64 bytes: four 16-byte pieces at p + k * stride (k = 0..3).
inline __m512i gather4x16(const uint8_t* p, int64_t stride) {
  const __m256i a = _mm256_inserti128_si256(_mm256_castsi128_si256(ld128(p)), ld128(p + stride), 1);
  const __m256i b = _mm256_inserti128_si256(_mm256_castsi128_si256(ld128(p + 2 * stride)), ld128(p + 3 * stride), 1);
  return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

// ---------------------------------------------------------------------------------------------
// 32-block types. A group is 4 blocks; its unpacked form is two 64-byte vectors
//   lo = [b0 v0-15 | b1 v0-15 | b2 v0-15 | b3 v0-15],  hi = [b0 v16-31 | b1 v16-31 | ...]
// so that int32 lanes 4j..4j+3 of vpdpbusd(lo) + vpdpbusd(hi) hold block j; dw = 16 floats
// [d0 x4, d1 x4, d2 x4, d3 x4]; wmin = 4 floats (one per block). The activations use the same
// arrangement (quantize_rows_32).

// One full group of 4 blocks at p (stride TS bytes).
template <int64_t T>
__attribute__((always_inline)) inline void unpack_group32(const uint8_t* p, uint8_t* w, float* dw, float* wmin) {
  constexpr int64_t TS = T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : T == Q5_1 ? 24 : 34;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  __m512i lo, hi;
  if constexpr (T == Q8_0) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));  // int8 -> w + 128 (uint8)
    lo = _mm512_xor_si512(gather4x16(p + 2, TS), flip);
    hi = _mm512_xor_si512(gather4x16(p + 18, TS), flip);
  } else {
    constexpr int64_t QO = T == Q4_0 ? 2 : T == Q4_1 ? 4 : T == Q5_0 ? 6 : 8;  // qs offset
    const __m512i qs = gather4x16(p + QO, TS);
    lo = _mm512_and_si512(qs, m4);  // byte i: value i; high nibble: value i + 16
    hi = _mm512_and_si512(_mm512_srli_epi16(qs, 4), m4);
    if constexpr (T == Q5_0 || T == Q5_1) {
      constexpr int64_t HO = T == Q5_0 ? 2 : 4;  // qh (uint32: bit i is value i's 5th bit)
      uint64_t klo = 0, khi = 0;
      for (int j = 0; j < 4; ++j) {
        const uint32_t qh = ld32(p + j * TS + HO);
        klo |= static_cast<uint64_t>(qh & 0xFFFFu) << (16 * j);
        khi |= static_cast<uint64_t>(qh >> 16) << (16 * j);
      }
      const __m512i c16 = _mm512_set1_epi8(16);
      lo = _mm512_mask_add_epi8(lo, klo, lo, c16);
      hi = _mm512_mask_add_epi8(hi, khi, hi, c16);
    }
  }
  _mm512_storeu_si512(w, lo);
  _mm512_storeu_si512(w + 64, hi);
  const uint64_t hd = static_cast<uint64_t>(ld16(p)) | static_cast<uint64_t>(ld16(p + TS)) << 16 |
                      static_cast<uint64_t>(ld16(p + 2 * TS)) << 32 | static_cast<uint64_t>(ld16(p + 3 * TS)) << 48;
  const __m128 d4 = _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<long long>(hd)));
  const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  _mm512_storeu_ps(dw, _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(d4)));
  if constexpr (T == Q4_1 || T == Q5_1) {  // + m per block: wmin = m
    const uint64_t hm = static_cast<uint64_t>(ld16(p + 2)) | static_cast<uint64_t>(ld16(p + TS + 2)) << 16 |
                        static_cast<uint64_t>(ld16(p + 2 * TS + 2)) << 32 |
                        static_cast<uint64_t>(ld16(p + 3 * TS + 2)) << 48;
    _mm_storeu_ps(wmin, _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<long long>(hm))));
  } else {  // d * (q - off): wmin = -off * d
    constexpr float off = T == Q4_0 ? 8.f : T == Q5_0 ? 16.f : 128.f;
    _mm_storeu_ps(wmin, _mm_mul_ps(d4, _mm_set1_ps(-off)));
  }
}

// Groups [g0, g0 + ng) of one row; a last partial group is padded with zero blocks (d = 0).
template <int64_t T>
void unpack_row32(const uint8_t* row, int64_t nblocks, int64_t g0, int64_t ng, uint8_t* w, float* dw, float* wmin) {
  constexpr int64_t TS = T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : T == Q5_1 ? 24 : 34;
  for (int64_t g = 0; g < ng; ++g) {
    const int64_t b0 = (g0 + g) * 4;
    uint8_t* wg = w + g * 128;
    float* dwg = dw + g * 16;
    float* wm = wmin + b0;
    if (b0 + 4 <= nblocks) {
      unpack_group32<T>(row + b0 * TS, wg, dwg, wm);
    } else {
      alignas(64) uint8_t tmp[4 * TS];
      std::memset(tmp, 0, sizeof(tmp));
      std::memcpy(tmp, row + b0 * TS, static_cast<size_t>((nblocks - b0) * TS));
      unpack_group32<T>(tmp, wg, dwg, wm);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// K-quants. A super-block unpacks into four 64-byte vectors of values w[0..3] and four vectors of
// int32 lanes sc[0..3] (the sub-block scale of each lane, zero-extended 16-bit, for vpdpwssd), dw
// (d), and its wmin slots. Activations are arranged per type to match (quantize_rows_k):
//   Q4_K / Q5_K: w0 = [sub 0 | sub 2], w1 = [sub 1 | sub 3], w2 = [sub 4 | sub 6], w3 = [sub 5 | sub 7]
//                (sub s = values 32s .. 32s+31: low nibbles of qs[0:32] are sub 0, high sub 1, ...)
//   Q6_K:        natural order, w_v = values 64v .. 64v+63.

inline void unpack_sb_q4k(const uint8_t* p, bool q5, uint8_t* w, uint8_t* sc, float* dw, float* wmin) {
  const float d = h2f(p), dmin = h2f(p + 2);
  uint32_t utmp[4];
  k_scales_mins(p + 4, utmp);  // bytes 0..7: the 8 scales, 8..15: the 8 mins
  const __m128i sm = _mm_loadu_si128(reinterpret_cast<const __m128i*>(utmp));
  const __m512i s32 = _mm512_cvtepu8_epi32(sm);
  const __m512i i0 = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i i1 = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i i2 = _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4);
  const __m512i i3 = _mm512_set_epi32(7, 7, 7, 7, 7, 7, 7, 7, 5, 5, 5, 5, 5, 5, 5, 5);
  _mm512_storeu_si512(sc, _mm512_permutexvar_epi32(i0, s32));
  _mm512_storeu_si512(sc + 64, _mm512_permutexvar_epi32(i1, s32));
  _mm512_storeu_si512(sc + 128, _mm512_permutexvar_epi32(i2, s32));
  _mm512_storeu_si512(sc + 192, _mm512_permutexvar_epi32(i3, s32));
  const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)));
  _mm256_storeu_ps(wmin, _mm256_mul_ps(mins, _mm256_set1_ps(-dmin)));
  *dw = d;

  const uint8_t* qs = p + (q5 ? 48 : 16);
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i a = _mm512_loadu_si512(qs), b = _mm512_loadu_si512(qs + 64);
  __m512i w0 = _mm512_and_si512(a, m4), w1 = _mm512_and_si512(_mm512_srli_epi16(a, 4), m4);
  __m512i w2 = _mm512_and_si512(b, m4), w3 = _mm512_and_si512(_mm512_srli_epi16(b, 4), m4);
  if (q5) {  // qh[l] bit s: the 5th bit of value l of sub-block s
    const __m512i qh = _mm512_broadcast_i64x4(ld256(p + 16));
    const __m512i c16 = _mm512_set1_epi8(16);
    auto bits = [](int lo, int hi) {
      return _mm512_mask_blend_epi64(0xF0, _mm512_set1_epi8(static_cast<char>(1 << lo)),
                                     _mm512_set1_epi8(static_cast<char>(1 << hi)));
    };
    w0 = _mm512_mask_add_epi8(w0, _mm512_test_epi8_mask(qh, bits(0, 2)), w0, c16);
    w1 = _mm512_mask_add_epi8(w1, _mm512_test_epi8_mask(qh, bits(1, 3)), w1, c16);
    w2 = _mm512_mask_add_epi8(w2, _mm512_test_epi8_mask(qh, bits(4, 6)), w2, c16);
    w3 = _mm512_mask_add_epi8(w3, _mm512_test_epi8_mask(qh, bits(5, 7)), w3, c16);
  }
  _mm512_storeu_si512(w, w0);
  _mm512_storeu_si512(w + 64, w1);
  _mm512_storeu_si512(w + 128, w2);
  _mm512_storeu_si512(w + 192, w3);
}

inline void unpack_sb_q6k(const uint8_t* p, uint8_t* w, uint8_t* sc, float* dw, float* wmin) {
  const float d = h2f(p + 208);
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  // per 16-bit lane shift counts: the first 32 bytes / the last 32 bytes of a vector
  const __m512i cnt_a = _mm512_mask_blend_epi64(0xF0, _mm512_set1_epi16(4), _mm512_set1_epi16(2));
  const __m512i cnt_b = _mm512_mask_blend_epi64(0xF0, _mm512_setzero_si512(), _mm512_set1_epi16(2));
  for (int h = 0; h < 2; ++h) {  // values 128h .. 128h+127
    const __m512i l = _mm512_loadu_si512(p + 64 * h);               // ql: low nibbles 0..63, high 64..127
    const __m512i q = _mm512_broadcast_i64x4(ld256(p + 128 + 32 * h));  // qh: bits 2k..2k+1 -> values 32k + i
    const __m512i lo = _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_and_si512(_mm512_sllv_epi16(q, cnt_a), m30));
    const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                                       _mm512_and_si512(_mm512_srlv_epi16(q, cnt_b), m30));
    _mm512_storeu_si512(w + 128 * h, lo);
    _mm512_storeu_si512(w + 128 * h + 64, hi);
  }
  const __m512i s = _mm512_cvtepi8_epi32(ld128(p + 192));  // 16 signed scales, one per 16 values
  const __m512i s16 = _mm512_and_si512(s, _mm512_set1_epi32(0xFFFF));
  for (int v = 0; v < 4; ++v) {  // lanes 4k..4k+3 of vector v: sub-block 4v + k
    const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(4 * v),
                                         _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0));
    _mm512_storeu_si512(sc + 64 * v, _mm512_permutexvar_epi32(idx, s16));
  }
  _mm512_storeu_ps(wmin, _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(-32.f * d)));
  *dw = d;
}

// ---------------------------------------------------------------------------------------------
// Activation quantization (one row of x).

// 32-block types: per group of 4 blocks 128 bytes (lo 64 | hi 64, see above), 16 floats of d;
// amin[b] = d * sum(q) per block (the slots past nblocks zeroed by the caller).
void quantize_row_32(const float* x, int64_t K, int8_t* q, float* ad, float* amin) {
  const int64_t nb = K / 32, ng = (nb + 3) / 4;
  for (int64_t g = 0; g < ng; ++g) {
    for (int j = 0; j < 4; ++j) {
      const int64_t b = 4 * g + j;
      int8_t* lo = q + g * 128 + 16 * j;
      int8_t* hi = lo + 64;
      float* adj = ad + g * 16 + 4 * j;
      if (b >= nb) {
        std::memset(lo, 0, 16);
        std::memset(hi, 0, 16);
        for (int i = 0; i < 4; ++i) adj[i] = 0.f;
        continue;
      }
      const __m512 v0 = _mm512_loadu_ps(x + 32 * b), v1 = _mm512_loadu_ps(x + 32 * b + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm512_cvtepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm512_cvtepi32_epi8(q1));
      amin[b] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
      for (int i = 0; i < 4; ++i) adj[i] = d;
    }
  }
}

// K-quants: per super-block 256 bytes (arranged for the type), one float d; amin per 32 values
// (Q4_K, Q5_K) or per 16 (Q6_K).
void quantize_row_k(const float* x, int64_t K, bool q6, int8_t* q, float* ad, float* amin) {
  const int64_t nsb = K / 256;
  for (int64_t s = 0; s < nsb; ++s) {
    const float* xs = x + 256 * s;
    __m512 mx = _mm512_setzero_ps();
    for (int i = 0; i < 16; ++i) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(xs + 16 * i)));
    const float amax = _mm512_reduce_max_ps(mx);
    const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    int32_t bs[16];
    for (int i = 0; i < 16; ++i) {
      const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xs + 16 * i), _mm512_set1_ps(id)));
      bs[i] = _mm512_reduce_add_epi32(qi);
      const int sub = i / 2;  // 32-value sub-block
      const int64_t pos = q6 ? 16 * i : 128 * (sub / 4) + 64 * (sub % 2) + 32 * ((sub / 2) % 2) + 16 * (i % 2);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 256 * s + pos), _mm512_cvtepi32_epi8(qi));
    }
    ad[s] = d;
    if (q6) {
      for (int i = 0; i < 16; ++i) amin[16 * s + i] = d * static_cast<float>(bs[i]);
    } else {
      for (int k = 0; k < 8; ++k) amin[8 * s + k] = d * static_cast<float>(bs[2 * k] + bs[2 * k + 1]);
    }
  }
}

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};
template <typename T>
std::unique_ptr<T[], AlignedFree> aligned_buffer(int64_t n) {
  const size_t bytes = (static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T) + 63) / 64 * 64;
  return std::unique_ptr<T[], AlignedFree>(static_cast<T*>(std::aligned_alloc(64, bytes)));
}

// The horizontal sums of 4 vectors: [sum a, sum b, sum c, sum d].
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // per 128-bit chunk: [a0+a2, b0+b2, a1+a3, b1+b3] and the same of c, d
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // per chunk: [a, b, c, d] partial sums
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// ---------------------------------------------------------------------------------------------
// Decode (M <= 4 rows of x): one weight row at a time, each unit unpacked into an L1 scratch and
// used at once for the (up to 4) rows of x. The weight bytes are read in one sequential stream per
// thread: the tiles' interleaved reading of 4 rows by chunks runs at a third of the memory
// bandwidth (hardware prefetchers) where rows are long (K = 8960).

template <int64_t T>
inline void unpack_unit(const uint8_t* row, int64_t u, int64_t nblocks, uint8_t* w, uint8_t* sc, float* dw, float* wm) {
  if constexpr (T == Q4_K || T == Q5_K)
    unpack_sb_q4k(row + u * (T == Q4_K ? 144 : 176), T == Q5_K, w, sc, dw, wm + u * 8);
  else if constexpr (T == Q6_K)
    unpack_sb_q6k(row + u * 210, w, sc, dw, wm + u * 16);
  else if (4 * u + 4 <= nblocks)
    unpack_group32<T>(row + 4 * u * (T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : T == Q5_1 ? 24 : 34), w, dw,
                      wm + 4 * u);
  else
    unpack_row32<T>(row, nblocks, u, 1, w, dw, wm);
}

// One weight row against C (<= 8) rows of x: y[c * ldy] = x_c . row.
template <int64_t T, int C>
inline void decode_row(const uint8_t* row, int64_t nblocks, int64_t nunits, const int8_t* Aq, int64_t aq_rs,
                       const float* Ad, int64_t ad_rs, const float* Am, int64_t spad, float* wm, float* y, int64_t ldy) {
  constexpr bool KQ = T == Q4_K || T == Q5_K || T == Q6_K;
  constexpr int64_t qunit = KQ ? 256 : 128, dunit = KQ ? 1 : 16;
  constexpr int64_t UB = T == Q4_0 ? 72 : T == Q4_1 ? 80 : T == Q5_0 ? 88 : T == Q5_1 ? 96 : T == Q8_0 ? 136
                       : T == Q4_K ? 144 : T == Q5_K ? 176 : 210;  // weight bytes per unit
  alignas(64) uint8_t w[256];
  alignas(64) uint8_t sc[256];
  alignas(64) float dw[16];
  const __m512i zero = _mm512_setzero_si512();
  __m512 acc[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t u = 0; u < nunits; ++u) {
    {  // the weight stream 8 KiB ahead (rows are contiguous, or the prefetch is just wasted): without
       // it, at K = 8960 and a few rows of x the stream runs at half the bandwidth
      const char* pf = reinterpret_cast<const char*>(row) + u * UB + 8192;
      if (KQ) for (int64_t b = 0; b < UB; b += 64) _mm_prefetch(pf + b, _MM_HINT_T0);
    }
    unpack_unit<T>(row, u, nblocks, w, sc, dw, wm);
    if constexpr (KQ) {
      __m512i iacc[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) iacc[c] = zero;
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        const __m512i wv = _mm512_load_si512(w + 64 * v), sv = _mm512_load_si512(sc + 64 * v);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
          const __m512i a = _mm512_loadu_si512(Aq + c * aq_rs + u * qunit + 64 * v);
          iacc[c] = _mm512_dpwssd_epi32(iacc[c], _mm512_dpbusd_epi32(zero, wv, a), sv);
        }
      }
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[c]), _mm512_set1_ps(dw[0] * Ad[c * ad_rs + u]), acc[c]);
    } else {
      const __m512i wlo = _mm512_load_si512(w), whi = _mm512_load_si512(w + 64);
      const __m512 dv = _mm512_load_ps(dw);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const int8_t* a = Aq + c * aq_rs + u * qunit;
        const __m512i t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, wlo, _mm512_loadu_si512(a)), whi,
                                              _mm512_loadu_si512(a + 64));
        acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(dv, _mm512_loadu_ps(Ad + c * ad_rs + u * dunit)),
                                 acc[c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    const float* am = Am + c * spad;
    for (int64_t j = 0; j < spad; j += 16) acc[c] = _mm512_fmadd_ps(_mm512_load_ps(wm + j), _mm512_loadu_ps(am + j), acc[c]);
    // the 16 lanes summed as the prefill tiles sum them (hsum4's lane 0 depends on its first
    // vector alone), not as _mm512_reduce_add_ps does: a row gets the same bits at any row count
    y[c * ldy] = _mm_cvtss_f32(hsum4(acc[c], acc[c], acc[c], acc[c]));
  }
}

// Weight rows [n0, n1) against all M (<= 16) rows of x, 8 at a time: a row (at most a few KiB)
// is read from memory once and stays in L1 for the second group of 8.
template <int64_t T>
void decode_rows(const uint8_t* W, int64_t ldw, int64_t n0, int64_t n1, int64_t M, int64_t K, const int8_t* Aq,
                 int64_t aq_rs, const float* Ad, int64_t ad_rs, const float* Am, int64_t spad, float* y, int64_t ldy) {
  constexpr bool KQ = T == Q4_K || T == Q5_K || T == Q6_K;
  const int64_t nblocks = K / 32, nunits = KQ ? K / 256 : (nblocks + 3) / 4;
  auto wm = aligned_buffer<float>(spad);
  std::fill(wm.get(), wm.get() + spad, 0.f);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = W + n * ldw;
    for (int64_t c0 = 0; c0 < M; c0 += 8) {
      const int8_t* aq = Aq + c0 * aq_rs;
      const float* ad = Ad + c0 * ad_rs;
      const float* am = Am + c0 * spad;
      float* yc = y + c0 * ldy + n;
#define RS_DECODE_ROW(C) decode_row<T, C>(row, nblocks, nunits, aq, aq_rs, ad, ad_rs, am, spad, wm.get(), yc, ldy)
      switch (std::min<int64_t>(8, M - c0)) {
        case 1: RS_DECODE_ROW(1); break;
        case 2: RS_DECODE_ROW(2); break;
        case 3: RS_DECODE_ROW(3); break;
        case 4: RS_DECODE_ROW(4); break;
        case 5: RS_DECODE_ROW(5); break;
        case 6: RS_DECODE_ROW(6); break;
        case 7: RS_DECODE_ROW(7); break;
        default: RS_DECODE_ROW(8); break;
      }
#undef RS_DECODE_ROW
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Micro-kernels: R weight rows x C rows of x, accumulators in registers (F: float32 x16 each,
// loaded and stored around one K chunk).

template <int R, int C>
inline void mk32(const uint8_t* const* uw, const float* const* udw, const int8_t* const* aq, const float* const* ad,
                 int64_t ng, float* const* F) {
  __m512 acc[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_loadu_ps(F[r * C + c]);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t g = 0; g < ng; ++g) {
    __m512i alo[C], ahi[C];
    __m512 da[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      alo[c] = in_reg(_mm512_loadu_si512(aq[c] + g * 128));
      ahi[c] = in_reg(_mm512_loadu_si512(aq[c] + g * 128 + 64));
      da[c] = in_reg(_mm512_loadu_ps(ad[c] + g * 16));
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512i wlo = in_reg(_mm512_loadu_si512(uw[r] + g * 128));
      const __m512i whi = in_reg(_mm512_loadu_si512(uw[r] + g * 128 + 64));
      const __m512 dw = in_reg(_mm512_loadu_ps(udw[r] + g * 16));
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const __m512i t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, wlo, alo[c]), whi, ahi[c]);
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(dw, da[c]), acc[r][c]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(F[r * C + c], acc[r][c]);
}

template <int R, int C>
inline void mkK(const uint8_t* const* uw, const uint8_t* const* usc, const float* const* udw, const int8_t* const* aq,
                const float* const* ad, int64_t nsb, float* const* F) {
  __m512 acc[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_loadu_ps(F[r * C + c]);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t s = 0; s < nsb; ++s) {
    __m512i iacc[R][C];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) iacc[r][c] = zero;
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      __m512i a[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) a[c] = in_reg(_mm512_loadu_si512(aq[c] + s * 256 + 64 * v));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512i w = in_reg(_mm512_loadu_si512(uw[r] + s * 256 + 64 * v));
        const __m512i sc = in_reg(_mm512_loadu_si512(usc[r] + s * 256 + 64 * v));
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c)  // each lane: 4 products, |.| < 2^15: one int16 times the scale
          iacc[r][c] = _mm512_dpwssd_epi32(iacc[r][c], _mm512_dpbusd_epi32(zero, w, a[c]), sc);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 dw = _mm512_set1_ps(udw[r][s]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[r][c]), _mm512_mul_ps(dw, _mm512_set1_ps(ad[c][s])),
                                    acc[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(F[r * C + c], acc[r][c]);
}

template <bool KQ, int R, int C>
inline void mk(const uint8_t* const* uw, const uint8_t* const* usc, const float* const* udw, const int8_t* const* aq,
               const float* const* ad, int64_t nu, float* const* F) {
  if constexpr (KQ)
    mkK<R, C>(uw, usc, udw, aq, ad, nu, F);
  else
    mk32<R, C>(uw, udw, aq, ad, nu, F);
}

template <bool KQ>
void mk_dispatch(int rr, int cc, const uint8_t* const* uw, const uint8_t* const* usc, const float* const* udw,
                 const int8_t* const* aq, const float* const* ad, int64_t nu, float* const* F) {
  switch (rr * 4 + cc) {
    case 1 * 4 + 1: return mk<KQ, 1, 1>(uw, usc, udw, aq, ad, nu, F);
    case 1 * 4 + 2: return mk<KQ, 1, 2>(uw, usc, udw, aq, ad, nu, F);
    case 1 * 4 + 3: return mk<KQ, 1, 3>(uw, usc, udw, aq, ad, nu, F);
    case 1 * 4 + 4: return mk<KQ, 1, 4>(uw, usc, udw, aq, ad, nu, F);
    case 2 * 4 + 1: return mk<KQ, 2, 1>(uw, usc, udw, aq, ad, nu, F);
    case 2 * 4 + 2: return mk<KQ, 2, 2>(uw, usc, udw, aq, ad, nu, F);
    case 2 * 4 + 3: return mk<KQ, 2, 3>(uw, usc, udw, aq, ad, nu, F);
    default: return mk<KQ, 2, 4>(uw, usc, udw, aq, ad, nu, F);
  }
}

inline int64_t pad16(int64_t n) { return (n + 15) / 16 * 16; }

// y[M, N] (row stride ldy) = x[M, K] (contiguous) @ dequantize(W)^T.
template <bool KQ>
void quant_gemm(const float* x, int64_t M, int64_t K, const uint8_t* W, int64_t ldw, int64_t N, const QInfo& qi,
                float* y, int64_t ldy, int64_t /*fused_rows: no fused decode in this build*/, bool /*i16: AVX2 only*/) {
  const int64_t qtype = qi.id;
  // the unit: a group of 4 blocks (32-block types) or a super-block (K-quants)
  const int64_t nblocks = K / 32;
  const int64_t nunits = KQ ? K / 256 : (nblocks + 3) / 4;
  const int64_t qunit = KQ ? 256 : 128;       // activation / unpacked weight bytes per unit
  const int64_t dunit = KQ ? 1 : 16;          // floats of d per unit
  const int64_t UC = KQ ? UCK : UC32;         // units per K chunk
  const int64_t nslots = KQ ? (qtype == Q6_K ? K / 16 : K / 32) : nblocks;
  const int64_t spad = pad16(nslots);
  const int64_t slots_per_unit = KQ ? (qtype == Q6_K ? 16 : 8) : 4;
  const int64_t row_bytes = K / qi.block * qi.bytes;

  // 1. every row of x quantized once
  const int64_t aq_rs = nunits * qunit, ad_rs = nunits * dunit;
  auto Aq = aligned_buffer<int8_t>(M * aq_rs);
  auto Ad = aligned_buffer<float>(M * ad_rs);
  auto Am = aligned_buffer<float>(M * spad);
  radixserve::parallel_for_dynamic(M, 4, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      float* am = Am.get() + m * spad;
      std::fill(am + nslots, am + spad, 0.f);
      if constexpr (KQ)
        quantize_row_k(x + m * K, K, qtype == Q6_K, Aq.get() + m * aq_rs, Ad.get() + m * ad_rs, am);
      else
        quantize_row_32(x + m * K, K, Aq.get() + m * aq_rs, Ad.get() + m * ad_rs, am);
    }
  });

  if (M <= kDecodeRows) {  // decode: one sequential pass over the weight rows
    radixserve::parallel_for_dynamic(N, 16, [&](int64_t n0, int64_t n1) {
      const int8_t* aq = Aq.get();
      const float* ad = Ad.get();
      const float* am = Am.get();
#define RS_DECODE(T) decode_rows<T>(W, ldw, n0, n1, M, K, aq, aq_rs, ad, ad_rs, am, spad, y, ldy)
      switch (qtype) {
        case Q4_0: RS_DECODE(Q4_0); break;
        case Q4_1: RS_DECODE(Q4_1); break;
        case Q5_0: RS_DECODE(Q5_0); break;
        case Q5_1: RS_DECODE(Q5_1); break;
        case Q8_0: RS_DECODE(Q8_0); break;
        case Q4_K: RS_DECODE(Q4_K); break;
        case Q5_K: RS_DECODE(Q5_K); break;
        default: RS_DECODE(Q6_K); break;
      }
#undef RS_DECODE
    });
    return;
  }

  // 2. rows of x in blocks of MC (their quantized bytes ~ 512 KiB, an L2's share)
  int64_t MC = (512 * 1024) / std::max<int64_t>(1, aq_rs + ad_rs * 4 + spad * 4);
  MC = std::max<int64_t>(4, std::min<int64_t>(256, MC / 4 * 4));
  MC = std::min(MC, (M + 3) / 4 * 4);
  const int64_t ntiles = (N + NT - 1) / NT;

  radixserve::parallel_for_dynamic(ntiles, 1, [&](int64_t t0, int64_t t1) {
    auto Uw = aligned_buffer<uint8_t>(NT * UC * qunit);
    auto Usc = aligned_buffer<uint8_t>(KQ ? NT * UC * 256 : 1);
    auto Udw = aligned_buffer<float>(NT * UC * dunit);
    auto Fb = aligned_buffer<float>(NT * MC * 16);
    auto Wm = aligned_buffer<float>(NT * spad);
    std::fill(Wm.get(), Wm.get() + NT * spad, 0.f);
    for (int64_t mb = 0; mb < M; mb += MC) {
      const int64_t mc = std::min(MC, M - mb);
      for (int64_t tile = t0; tile < t1; ++tile) {
        const int64_t n0 = tile * NT, nr = std::min(NT, N - n0);
        // rows past N (the last tile) take part as zeros: F and wmin zeroed
        for (int64_t r = 0; r < NT; ++r) std::fill(Fb.get() + r * MC * 16, Fb.get() + (r * MC + mc) * 16, 0.f);
        if (nr < NT) std::fill(Wm.get() + nr * spad, Wm.get() + NT * spad, 0.f);
        if (mc >= 8 && tile + 1 < t1) {  // the next tile's weight rows towards L2 while this one computes
          const uint8_t* next = W + (n0 + NT) * ldw;
          const int64_t nn = std::min(NT, N - n0 - NT);
          for (int64_t r = 0; r < nn; ++r)
            for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(next + r * ldw + b), _MM_HINT_T1);
        }
        for (int64_t u0 = 0; u0 < nunits; u0 += UC) {
          const int64_t uc = std::min(UC, nunits - u0);
          for (int64_t r = 0; r < nr; ++r) {  // unpack the tile's rows, this chunk
            const uint8_t* row = W + (n0 + r) * ldw;
            uint8_t* uw = Uw.get() + r * UC * qunit;
            float* udw = Udw.get() + r * UC * dunit;
            float* wm = Wm.get() + r * spad;
            if constexpr (KQ) {
              uint8_t* usc = Usc.get() + r * UC * 256;
              for (int64_t u = 0; u < uc; ++u) {
                const uint8_t* p = row + (u0 + u) * qi.bytes;
                float* wmu = wm + (u0 + u) * slots_per_unit;
                if (qtype == Q6_K)
                  unpack_sb_q6k(p, uw + u * 256, usc + u * 256, udw + u, wmu);
                else
                  unpack_sb_q4k(p, qtype == Q5_K, uw + u * 256, usc + u * 256, udw + u, wmu);
              }
            } else {
              switch (qtype) {
                case Q4_0: unpack_row32<Q4_0>(row, nblocks, u0, uc, uw, udw, wm); break;
                case Q4_1: unpack_row32<Q4_1>(row, nblocks, u0, uc, uw, udw, wm); break;
                case Q5_0: unpack_row32<Q5_0>(row, nblocks, u0, uc, uw, udw, wm); break;
                case Q5_1: unpack_row32<Q5_1>(row, nblocks, u0, uc, uw, udw, wm); break;
                default: unpack_row32<Q8_0>(row, nblocks, u0, uc, uw, udw, wm); break;
              }
            }
          }
          for (int64_t c0 = 0; c0 < mc; c0 += 4) {
            const int cc = static_cast<int>(std::min<int64_t>(4, mc - c0));
            const int8_t* aq[4];
            const float* ad[4];
            for (int c = 0; c < cc; ++c) {
              const int64_t m = mb + c0 + c;
              aq[c] = Aq.get() + m * aq_rs + u0 * qunit;
              ad[c] = Ad.get() + m * ad_rs + u0 * dunit;
            }
            for (int64_t r0 = 0; r0 < nr; r0 += 2) {
              const int rr = static_cast<int>(std::min<int64_t>(2, nr - r0));
              const uint8_t* uw[2];
              const uint8_t* usc[2];
              const float* udw[2];
              float* F[8];
              for (int r = 0; r < rr; ++r) {
                uw[r] = Uw.get() + (r0 + r) * UC * qunit;
                usc[r] = KQ ? Usc.get() + (r0 + r) * UC * 256 : nullptr;
                udw[r] = Udw.get() + (r0 + r) * UC * dunit;
                for (int c = 0; c < cc; ++c) F[r * cc + c] = Fb.get() + ((r0 + r) * MC + c0 + c) * 16;
              }
              mk_dispatch<KQ>(rr, cc, uw, usc, udw, aq, ad, uc, F);
            }
          }
        }
        // 3. the integer parts' sums + the offsets / mins (wmin . amin): the tile's 4 outputs of a
        // row of x summed together and stored at once
        static_assert(NT == 4, "the finalization sums 4 rows at once");
        const float* wm = Wm.get();
        for (int64_t c = 0; c < mc; ++c) {
          const float* am = Am.get() + (mb + c) * spad;
          const float* f = Fb.get() + c * 16;
          __m512 v0 = _mm512_loadu_ps(f), v1 = _mm512_loadu_ps(f + MC * 16);
          __m512 v2 = _mm512_loadu_ps(f + 2 * MC * 16), v3 = _mm512_loadu_ps(f + 3 * MC * 16);
          for (int64_t j = 0; j < spad; j += 16) {
            const __m512 a = _mm512_loadu_ps(am + j);
            v0 = _mm512_fmadd_ps(_mm512_loadu_ps(wm + j), a, v0);
            v1 = _mm512_fmadd_ps(_mm512_loadu_ps(wm + spad + j), a, v1);
            v2 = _mm512_fmadd_ps(_mm512_loadu_ps(wm + 2 * spad + j), a, v2);
            v3 = _mm512_fmadd_ps(_mm512_loadu_ps(wm + 3 * spad + j), a, v3);
          }
          const __m128 sums = hsum4(v0, v1, v2, v3);
          float* yp = y + (mb + c) * ldy + n0;
          if (nr == NT)
            _mm_storeu_ps(yp, sums);
          else
            _mm_mask_storeu_ps(yp, static_cast<__mmask8>((1u << nr) - 1), sums);
        }
      }
    }
  });
}


// ---------------------------------------------------------------------------------------------
// Dequantization of weight rows to bf16, for the prefill path (many rows of x): there the GEMM is
// compute-bound and torch's oneDNN bf16 GEMM outruns the integer kernel, so the caller
// dequantizes a tile of output rows at a time and multiplies it there. Same unpacking as the
// GEMM (so the same values), then value = scale * u + min per block / sub-block, rounded to bf16
// (round to nearest even).

inline __m256i f32_to_bf16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

// 16 unsigned values -> scale * u + min, stored as 16 bf16
inline void emit16(const uint8_t* u8, float scale, float min, uint16_t* out) {
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(ld128(u8)));
  const __m512 r = _mm512_fmadd_ps(v, _mm512_set1_ps(scale), _mm512_set1_ps(min));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), f32_to_bf16(r));
}

template <int64_t T>
void dequant_row32(const uint8_t* row, int64_t nblocks, uint16_t* out) {
  alignas(64) uint8_t w[128];
  alignas(64) float dw[16];
  alignas(64) float wmin[4];
  constexpr int64_t TS = T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : T == Q5_1 ? 24 : 34;
  for (int64_t g = 0; g * 4 < nblocks; ++g) {
    unpack_row32<T>(row + g * 4 * TS, nblocks - g * 4, 0, 1, w, dw, wmin);  // pads a last partial group
    for (int64_t b = 0; b < 4 && g * 4 + b < nblocks; ++b) {
      uint16_t* o = out + (g * 4 + b) * 32;
      emit16(w + 16 * b, dw[4 * b], wmin[b], o);
      emit16(w + 64 + 16 * b, dw[4 * b], wmin[b], o + 16);
    }
  }
}

void dequant_row_k(const uint8_t* row, int64_t nsb, int64_t qtype, uint16_t* out) {
  alignas(64) uint8_t w[256];
  alignas(64) uint8_t sc[256];
  alignas(64) float wmin[16];
  float d = 0.f;
  constexpr int kSub[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};  // Q4_K / Q5_K: sub-blocks of each vector's halves
  for (int64_t s = 0; s < nsb; ++s) {
    uint16_t* o = out + s * 256;
    if (qtype == Q6_K) {
      const uint8_t* p = row + s * 210;
      unpack_sb_q6k(p, w, sc, &d, wmin);
      for (int j = 0; j < 16; ++j)  // natural order, a scale per 16 values
        emit16(w + 16 * j, d * static_cast<float>(static_cast<int8_t>(p[192 + j])), wmin[j], o + 16 * j);
    } else {
      const int64_t ts = qtype == Q5_K ? 176 : 144;
      unpack_sb_q4k(row + s * ts, qtype == Q5_K, w, sc, &d, wmin);
      const int32_t* sc32 = reinterpret_cast<const int32_t*>(sc);
      for (int v = 0; v < 4; ++v)
        for (int h = 0; h < 2; ++h) {
          const int sub = kSub[v][h];
          const float scale = d * static_cast<float>(sc32[v * 16 + h * 8]);
          const uint8_t* u = w + 64 * v + 32 * h;
          emit16(u, scale, wmin[sub], o + 32 * sub);
          emit16(u + 16, scale, wmin[sub], o + 32 * sub + 16);
        }
    }
  }
}

void dequant_rows(const uint8_t* W, int64_t ldw, int64_t N, int64_t K, const QInfo& qi, uint16_t* out) {
  const int64_t nb = K / qi.block;
  radixserve::parallel_for_dynamic(N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = W + n * ldw;
      uint16_t* o = out + n * K;
      switch (qi.id) {
        case Q4_0: dequant_row32<Q4_0>(row, nb, o); break;
        case Q4_1: dequant_row32<Q4_1>(row, nb, o); break;
        case Q5_0: dequant_row32<Q5_0>(row, nb, o); break;
        case Q5_1: dequant_row32<Q5_1>(row, nb, o); break;
        case Q8_0: dequant_row32<Q8_0>(row, nb, o); break;
        default: dequant_row_k(row, nb, qi.id, o);
      }
    }
  });
}

#elif defined(RADIXSERVE_QUANT_AVX2)

// ---------------------------------------------------------------------------------------------
// AVX2 (+ FMA, F16C): the same numerics with 256-bit vectors and no VNNI. Products of unsigned
// weight bytes and signed activation bytes by vpmaddubsw (pairs summed into int16, saturating:
// safe here, |pair| <= 2 * 63 * 127 for Q6_K, 2 * 128 * 127 for Q8_0's sign trick), then
// vpmaddwd: by ones (32-block types: int32 lanes of 4 products) or by the K-quants' sub-block
// scales (int16 lanes: 8 products times the scale, exact in int32). Both the weights and the
// activations are kept in their natural order (a 32-byte vector is 32 consecutive values).
//   - Q4_0 .. Q5_1: the unsigned values 0..15 / 0..31; the offsets and mins are the wmin terms
//     (as in the AVX-512 section).
//   - Q8_0: llama.cpp's sign trick: vpmaddubsw(|w|, sign(a, w)) = the signed products w * a
//     exactly (|w| <= 128 fits the unsigned operand), so no offset term (wmin = 0).
//   - Q4_K / Q5_K: sub-block s = values 32s .. 32s+31; its 6-bit scale (int16 x 16) multiplies
//     the vpmaddubsw pairs; the mins are wmin terms. Q6_K: a 32-value chunk holds two 16-value
//     sub-blocks, scales [s0 x 8 | s1 x 8] (vpmaddubsw's int16 lanes 0-7 come from bytes 0-15);
//     the -32 offset is a wmin term.
// A unit is a block (32-block types) or a super-block; its unpacked form (UW bytes): the values,
// then (K-quants) the eight 32-byte scale vectors or (Q8_0) the signed values.

// Up to this many rows of x: the decode path. From 13 rows on the prefill tiles (one block of rows
// of x, so the weights are still read once) were 7-20% faster on Zen 3 (benchmarks/NOTES.md, issue
// 54 session 11); at 10 and fewer the decode path was.
constexpr int64_t kDecodeRows = 12;
constexpr int64_t NT = 4;            // prefill: weight rows per tile (unpacked together)
constexpr int64_t KCHUNK = 2048;     // prefill: values of K unpacked at a time

constexpr bool is_kq(int64_t t) { return t == Q4_K || t == Q5_K || t == Q6_K; }
constexpr int64_t type_size(int64_t t) {
  return t == Q4_0 ? 18 : t == Q4_1 ? 20 : t == Q5_0 ? 22 : t == Q5_1 ? 24 : t == Q8_0 ? 34
       : t == Q4_K ? 144 : t == Q5_K ? 176 : 210;
}
constexpr int64_t unit_values(int64_t t) { return is_kq(t) ? 256 : 32; }
constexpr int64_t unpacked_bytes(int64_t t) { return is_kq(t) ? 512 : t == Q8_0 ? 64 : 32; }  // UW
constexpr int64_t slots_per_unit(int64_t t) { return t == Q6_K ? 16 : is_kq(t) ? 8 : 1; }

inline __m256i ld256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
// A loaded vector kept in a register (as in the AVX-512 section): stops GCC from hoisting every
// load of an unrolled loop to the top, where they no longer fit in 16 registers and spill.
template <typename V>
inline V in_reg(V v) {
  __asm__("" : "+x"(v));
  return v;
}
inline void st256(void* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }

inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
inline int32_t hsum8i(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1))));
}
inline float hmax8(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

// 16 bytes of nibbles -> 32 values: the low nibbles (values 0..15), then the high ones (16..31)
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
}

// 32 bits -> 32 bytes, 0x10 where bit i is set (the 5th bit of Q5_0 / Q5_1 values)
inline __m256i bits32_x16(uint32_t x) {
  const __m256i shuf = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
  const __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x)), shuf);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit), _mm256_set1_epi8(0x10));
}

// One block of a 32-block type at p -> w (UW bytes), its d, its wmin slot.
template <int64_t T>
inline void unpack_block32(const uint8_t* p, uint8_t* w, float* dw, float* wmin) {
  const float d = h2f(p);
  *dw = d;
  if constexpr (T == Q8_0) {
    const __m256i q = ld256(p + 2);
    st256(w, _mm256_abs_epi8(q));  // -128 -> 0x80 = 128 as the unsigned operand
    st256(w + 32, q);
    *wmin = 0.f;
  } else {
    constexpr int64_t QO = T == Q4_0 ? 2 : T == Q4_1 ? 4 : T == Q5_0 ? 6 : 8;
    __m256i v = nibbles32(p + QO);
    if constexpr (T == Q5_0 || T == Q5_1) v = _mm256_or_si256(v, bits32_x16(ld32(p + (T == Q5_0 ? 2 : 4))));
    st256(w, v);
    if constexpr (T == Q4_1 || T == Q5_1)
      *wmin = h2f(p + 2);
    else
      *wmin = d * (T == Q4_0 ? -8.f : -16.f);
  }
}

inline void unpack_sb_q4k(const uint8_t* p, bool q5, uint8_t* w, float* dw, float* wmin) {
  const float d = h2f(p), dmin = h2f(p + 2);
  uint32_t utmp[4];
  k_scales_mins(p + 4, utmp);  // bytes 0..7: the 8 scales, 8..15: the 8 mins
  const __m128i sm = _mm_loadu_si128(reinterpret_cast<const __m128i*>(utmp));
  const __m128i s16 = _mm_cvtepu8_epi16(sm);  // the 8 scales as int16
  uint8_t* sc = w + 256;
  for (int s = 0; s < 8; ++s) {  // int16 lane s everywhere (a shuffle: no trip through a scalar register)
    const __m128i b = _mm_shuffle_epi8(s16, _mm_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * s)));
    st256(sc + 32 * s, _mm256_set_m128i(b, b));
  }
  const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)));
  _mm256_storeu_ps(wmin, _mm256_mul_ps(mins, _mm256_set1_ps(-dmin)));
  *dw = d;
  const uint8_t* qs = p + (q5 ? 48 : 16);
  const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  const __m256i qh = q5 ? ld256(p + 16) : _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {  // qs[32j ..]: low nibbles sub-block 2j, high nibbles 2j + 1
    const __m256i a = ld256(qs + 32 * j);
    __m256i lo = _mm256_and_si256(a, m4), hi = _mm256_and_si256(_mm256_srli_epi16(a, 4), m4);
    if (q5) {  // qh[l] bit s: the 5th bit of value l of sub-block s
      const __m256i hl = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j)), one);
      const __m256i hh = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j + 1)), one);
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(hl, 4));
      hi = _mm256_or_si256(hi, _mm256_slli_epi16(hh, 4));
    }
    st256(w + 64 * j, lo);
    st256(w + 64 * j + 32, hi);
  }
}

inline void unpack_sb_q6k(const uint8_t* p, uint8_t* w, float* dw, float* wmin) {
  const float d = h2f(p + 208);
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h) {  // values 128h .. 128h+127
    const __m256i l0 = ld256(p + 64 * h), l1 = ld256(p + 64 * h + 32), q = ld256(p + 128 + 32 * h);
    uint8_t* o = w + 128 * h;
    st256(o, _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(q, 4), m30)));
    st256(o + 32, _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(q, 2), m30)));
    st256(o + 64, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(q, m30)));
    st256(o + 96, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                  _mm256_and_si256(_mm256_srli_epi16(q, 2), m30)));
  }
  const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192));  // a signed scale per 16 values
  const __m128i s16[2] = {_mm_cvtepi8_epi16(s8), _mm_cvtepi8_epi16(_mm_srli_si128(s8, 8))};  // scales 0-7, 8-15
  uint8_t* sc = w + 256;
  for (int k = 0; k < 8; ++k) {  // [scale 2k x 8 | scale 2k+1 x 8], by shuffles
    const __m128i v = s16[k / 4];
    const int j = 2 * (k % 4);
    const __m128i a = _mm_shuffle_epi8(v, _mm_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * j)));
    const __m128i b = _mm_shuffle_epi8(v, _mm_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * (j + 1))));
    st256(sc + 32 * k, _mm256_set_m128i(b, a));
  }
  const __m256 m32 = _mm256_set1_ps(-32.f * d);
  _mm256_storeu_ps(wmin, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8)), m32));
  _mm256_storeu_ps(wmin + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8))), m32));
  *dw = d;
}

// Unit u of a row -> w (UW bytes), dw, wmin[slots of u].
template <int64_t T>
inline void unpack_unit(const uint8_t* row, int64_t u, uint8_t* w, float* dw, float* wmin) {
  const uint8_t* p = row + u * type_size(T);
  if constexpr (T == Q4_K || T == Q5_K)
    unpack_sb_q4k(p, T == Q5_K, w, dw, wmin);
  else if constexpr (T == Q6_K)
    unpack_sb_q6k(p, w, dw, wmin);
  else
    unpack_block32<T>(p, w, dw, wmin);
}

// ---------------------------------------------------------------------------------------------
// Activation quantization (one row of x, natural order): per block of 32 (or super-block of 256)
// d = amax / 127, q = rint(x * (127 / amax)); amin[slot] = d * sum(q) per 32 values (32-block
// types, Q4_K, Q5_K) or 16 (Q6_K).

// 32 floats scaled by id -> 32 int8 at q; the sums of q of values 0..15 and 16..31
inline void quantize32(const float* x, __m256 id, int8_t* q, int32_t* s0, int32_t* s1) {
  const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), id));
  const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), id));
  const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), id));
  const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), id));
  *s0 = hsum8i(_mm256_add_epi32(i0, i1));
  *s1 = hsum8i(_mm256_add_epi32(i2, i3));
  // packs interleave the 128-bit lanes: the permutation restores the order
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  st256(q, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

inline float amax_of(const float* x, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 mx = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  return hmax8(mx);
}

void quantize_row(const float* x, int64_t K, int64_t qtype, int8_t* q, float* ad, float* amin) {
  const int64_t nv = is_kq(qtype) ? 256 : 32;
  for (int64_t b = 0; b < K / nv; ++b) {
    const float* xb = x + nv * b;
    const float amax = amax_of(xb, nv);
    const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    ad[b] = d;
    for (int64_t k = 0; k < nv / 32; ++k) {
      int32_t s0, s1;
      quantize32(xb + 32 * k, _mm256_set1_ps(id), q + nv * b + 32 * k, &s0, &s1);
      if (qtype == Q6_K) {
        amin[16 * b + 2 * k] = d * static_cast<float>(s0);
        amin[16 * b + 2 * k + 1] = d * static_cast<float>(s1);
      } else {
        amin[(nv / 32) * b + k] = d * static_cast<float>(s0 + s1);
      }
    }
  }
}

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};
template <typename V>
std::unique_ptr<V[], AlignedFree> aligned_buffer(int64_t n) {
  const size_t bytes = (static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(V) + 63) / 64 * 64;
  return std::unique_ptr<V[], AlignedFree>(static_cast<V*>(std::aligned_alloc(64, bytes)));
}

// Scratch of at least n V's, this thread's own (ID: which buffer), kept for the next call: a fresh
// buffer per call of a prefill's size is fresh pages from the kernel, faulted and zeroed every time.
template <typename V, int ID>
V* scratch(int64_t n) {
  thread_local std::unique_ptr<V[], AlignedFree> buf;
  thread_local int64_t capacity = 0;
  if (n > capacity) {
    buf = aligned_buffer<V>(n);
    capacity = n;
  }
  return buf.get();
}

inline int64_t pad8(int64_t n) { return (n + 7) / 8 * 8; }

// sum_j wm[j] * am[j] over n (a multiple of 8) slots: the offsets' / mins' share of one output
inline __m256 wmin_dot(const float* wm, const float* am, int64_t n, __m256 acc) {
  for (int64_t j = 0; j < n; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(wm + j), _mm256_loadu_ps(am + j), acc);
  return acc;
}

// ---------------------------------------------------------------------------------------------
// The float order of one output, the same in every path (the prefill tiles, the scratch decode and
// the fused decode), so that a row of x gets the same bits whatever the row count (speculative
// verification of k + 1 rows equals plain decoding; --enable-deterministic-inference):
//   for each K chunk of KCHUNK values (the tiles' unit of work), two sets of 8 lanes from zero:
//     per unit in order: lanes = fma(float(the unit's int32 lanes), d_w * d_a, lanes);
//     the chunk's offset / min slots in order, 8 at a time: wl = fma(wmin[j..], amin[j..], wl);
//     y = hsum8(lanes + wl) at the first chunk, y + hsum8(lanes + wl) after.
// The int32 lanes are exact sums (the paths may add them in any order); the unit's offset / min
// terms stay float products wmin * amin (not folded into the integers), as the tiles have them.
// wl is a chain of its own so that the fused decode adds a super-block's terms as it goes (its
// 8 or 16 slots are the next ones in order), beside the integer work, not in a serial tail.

// The slots of the offset / min terms of the chunk of units [u0, u0 + uc): its units' own, and at
// the last chunk the padding up to spad (zeros on both sides).
inline int64_t chunk_slots(int64_t u0, int64_t uc, int64_t nunits, int64_t spu, int64_t spad) {
  return u0 + uc == nunits ? spad - u0 * spu : uc * spu;
}

// One chunk's lanes and offset / min lanes (wl) into *y.
inline void add_chunk_lanes(__m256 lanes, __m256 wl, bool first, float* y) {
  const float v = hsum8(_mm256_add_ps(lanes, wl));
  *y = first ? v : *y + v;
}

// One chunk's lanes + its offset / min slots (wm, am: the chunk's first slot; n slots) into *y.
inline void add_chunk(__m256 lanes, const float* wm, const float* am, int64_t n, bool first, float* y) {
  add_chunk_lanes(lanes, wmin_dot(wm, am, n, _mm256_setzero_ps()), first, y);
}

// hsum8 of four vectors at once, in hsum8's own tree ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)), so
// the bits are hsum8's: [hsum8(v0), hsum8(v1), hsum8(v2), hsum8(v3)].
inline __m128 hsum8x4(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
  const __m256 t01 = _mm256_add_ps(_mm256_permute2f128_ps(v0, v1, 0x20), _mm256_permute2f128_ps(v0, v1, 0x31));
  const __m256 t23 = _mm256_add_ps(_mm256_permute2f128_ps(v2, v3, 0x20), _mm256_permute2f128_ps(v2, v3, 0x31));
  // per 128-bit half (low: v0, v2; high: v1, v3): [s0 + s2, s1 + s3] of each
  const __m256 z = _mm256_add_ps(_mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 h = _mm256_hadd_ps(z, z);  // low: [h0, h2, h0, h2], high: [h1, h3, h1, h3]
  return _mm_unpacklo_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// add_chunk for the nr (<= 4) consecutive outputs y[0 .. nr) of one row of x (the prefill tile's
// rows: lanes[r], their slots wm[r]; the row's am): the same bits, with the four offset / min
// chains and horizontal sums interleaved instead of one latency chain per output.
inline void add_chunk4(const __m256* lanes, const float* const* wm, const float* am, int64_t n, int64_t nr, bool first,
                       float* y) {
  __m256 v[4];
  for (int r = 0; r < 4; ++r) v[r] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 a = _mm256_loadu_ps(am + j);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r)
      if (r < nr) v[r] = _mm256_fmadd_ps(_mm256_loadu_ps(wm[r] + j), a, v[r]);
  }
  for (int r = 0; r < 4; ++r) v[r] = r < nr ? _mm256_add_ps(lanes[r], v[r]) : v[r];
  const __m128 h = hsum8x4(v[0], v[1], v[2], v[3]);
  if (nr == 4) {
    _mm_storeu_ps(y, first ? h : _mm_add_ps(_mm_loadu_ps(y), h));
    return;
  }
  alignas(16) float hs[4];
  _mm_store_ps(hs, h);
  for (int64_t r = 0; r < nr; ++r) y[r] = first ? hs[r] : y[r] + hs[r];
}

// ---------------------------------------------------------------------------------------------
// The integer dot products of one unpacked unit with C rows of x (a[c]: the unit's activation
// bytes of row c; sd[c] = d_w * d_a): acc[c] += float(int32 lanes) * sd[c].

template <int64_t T, int C>
__attribute__((always_inline)) inline void dot_unit(const uint8_t* w, const int8_t* const* a, const float* sd,
                                                    __m256* acc) {
  if constexpr (is_kq(T)) {
    __m256i iacc[C];
    for (int c = 0; c < C; ++c) iacc[c] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int k = 0; k < 8; ++k) {  // not unrolled: see in_reg
      const __m256i wv = in_reg(_mm256_load_si256(reinterpret_cast<const __m256i*>(w + 32 * k)));
      const __m256i sv = in_reg(_mm256_load_si256(reinterpret_cast<const __m256i*>(w + 256 + 32 * k)));
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
        iacc[c] = _mm256_add_epi32(iacc[c], _mm256_madd_epi16(_mm256_maddubs_epi16(wv, ld256(a[c] + 32 * k)), sv));
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[c]), _mm256_set1_ps(sd[c]), acc[c]);
  } else {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(w));
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      __m256i av = ld256(a[c]);
      if constexpr (T == Q8_0) av = _mm256_sign_epi8(av, _mm256_load_si256(reinterpret_cast<const __m256i*>(w + 32)));
      const __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, av), ones);
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(sd[c]), acc[c]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Decode (M <= kDecodeRows rows of x): one weight row at a time, read once, in order (software prefetch
// 8 KiB ahead). The first pass over the row (rows of x 0..3) unpacks it unit by unit into a
// row-sized L1 scratch (K-quants: 2 bytes per value; a few KiB .. 18 KiB at K = 8960); the other
// passes (4 rows of x each: AVX2's 16 registers) read the scratch.

template <int64_t T, int C, bool UNPACK>
void decode_pass(const uint8_t* row, int64_t nunits, uint8_t* uw, float* udw, float* wm, const int8_t* Aq,
                 int64_t K, const float* Ad, int64_t nad, const float* Am, int64_t spad, float* y, int64_t ldy) {
  constexpr int64_t UW = unpacked_bytes(T), UV = unit_values(T), SPU = slots_per_unit(T), UC = KCHUNK / UV;
  for (int64_t u0 = 0; u0 < nunits; u0 += UC) {  // the tiles' K chunks (see "The float order")
    const int64_t uc = std::min(UC, nunits - u0);
    __m256 acc[C];
    for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t u = u0; u < u0 + uc; ++u) {
      if constexpr (UNPACK) {
        _mm_prefetch(reinterpret_cast<const char*>(row) + u * type_size(T) + 8192, _MM_HINT_T0);
        if constexpr (type_size(T) > 64) {
          for (int64_t b = 64; b < type_size(T); b += 64)
            _mm_prefetch(reinterpret_cast<const char*>(row) + u * type_size(T) + 8192 + b, _MM_HINT_T0);
        }
        unpack_unit<T>(row, u, uw + u * UW, udw + u, wm + u * SPU);
      }
      const int8_t* a[C];
      float sd[C];
      for (int c = 0; c < C; ++c) {
        a[c] = Aq + c * K + u * UV;
        sd[c] = udw[u] * Ad[c * nad + u];
      }
      dot_unit<T, C>(uw + u * UW, a, sd, acc);
    }
    const int64_t s0 = u0 * SPU, ns = chunk_slots(u0, uc, nunits, SPU, spad);
    for (int c = 0; c < C; ++c) add_chunk(acc[c], wm + s0, Am + c * spad + s0, ns, u0 == 0, y + c * ldy);
  }
}

template <int64_t T>
void decode_rows(const uint8_t* W, int64_t ldw, int64_t n0, int64_t n1, int64_t M, int64_t K, const int8_t* Aq,
                 const float* Ad, int64_t nad, const float* Am, int64_t spad, float* y, int64_t ldy) {
  const int64_t nunits = K / unit_values(T);
  auto uw = aligned_buffer<uint8_t>(nunits * unpacked_bytes(T));
  auto udw = aligned_buffer<float>(nunits);
  auto wm = aligned_buffer<float>(spad);
  std::fill(wm.get(), wm.get() + spad, 0.f);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = W + n * ldw;
    for (int64_t c0 = 0; c0 < M; c0 += 4) {
      const int8_t* aq = Aq + c0 * K;
      const float* ad = Ad + c0 * nad;
      const float* am = Am + c0 * spad;
      float* yc = y + c0 * ldy + n;
#define RS_PASS(C, U) \
  decode_pass<T, C, U>(row, nunits, uw.get(), udw.get(), wm.get(), aq, K, ad, nad, am, spad, yc, ldy)
      const int64_t cc = std::min<int64_t>(4, M - c0);
      if (c0 == 0) {
        switch (cc) {
          case 1: RS_PASS(1, true); break;
          case 2: RS_PASS(2, true); break;
          case 3: RS_PASS(3, true); break;
          default: RS_PASS(4, true); break;
        }
      } else {
        switch (cc) {
          case 1: RS_PASS(1, false); break;
          case 2: RS_PASS(2, false); break;
          case 3: RS_PASS(3, false); break;
          default: RS_PASS(4, false); break;
        }
      }
#undef RS_PASS
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Fused decode (M <= fused_rows(): 4 by default, measured in benchmarks/cpu/quant_gemm.py): each
// weight block is unpacked in registers and dotted at once with up to 4 rows of x, as llama.cpp's
// ggml_vec_dot_q4_K_q8_K / q6_K_q8_K do on AVX2. Only a unit's offset / min terms (wmin: 1, 8 or
// 16 floats) go to memory, into a chunk-sized buffer; the scratch path above also stores each
// super-block's 256 values and eight 32-byte scale vectors to L1 and reads them back (~2x the
// instructions). The sums are the scratch path's and the tiles', in their order ("The float
// order" above): per unit the same exact int32 lanes (the K-quants' sub-block scales applied by
// vpmaddwd), times the same d_w * d_a, and per K chunk the same wmin * amin products, so taking
// the fused path changes the speed, not the bits.
// Rows of x beyond 4 take more passes over the row (it is then in L1 / L2, not memory).

constexpr int kFusedRowsDefault = 4;
constexpr int64_t kFusedRowsMax = 16;  // quant_decode_fused_rows' limit (the fused path takes any row count)
std::atomic<int> g_fused_rows{kFusedRowsDefault};

// int16 lane s of a vector of 8 int16 (both 128-bit halves) in every int16 lane
inline __m256i lane16(int s) { return _mm256_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * s)); }
// low half: int16 lane s, high half: lane t
inline __m256i lanes16(int s, int t) {
  return _mm256_setr_m128i(_mm_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * s)),
                           _mm_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * t)));
}

// The rows of x of one unit: a[c] its activation bytes, da[c] its d, am[c] its first amin slot.
template <int C>
struct FusedX {
  const int8_t* a[C];
  float da[C];
  const float* am[C];
};

// One Q4_K / Q5_K super-block at p; its 8 wmin slots (-dmin * min, as unpack_sb_q4k) times amin
// into wl.
template <int64_t T, int C>
__attribute__((always_inline)) inline void fused_sb_q4k(const uint8_t* p, const FusedX<C>& x, __m256* acc,
                                                        __m256* wl) {
  constexpr bool q5 = T == Q5_K;
  const float d = h2f(p), dmin = h2f(p + 2);
  uint32_t utmp[4];
  k_scales_mins(p + 4, utmp);  // bytes 0..7: the 8 scales, 8..15: the 8 mins
  const __m128i sm8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(utmp));
  const __m256i sm = _mm256_cvtepu8_epi16(sm8);
  const __m256i sc = _mm256_permute2x128_si256(sm, sm, 0x00);  // the 8 scales (int16) in both halves
  const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm8, 8)));
  const __m256 wm = _mm256_mul_ps(mins, _mm256_set1_ps(-dmin));
  const uint8_t* qs = p + (q5 ? 48 : 16);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m256i iacc[C];
  for (int c = 0; c < C; ++c) iacc[c] = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {  // qs[32j ..]: low nibbles = sub-block 2j (values 64j ..), high = 2j + 1
    const __m256i bits = ld256(qs + 32 * j);
    __m256i lo = _mm256_and_si256(bits, m4), hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
    if constexpr (q5) {  // qh[l] bit s: the 5th bit of value l of sub-block s
      const __m256i qh = ld256(p + 16), one = _mm256_set1_epi8(1);
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4));
      hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4));
    }
    const __m256i sl = _mm256_shuffle_epi8(sc, lane16(2 * j)), sh = _mm256_shuffle_epi8(sc, lane16(2 * j + 1));
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, ld256(x.a[c] + 64 * j)), sl);
      const __m256i ph = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, ld256(x.a[c] + 64 * j + 32)), sh);
      iacc[c] = _mm256_add_epi32(iacc[c], _mm256_add_epi32(pl, ph));
    }
  }
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[c]), _mm256_set1_ps(d * x.da[c]), acc[c]);
    wl[c] = _mm256_fmadd_ps(wm, _mm256_loadu_ps(x.am[c]), wl[c]);
  }
}

// One Q6_K super-block at p: values 128h + 32i (vector k = 4h + i) from ql (low 4 bits) and qh
// (2 bits), as in unpack_sb_q6k; vector k holds sub-blocks 2k, 2k + 1. Its 16 wmin slots (the -32
// offset: -32 * d * scale, as unpack_sb_q6k) times amin into wl.
template <int C>
__attribute__((always_inline)) inline void fused_sb_q6k(const uint8_t* p, const FusedX<C>& x, __m256* acc,
                                                        __m256* wl) {
  const float d = h2f(p + 208);
  const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192));  // a signed scale per 16 values
  const __m256i s16 = _mm256_cvtepi8_epi16(s8);
  const __m256i sa = _mm256_permute2x128_si256(s16, s16, 0x00);  // scales 0..7 in both halves
  const __m256i sb = _mm256_permute2x128_si256(s16, s16, 0x11);  // scales 8..15
  const __m256 m32 = _mm256_set1_ps(-32.f * d);
  const __m256 wm0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8)), m32);
  const __m256 wm1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8))), m32);
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  __m256i iacc[C];
  for (int c = 0; c < C; ++c) iacc[c] = _mm256_setzero_si256();
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    const __m256i l0 = ld256(p + 64 * h), l1 = ld256(p + 64 * h + 32), q = ld256(p + 128 + 32 * h);
    const __m256i s = h == 0 ? sa : sb;
    __m256i w[4];
    w[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(q, 4), m30));
    w[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(q, 2), m30));
    w[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(q, m30));
    w[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                           _mm256_and_si256(_mm256_srli_epi16(q, 2), m30));
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m256i sv = _mm256_shuffle_epi8(s, lanes16(2 * i, 2 * i + 1));
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
        iacc[c] = _mm256_add_epi32(
            iacc[c], _mm256_madd_epi16(_mm256_maddubs_epi16(w[i], ld256(x.a[c] + 128 * h + 32 * i)), sv));
    }
  }
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[c]), _mm256_set1_ps(d * x.da[c]), acc[c]);
    wl[c] = _mm256_fmadd_ps(wm0, _mm256_loadu_ps(x.am[c]), wl[c]);
    wl[c] = _mm256_fmadd_ps(wm1, _mm256_loadu_ps(x.am[c] + 8), wl[c]);
  }
}

// One block of a 32-block type at p; its wmin slot (as unpack_block32) -> *wm.
template <int64_t T, int C>
__attribute__((always_inline)) inline void fused_block32(const uint8_t* p, const FusedX<C>& x, __m256* acc,
                                                         float* wm) {
  const float d = h2f(p);
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (T == Q8_0) {  // the sign trick (see the AVX2 section's comment): no offset
    const __m256i q = ld256(p + 2), w = _mm256_abs_epi8(q);
    *wm = 0.f;
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_sign_epi8(ld256(x.a[c]), q)), ones);
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(d * x.da[c]), acc[c]);
    }
  } else {
    constexpr int64_t QO = T == Q4_0 ? 2 : T == Q4_1 ? 4 : T == Q5_0 ? 6 : 8;
    __m256i v = nibbles32(p + QO);
    if constexpr (T == Q5_0 || T == Q5_1) v = _mm256_or_si256(v, bits32_x16(ld32(p + (T == Q5_0 ? 2 : 4))));
    *wm = (T == Q4_1 || T == Q5_1) ? h2f(p + 2) : d * (T == Q4_0 ? -8.f : -16.f);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(v, ld256(x.a[c])), ones);
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(d * x.da[c]), acc[c]);
    }
  }
}

constexpr int64_t kFusedPrefetch = 1024;  // bytes ahead in the row stream (software prefetch)

// One weight row against C (<= 4) rows of x: y[c * ldy] = x_c . row, by K chunks (the tiles').
template <int64_t T, int C>
void fused_row(const uint8_t* row, int64_t nunits, const int8_t* Aq, int64_t K, const float* Ad, int64_t nad,
               const float* Am, int64_t spad, float* y, int64_t ldy) {
  constexpr int64_t TS = type_size(T), UV = unit_values(T), SPU = slots_per_unit(T), UC = KCHUNK / UV;
  alignas(32) float wm[is_kq(T) ? 8 : UC];  // 32-block types: the chunk's offset / min slots (one a block)
  for (int64_t u0 = 0; u0 < nunits; u0 += UC) {
    const int64_t uc = std::min(UC, nunits - u0), ns = chunk_slots(u0, uc, nunits, SPU, spad);
    __m256 acc[C], wl[C];
    for (int c = 0; c < C; ++c) acc[c] = wl[c] = _mm256_setzero_ps();
    for (int64_t u = u0; u < u0 + uc; ++u) {
      const uint8_t* p = row + u * TS;
      if constexpr (kFusedPrefetch > 0) {
        _mm_prefetch(reinterpret_cast<const char*>(p) + kFusedPrefetch, _MM_HINT_T0);
        if constexpr (TS > 64)
          for (int64_t b = 64; b < TS; b += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + kFusedPrefetch + b, _MM_HINT_T0);
      }
      FusedX<C> x;
      for (int c = 0; c < C; ++c) {
        x.a[c] = Aq + c * K + u * UV;
        x.da[c] = Ad[c * nad + u];
        x.am[c] = Am + c * spad + u * SPU;
      }
      if constexpr (T == Q4_K || T == Q5_K)
        fused_sb_q4k<T, C>(p, x, acc, wl);
      else if constexpr (T == Q6_K)
        fused_sb_q6k<C>(p, x, acc, wl);
      else
        fused_block32<T, C>(p, x, acc, wm + (u - u0));
    }
    if constexpr (!is_kq(T)) {  // a slot a block: the chunk's slots summed 8 at a time at its end
      std::fill(wm + uc, wm + ns, 0.f);  // the last chunk's padding
      for (int c = 0; c < C; ++c) wl[c] = wmin_dot(wm, Am + c * spad + u0, ns, wl[c]);
    }
    for (int c = 0; c < C; ++c) add_chunk_lanes(acc[c], wl[c], u0 == 0, y + c * ldy);
  }
}

// Weight rows [n0, n1) against all M rows of x, 4 at a time.
template <int64_t T>
void fused_rows(const uint8_t* W, int64_t ldw, int64_t n0, int64_t n1, int64_t M, int64_t K, const int8_t* Aq,
                const float* Ad, int64_t nad, const float* Am, int64_t spad, float* y, int64_t ldy) {
  const int64_t nunits = K / unit_values(T);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = W + n * ldw;
    for (int64_t c0 = 0; c0 < M; c0 += 4) {
#define RS_FUSED(C) \
  fused_row<T, C>(row, nunits, Aq + c0 * K, K, Ad + c0 * nad, nad, Am + c0 * spad, spad, y + c0 * ldy + n, ldy)
      switch (std::min<int64_t>(4, M - c0)) {
        case 1: RS_FUSED(1); break;
        case 2: RS_FUSED(2); break;
        case 3: RS_FUSED(3); break;
        default: RS_FUSED(4); break;
      }
#undef RS_FUSED
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Prefill micro-kernels: R weight rows x C rows of x over one K chunk of nu units. F[r * C + c]:
// 8 float32 partial sums (in memory between chunks).

// K-quants: per super-block R x C int32 accumulators in registers, then F += float * d_w * d_a.
// I16 (the int16-sum tiles below): int16 accumulators, scaled once at the super-block's end.
template <int R, int C, bool I16 = false>
inline void mk_kq(const uint8_t* const* uw, const float* const* udw, const int8_t* const* aq, const float* const* ad,
                  int64_t nu, float* const* F) {
  for (int64_t s = 0; s < nu; ++s) {
    __m256i iacc[R][C];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) iacc[r][c] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int k = 0; k < 8; ++k) {  // not unrolled: GCC hoists the loads of all chunks and spills
      __m256i wv[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        wv[r] = in_reg(_mm256_load_si256(reinterpret_cast<const __m256i*>(uw[r] + s * 512 + 32 * k)));
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const __m256i a = in_reg(ld256(aq[c] + s * 256 + 32 * k));
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m256i p = _mm256_maddubs_epi16(wv[r], a);
          if constexpr (I16) {
            iacc[r][c] = _mm256_add_epi16(iacc[r][c], p);
          } else {
            const __m256i sv = _mm256_load_si256(reinterpret_cast<const __m256i*>(uw[r] + s * 512 + 256 + 32 * k));
            iacc[r][c] = _mm256_add_epi32(iacc[r][c], _mm256_madd_epi16(p, sv));
          }
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        __m256i t = iacc[r][c];
        if constexpr (I16) t = _mm256_madd_epi16(t, _mm256_load_si256(reinterpret_cast<const __m256i*>(uw[r] + s * 512 + 256)));
        float* f = F[r * C + c];
        _mm256_storeu_ps(f, _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(udw[r][s] * ad[c][s]),
                                            _mm256_loadu_ps(f)));
      }
  }
}

// The full register block (2 weight rows x 4 rows of x) of mk_kq, the prefill's hot loop: written
// as one inline-assembly block per 32 values because GCC, given the intrinsics, hoists the four
// activation loads, runs out of the 16 registers and spills an accumulator, whose trip through
// memory every iteration cost ~10% (benchmarks/NOTES.md, issue 54 session 11). Registers: the 8
// int32 accumulators (GCC's choice), ymm8/9 the two rows' weight bytes, ymm10/11 their scale
// vectors (loaded once per 32 values, not once per row of x), ymm12 an activation vector, ymm13/14
// the products. The scales d_w * d_a of the 8 outputs are formed four at a time (one vector
// product per weight row, the same bits as the scalar products) and the float update is mk_kq's.
inline void mk_kq24(const uint8_t* const* uw, const float* const* udw, const int8_t* const* aq, const float* const* ad,
                    int64_t nu, float* const* F) {
  for (int64_t s = 0; s < nu; ++s) {
    __m256i c00 = _mm256_setzero_si256(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00;
    const uint8_t* w0 = uw[0] + s * 512;
    const uint8_t* w1 = uw[1] + s * 512;
    const int8_t *a0 = aq[0] + s * 256, *a1 = aq[1] + s * 256, *a2 = aq[2] + s * 256, *a3 = aq[3] + s * 256;
    for (int64_t k = 0; k < 256; k += 32) {
#define RS_ROW_OF_X(A, C0, C1)                 \
  "vmovdqu (%[" A "],%[k]), %%ymm12\n\t"       \
  "vpmaddubsw %%ymm12, %%ymm8, %%ymm13\n\t"    \
  "vpmaddubsw %%ymm12, %%ymm9, %%ymm14\n\t"    \
  "vpmaddwd %%ymm10, %%ymm13, %%ymm13\n\t"     \
  "vpmaddwd %%ymm11, %%ymm14, %%ymm14\n\t"     \
  "vpaddd %%ymm13, %[" C0 "], %[" C0 "]\n\t"   \
  "vpaddd %%ymm14, %[" C1 "], %[" C1 "]\n\t"
      __asm__("vmovdqa (%[w0],%[k]), %%ymm8\n\t"
              "vmovdqa (%[w1],%[k]), %%ymm9\n\t"
              "vmovdqa 256(%[w0],%[k]), %%ymm10\n\t"
              "vmovdqa 256(%[w1],%[k]), %%ymm11\n\t"
              RS_ROW_OF_X("a0", "c00", "c10") RS_ROW_OF_X("a1", "c01", "c11")
              RS_ROW_OF_X("a2", "c02", "c12") RS_ROW_OF_X("a3", "c03", "c13")
              : [c00] "+x"(c00), [c01] "+x"(c01), [c02] "+x"(c02), [c03] "+x"(c03),
                [c10] "+x"(c10), [c11] "+x"(c11), [c12] "+x"(c12), [c13] "+x"(c13)
              : [w0] "r"(w0), [w1] "r"(w1), [a0] "r"(a0), [a1] "r"(a1), [a2] "r"(a2), [a3] "r"(a3), [k] "r"(k)
              : "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "memory");
#undef RS_ROW_OF_X
    }
    const __m128 da = _mm_setr_ps(ad[0][s], ad[1][s], ad[2][s], ad[3][s]);
    const __m256 sd0 = _mm256_castps128_ps256(_mm_mul_ps(_mm_set1_ps(udw[0][s]), da));
    const __m256 sd1 = _mm256_castps128_ps256(_mm_mul_ps(_mm_set1_ps(udw[1][s]), da));
    const __m256i lane[4] = {_mm256_set1_epi32(0), _mm256_set1_epi32(1), _mm256_set1_epi32(2), _mm256_set1_epi32(3)};
    const __m256i acc[8] = {c00, c01, c02, c03, c10, c11, c12, c13};
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const __m256 sd = _mm256_permutevar8x32_ps(i < 4 ? sd0 : sd1, lane[i % 4]);
      _mm256_storeu_ps(F[i], _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i]), sd, _mm256_loadu_ps(F[i])));
    }
  }
}

// 32-block types: per block the int32 lanes converted and scaled at once (a scale per block).
template <int64_t T, int R, int C>
inline void mk32(const uint8_t* const* uw, const float* const* udw, const int8_t* const* aq, const float* const* ad,
                 int64_t nu, float* const* F) {
  constexpr int64_t UW = unpacked_bytes(T);
  __m256 acc[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_loadu_ps(F[r * C + c]);
  const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 1
  for (int64_t b = 0; b < nu; ++b) {
    __m256i wv[R];
    __m256 dw[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      wv[r] = in_reg(_mm256_load_si256(reinterpret_cast<const __m256i*>(uw[r] + b * UW)));
      dw[r] = _mm256_broadcast_ss(udw[r] + b);
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m256i a = in_reg(ld256(aq[c] + b * 32));
      const __m256 da = _mm256_broadcast_ss(ad[c] + b);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        __m256i av = a;
        if constexpr (T == Q8_0)
          av = _mm256_sign_epi8(a, _mm256_load_si256(reinterpret_cast<const __m256i*>(uw[r] + b * UW + 32)));
        const __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(wv[r], av), ones);
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dw[r], da), acc[r][c]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(F[r * C + c], acc[r][c]);
}

inline void mk_i16_24(const uint8_t* const* uw, const float* const* udw, const int8_t* const* aq, const float* const* ad,
                      int64_t nu, float* const* F);  // the int16-sum tiles' 2 x 4 block (below)

// I16: the int16-sum tiles' kernels (Q4_K).
template <int64_t T, int R, int C, bool I16 = false>
inline void mk(const uint8_t* const* uw, const float* const* udw, const int8_t* const* aq, const float* const* ad,
               int64_t nu, float* const* F) {
  if constexpr (I16 && R == 2 && C == 4)
    mk_i16_24(uw, udw, aq, ad, nu, F);
  else if constexpr (I16)
    mk_kq<R, C, true>(uw, udw, aq, ad, nu, F);
  else if constexpr (is_kq(T) && R == 2 && C == 4)
    mk_kq24(uw, udw, aq, ad, nu, F);
  else if constexpr (is_kq(T))
    mk_kq<R, C>(uw, udw, aq, ad, nu, F);
  else
    mk32<T, R, C>(uw, udw, aq, ad, nu, F);
}

// The register block of the micro-kernels: RB = 2 weight rows x CB = 4 rows of x (K-quants: 8 int32
// accumulators, one of them spilled by GCC; 1 x 8 spills nothing but loads each activation vector
// from L2 for one weight row only, and measured 1.2-1.5x slower on Zen 3).
constexpr int RB = 2;
constexpr int CB = 4;

template <int64_t T, bool I16 = false>
void mk_dispatch(int rr, int cc, const uint8_t* const* uw, const float* const* udw, const int8_t* const* aq,
                 const float* const* ad, int64_t nu, float* const* F) {
  switch (rr * 4 + cc) {
    case 1 * 4 + 1: return mk<T, 1, 1, I16>(uw, udw, aq, ad, nu, F);
    case 1 * 4 + 2: return mk<T, 1, 2, I16>(uw, udw, aq, ad, nu, F);
    case 1 * 4 + 3: return mk<T, 1, 3, I16>(uw, udw, aq, ad, nu, F);
    case 1 * 4 + 4: return mk<T, 1, 4, I16>(uw, udw, aq, ad, nu, F);
    case 2 * 4 + 1: return mk<T, 2, 1, I16>(uw, udw, aq, ad, nu, F);
    case 2 * 4 + 2: return mk<T, 2, 2, I16>(uw, udw, aq, ad, nu, F);
    case 2 * 4 + 3: return mk<T, 2, 3, I16>(uw, udw, aq, ad, nu, F);
    default: return mk<T, 2, 4, I16>(uw, udw, aq, ad, nu, F);
  }
}

// ---------------------------------------------------------------------------------------------
// The int16-sum tiles (path int8_i16, Q4_K): a Q4_K value times an activation byte is at most
// 15 * 127, so a vpmaddubsw lane (two such products) is at most 3810 and the 8 lanes of a
// super-block's 8 vectors add up in int16 without overflow (30480). If every lane of every vector
// holds one sub-block's values in the same place, the 8 vectors' int16 sums take their scales in
// one vpmaddwd per super-block instead of one per vector: 9 multiplies per 256 values, not 16.
// The layout (weights at unpack, activations after quantization, the same permutation of int16
// pairs): vector k, lane i = values 4k + 2 (i / 8), +1 of sub-block i % 8; the scale vector holds
// sub-block i % 8's scale in lane i. The int32 sums are the same integers as int8's in other lanes,
// so the float rounding (not the accuracy) differs from int8's.

// 256 bytes in sub-block order -> the int16-sum layout (in place). As 32-bit words, sub-block j's
// word k (values 4k .. 4k+3) is entry (j, k) of an 8 x 8 matrix: vector k is column k transposed,
// its words' low halves in lanes 0-7 and high halves in lanes 8-15.
inline void permute_i16(uint8_t* v) {
  __m256i r[8], t[8], u[8];
  for (int j = 0; j < 8; ++j) r[j] = ld256(v + 32 * j);
  for (int j = 0; j < 8; j += 2) {
    t[j] = _mm256_unpacklo_epi32(r[j], r[j + 1]);
    t[j + 1] = _mm256_unpackhi_epi32(r[j], r[j + 1]);
  }
  for (int h = 0; h < 8; h += 4) {  // rows h .. h+3: columns (0 | 4), (1 | 5), (2 | 6), (3 | 7)
    u[h] = _mm256_unpacklo_epi64(t[h], t[h + 2]);
    u[h + 1] = _mm256_unpackhi_epi64(t[h], t[h + 2]);
    u[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]);
    u[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]);
  }
  const __m256i halves = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                          0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  for (int k = 0; k < 4; ++k) {
    const __m256i lo = _mm256_permute2x128_si256(u[k], u[k + 4], 0x20);  // column k: rows 0-3 | 4-7
    const __m256i hi = _mm256_permute2x128_si256(u[k], u[k + 4], 0x31);  // column k + 4
    st256(v + 32 * k, _mm256_permute4x64_epi64(_mm256_shuffle_epi8(lo, halves), _MM_SHUFFLE(3, 1, 2, 0)));
    st256(v + 32 * (k + 4), _mm256_permute4x64_epi64(_mm256_shuffle_epi8(hi, halves), _MM_SHUFFLE(3, 1, 2, 0)));
  }
}

// Q4_K unit u of a row -> w: 256 value bytes (permuted), then the scale vector (lane i: sub-block i % 8)
inline void unpack_unit_i16(const uint8_t* row, int64_t u, uint8_t* w, float* dw, float* wmin) {
  unpack_sb_q4k(row + u * type_size(Q4_K), false, w, dw, wmin);  // scale vectors: sub-block s at 256 + 32 s
  permute_i16(w);
  alignas(32) int16_t sc[16];
  for (int i = 0; i < 16; ++i) std::memcpy(sc + i, w + 256 + 32 * (i % 8), 2);
  std::memcpy(w + 256, sc, 32);
}

// The sum of every lane of a[i] in lane i (exact: int32 adds), by unpacks and adds.
inline __m256i hsum8x8i(const __m256i* a) {
  __m256i p[4], q[2];
  for (int i = 0; i < 4; ++i)  // per 128-bit half: a[2i]'s and a[2i+1]'s pairs of lanes
    p[i] = _mm256_add_epi32(_mm256_unpacklo_epi32(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 2; ++i)  // per half: a[4i .. 4i+3]'s sums of that half
    q[i] = _mm256_add_epi32(_mm256_unpacklo_epi64(p[2 * i], p[2 * i + 1]), _mm256_unpackhi_epi64(p[2 * i], p[2 * i + 1]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(q[0], q[1], 0x20), _mm256_permute2x128_si256(q[0], q[1], 0x31));
}

// The int16-sum tiles' full register block (2 x 4) in inline assembly, as mk_kq24 and for its reason
// (GCC spills an accumulator): ymm8/9 the two rows' weight bytes, ymm12 an activation vector,
// ymm13/14 products. Per super-block the 8 outputs' int32 sums are reduced to one lane each (exact)
// and one vector product-add of 8 scales d_w * d_a keeps the 8 float sums in a register across
// super-blocks; at the end each goes into lane 0 of its F (the other lanes stay as they are:
// add_chunk4 sums all 8). The edge blocks (mk_kq<R, C, true>) keep 8 lanes, so an output's float
// rounding depends on its block; this path does not promise batch invariance (int8 does).
inline void mk_i16_24(const uint8_t* const* uw, const float* const* udw, const int8_t* const* aq, const float* const* ad,
                      int64_t nu, float* const* F) {
  __m256 sums = _mm256_setzero_ps();  // lane i: output i = (weight row i / 4, row of x i % 4)
  for (int64_t s = 0; s < nu; ++s) {
    __m256i c00 = _mm256_setzero_si256(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00;
    const uint8_t* w0 = uw[0] + s * 512;
    const uint8_t* w1 = uw[1] + s * 512;
    const int8_t *a0 = aq[0] + s * 256, *a1 = aq[1] + s * 256, *a2 = aq[2] + s * 256, *a3 = aq[3] + s * 256;
    for (int64_t k = 0; k < 256; k += 32) {
#define RS_ROW_OF_X(A, C0, C1)                 \
  "vmovdqu (%[" A "],%[k]), %%ymm12\n\t"       \
  "vpmaddubsw %%ymm12, %%ymm8, %%ymm13\n\t"    \
  "vpmaddubsw %%ymm12, %%ymm9, %%ymm14\n\t"    \
  "vpaddw %%ymm13, %[" C0 "], %[" C0 "]\n\t"   \
  "vpaddw %%ymm14, %[" C1 "], %[" C1 "]\n\t"
      __asm__("vmovdqa (%[w0],%[k]), %%ymm8\n\t"
              "vmovdqa (%[w1],%[k]), %%ymm9\n\t"
              RS_ROW_OF_X("a0", "c00", "c10") RS_ROW_OF_X("a1", "c01", "c11")
              RS_ROW_OF_X("a2", "c02", "c12") RS_ROW_OF_X("a3", "c03", "c13")
              : [c00] "+x"(c00), [c01] "+x"(c01), [c02] "+x"(c02), [c03] "+x"(c03),
                [c10] "+x"(c10), [c11] "+x"(c11), [c12] "+x"(c12), [c13] "+x"(c13)
              : [w0] "r"(w0), [w1] "r"(w1), [a0] "r"(a0), [a1] "r"(a1), [a2] "r"(a2), [a3] "r"(a3), [k] "r"(k)
              : "xmm8", "xmm9", "xmm12", "xmm13", "xmm14", "memory");
#undef RS_ROW_OF_X
    }
    const __m256i sv0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w0 + 256));
    const __m256i sv1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w1 + 256));
    const __m256i acc[8] = {_mm256_madd_epi16(c00, sv0), _mm256_madd_epi16(c01, sv0), _mm256_madd_epi16(c02, sv0),
                            _mm256_madd_epi16(c03, sv0), _mm256_madd_epi16(c10, sv1), _mm256_madd_epi16(c11, sv1),
                            _mm256_madd_epi16(c12, sv1), _mm256_madd_epi16(c13, sv1)};
    const __m128 da = _mm_setr_ps(ad[0][s], ad[1][s], ad[2][s], ad[3][s]);
    const __m256 sd = _mm256_mul_ps(_mm256_set_m128(_mm_set1_ps(udw[1][s]), _mm_set1_ps(udw[0][s])),
                                    _mm256_set_m128(da, da));
    sums = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hsum8x8i(acc)), sd, sums);
  }
  alignas(32) float out[8];
  _mm256_store_ps(out, sums);
  for (int i = 0; i < 8; ++i) F[i][0] += out[i];
}

// Prefill: K in chunks of KCHUNK values, outermost: for each chunk and block of MC rows of x
// (their chunk of quantized bytes, MC x 2 KiB, held in L2) the weight rows are taken in tiles of
// NT, each tile's chunk unpacked once into an L1 buffer and used for every row of x in the block
// (register blocks of RB weight rows x CB rows of x). Each chunk's partial sums (with its share of
// the offset / min terms) are added into y, so MC does not shrink with K (the weights are read
// M / MC times whatever K is).
template <int64_t T, bool I16 = false>
void prefill_tiles(const uint8_t* W, int64_t ldw, int64_t t0, int64_t t1, int64_t N, int64_t M, int64_t MC, int64_t K,
                   const int8_t* Aq, const float* Ad, int64_t nad, const float* Am, int64_t spad, float* y,
                   int64_t ldy) {
  constexpr int64_t UW = unpacked_bytes(T), UV = unit_values(T), SPU = slots_per_unit(T);
  constexpr int64_t UC = KCHUNK / UV;  // units per K chunk
  const int64_t nunits = K / UV;
  uint8_t* Uw = scratch<uint8_t, 3>(NT * UC * UW);
  float* Udw = scratch<float, 4>(NT * UC);
  float* Fb = scratch<float, 5>(NT * MC * 8);
  float* Wm = scratch<float, 6>(NT * spad);
  std::fill(Wm, Wm + NT * spad, 0.f);  // the slots past the last unit stay zero
  for (int64_t u0 = 0; u0 < nunits; u0 += UC) {
    const int64_t uc = std::min(UC, nunits - u0);
    const int64_t s0 = u0 * SPU, ns = chunk_slots(u0, uc, nunits, SPU, spad);  // this chunk's offset / min slots
    for (int64_t mb = 0; mb < M; mb += MC) {
      const int64_t mc = std::min(MC, M - mb);
      for (int64_t tile = t0; tile < t1; ++tile) {
        const int64_t n0 = tile * NT, nr = std::min(NT, N - n0);
        std::fill(Fb, Fb + NT * MC * 8, 0.f);
        if (tile + 1 < t1) {  // the next tile's chunk towards L2 while this one computes
          const int64_t nn = std::min(NT, N - n0 - NT);
          for (int64_t r = 0; r < nn; ++r)
            for (int64_t b = 0; b < uc * type_size(T); b += 64)
              _mm_prefetch(reinterpret_cast<const char*>(W + (n0 + NT + r) * ldw + u0 * type_size(T) + b),
                           _MM_HINT_T1);
        }
        for (int64_t r = 0; r < nr; ++r) {
          const uint8_t* row = W + (n0 + r) * ldw;
          for (int64_t u = 0; u < uc; ++u) {
            if constexpr (I16)
              unpack_unit_i16(row, u0 + u, Uw + (r * UC + u) * UW, Udw + r * UC + u, Wm + r * spad + (u0 + u) * SPU);
            else
              unpack_unit<T>(row, u0 + u, Uw + (r * UC + u) * UW, Udw + r * UC + u,
                             Wm + r * spad + (u0 + u) * SPU);
          }
        }
        for (int64_t c0 = 0; c0 < mc; c0 += CB) {
          const int cc = static_cast<int>(std::min<int64_t>(CB, mc - c0));
          const int8_t* aq[CB];
          const float* ad[CB];
          for (int c = 0; c < cc; ++c) {
            const int64_t m = mb + c0 + c;
            aq[c] = Aq + m * K + u0 * UV;
            ad[c] = Ad + m * nad + u0;
          }
          for (int64_t r0 = 0; r0 < nr; r0 += RB) {
            const int rr = static_cast<int>(std::min<int64_t>(RB, nr - r0));
            const uint8_t* uw[RB];
            const float* udw[RB];
            float* F[RB * CB];
            for (int r = 0; r < rr; ++r) {
              uw[r] = Uw + (r0 + r) * UC * UW;
              udw[r] = Udw + (r0 + r) * UC;
              for (int c = 0; c < cc; ++c) F[r * cc + c] = Fb + ((r0 + r) * MC + c0 + c) * 8;
            }
            mk_dispatch<T, I16>(rr, cc, uw, udw, aq, ad, uc, F);
          }
        }
        static_assert(NT == 4, "add_chunk4 sums 4 rows at once");
        const float* wm[NT];
        for (int64_t r = 0; r < NT; ++r) wm[r] = Wm + std::min(r, nr - 1) * spad + s0;
        for (int64_t c = 0; c < mc; ++c) {  // the chunk's sums + its offsets / mins (wmin . amin) into y
          __m256 lanes[NT];
          for (int64_t r = 0; r < NT; ++r) lanes[r] = _mm256_loadu_ps(Fb + (std::min(r, nr - 1) * MC + c) * 8);
          add_chunk4(lanes, wm, Am + (mb + c) * spad + s0, ns, nr, u0 == 0, y + (mb + c) * ldy + n0);
        }
      }
    }
  }
}

// y[M, N] (row stride ldy) = x[M, K] (contiguous) @ dequantize(W)^T. fused_limit: this call's row limit
// for the fused decode (-1: the process's, quant_decode_fused_rows).
template <int64_t T>
void quant_gemm_t(const float* x, int64_t M, int64_t K, const uint8_t* W, int64_t ldw, int64_t N, float* y,
                  int64_t ldy, int64_t fused_limit, bool i16) {
  const int64_t nad = K / unit_values(T);                   // activation d per row
  const int64_t spad = pad8(nad * slots_per_unit(T));       // offset / min slots per row
  // 1. every row of x quantized once, into this thread's scratch (reused: no page faults per call)
  const int64_t limit = fused_limit >= 0 ? std::min(fused_limit, kFusedRowsMax) : g_fused_rows.load(std::memory_order_relaxed);
  const bool fused = M <= limit;
  int8_t* Aq = scratch<int8_t, 0>(M * K);
  float* Ad = scratch<float, 1>(M * nad);
  float* Am = scratch<float, 2>(M * spad);
  radixserve::parallel_for_dynamic(M, 4, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      float* am = Am + m * spad;
      std::fill(am, am + spad, 0.f);
      quantize_row(x + m * K, K, T, Aq + m * K, Ad + m * nad, am);
    }
  });
  if (fused) {
    radixserve::parallel_for_dynamic(N, 16, [&](int64_t n0, int64_t n1) {
      fused_rows<T>(W, ldw, n0, n1, M, K, Aq, Ad, nad, Am, spad, y, ldy);
    });
    return;
  }
  if (M <= kDecodeRows) {
    radixserve::parallel_for_dynamic(N, 16, [&](int64_t n0, int64_t n1) {
      decode_rows<T>(W, ldw, n0, n1, M, K, Aq, Ad, nad, Am, spad, y, ldy);
    });
    return;
  }
  // 2. rows of x in blocks of MC (their quantized bytes of a K chunk ~ 256 KiB, half an L2)
  int64_t MC = (256 * 1024) / (std::min(K, KCHUNK) + 64);
  MC = std::max<int64_t>(4, std::min<int64_t>(256, MC / 4 * 4));
  MC = std::min(MC, (M + 3) / 4 * 4);
  const int64_t ntiles = (N + NT - 1) / NT;
  if constexpr (T == Q4_K) {
    if (i16) {  // the activations into the int16-sum layout (the weights take it at unpack)
      radixserve::parallel_for_dynamic(M, 4, [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m)
          for (int64_t b = 0; b < K / 256; ++b) permute_i16(reinterpret_cast<uint8_t*>(Aq + m * K + 256 * b));
      });
      radixserve::parallel_for_dynamic(ntiles, 1, [&](int64_t t0, int64_t t1) {
        prefill_tiles<T, true>(W, ldw, t0, t1, N, M, MC, K, Aq, Ad, nad, Am, spad, y, ldy);
      });
      return;
    }
  }
  radixserve::parallel_for_dynamic(ntiles, 1, [&](int64_t t0, int64_t t1) {
    prefill_tiles<T>(W, ldw, t0, t1, N, M, MC, K, Aq, Ad, nad, Am, spad, y, ldy);
  });
}

template <bool KQ>
void quant_gemm(const float* x, int64_t M, int64_t K, const uint8_t* W, int64_t ldw, int64_t N, const QInfo& qi,
                float* y, int64_t ldy, int64_t fused_limit, bool i16) {
  switch (qi.id) {
    case Q4_0: return quant_gemm_t<Q4_0>(x, M, K, W, ldw, N, y, ldy, fused_limit, i16);
    case Q4_1: return quant_gemm_t<Q4_1>(x, M, K, W, ldw, N, y, ldy, fused_limit, i16);
    case Q5_0: return quant_gemm_t<Q5_0>(x, M, K, W, ldw, N, y, ldy, fused_limit, i16);
    case Q5_1: return quant_gemm_t<Q5_1>(x, M, K, W, ldw, N, y, ldy, fused_limit, i16);
    case Q8_0: return quant_gemm_t<Q8_0>(x, M, K, W, ldw, N, y, ldy, fused_limit, i16);
    case Q4_K: return quant_gemm_t<Q4_K>(x, M, K, W, ldw, N, y, ldy, fused_limit, i16);
    case Q5_K: return quant_gemm_t<Q5_K>(x, M, K, W, ldw, N, y, ldy, fused_limit, i16);
    default: return quant_gemm_t<Q6_K>(x, M, K, W, ldw, N, y, ldy, fused_limit, i16);
  }
}

// ---------------------------------------------------------------------------------------------
// Dequantization to float32 with the unpacking above (quant_dequantize_f32 / _bf16 on AVX2):
// value = scale * u + min, one fma per value.

// 8 unsigned bytes at u -> scale * u + min
inline __m256 emit8(const uint8_t* u, __m256 scale, __m256 min) {
  const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(u))));
  return _mm256_fmadd_ps(v, scale, min);
}

template <int64_t T>
void dequant_row_f32_simd(const uint8_t* row, int64_t K, float* out) {
  alignas(32) uint8_t w[512];
  alignas(32) float wm[16];
  float d = 0.f;
  for (int64_t u = 0; u < K / unit_values(T); ++u) {
    float* o = out + u * unit_values(T);
    unpack_unit<T>(row, u, w, &d, wm);
    if constexpr (T == Q8_0) {  // the signed values are at w + 32
      const __m256 dv = _mm256_set1_ps(d);
      for (int i = 0; i < 32; i += 8)
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                  _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 32 + i)))),
                                              dv));
    } else if constexpr (!is_kq(T)) {
      const __m256 sv = _mm256_set1_ps(d), mv = _mm256_set1_ps(wm[0]);
      for (int i = 0; i < 32; i += 8) _mm256_storeu_ps(o + i, emit8(w + i, sv, mv));
    } else {
      for (int i = 0; i < 256; i += 16) {  // 16 values: one scale (the int16 lanes of the scale vectors)
        int16_t sc;
        std::memcpy(&sc, w + 256 + 32 * (i / 32) + (T == Q6_K ? (i % 32) : 0), 2);
        const __m256 sv = _mm256_set1_ps(d * static_cast<float>(sc));
        const __m256 mv = _mm256_set1_ps(wm[T == Q6_K ? i / 16 : i / 32]);
        _mm256_storeu_ps(o + i, emit8(w + i, sv, mv));
        _mm256_storeu_ps(o + i + 8, emit8(w + i + 8, sv, mv));
      }
    }
  }
}

// true where done (the AVX2 build); the portable loop otherwise
bool dequant_row_f32_fast(const uint8_t* row, int64_t K, int64_t qtype, float* out) {
  switch (qtype) {
    case Q4_0: dequant_row_f32_simd<Q4_0>(row, K, out); return true;
    case Q4_1: dequant_row_f32_simd<Q4_1>(row, K, out); return true;
    case Q5_0: dequant_row_f32_simd<Q5_0>(row, K, out); return true;
    case Q5_1: dequant_row_f32_simd<Q5_1>(row, K, out); return true;
    case Q8_0: dequant_row_f32_simd<Q8_0>(row, K, out); return true;
    case Q4_K: dequant_row_f32_simd<Q4_K>(row, K, out); return true;
    case Q5_K: dequant_row_f32_simd<Q5_K>(row, K, out); return true;
    case Q6_K: dequant_row_f32_simd<Q6_K>(row, K, out); return true;
    default: return false;
  }
}

#endif  // RADIXSERVE_QUANT_AVX512 / RADIXSERVE_QUANT_AVX2

// ---------------------------------------------------------------------------------------------
// Portable dequantization (any ISA): weight rows -> float32 (quant_dequantize_f32: the "dequantize
// a tile + torch's float32 GEMM" candidate) and, where the AVX-512 section is not built, -> bf16.
// value = scale * u + min per block / sub-block (u: the unsigned stored value), contracted to one
// fma where the ISA has it, as the AVX-512 unpacking does; gguf's numpy rounds d * q and - m
// separately, so the two can differ in the last bit where they are not the same product.

inline float half_bits_to_f32(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return static_cast<float>(c10::Half(v, c10::Half::from_bits()));
}

// One row of K values of type qtype -> out[K] (float32).
void dequant_row_f32(const uint8_t* row, int64_t K, int64_t qtype, float* out) {
#if defined(RADIXSERVE_QUANT_AVX2)
  if (dequant_row_f32_fast(row, K, qtype, out)) return;
#endif
  const QInfo& qi = *find_type(qtype);
  for (int64_t b = 0; b < K / qi.block; ++b) {
    const uint8_t* p = row + b * qi.bytes;
    float* o = out + b * qi.block;
    const float d = half_bits_to_f32(qtype == Q6_K ? p + 208 : p);
    switch (qtype) {
      case Q4_0:
      case Q4_1:
      case Q5_0:
      case Q5_1: {
        const bool q5 = qtype == Q5_0 || qtype == Q5_1, has_m = qtype == Q4_1 || qtype == Q5_1;
        const float min = has_m ? half_bits_to_f32(p + 2) : d * (q5 ? -16.f : -8.f);
        uint32_t qh = 0;
        if (q5) std::memcpy(&qh, p + (has_m ? 4 : 2), 4);
        const uint8_t* qs = p + (qtype == Q4_0 ? 2 : qtype == Q4_1 ? 4 : qtype == Q5_0 ? 6 : 8);
        for (int i = 0; i < 16; ++i) {
          const int lo = (qs[i] & 15) | static_cast<int>(((qh >> i) & 1) << 4);
          const int hi = (qs[i] >> 4) | static_cast<int>(((qh >> (i + 16)) & 1) << 4);
          o[i] = d * static_cast<float>(lo) + min;
          o[i + 16] = d * static_cast<float>(hi) + min;
        }
        break;
      }
      case Q8_0:
        for (int i = 0; i < 32; ++i) o[i] = d * static_cast<float>(static_cast<int8_t>(p[2 + i]));
        break;
      case Q4_K:
      case Q5_K: {
        const bool q5 = qtype == Q5_K;
        const float dmin = half_bits_to_f32(p + 2);
        const uint8_t* s = p + 4;  // 12 bytes: 8 six-bit scales and mins (ggml's get_scale_min_k4)
        const uint8_t* qh = p + 16;
        const uint8_t* qs = p + (q5 ? 48 : 16);
        for (int sub = 0; sub < 8; ++sub) {
          const int sc = sub < 4 ? s[sub] & 63 : (s[sub + 4] & 0xF) | ((s[sub - 4] >> 6) << 4);
          const int m = sub < 4 ? s[sub + 4] & 63 : (s[sub + 4] >> 4) | ((s[sub] >> 6) << 4);
          const float scale = d * static_cast<float>(sc), min = -(dmin * static_cast<float>(m));
          const uint8_t* q = qs + 32 * (sub / 2);
          for (int l = 0; l < 32; ++l) {
            int u = sub % 2 ? q[l] >> 4 : q[l] & 15;
            if (q5) u |= ((qh[l] >> sub) & 1) << 4;
            o[32 * sub + l] = scale * static_cast<float>(u) + min;
          }
        }
        break;
      }
      default: {  // Q6_K
        const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
        for (int h = 0; h < 2; ++h) {
          const uint8_t* ql = p + 64 * h;
          const uint8_t* qh = p + 128 + 32 * h;
          for (int l = 0; l < 32; ++l) {
            const int u[4] = {(ql[l] & 15) | ((qh[l] & 3) << 4), (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4),
                              (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4), (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)};
            for (int j = 0; j < 4; ++j) {
              const int v = 128 * h + 32 * j + l;
              const float scale = d * static_cast<float>(sc[v / 16]);
              o[v] = scale * static_cast<float>(u[j]) + scale * -32.f;
            }
          }
        }
      }
    }
  }
}

// float32 -> bf16 bits, round to nearest even (as torch rounds)
inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

// Checks of a weight [N, row_bytes] for the dequantization entry points; returns its type.
const QInfo& check_dequant_args(const char* fn, const at::Tensor& weight, int64_t qtype, int64_t K) {
  const QInfo* qi = find_type(qtype);
  TORCH_CHECK(qi != nullptr, fn, ": unsupported ggml type ", qtype);
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.dim() == 2 &&
                  weight.stride(1) == 1,
              fn, ": weight must be a CPU uint8 [N, row_bytes] with contiguous rows");
  TORCH_CHECK(K > 0 && K % qi->block == 0, fn, ": in_features ", K, " is not a multiple of ", qi->block);
  TORCH_CHECK(weight.size(1) == K / qi->block * qi->bytes, fn, ": weight rows are ", weight.size(1),
              " bytes, expected ", K / qi->block * qi->bytes);
  return *qi;
}

// weight rows [N, row_bytes] -> float32 [N, K]
at::Tensor quant_dequantize_f32(const at::Tensor& weight, int64_t qtype, int64_t in_features) {
  check_dequant_args("quant_dequantize_f32", weight, qtype, in_features);
  const int64_t N = weight.size(0), K = in_features, ldw = weight.stride(0);
  at::Tensor out = at::empty({N, K}, weight.options().dtype(at::kFloat));
  const uint8_t* W = weight.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  radixserve::parallel_for_dynamic(N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) dequant_row_f32(W + n * ldw, K, qtype, o + n * K);
  });
  return out;
}

#if !defined(RADIXSERVE_QUANT_AVX512)
// The bf16 tile where the AVX-512 unpacking is not built: the float32 rows rounded.
void dequant_rows(const uint8_t* W, int64_t ldw, int64_t N, int64_t K, const QInfo& qi, uint16_t* out) {
  radixserve::parallel_for_dynamic(N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> tmp(static_cast<size_t>(K));
    for (int64_t n = n0; n < n1; ++n) {
      dequant_row_f32(W + n * ldw, K, qi.id, tmp.data());
      for (int64_t k = 0; k < K; ++k) out[n * K + k] = f32_to_bf16_bits(tmp[k]);
    }
  });
}
#endif

const char* quant_gemm_isa() {
#if defined(RADIXSERVE_QUANT_AVX512)
  return "avx512_vnni";
#elif defined(RADIXSERVE_QUANT_AVX2)
  return "avx2";
#else
  return "";
#endif
}

// The fused decode's row limit (AVX2 build): quant_linear with M <= this many rows of x takes it,
// 0 turns it off (the scratch path then decodes, as before: for comparing the two). Sets it when
// rows >= 0; returns the previous value. Other builds have no fused path: always 0.
int64_t quant_decode_fused_rows(int64_t rows) {
#if defined(RADIXSERVE_QUANT_AVX2)
  const int prev = g_fused_rows.load();
  if (rows >= 0) g_fused_rows.store(static_cast<int>(std::min<int64_t>(rows, kFusedRowsMax)));
  return prev;
#else
  (void)rows;
  return 0;
#endif
}

bool has_quant_gemm() {
#if defined(RADIXSERVE_QUANT_GEMM)
  return true;
#else
  return false;
#endif
}

std::vector<int64_t> quant_gemm_types() {
  std::vector<int64_t> out;
#if defined(RADIXSERVE_QUANT_GEMM)
  for (const auto& t : kTypes) out.push_back(t.id);
#endif
  return out;
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& weight, int64_t qtype, int64_t in_features,
                        const c10::optional<at::Tensor>& out, int64_t fused_limit, bool i16) {
#if defined(RADIXSERVE_QUANT_GEMM)
  const QInfo* qi = find_type(qtype);
  TORCH_CHECK(qi != nullptr, "quant_linear: unsupported ggml type ", qtype);
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "quant_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "quant_linear: x must be float32");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.stride(1) == 1,
              "quant_linear: weight must be uint8 [N, row_bytes] with contiguous rows");
  const int64_t K = in_features;
  TORCH_CHECK(K > 0 && K % qi->block == 0, "quant_linear: in_features ", K, " is not a multiple of ", qi->block);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "quant_linear: x's last dim must be in_features");
  const int64_t row_bytes = K / qi->block * qi->bytes;
  TORCH_CHECK(weight.size(1) == row_bytes, "quant_linear: weight rows are ", weight.size(1), " bytes, expected ",
              row_bytes);
  const int64_t N = weight.size(0);
  TORCH_CHECK(N <= 1 || weight.stride(0) >= row_bytes, "quant_linear: overlapping weight rows");
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  if (out.has_value()) {  // a [M, N] float32 view with unit column stride, e.g. columns of a fused layer's output
    const at::Tensor& o = *out;
    TORCH_CHECK(o.device().is_cpu() && o.scalar_type() == at::kFloat && o.dim() == 2 && o.size(0) == M &&
                    o.size(1) == N && o.stride(1) == 1 && (M <= 1 || o.stride(0) >= N),
                "quant_linear: out must be float32 [", M, ", ", N, "] with contiguous rows");
  }
  at::Tensor y = out.has_value() ? *out : at::empty({M, N}, x.options());
  if (M > 0 && N > 0) {
    const bool kq = qi->block == 256;
    const int64_t ldy = M > 1 ? y.stride(0) : N;
    if (kq)
      quant_gemm<true>(x2.data_ptr<float>(), M, K, weight.data_ptr<uint8_t>(), weight.stride(0), N, *qi,
                       y.data_ptr<float>(), ldy, fused_limit, i16);
    else
      quant_gemm<false>(x2.data_ptr<float>(), M, K, weight.data_ptr<uint8_t>(), weight.stride(0), N, *qi,
                        y.data_ptr<float>(), ldy, fused_limit, i16);
  }
  return out.has_value() ? y : y.view(out_shape);
#else
  (void)out;
  (void)fused_limit;
  (void)i16;
  (void)x;
  (void)weight;
  (void)qtype;
  (void)in_features;
  (void)find_type;
  TORCH_CHECK(false, "quant_linear: built without AVX512-VNNI or AVX2");
#endif
}

// weight rows [N, row_bytes] -> bf16 [N, K] (the prefill path's tile; see dequant_rows)
at::Tensor quant_dequantize_bf16(const at::Tensor& weight, int64_t qtype, int64_t in_features) {
  const QInfo& qi = check_dequant_args("quant_dequantize_bf16", weight, qtype, in_features);
  const int64_t N = weight.size(0), K = in_features;
  at::Tensor out = at::empty({N, K}, weight.options().dtype(at::kBFloat16));
  if (N > 0)
    dequant_rows(weight.data_ptr<uint8_t>(), weight.stride(0), N, K, qi,
                 reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  return out;
}

}  // namespace

void register_quant_kernels(pybind11::module_& m) {
  m.def("has_quant_gemm", &has_quant_gemm, "whether quant_linear is built (AVX512-VNNI or AVX2)");
  m.def("quant_gemm_isa", [] { return std::string(quant_gemm_isa()); },
        "the instruction set quant_linear is built for: \"avx512_vnni\", \"avx2\" or \"\" (none)");
  m.def("quant_gemm_types", &quant_gemm_types, "the ggml type ids quant_linear supports");
  m.def("quant_decode_fused_rows", &quant_decode_fused_rows,
        "the AVX2 build's fused decode takes quant_linear calls of up to this many rows of x (0: off, the "
        "scratch path); sets it where rows >= 0 (at most 16), returns the previous value (0 where not built)",
        py::arg("rows") = -1);
  m.def("quant_linear", &quant_linear,
        "y = x @ dequantize(weight)^T with GGUF-quantized weight rows (x quantized to 8 bits per block, "
        "integer dot products); out: a float32 [M, N] view with contiguous rows (e.g. some columns of a "
        "larger output) to write y into instead of a new tensor; fused_limit: this call's row limit for the "
        "AVX2 fused decode (-1: the process's); i16: the int16-sum tiles for Q4_K at 13+ rows (AVX2; ignored "
        "elsewhere)",
        py::arg("x"), py::arg("weight"), py::arg("qtype"), py::arg("in_features"), py::arg("out") = py::none(),
        py::arg("fused_limit") = -1, py::arg("i16") = false);
  m.def("quant_dequantize_bf16", &quant_dequantize_bf16,
        "GGUF-quantized weight rows [N, row_bytes] -> bf16 [N, in_features] (the prefill path's tile)",
        py::arg("weight"), py::arg("qtype"), py::arg("in_features"));
  m.def("quant_dequantize_f32", &quant_dequantize_f32,
        "GGUF-quantized weight rows [N, row_bytes] -> float32 [N, in_features] (any CPU)", py::arg("weight"),
        py::arg("qtype"), py::arg("in_features"));
}
