// The segmented LoRA matmul on the CPU (issue 28): every adapter segment of one linear layer, for
// every part of a fused projection (q|k|v, gate|up), in one call and one parallel region:
//
//     y[t, off_p : off_p + n_p] += scaling_g * (x[t] @ A_p[slot_g]^T) @ B_p[slot_g]^T
//
// for each token t of each group g (the tokens of every segment that uses one adapter slot: the
// segments of a slot need not be adjacent, e.g. a decode batch that interleaves adapters, and
// each slot's A and B are read once per call). A_p / B_p are the pool's whole buffers
// [layer, slot, rank, in] and [layer, slot, out, rank] (radixserve/lora/mem_pool.py), read in
// place. Ranks below the pool's rank are zero-padded there, so one loop serves every rank.
// float32 activations (the CPU's bf16 mode runs its activations in float32); the buffers float32
// or bf16 (half the bytes: with 8 adapters of rank 16 on SmolLM2 the float32 slots are 155 MB a
// step to read), widened to float32 as they are loaded; the caller keeps the torch path for
// other dtypes. Work items are (group, part): each computes its
// tokens' [tokens, rank] product with A, then expands it through B into disjoint parts of y.
// Registered into the cpu_kernels extension by register_lora_kernels (cpu_kernels.cpp).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <map>
#include <vector>

