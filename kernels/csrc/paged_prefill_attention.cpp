// Causal attention of prefill chunks straight out of the paged KV cache, for the CPU.
//
// A chunk is q_len consecutive query rows of one sequence whose K/V (and that of any
// context before them: a prefix-cache hit, an earlier chunk) already sit in the cache;
// its row i is at position seq_len - q_len + i and sees the keys up to its own.
//
// paged_decode_attention handles a row at a time, with the row's queries in a vector
// and a horizontal sum per score. Here a work item is 16 rows of one chunk and one kv
// head, and the 16 rows are the 16 lanes of every vector ("queries across lanes"):
//   * scores: for each of a tile's 16 key positions t, s[t] = sum_d K[t][d] * Qt[d],
//     where Qt[d] holds dimension d of the 16 queries (transposed once per item) and
//     K[t][d] is broadcast: head_dim FMAs per position, no horizontal sum;
//   * online softmax per lane (running max, sum, rescale): all vertical;
//   * out: Ot[d] = Ot[d] * alpha + sum_t V[t][d] * p[t], the output kept transposed.
// So the arithmetic is FMAs almost only, and any head_dim works. A tile's 16 K and V
// rows are copied into a contiguous buffer first (blocks are scattered; one base
// pointer keeps the FMA loop to broadcasts at fixed offsets), once for all the query
// heads that share the kv head.
//
// Threads take items one at a time as they come free (a causal chunk's last rows cost
// more than its first). Items are listed chunk by chunk, so the thread that takes the
// next one likely has that chunk's K/V in its caches already.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "attention_args.h"
#include "vec.h"

