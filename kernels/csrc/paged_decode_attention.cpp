// Decode attention straight out of the paged KV cache, for the CPU.
//
// Each query row attends to the first seq_len tokens of its block table: a decode's
// one new token to its whole context, or a prefill row to the context up to its own
// position (the planner in kernels/cpu_attention.py gives each row its length).
// torch can only do this after gathering every sequence's blocks into a contiguous
// tensor, which copies the whole context once per layer; this kernel reads each K/V
// row where it lies, once.
//
// Work is split over (row, kv head) pairs, which ATen's threads take one at a time as
// they come free, longest rows first (one long context among short ones would
// otherwise leave a thread idle: 1.7x on 1 x 4096 + 15 x 64 tokens). Within a pair, the
// G = num_heads / num_kv_heads query heads that share the kv head are handled together
// so every K and V row is loaded once for all of them. The vector path (head_dim a
// multiple of 16, up to 128) walks the context in tiles of 16 positions: the tile's 16
// scores per query head come out as one vector, then one online-softmax rescale per
// tile; the next tile's rows are prefetched, as blocks are scattered. Other head sizes
// take a scalar path that does the same block by block.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "attention_args.h"
#include "vec.h"

namespace {

constexpr int kMaxBlockSize = 128;  // EngineConfig allows block sizes up to 128
constexpr int kMaxChunks = 8;       // the vector path takes head_dim 16, 32, ..., 128
constexpr int kMaxGroup = 64;       // and up to 64 query heads per kv head

using kvops::exp16;
using kvops::kLanes;
using kvops::load16;
using kvops::splat;
using kvops::store16;
using kvops::v16;

// Lane t of the result = the sum of the 16 lanes of p[t]: a transpose-and-add tree
// (15 adds and 30 shuffles for 16 sums instead of 16 separate horizontal sums).
inline v16 sum_lanes_16(const v16* p) {
  v16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19,
                                   20, 21, 22, 23) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22,
                                   23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                   21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22,
                                   23, 26, 27, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
}

// Horizontal max and sum by halving (4 shuffles instead of 15 dependent scalar steps).
inline v16 swap_halves(v16 v, int width) {
  switch (width) {
    case 8: return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    case 4: return __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    case 2: return __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    default: return __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  }
}

inline float hmax(v16 v) {
  for (int width = 8; width >= 1; width /= 2) {
    const v16 w = swap_halves(v, width);
    v = v > w ? v : w;
  }
  return v[0];
}

inline float hsum(v16 v) {
  for (int width = 8; width >= 1; width /= 2) v += swap_halves(v, width);
  return v[0];
}

// The scalar path's helpers (head_dim not a multiple of 16).
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) y[d] += a * x[d];
}

inline void scale_inplace(float* __restrict y, float a, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) y[d] *= a;
}

// One (row, kv head) pair: where its queries, output and K/V are.
struct Item {
  const float* q;           // first query head of the group, already at the row
  int64_t q_head;           // stride between query heads
  float* out;               // same for out
  int64_t o_head;
  const float* k;           // the cache at this kv head: + block * k_blk + offset * k_tok
  const float* v;
  const int32_t* table;
  int64_t seq_len;
};

struct Layout {
  int64_t group, head_dim, block_shift, block_mask;
  int64_t k_blk, k_tok, v_blk, v_tok;
  float scale;
};