namespace {

struct SlotGroup {
  int64_t slot;
  float scaling;
  std::vector<int64_t> tokens;  // row indices of x / y
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// 16 weights as float32 (masked lanes zero): float32 as is, bf16 widened (the high half of a float32).
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// 16 vectors -> one vector of their 16 horizontal sums (out[i] = sum of v[i]'s lanes), by a
// transpose-add tree: 15 shuffle+add steps instead of 16 separate horizontal sums.
inline __m512 hsum16(__m512 v[16]) {
  __m512 w[8];
  for (int i = 0; i < 8; ++i)  // per 128-bit chunk: [a0+a2, b0+b2, a1+a3, b1+b3]
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 u[4];
  for (int j = 0; j < 4; ++j) {  // per chunk: the chunk's sums of outputs 4j .. 4j+3
    const __m512d a = _mm512_castps_pd(w[2 * j]), b = _mm512_castps_pd(w[2 * j + 1]);
    u[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // chunks summed pairwise, then across the halves: chunk j of the result holds outputs 4j..4j+3
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// h[t * R + r] = scaling * x_t . A[r] for TM (<= 4) tokens and 4 rows of A (r0 .. r0 + rn): 4 x TM
// independent accumulators (one dot product alone waits on the FMA latency), and each chunk of an
// A row is loaded once for all TM tokens.
template <int TM, typename W>
inline void shrink_tile(const float* const* x, const W* A, int64_t K, int64_t r0, int64_t rn, float scaling,
                        float* h, int64_t R) {
  __m512 acc[TM][4];
  const W* a[4];
  for (int j = 0; j < 4; ++j) {
    a[j] = A + (r0 + std::min<int64_t>(j, rn - 1)) * K;  // rows past rn repeat the last (not stored)
    for (int t = 0; t < TM; ++t) acc[t][j] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = K - k >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 av[4];
    for (int j = 0; j < 4; ++j) av[j] = load16(a[j] + k, m);
    for (int t = 0; t < TM; ++t) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x[t] + k);
      for (int j = 0; j < 4; ++j) acc[t][j] = _mm512_fmadd_ps(xv, av[j], acc[t][j]);
    }
  }
  for (int t = 0; t < TM; ++t)
    for (int64_t j = 0; j < rn; ++j) h[t * R + r0 + j] = scaling * _mm512_reduce_add_ps(acc[t][j]);
}

// h [tokens, R] = scaling * x[tokens] @ A^T
template <typename W>
inline void shrink(const std::vector<int64_t>& tokens, const float* xp, int64_t xs, const W* A, int64_t K,
                   int64_t R, float scaling, float* h) {
  using ShrinkFn = void (*)(const float* const*, const W*, int64_t, int64_t, int64_t, float, float*, int64_t);
  constexpr ShrinkFn kShrink[5] = {nullptr, shrink_tile<1, W>, shrink_tile<2, W>, shrink_tile<3, W>, shrink_tile<4, W>};
  const int64_t nt = static_cast<int64_t>(tokens.size());
  for (int64_t i0 = 0; i0 < nt; i0 += 4) {
    const int64_t tm = std::min<int64_t>(4, nt - i0);
    const float* x[4];
    for (int64_t t = 0; t < tm; ++t) x[t] = xp + tokens[i0 + t] * xs;
    for (int64_t r0 = 0; r0 < R; r0 += 4) kShrink[tm](x, A, K, r0, std::min<int64_t>(4, R - r0), scaling, h + i0 * R, R);
  }
}

// y_row[n] += sum_r h[r] * B[n, r] for n in [0, N): 16 outputs at a time, B rows read in place.
template <typename W>
inline void expand_row(float* y_row, const float* h, const W* B, int64_t N, int64_t R) {
  for (int64_t n0 = 0; n0 < N; n0 += 16) {
    const int64_t valid = std::min<int64_t>(16, N - n0);
    __m512 v[16];
    for (int i = 0; i < 16; ++i) v[i] = _mm512_setzero_ps();
    for (int64_t r0 = 0; r0 < R; r0 += 16) {
      const int64_t rn = std::min<int64_t>(16, R - r0);
      const __mmask16 rm = rn >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << rn) - 1);
      const __m512 hv = _mm512_maskz_loadu_ps(rm, h + r0);
      // a constant trip count keeps v[] in registers; rows past N repeat the last (not stored)
      for (int i = 0; i < 16; ++i)
        v[i] = _mm512_fmadd_ps(load16(B + std::min<int64_t>(n0 + i, N - 1) * R + r0, rm), hv, v[i]);
    }
    const __mmask16 nm = valid >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
    _mm512_mask_storeu_ps(y_row + n0, nm, _mm512_add_ps(_mm512_maskz_loadu_ps(nm, y_row + n0), hsum16(v)));
  }
}
// In place: v[j] becomes column j of the 16 x 16 matrix whose rows were v[0..15] (64 shuffles).
inline void transpose16(__m512 v[16]) {
  __m512 t[16];
  for (int k = 0; k < 8; ++k) {  // per 128-bit lane L: [a(4L), b(4L), a(4L+1), b(4L+1)] and the upper pair
    t[2 * k] = _mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]);
  }
  __m512 u[16];
  for (int k = 0; k < 4; ++k) {  // u[4k + m], lane L: column 4L + m of rows 4k .. 4k + 3
    const __m512d t0 = _mm512_castps_pd(t[4 * k]), t1 = _mm512_castps_pd(t[4 * k + 1]);
    const __m512d t2 = _mm512_castps_pd(t[4 * k + 2]), t3 = _mm512_castps_pd(t[4 * k + 3]);
    u[4 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
    u[4 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
    u[4 * k + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
    u[4 * k + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
  }
  for (int m = 0; m < 4; ++m) {  // column 4L + m: lane L of u[m], u[4 + m], u[8 + m], u[12 + m]
    const __m512 a0 = _mm512_shuffle_f32x4(u[m], u[4 + m], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 a1 = _mm512_shuffle_f32x4(u[m], u[4 + m], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512 b0 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 b1 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], _MM_SHUFFLE(3, 1, 3, 1));
    v[m] = _mm512_shuffle_f32x4(a0, b0, _MM_SHUFFLE(2, 0, 2, 0));
    v[4 + m] = _mm512_shuffle_f32x4(a1, b1, _MM_SHUFFLE(2, 0, 2, 0));
    v[8 + m] = _mm512_shuffle_f32x4(a0, b0, _MM_SHUFFLE(3, 1, 3, 1));
    v[12 + m] = _mm512_shuffle_f32x4(a1, b1, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// y[tokens[i], :N] += h[i] @ B^T. One token: a tree of horizontal sums (expand_row); two or more
// (measured faster from two): each 16 x 16 block of B is transposed once, then every token takes
// 16 broadcast FMAs per block.
// h holds 16 floats (zeros or finite) past its last token's R: a 16-wide read of a short rank
// chunk meets a zero column of B there.
template <typename W>
inline void expand(float* yp, int64_t ys, const std::vector<int64_t>& tokens, const float* h, const W* B,
                   int64_t N, int64_t R) {
  const int64_t nt = static_cast<int64_t>(tokens.size());
  if (nt < 2) {
    for (int64_t i = 0; i < nt; ++i) expand_row(yp + tokens[i] * ys, h + i * R, B, N, R);
    return;
  }
  for (int64_t n0 = 0; n0 < N; n0 += 16) {
    const int64_t valid = std::min<int64_t>(16, N - n0);
    const __mmask16 nm = valid >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
    for (int64_t r0 = 0; r0 < R; r0 += 16) {
      const int64_t rn = std::min<int64_t>(16, R - r0);
      const __mmask16 rm = rn >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << rn) - 1);
      __m512 c[16];
      for (int i = 0; i < 16; ++i) c[i] = load16(B + std::min<int64_t>(n0 + i, N - 1) * R + r0, rm);
      transpose16(c);  // c[j]: B[n0 .. n0 + 15, r0 + j]
      for (int64_t i = 0; i < nt; ++i) {
        float* yr = yp + tokens[i] * ys + n0;
        const float* hr = h + i * R + r0;
        __m512 acc = _mm512_maskz_loadu_ps(nm, yr);
        for (int j = 0; j < 16; ++j) acc = _mm512_fmadd_ps(_mm512_set1_ps(hr[j]), c[j], acc);
        _mm512_mask_storeu_ps(yr, nm, acc);
      }
    }
  }
}
#else
template <typename W>
inline float dot_w(const float* a, const W* b, int64_t n) {
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc += a[i] * static_cast<float>(b[i]);
  return acc;
}

template <typename W>
inline void shrink(const std::vector<int64_t>& tokens, const float* xp, int64_t xs, const W* A, int64_t K,
                   int64_t R, float scaling, float* h) {
  const int64_t nt = static_cast<int64_t>(tokens.size());
  for (int64_t r = 0; r < R; ++r)  // one row of A, from cache, for every token of the group
    for (int64_t i = 0; i < nt; ++i) h[i * R + r] = scaling * dot_w(xp + tokens[i] * xs, A + r * K, K);
}

template <typename W>
inline void expand(float* yp, int64_t ys, const std::vector<int64_t>& tokens, const float* h, const W* B,
                   int64_t N, int64_t R) {
  for (size_t i = 0; i < tokens.size(); ++i)
    for (int64_t n = 0; n < N; ++n) yp[tokens[i] * ys + n] += dot_w(h + i * R, B + n * R, R);
}
#endif

void check_buffer(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.dim() == 4 && t.scalar_type() == dtype && t.is_contiguous() &&
                  (dtype == at::kFloat || dtype == at::kBFloat16),
              "lora_delta: ", name, " must be a contiguous pool buffer, every one float32 or every one bf16");
}

// Work items (group, part): the group's h = x @ A^T, then y += h @ B^T into the part's columns.
template <typename W>
void run_groups(const std::vector<SlotGroup>& groups, const float* xp, int64_t xs, float* yp, int64_t ys, int64_t K,
                int64_t R, int64_t S, int64_t layer, const std::vector<at::Tensor>& a_bufs,
                const std::vector<at::Tensor>& b_bufs, const std::vector<int64_t>& offsets) {
  const int64_t P = static_cast<int64_t>(a_bufs.size()), G = static_cast<int64_t>(groups.size());
  at::parallel_for(0, G * P, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h;
    for (int64_t item = begin; item < end; ++item) {
      const SlotGroup& g = groups[item / P];
      const int64_t p = item % P, nt = static_cast<int64_t>(g.tokens.size()), Np = b_bufs[p].size(2);
      const W* A = a_bufs[p].data_ptr<W>() + (layer * S + g.slot) * R * K;
      const W* B = b_bufs[p].data_ptr<W>() + (layer * S + g.slot) * Np * R;
      h.assign(nt * R + 16, 0.f);
      shrink(g.tokens, xp, xs, A, K, R, g.scaling, h.data());
      expand(yp + offsets[p], ys, g.tokens, h.data(), B, Np, R);
    }
  });
}

// y [T, N] (row stride free, last dim contiguous) += the LoRA delta of x [T, K]. segments [S, 3]
// int64 rows (start, end, slot); scalings [S] float32 (one per segment; a slot's segments share it).
void lora_delta(at::Tensor y, const at::Tensor& x, const std::vector<at::Tensor>& a_bufs,
                const std::vector<at::Tensor>& b_bufs, const std::vector<int64_t>& offsets, int64_t layer,
                const at::Tensor& segments, const at::Tensor& scalings) {
  const int64_t P = static_cast<int64_t>(a_bufs.size());
  TORCH_CHECK(P > 0 && static_cast<int64_t>(b_bufs.size()) == P && static_cast<int64_t>(offsets.size()) == P,
              "lora_delta: one A, B and offset per part");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.scalar_type() == at::kFloat &&
                  y.scalar_type() == at::kFloat && x.stride(1) == 1 && y.stride(1) == 1,
              "lora_delta: float32 x [T, K] and y [T, N], contiguous in their last dimension");
  TORCH_CHECK(segments.dim() == 2 && segments.size(1) == 3 && segments.scalar_type() == at::kLong &&
                  segments.is_contiguous() && scalings.scalar_type() == at::kFloat && scalings.is_contiguous() &&
                  scalings.numel() == segments.size(0),
              "lora_delta: segments [S, 3] int64 (start, end, slot) and scalings [S] float32");
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1);
  const int64_t R = a_bufs[0].size(2), S = a_bufs[0].size(1);
  for (int64_t p = 0; p < P; ++p) {
    check_buffer(a_bufs[p], a_bufs[0].scalar_type(), "A");
    check_buffer(b_bufs[p], a_bufs[0].scalar_type(), "B");
    TORCH_CHECK(a_bufs[p].size(0) > layer && a_bufs[p].size(1) == S && a_bufs[p].size(2) == R && a_bufs[p].size(3) == K &&
                    b_bufs[p].size(0) > layer && b_bufs[p].size(1) == S && b_bufs[p].size(3) == R &&
                    offsets[p] >= 0 && offsets[p] + b_bufs[p].size(2) <= N,
                "lora_delta: part ", p, ": the A/B buffers do not match x, y or each other");
  }
  // Tokens grouped by slot, in order of first appearance.
  const int64_t* seg = segments.data_ptr<int64_t>();
  const float* sc = scalings.data_ptr<float>();
  std::vector<SlotGroup> groups;
  std::map<int64_t, size_t> index;
  for (int64_t s = 0; s < segments.size(0); ++s) {
    const int64_t start = seg[3 * s], end = seg[3 * s + 1], slot = seg[3 * s + 2];
    TORCH_CHECK(0 <= start && start <= end && end <= T && 0 <= slot && slot < S, "lora_delta: segment ", s,
                " out of range");
    auto it = index.find(slot);
    if (it == index.end()) {
      it = index.emplace(slot, groups.size()).first;
      groups.push_back({slot, sc[s], {}});
    }
    for (int64_t t = start; t < end; ++t) groups[it->second].tokens.push_back(t);
  }
  if (groups.empty() || R == 0) return;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (a_bufs[0].scalar_type() == at::kBFloat16)
    run_groups<at::BFloat16>(groups, xp, x.stride(0), yp, y.stride(0), K, R, S, layer, a_bufs, b_bufs, offsets);
  else
    run_groups<float>(groups, xp, x.stride(0), yp, y.stride(0), K, R, S, layer, a_bufs, b_bufs, offsets);
}

}  // namespace

void register_lora_kernels(pybind11::module_& m) {
  m.def("lora_delta", &lora_delta,
        "y += the segmented LoRA delta of x: every slot group and every part of a fused projection in one call",
        py::arg("y"), py::arg("x"), py::arg("a_buffers"), py::arg("b_buffers"), py::arg("offsets"), py::arg("layer"),
        py::arg("segments"), py::arg("scalings"));
}