namespace {

using kvops::exp16;
using kvops::kLanes;
using kvops::load16;
using kvops::splat;
using kvops::store16;
using kvops::v16;

constexpr int64_t kTile = 16;        // key positions per tile: one score vector each
static_assert(kTile % kLanes == 0, "a tile of K or V rows fills whole vectors");
constexpr int64_t kMaxHeadDim = 256;

struct Layout {
  int64_t head_dim, group, block_size;
  int64_t k_blk, k_tok, k_head, v_blk, v_tok, v_head;
  int64_t q_tok, q_head, o_tok, o_head;
  float scale;
};

// One item: rows [r0, r0 + n) of a chunk (n <= 16), and the query heads that read kv
// head kv_head (each tile's K/V rows are copied once for all of them).
struct Item {
  int64_t chunk, r0, n, kv_head;
};

struct Chunk {
  int64_t q_start, q_len, seq_len;
  const int32_t* table;
};

// Scratch of one thread: per query head of a group, its queries and outputs (lanes =
// rows) and running max and sum; one tile of K and of V rows.
struct Scratch {
  std::vector<v16> qt, ot, m, l, kt, vt;
  Scratch(int64_t D, int64_t G)
      : qt(G * D), ot(G * D), m(G), l(G), kt(kTile * D / kLanes), vt(kTile * D / kLanes) {}
};

// dst[0, D) = src[0, D)
template <int64_t kD>
inline void copy_row(float* dst, const float* src, int64_t D) {
  if (kD % kLanes == 0 && kD > 0) {
#pragma GCC unroll 16
    for (int64_t d = 0; d < kD; d += kLanes) store16(dst + d, load16(src + d));
  } else {
    for (int64_t d = 0; d < D; ++d) dst[d] = src[d];
  }
}

// One query head (qt, ot: [D] vectors, m, l: its softmax state) over one tile of kTile
// keys at kt, vt ([kTile][D] rows); keys at positions >= `limit` lane by lane are
// masked when `masked`.
template <int64_t kD>
inline void attend_tile(int64_t D, const v16* qt, v16* ot, v16& m, v16& l, const float* kt,
                        const float* vt, bool masked, int64_t p0, v16 limit) {
  v16 sc[kTile];
#pragma GCC unroll 16
  for (int64_t t = 0; t < kTile; ++t) sc[t] = splat(0.f);
  for (int64_t d = 0; d < D; ++d) {
    const v16 qd = qt[d];
#pragma GCC unroll 16
    for (int64_t t = 0; t < kTile; ++t) sc[t] += splat(kt[t * D + d]) * qd;
  }
  if (masked) {
#pragma GCC unroll 16
    for (int64_t t = 0; t < kTile; ++t) {
      const v16 pos = splat(static_cast<float>(p0 + t));
      sc[t] = pos < limit ? sc[t] : splat(-INFINITY);
    }
  }
  v16 tile_max = sc[0];
#pragma GCC unroll 16
  for (int64_t t = 1; t < kTile; ++t) tile_max = sc[t] > tile_max ? sc[t] : tile_max;
  const v16 new_m = tile_max > m ? tile_max : m;  // finite: key 0 is in every lane's first tile
  const v16 alpha = exp16(m - new_m);             // 0 on the first tile (m = -inf)
  v16 sum = splat(0.f);
#pragma GCC unroll 16
  for (int64_t t = 0; t < kTile; ++t) {
    sc[t] = exp16(sc[t] - new_m);  // 0 where masked
    sum += sc[t];
  }
  l = l * alpha + sum;
  m = new_m;
  for (int64_t d = 0; d < D; ++d) {
    v16 o = ot[d] * alpha;
#pragma GCC unroll 16
    for (int64_t t = 0; t < kTile; ++t) o += splat(vt[t * D + d]) * sc[t];
    ot[d] = o;
  }
}

// kD: head_dim when known at compile time (the tile's rows then sit at constant
// offsets from one pointer), 0 for any other head_dim (read from the layout).
template <int64_t kD>
void attend_item(const Item& it, const Chunk& c, const Layout& L, const float* q, const float* kc,
                 const float* vc, float* out, Scratch& s) {
  const int64_t D = kD > 0 ? kD : L.head_dim, G = L.group, h0 = it.kv_head * G;
  float* kt = reinterpret_cast<float*>(s.kt.data());
  float* vt = reinterpret_cast<float*>(s.vt.data());
  // Queries, transposed and scaled; idle lanes (n < 16) repeat the last row.
  const int64_t first_row = c.q_start + it.r0;
  for (int64_t g = 0; g < G; ++g) {
    float* qt = reinterpret_cast<float*>(s.qt.data() + g * D);
    for (int64_t j = 0; j < kLanes; ++j) {
      const float* src = q + (first_row + std::min(j, it.n - 1)) * L.q_tok + (h0 + g) * L.q_head;
      for (int64_t d = 0; d < D; ++d) qt[d * kLanes + j] = src[d] * L.scale;
    }
    for (int64_t d = 0; d < D; ++d) s.ot[g * D + d] = splat(0.f);
    s.m[g] = splat(-INFINITY);
    s.l[g] = splat(0.f);
  }
  // Lane j sees keys [0, limit_j): its own position plus one.
  const int64_t base = c.seq_len - c.q_len + it.r0 + 1;
  v16 limit;
  for (int64_t j = 0; j < kLanes; ++j) limit[j] = static_cast<float>(base + std::min(j, it.n - 1));
  const int64_t end = base + it.n - 1;  // keys the last row sees
  const float* k_head = kc + it.kv_head * L.k_head;
  const float* v_head = vc + it.kv_head * L.v_head;

  for (int64_t p0 = 0; p0 < end; p0 += kTile) {
    const int64_t nt = std::min(kTile, end - p0);
    for (int64_t t = 0; t < nt; ++t) {
      const int64_t pos = p0 + t;
      const int64_t blk = c.table[pos / L.block_size], off = pos % L.block_size;
      copy_row<kD>(kt + t * D, k_head + blk * L.k_blk + off * L.k_tok, D);
      copy_row<kD>(vt + t * D, v_head + blk * L.v_blk + off * L.v_tok, D);
    }
    // Rows past the tile's end hold stale data: their weights are 0, but 0 * NaN is
    // not, so clear them.
    for (int64_t t = nt; t < kTile; ++t) {
      std::memset(kt + t * D, 0, D * sizeof(float));
      std::memset(vt + t * D, 0, D * sizeof(float));
    }
    const bool masked = p0 + kTile > base;  // some key here is past some row's own
    for (int64_t g = 0; g < G; ++g)
      attend_tile<kD>(D, s.qt.data() + g * D, s.ot.data() + g * D, s.m[g], s.l[g], kt, vt, masked,
                      p0, limit);
  }
  for (int64_t g = 0; g < G; ++g) {
    const v16 inv = splat(1.f) / s.l[g];
    const float* ot = reinterpret_cast<const float*>(s.ot.data() + g * D);
    for (int64_t d = 0; d < D; ++d) s.ot[g * D + d] *= inv;
    for (int64_t j = 0; j < it.n; ++j) {
      float* dst = out + (first_row + j) * L.o_tok + (h0 + g) * L.o_head;
      for (int64_t d = 0; d < D; ++d) dst[d] = ot[d * kLanes + j];
    }
  }
}

using ItemFn = void (*)(const Item&, const Chunk&, const Layout&, const float*, const float*,
                        const float*, float*, Scratch&);

ItemFn item_fn(int64_t head_dim) {
  switch (head_dim) {
    case 16: return attend_item<16>;
    case 32: return attend_item<32>;
    case 64: return attend_item<64>;
    case 80: return attend_item<80>;
    case 96: return attend_item<96>;
    case 128: return attend_item<128>;
    default: return attend_item<0>;
  }
}

void check_args(const at::Tensor& out, const at::Tensor& q, const at::Tensor& key_cache,
                const at::Tensor& value_cache, const at::Tensor& q_starts, const at::Tensor& q_lens,
                const at::Tensor& block_tables, const at::Tensor& seq_lens) {
  kvops::check_q_and_caches("paged_prefill_attention", out, q, key_cache, value_cache);
  TORCH_CHECK(q.size(2) <= kMaxHeadDim, "head_dim above ", kMaxHeadDim);
  TORCH_CHECK(q_starts.scalar_type() == at::kLong && q_starts.dim() == 1, "q_starts must be int64 [num_chunks]");
  TORCH_CHECK(q_lens.scalar_type() == at::kInt && q_lens.dim() == 1, "q_lens must be int32 [num_chunks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1, "seq_lens must be int32 [num_chunks]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous(),
              "block_tables must be contiguous int32 [num_chunks, max_blocks]");
  TORCH_CHECK(q_starts.size(0) == q_lens.size(0) && q_starts.size(0) == seq_lens.size(0) &&
                  q_starts.size(0) == block_tables.size(0),
              "q_starts, q_lens, seq_lens and block_tables must have one entry per chunk");
}

}  // namespace

