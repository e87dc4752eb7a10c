// The GatedDeltaNet decode step on the CPU (issue 41): one token per request, the recurrent state
// updated in place in the layer's state pool (layers/gated_delta_net.py: recurrent_gated_delta_step
// is the torch reference, which gathers the states, makes ~5 temporaries of their size and writes
// them back). Per (request, value head), with S the head's [dk, dv] float32 state:
//
//   S <- exp(g) S;   d = beta (v - S^T k);   S <- S + k d^T;   o = S^T q
//
// in two passes over S (the second from L1/L2: a 128 x 128 head is 64 KiB): the decay and S^T k,
// then the rank-1 update and S^T q. Sums run over dk in the same order as a row-by-row loop;
// torch sums in another order, so the two agree to float32 rounding, not bit for bit.
// Registered into the cpu_kernels extension by register_gdn_kernels (cpu_kernels.cpp).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace {

// q, k [B, H, dk] and v [B, H, dv] float32; g, beta [B, H] float32; state_pool [slots, H, dk, dv]
// float32 (this layer's temporal state, rows slots[b] read and written); has_initial [B] bool
// (false: the request starts from a zero state). Returns o [B, H, dv] float32.
at::Tensor gated_delta_decode(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                              const at::Tensor& g_in, const at::Tensor& beta_in, at::Tensor state_pool,
                              const at::Tensor& slots_in, const at::Tensor& has_initial_in) {
  TORCH_CHECK(q_in.dim() == 3 && k_in.sizes() == q_in.sizes() && v_in.dim() == 3 && v_in.size(0) == q_in.size(0) &&
                  v_in.size(1) == q_in.size(1),
              "gated_delta_decode: q, k [B, H, dk] and v [B, H, dv]");
  for (const at::Tensor* t : {&q_in, &k_in, &v_in, &g_in, &beta_in})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "gated_delta_decode: float32 q, k, v, g, beta");
  const int64_t B = q_in.size(0), H = q_in.size(1), dk = q_in.size(2), dv = v_in.size(2);
  TORCH_CHECK(g_in.sizes() == at::IntArrayRef({B, H}) && beta_in.sizes() == g_in.sizes(), "gated_delta_decode: g, beta [B, H]");
  TORCH_CHECK(state_pool.dim() == 4 && state_pool.scalar_type() == at::kFloat && state_pool.is_contiguous() &&
                  state_pool.size(1) == H && state_pool.size(2) == dk && state_pool.size(3) == dv,
              "gated_delta_decode: a contiguous float32 state pool [slots, H, dk, dv]");
  const at::Tensor slots = slots_in.to(at::kLong).contiguous(), init = has_initial_in.to(at::kBool).contiguous();
  TORCH_CHECK(slots.numel() == B && init.numel() == B, "gated_delta_decode: slots, has_initial [B]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(sp[b] >= 0 && sp[b] < state_pool.size(0), "gated_delta_decode: slot ", sp[b], " outside the pool");
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(), g = g_in.contiguous(),
                   beta = beta_in.contiguous();
  at::Tensor out = at::empty({B, H, dv}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>(),
              *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  const bool* ip = init.data_ptr<bool>();
  float* pool = state_pool.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> kv(dv), delta(dv);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / H, h = w % H;
      float* S = pool + (sp[b] * H + h) * dk * dv;
      const float *qh = qp + w * dk, *kh = kp + w * dk, *vh = vp + w * dv;
      float* o = op + w * dv;
      if (!ip[b]) std::memset(S, 0, sizeof(float) * dk * dv);
      const float decay = std::exp(gp[w]), bt = bp[w];
      std::fill(kv.begin(), kv.end(), 0.f);
      for (int64_t i = 0; i < dk; ++i) {  // S <- exp(g) S; kv = S^T k
        float* row = S + i * dv;
        const float ki = kh[i];
#pragma omp simd
        for (int64_t j = 0; j < dv; ++j) {
          row[j] *= decay;
          kv[j] += row[j] * ki;
        }
      }
#pragma omp simd
      for (int64_t j = 0; j < dv; ++j) {
        delta[j] = (vh[j] - kv[j]) * bt;
        o[j] = 0.f;
      }
      for (int64_t i = 0; i < dk; ++i) {  // S <- S + k d^T; o = S^T q
        float* row = S + i * dv;
        const float ki = kh[i], qi = qh[i];
#pragma omp simd
        for (int64_t j = 0; j < dv; ++j) {
          row[j] += ki * delta[j];
          o[j] += row[j] * qi;
        }
      }
    }
  });
  return out;
}

}  // namespace

void register_gdn_kernels(pybind11::module_& m) {
  m.def("gated_delta_decode", &gated_delta_decode,
        "one GatedDeltaNet decode step per request, its state updated in place in the pool", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("state_pool"), py::arg("slots"), py::arg("has_initial"));
}