// One pair on the vector path (head_dim = 16 * nc): tiles of 16 positions; the tile's
// scores for each query head come out as one vector.
template <int64_t nc>
void attend_vector(const Item& it, const Layout& L, v16* qv, v16* acc, v16* partial, float* weights) {
  const int64_t G = L.group;
  float m[kMaxGroup], l[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t c = 0; c < nc; ++c) {
      qv[g * nc + c] = load16(it.q + g * it.q_head + c * kLanes) * L.scale;
      acc[g * nc + c] = splat(0.f);
    }
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
  }
  v16 lane_index;
  for (int i = 0; i < kLanes; ++i) lane_index[i] = static_cast<float>(i);
  const float* krow[kLanes];
  const float* vrow[kLanes];
  for (int64_t pos0 = 0; pos0 < it.seq_len; pos0 += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, it.seq_len - pos0);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = pos0 + t;
      const int64_t blk = it.table[pos >> L.block_shift], off = pos & L.block_mask;
      krow[t] = it.k + blk * L.k_blk + off * L.k_tok;
      vrow[t] = it.v + blk * L.v_blk + off * L.v_tok;
    }
    // Ask for the next tile's rows now: blocks are scattered, so the hardware
    // prefetcher cannot guess where the next one starts.
    for (int64_t pos = pos0 + kLanes; pos < std::min(it.seq_len, pos0 + 2 * kLanes); ++pos) {
      const int64_t blk = it.table[pos >> L.block_shift], off = pos & L.block_mask;
      const char* k = reinterpret_cast<const char*>(it.k + blk * L.k_blk + off * L.k_tok);
      const char* v = reinterpret_cast<const char*>(it.v + blk * L.v_blk + off * L.v_tok);
      for (int64_t c = 0; c < nc; ++c) {
        __builtin_prefetch(k + c * 64);
        __builtin_prefetch(v + c * 64);
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      v16 kc[nc];
      for (int64_t c = 0; c < nc; ++c) kc[c] = load16(krow[t] + c * kLanes);
      for (int64_t g = 0; g < G; ++g) {
        v16 a = qv[g * nc] * kc[0];
        for (int64_t c = 1; c < nc; ++c) a += qv[g * nc + c] * kc[c];
        partial[g * kLanes + t] = a;
      }
    }
    for (int64_t t = n; t < kLanes; ++t)
      for (int64_t g = 0; g < G; ++g) partial[g * kLanes + t] = splat(0.f);
    for (int64_t g = 0; g < G; ++g) {
      v16 s = sum_lanes_16(partial + g * kLanes);
      if (n < kLanes) s = lane_index < static_cast<float>(n) ? s : splat(-INFINITY);
      const float new_max = std::max(m[g], hmax(s));
      const float alpha = std::exp(m[g] - new_max);  // 0 on the first tile
      const v16 p = exp16(s - new_max);              // 0 where s is -inf
      l[g] = l[g] * alpha + hsum(p);
      m[g] = new_max;
      if (alpha != 1.f)
        for (int64_t c = 0; c < nc; ++c) acc[g * nc + c] *= alpha;
      store16(weights + g * kLanes, p);
    }
    for (int64_t t = 0; t < n; ++t) {
      v16 vc[nc];
      for (int64_t c = 0; c < nc; ++c) vc[c] = load16(vrow[t] + c * kLanes);
      for (int64_t g = 0; g < G; ++g) {
        const v16 w = splat(weights[g * kLanes + t]);
        for (int64_t c = 0; c < nc; ++c) acc[g * nc + c] += w * vc[c];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.f / l[g];
    for (int64_t c = 0; c < nc; ++c) store16(it.out + g * it.o_head + c * kLanes, acc[g * nc + c] * inv);
  }
}

// The same on the scalar path (head_dim not a multiple of 16): block by block.
void attend_scalar(const Item& it, const Layout& L, float* qs, float* acc, float* m, float* l,
                   float* scores) {
  const int64_t G = L.group, D = L.head_dim, block_size = L.block_mask + 1;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t d = 0; d < D; ++d) qs[g * D + d] = it.q[g * it.q_head + d] * L.scale;
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
  }
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t start = 0; start < it.seq_len; start += block_size) {
    const int64_t n = std::min(block_size, it.seq_len - start);
    const int64_t blk = it.table[start >> L.block_shift];
    const float* kb = it.k + blk * L.k_blk;
    const float* vb = it.v + blk * L.v_blk;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t g = 0; g < G; ++g)
        scores[g * kMaxBlockSize + t] = dot(qs + g * D, kb + t * L.k_tok, D);
    for (int64_t g = 0; g < G; ++g) {
      float* sc = scores + g * kMaxBlockSize;
      float block_max = sc[0];
      for (int64_t t = 1; t < n; ++t) block_max = std::max(block_max, sc[t]);
      const float new_max = std::max(m[g], block_max);
      const float alpha = std::exp(m[g] - new_max);  // 0 on the first block
      float sum = 0.f;
      for (int64_t t = 0; t < n; ++t) {
        sc[t] = std::exp(sc[t] - new_max);
        sum += sc[t];
      }
      l[g] = l[g] * alpha + sum;
      m[g] = new_max;
      if (alpha != 1.f) scale_inplace(acc + g * D, alpha, D);
    }
    for (int64_t t = 0; t < n; ++t)
      for (int64_t g = 0; g < G; ++g)
        axpy(acc + g * D, scores[g * kMaxBlockSize + t], vb + t * L.v_tok, D);
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.f / l[g];
    for (int64_t d = 0; d < D; ++d) it.out[g * it.o_head + d] = acc[g * D + d] * inv;
  }
}

// The vector path for each head_dim / 16, chosen once per call.
using VectorPath = void (*)(const Item&, const Layout&, v16*, v16*, v16*, float*);
constexpr VectorPath kVectorPaths[kMaxChunks] = {
    attend_vector<1>, attend_vector<2>, attend_vector<3>, attend_vector<4>,
    attend_vector<5>, attend_vector<6>, attend_vector<7>, attend_vector<8>};

