// Fused element-wise steps of a Llama layer, for float32 on the CPU.
//
// In a decode step each of these runs on a few rows, so torch's cost is the
// dispatch of the half-dozen ops each one takes (RMSNorm alone is five), not the
// arithmetic; in a prefill step it is the extra passes over [tokens, 3072] tensors.
// One pass each here, parallel over rows.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "vec.h"

namespace {

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2, name, " must be 2-d [rows, features]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(),
              name, " must be a float32 CPU tensor");
  TORCH_CHECK(x.stride(1) == 1, name, "'s rows must be contiguous");
}

void check_norm_weight(const at::Tensor& weight, int64_t features) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == features && weight.is_contiguous() &&
                  weight.scalar_type() == at::kFloat,
              "weight must be float32 [features]");
}

// Rows per parallel_for task: enough work per task to be worth a thread.
int64_t grain(int64_t features) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, features)); }

void rms_norm_row(const float* __restrict x, const float* __restrict w, float* __restrict y,
                  int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv * w[i];
}

}  // namespace

// y = x / sqrt(mean(x^2) + eps) * weight, row by row (Llama's RMSNorm).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_norm_weight(weight, x.size(1));
  const int64_t rows = x.size(0), n = x.size(1);
  auto y = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      rms_norm_row(xp + r * xs, wp, yp + r * n, n, static_cast<float>(eps));
  });
  return y;
}

// h += delta (in place: h is the residual stream), then return rms_norm(h).
at::Tensor add_rms_norm(at::Tensor h, const at::Tensor& delta, const at::Tensor& weight,
                        double eps) {
  check_rows(h, "h");
  check_rows(delta, "delta");
  TORCH_CHECK(h.sizes() == delta.sizes(), "h and delta differ in shape");
  TORCH_CHECK(h.is_contiguous(), "h must be contiguous");
  check_norm_weight(weight, h.size(1));
  const int64_t rows = h.size(0), n = h.size(1);
  auto y = at::empty({rows, n}, h.options());
  float* hp = h.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ds = delta.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* hr = hp + r * n;
      const float* dr = dp + r * ds;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) hr[i] += dr[i];
      rms_norm_row(hr, wp, yp + r * n, n, static_cast<float>(eps));
    }
  });
  return y;
}

// gate_up: [rows, 2 * n] (gate then up) -> silu(gate) * up: [rows, n] (SwiGLU).
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of features");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto y = at::empty({rows, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t gs = gate_up.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * gs;
      const float* u = g + n;
      float* out = yp + r * n;
      int64_t i = 0;
      for (; i + kvops::kLanes <= n; i += kvops::kLanes) {
        const kvops::v16 gv = kvops::load16(g + i);
        kvops::store16(out + i, gv / (1.f + kvops::exp16(-gv)) * kvops::load16(u + i));
      }
      for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(kvops, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) h, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvops, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
}

// RoPE on q and k, and the store of k and v into the paged cache, in one pass.
// qkv: [T, (H + 2 * Hkv) * D], q heads then k heads then v heads, rotary pairs
// interleaved (d = 2i, 2i + 1; the loader reorders HF's halves); rope: [T, D / 2, 2]
// (cos, sin of position * frequency); kv_layer: [2, num_blocks, block_size, Hkv, D];
// slot_mapping: [T] int64 (block * block_size + offset). Returns the rotated q [T, H, D].
at::Tensor rope_store_kv(const at::Tensor& qkv, const at::Tensor& rope, at::Tensor kv_layer,
                         const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(0) == 2 && kv_layer.is_contiguous() &&
                  kv_layer.scalar_type() == at::kFloat,
              "kv_layer must be contiguous float32 [2, num_blocks, block_size, num_kv_heads, head_dim]");
  const int64_t T = qkv.size(0), D = kv_layer.size(4);
  TORCH_CHECK(kv_layer.size(3) == num_kv_heads, "kv_layer has ", kv_layer.size(3), " kv heads, not ",
              num_kv_heads);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * D, "qkv must be [T, (H + 2 Hkv) * D]");
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  TORCH_CHECK(rope.dim() == 3 && rope.size(0) == T && rope.size(1) == D / 2 && rope.size(2) == 2 &&
                  rope.is_contiguous() && rope.scalar_type() == at::kFloat,
              "rope must be contiguous float32 [T, head_dim / 2, 2]");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == T &&
                  slot_mapping.scalar_type() == at::kLong,
              "slot_mapping must be int64 [T]");
  const int64_t num_slots = kv_layer.size(1) * kv_layer.size(2);
  const auto slots_c = slot_mapping.contiguous();
  const int64_t* slots = slots_c.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " out of range");

  auto q = at::empty({T, num_heads, D}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const float* rp = rope.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kc = kv_layer.data_ptr<float>();
  float* vc = kc + num_slots * num_kv_heads * D;
  const int64_t row = qkv.stride(0), half = D / 2;
  at::parallel_for(0, T, grain((num_heads + 2 * num_kv_heads) * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* x = src + t * row;
      const float* r = rp + t * D;
      float* k_dst = kc + slots[t] * num_kv_heads * D;
      float* v_dst = vc + slots[t] * num_kv_heads * D;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        const float* in = x + h * D;
        float* out = h < num_heads ? qp + (t * num_heads + h) * D : k_dst + (h - num_heads) * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = in[2 * i], b = in[2 * i + 1], c = r[2 * i], s = r[2 * i + 1];
          out[2 * i] = a * c - b * s;
          out[2 * i + 1] = a * s + b * c;
        }
      }
      std::copy(x + (num_heads + num_kv_heads) * D, x + (num_heads + 2 * num_kv_heads) * D, v_dst);
    }
  });
  return q;
}

TORCH_LIBRARY_FRAGMENT(kvops, m) {
  m.def("rope_store_kv(Tensor qkv, Tensor rope, Tensor(a!) kv_layer, Tensor slot_mapping, "
        "int num_heads, int num_kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvops, CPU, m) {
  m.impl("rope_store_kv", &rope_store_kv);
}