// out[q_starts[c] + i] = causal attention of q[q_starts[c] + i] over the first
// seq_lens[c] - q_lens[c] + i + 1 tokens of block_tables[c]. Other rows are left alone.
void paged_prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& q_starts,
                             const at::Tensor& q_lens, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, double scale) {
  check_args(out, q, key_cache, value_cache, q_starts, q_lens, block_tables, seq_lens);
  const int64_t num_chunks = q_starts.size(0), num_tokens = q.size(0);
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t max_blocks = block_tables.size(1), num_kv_heads = key_cache.size(2);
  const auto starts_c = q_starts.contiguous();
  const auto qlens_c = q_lens.contiguous();
  const auto lens_c = seq_lens.contiguous();
  const int64_t* start_ptr = starts_c.data_ptr<int64_t>();
  const int32_t* qlen_ptr = qlens_c.data_ptr<int32_t>();
  const int32_t* len_ptr = lens_c.data_ptr<int32_t>();
  const int32_t* table_ptr = block_tables.data_ptr<int32_t>();

  std::vector<Chunk> chunks;
  std::vector<Item> items;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t start = start_ptr[c], n = qlen_ptr[c], len = len_ptr[c];
    TORCH_CHECK(n >= 1 && n <= len, "chunk ", c, ": q_len ", n, " must be in [1, seq_len = ", len, "]");
    TORCH_CHECK(start >= 0 && start + n <= num_tokens, "chunk ", c, ": rows [", start, ", ", start + n,
                ") out of range");
    const int64_t needed = (len + block_size - 1) / block_size;
    TORCH_CHECK(needed <= max_blocks, "chunk ", c, ": seq_len ", len, " needs more blocks than its table has");
    for (int64_t j = 0; j < needed; ++j) {
      const int32_t b = table_ptr[c * max_blocks + j];
      TORCH_CHECK(b >= 0 && b < num_blocks, "chunk ", c, ": block id ", b, " out of range");
    }
    chunks.push_back({start, n, len, table_ptr + c * max_blocks});
    // A chunk's items stay together (its K/V stay in this core's caches from one to the
    // next), last rows (most keys) first.
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t r0 = (n - 1) / kLanes * kLanes; r0 >= 0; r0 -= kLanes)
        items.push_back({c, r0, std::min<int64_t>(kLanes, n - r0), h});
  }

  const Layout layout{head_dim, num_heads / key_cache.size(2), block_size,
                      key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                      value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
                      q.stride(0), q.stride(1), out.stride(0), out.stride(1), static_cast<float>(scale)};
  const float* q_base = q.data_ptr<float>();
  const float* k_base = key_cache.data_ptr<float>();
  const float* v_base = value_cache.data_ptr<float>();
  float* out_base = out.data_ptr<float>();
  const int64_t num_items = static_cast<int64_t>(items.size());
  const ItemFn attend = item_fn(head_dim);
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(head_dim, layout.group);
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
        const Item& it = items[i];
        attend(it, chunks[it.chunk], layout, q_base, k_base, v_base, out_base, scratch);
      }
    }
  });
}

TORCH_LIBRARY_FRAGMENT(kvops, m) {
  m.def("paged_prefill_attention(Tensor(a!) out, Tensor q, Tensor key_cache, Tensor value_cache, "
        "Tensor q_starts, Tensor q_lens, Tensor block_tables, Tensor seq_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(kvops, CPU, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