void check_args(const at::Tensor& out, const at::Tensor& q, const at::Tensor& key_cache,
                const at::Tensor& value_cache, const at::Tensor& rows,
                const at::Tensor& block_tables, const at::Tensor& seq_lens) {
  kvops::check_q_and_caches("paged_decode_attention", out, q, key_cache, value_cache);
  TORCH_CHECK(key_cache.size(1) <= kMaxBlockSize, "block_size above 128");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "rows must be int64 [num_seqs]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.is_contiguous(),
              "block_tables must be contiguous int32 [num_seqs, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1,
              "seq_lens must be int32 [num_seqs]");
  TORCH_CHECK(rows.size(0) == block_tables.size(0) && rows.size(0) == seq_lens.size(0),
              "rows, block_tables and seq_lens must have one entry per sequence");
}

}  // namespace

// out[rows[s]] = attention of q[rows[s]] over the first seq_lens[s] tokens of
// block_tables[s]. Other rows of out are left alone.
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& rows,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale) {
  check_args(out, q, key_cache, value_cache, rows, block_tables, seq_lens);
  const int64_t num_seqs = rows.size(0);
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);

  const auto rows_c = rows.contiguous();
  const auto lens_c = seq_lens.contiguous();
  const int64_t* row_ptr = rows_c.data_ptr<int64_t>();
  const int32_t* len_ptr = lens_c.data_ptr<int32_t>();
  const int32_t* table_ptr = block_tables.data_ptr<int32_t>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(row_ptr[s] >= 0 && row_ptr[s] < num_tokens, "row ", row_ptr[s], " out of range");
    TORCH_CHECK(len_ptr[s] >= 1, "sequence ", s, " has seq_len ", len_ptr[s]);
    TORCH_CHECK((len_ptr[s] + block_size - 1) / block_size <= max_blocks,
                "sequence ", s, ": seq_len ", len_ptr[s], " needs more blocks than its table has");
    for (int64_t j = 0; j < (len_ptr[s] + block_size - 1) / block_size; ++j) {
      const int32_t b = table_ptr[s * max_blocks + j];
      TORCH_CHECK(b >= 0 && b < num_blocks, "sequence ", s, ": block id ", b, " out of range");
    }
  }

  const float* q_base = q.data_ptr<float>();
  float* out_base = out.data_ptr<float>();
  const float* k_base = key_cache.data_ptr<float>();
  const float* v_base = value_cache.data_ptr<float>();
  const int64_t q_tok = q.stride(0), q_head = q.stride(1);
  const int64_t o_tok = out.stride(0), o_head = out.stride(1);
  const int64_t k_blk = key_cache.stride(0), k_tok = key_cache.stride(1), k_head = key_cache.stride(2);
  const int64_t v_blk = value_cache.stride(0), v_tok = value_cache.stride(1),
                v_head = value_cache.stride(2);
  const float fscale = static_cast<float>(scale);

  const bool vector_path = head_dim % kLanes == 0 && head_dim / kLanes <= kMaxChunks &&
                           group <= kMaxGroup;
  const Layout layout{group, head_dim, __builtin_ctzll(block_size), block_size - 1,
                      k_blk, k_tok, v_blk, v_tok, fscale};
  const VectorPath attend = vector_path ? kVectorPaths[head_dim / kLanes - 1] : nullptr;

  // Rows differ in length (a batch mixes new and old requests, and prompt rows see
  // 1..q_len keys): threads take sequences one at a time as they come free, longest
  // first, rather than fixed halves of the list.
  std::vector<int64_t> order(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) order[s] = s;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return len_ptr[a] > len_ptr[b]; });
  const int64_t num_items = num_seqs * num_kv_heads;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    // Per-thread scratch.
    std::vector<v16> qv, acc, partial;
    std::vector<float> weights;
    std::vector<float> qs, accs, m, l, scores;
    if (vector_path) {
      qv.resize(group * head_dim / kLanes);
      acc.resize(group * head_dim / kLanes);
      partial.resize(group * kLanes);
      weights.resize(group * kLanes);
    } else {
      qs.resize(group * head_dim);
      accs.resize(group * head_dim);
      m.resize(group);
      l.resize(group);
      scores.resize(group * kMaxBlockSize);
    }
    for (int64_t item = next.fetch_add(1); item < num_items; item = next.fetch_add(1)) {
      const int64_t s = order[item / num_kv_heads], h = item % num_kv_heads;
      const int64_t row = row_ptr[s];
      const Item it{q_base + row * q_tok + h * group * q_head, q_head,
                    out_base + row * o_tok + h * group * o_head, o_head,
                    k_base + h * k_head, v_base + h * v_head, table_ptr + s * max_blocks,
                    len_ptr[s]};
      if (vector_path)
        attend(it, layout, qv.data(), acc.data(), partial.data(), weights.data());
      else
        attend_scalar(it, layout, qs.data(), accs.data(), m.data(), l.data(), scores.data());
    }
  });
}

TORCH_LIBRARY_FRAGMENT(kvops, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor key_cache, Tensor value_cache, "
        "Tensor rows, Tensor block_tables, Tensor seq_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(kvops, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
