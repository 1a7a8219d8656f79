// Float32 GEMM on a packed weight, built for decoding's few rows on a CPU, and correct
// (at 0.8-1.0x of MKL's speed) for prefill's many: out[M, N] = x[M, K] @ w_t[K, N] (+ bias).
//
// Why not torch.mm: below ~64 rows MKL is far from both limits of this problem, the
// time to stream the weight from DRAM and the FMA throughput. A decode step's matmuls
// have few rows (one per sequence) and a large weight, so the weight must be read
// exactly once, at memory speed, while every row's FMAs run on it from L1.
//
// Weight layout (pack_weight, once at load time): panels of kPanel columns,
// [ceil(N / kPanel), K, kPanel], the last panel zero-padded. A panel is one contiguous
// stream, and its K x kPanel block is what a thread works on: threads split the
// panels, so the weight is read once in total.
//
// Per panel: K is cut into chunks of kChunk rows (kChunk x kPanel floats fit in L1),
// and every block of kRowsPerBlock rows of x runs over the chunk with its
// kRowsPerBlock x kPanel accumulators in registers, so a chunk is fetched from memory
// once and used by all rows. A thread's panels are consecutive in memory: one stream,
// which the row blocks prefetch into L2 two chunks ahead, a few lines per step, so
// that the memory transfer overlaps the FMAs (without it, 8 to 64 rows take close to
// the sum of the two times, not the larger). Accumulators live in a per-thread buffer
// between chunks; finished panels are copied out (plus bias), which also handles the
// ragged last panel.
//
// Prefill (many rows): x is taken in passes of as many rows as fit in half of L2, and
// each thread runs over its panels once per pass, so the rows come from L2 and not
// from L3 for every panel. Above kChunkRowsUpTo rows K is one chunk: a panel then
// serves enough row blocks that it is reused from L2, the partial sums never leave the
// registers, and a whole panel's results go straight into the output (storing and
// reloading partial sums, zeroing the buffer and copying it out cost ~15% at M >= 512).
// On an Intel Xeon, at 512..2048 rows this is within a few percent of MKL when the
// weights sit in L3, and 0.8-1.0x of it when they come from DRAM (python -m
// kernels.bench_cpu gemm --prefill); on an AMD EPYC it is about 2x MKL, which takes a
// slower path there. So the engine times both once (kernels/cpu_ext.py matmul_choice)
// and gives matmuls of more than 96 rows to whichever is clearly faster.
//
// Vectors are vec.h's (GCC vector extensions, 16 floats); built without AVX-512 they
// are split into narrower registers by the compiler and stay correct, only slower,
// which is why the row block shrinks there (fewer accumulators than registers).

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "vec.h"

namespace {

using kvops::kLanes;
using kvops::load16;
using kvops::splat;
using kvops::store16;
using v16f = kvops::v16;

constexpr int64_t kVecsPerRow = 3;
// Columns per panel. 48 = 3 vectors: with 8 rows that is 24 accumulators, and the
// model's widths (576, 960, 1536, 3072) are even multiples of 48, so two threads get
// equal shares of panels.
constexpr int64_t kPanel = kVecsPerRow * kLanes;
#ifdef __AVX512F__
constexpr int kRowsPerBlock = 8;  // 8 x 3 accumulators + 3 weight vectors of 32 zmm
#else
constexpr int kRowsPerBlock = 2;  // a v16f is 2 ymm (AVX2) or 4 xmm: keep within 16
#endif
// K rows per chunk: 128 x 48 floats = 24 KB, half of a 48 KB L1.
constexpr int64_t kChunk = 128;
// Above this many rows K goes in chunks of kLongChunk (in practice one): such a chunk
// (K x 48 floats, 110 KB at K = 576, 295 KB at K = 1536) stays in L2 while enough row
// blocks run over it, and the partial sums stay in registers.
constexpr int64_t kChunkRowsUpTo = 64;
constexpr int64_t kLongChunk = 2048;
// How far ahead of the multiplication the weight stream is prefetched, in floats.
constexpr int64_t kPrefetchAhead = 2 * kChunk * kPanel;

template <int kRows>
struct Accumulators {
  v16f c[kRows][kVecsPerRow];

  // c += x[:, k] (outer) w[k, :]; x has row stride ldx, w is one weight row.
  __attribute__((always_inline)) void step(const float* x, int64_t ldx, int64_t k, const float* w) {
    v16f wk[kVecsPerRow];
#pragma GCC unroll 4
    for (int j = 0; j < kVecsPerRow; ++j) wk[j] = load16(w + j * kLanes);
#pragma GCC unroll 8
    for (int i = 0; i < kRows; ++i) {
      const v16f xi = splat(x[i * ldx + k]);
#pragma GCC unroll 4
      for (int j = 0; j < kVecsPerRow; ++j) c[i][j] += xi * wk[j];
    }
  }
};

// Which cache lines a row block prefetches, paced over its steps: prefetch number i
// (kPerStep of them per step) goes to line (i * rate) >> 32 after `start`. A rate of at
// most one line per prefetch skips no line, and asks for some twice.
struct Prefetch {
  const float* start;
  int64_t rate;  // lines per prefetch instruction, 32.32 fixed point
};

// Where a row block's accumulators start from and where they go: from `in` (row stride
// kPanel) or zero when in is null; to `out` (row stride ldo), plus bias[:kPanel] when
// bias is not null. The last chunk of a whole panel goes straight to the output, the
// others (and a ragged panel's last) to the thread's accumulator buffer.
struct Tile {
  const float* in;
  float* out;
  int64_t ldo;
  const float* bias;
};

// out[rows, kPanel] = in[rows, kPanel] + x[rows, kc] @ w[kc, kPanel] (see Tile); x has
// row stride ldx, w row stride kPanel. Also prefetches (into L2) as `pf` says, kPerStep
// lines per step: paced by the multiplication, so that few requests are in flight at a
// time (a burst of them stalls the loads), and without a branch in the loop.
template <int kRows, int kPerStep>
void row_block(int64_t kc, const float* x, int64_t ldx, const float* w, Tile t, Prefetch pf) {
  Accumulators<kRows> a;
#pragma GCC unroll 8
  for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kVecsPerRow; ++j)
      a.c[i][j] = t.in == nullptr ? v16f{} : load16(t.in + i * kPanel + j * kLanes);

  for (int64_t k = 0; k < kc; ++k) {
#pragma GCC unroll 4
    for (int j = 0; j < kPerStep; ++j)
      __builtin_prefetch(pf.start + (((k * kPerStep + j) * pf.rate) >> 32) * kLanes, 0, 2);
    a.step(x, ldx, k, w + k * kPanel);
  }

  v16f bias[kVecsPerRow] = {};
  if (t.bias != nullptr)
#pragma GCC unroll 4
    for (int j = 0; j < kVecsPerRow; ++j) bias[j] = load16(t.bias + j * kLanes);
#pragma GCC unroll 8
  for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kVecsPerRow; ++j) store16(t.out + i * t.ldo + j * kLanes, a.c[i][j] + bias[j]);
}

using RowBlockFn = void (*)(int64_t, const float*, int64_t, const float*, Tile, Prefetch);

// [rows - 1][prefetches per step]
static_assert(kVecsPerRow == 3, "kByPrefetch lists 0..kVecsPerRow prefetches per step");
template <int kRows>
constexpr RowBlockFn kByPrefetch[kVecsPerRow + 1] = {&row_block<kRows, 0>, &row_block<kRows, 1>,
                                                     &row_block<kRows, 2>, &row_block<kRows, 3>};
#ifdef __AVX512F__
constexpr const RowBlockFn* kRowBlocks[] = {kByPrefetch<1>, kByPrefetch<2>, kByPrefetch<3>, kByPrefetch<4>,
                                            kByPrefetch<5>, kByPrefetch<6>, kByPrefetch<7>, kByPrefetch<8>};
#else
constexpr const RowBlockFn* kRowBlocks[] = {kByPrefetch<1>, kByPrefetch<2>};
#endif
static_assert(sizeof(kRowBlocks) / sizeof(kRowBlocks[0]) == kRowsPerBlock, "one row-block kernel per size");

// out[M, kPanel] = x[M, K] @ panel[K, kPanel] (+ bias[:kPanel]), chunk by chunk of
// `chunk` rows of K, with the partial sums in acc [M, kPanel] in between; out has row
// stride ldo, and a null out means acc itself (a ragged panel, copied out by the caller).
// A thread's panels are consecutive in memory, one stream ending at stream_end. While a
// chunk is multiplied, the same amount of that stream kPrefetchAhead floats further on
// is prefetched, shared out evenly over the chunk's row blocks and their steps.
void multiply_panel(int64_t M, int64_t K, int64_t chunk, const float* x, const float* panel,
                    const float* stream_end, float* acc, float* out, int64_t ldo, const float* bias) {
  const int64_t row_blocks = (M + kRowsPerBlock - 1) / kRowsPerBlock;
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t kc = std::min(chunk, K - k0);
    const bool last = k0 + kc == K;
    const float* w = panel + k0 * kPanel;
    const bool in_stream = stream_end - w >= kPrefetchAhead + kc * kPanel;
    const int64_t lines = in_stream ? kc * kVecsPerRow : 0;
    const int64_t share = (lines + row_blocks - 1) / row_blocks;
    for (int64_t b = 0; b < row_blocks; ++b) {
      const int64_t r0 = b * kRowsPerBlock, rows = std::min<int64_t>(kRowsPerBlock, M - r0);
      const int64_t first = std::min(lines, b * share), count = std::min(lines, first + share) - first;
      const int64_t per_step = (count + kc - 1) / kc;  // 0..kVecsPerRow
      const Prefetch pf = per_step == 0 ? Prefetch{w, 0}
                                        : Prefetch{w + kPrefetchAhead + first * kLanes,
                                                   (count << 32) / (kc * per_step)};
      float* a = acc + r0 * kPanel;
      const Tile t = last && out != nullptr ? Tile{k0 == 0 ? nullptr : a, out + r0 * ldo, ldo, bias}
                                            : Tile{k0 == 0 ? nullptr : a, a, kPanel, nullptr};
      kRowBlocks[rows - 1][per_step](kc, x + r0 * K + k0, K, w, t, pf);
    }
  }
}

// out[rows, cols] = acc[rows, :cols] (+ bias[:cols]); out has row stride ldo.
void write_out(int64_t rows, int64_t cols, const float* acc, const float* bias, float* out, int64_t ldo) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* a = acc + i * kPanel;
    float* o = out + i * ldo;
    if (bias != nullptr) {
      for (int64_t j = 0; j < cols; ++j) o[j] = a[j] + bias[j];
    } else {
      std::memcpy(o, a, cols * sizeof(float));
    }
  }
}

int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// x rows per pass over the weight: at most as many as fit in kPassBytes (of a 2 MB L2),
// so that all of a thread's panels find the pass's rows in L2, not L3; the M rows are
// shared out evenly over the passes (a short last pass would stream the weight for few
// rows), in whole row blocks.
constexpr int64_t kPassBytes = 1 << 20;

int64_t rows_per_pass(int64_t M, int64_t K) {
  const int64_t most = std::max<int64_t>(kRowsPerBlock, kPassBytes / (std::max<int64_t>(K, 1) * 4));
  const int64_t passes = (M + most - 1) / most;
  return round_up((M + passes - 1) / passes, kRowsPerBlock);
}

int64_t num_panels(int64_t n) { return (n + kPanel - 1) / kPanel; }

at::Tensor pack_weight(const at::Tensor& w_t) {
  TORCH_CHECK(w_t.dim() == 2, "pack_weight: w_t must be 2-D [K, N] (the transposed weight), got ",
              w_t.dim(), "-D");
  TORCH_CHECK(w_t.scalar_type() == at::kFloat, "pack_weight: w_t must be float32, got ", w_t.scalar_type(),
              "; convert the weight with .float() first");
  const at::Tensor w = w_t.contiguous();
  const int64_t K = w.size(0), N = w.size(1), panels = num_panels(N);
  at::Tensor packed = at::zeros({panels, K, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min(kPanel, N - p * kPanel);
      for (int64_t k = 0; k < K; ++k)
        std::memcpy(dst + (p * K + k) * kPanel, src + k * N + p * kPanel, cols * sizeof(float));
    }
  });
  return packed;
}

// What packed_linear and packed_swiglu take, checked: x float32 [M, K]; packed, K
// rows in `panels` panels from `packer`; an optional float32 bias of bias_len values.
// Messages name the op. Holds x and the bias made contiguous, and the output [M, n].
struct PackedCall {
  at::Tensor x, bias, out;  // bias undefined when there is none
  int64_t M, K;
  const float* bias_ptr() const { return bias.defined() ? bias.data_ptr<float>() : nullptr; }
  bool empty() const { return out.numel() == 0; }
};

PackedCall check_packed_call(const char* op, const char* packer, const at::Tensor& x_in,
                             const at::Tensor& packed, int64_t n, int64_t panels,
                             const c10::optional<at::Tensor>& bias_in, int64_t bias_len,
                             const char* bias_note) {
  TORCH_CHECK(x_in.dim() == 2, op, ": x must be 2-D [M, K], got ", x_in.dim(),
              "-D; flatten the leading dimensions first");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, op, ": x must be float32, got ", x_in.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.scalar_type() == at::kFloat &&
                  packed.is_contiguous(),
              op, ": packed must be a contiguous float32 [panels, K, ", kPanel, "] tensor from ", packer,
              ", got ", packed.scalar_type(), " ", packed.sizes());
  TORCH_CHECK(n >= 0 && packed.size(0) == panels, op, ": n = ", n, " needs ", panels, " panels of ", kPanel,
              " columns but packed has ", packed.size(0), "; pass the n given to ", packer);
  TORCH_CHECK(x_in.size(1) == packed.size(1), op, ": x has K = ", x_in.size(1),
              " columns but the packed weight has K = ", packed.size(1), " rows");
  PackedCall call{x_in.contiguous(), at::Tensor(), at::empty({x_in.size(0), n}, x_in.options()),
                  x_in.size(0), x_in.size(1)};
  if (bias_in.has_value()) {
    TORCH_CHECK(bias_in->dim() == 1 && bias_in->size(0) == bias_len && bias_in->scalar_type() == at::kFloat,
                op, ": bias must be float32 [", bias_len, "]", bias_note, ", got ", bias_in->scalar_type(), " ",
                bias_in->sizes());
    call.bias = bias_in->contiguous();
  }
  return call;
}

at::Tensor packed_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n,
                         const c10::optional<at::Tensor>& bias_in) {
  const PackedCall call = check_packed_call("packed_linear", "pack_weight", x_in, packed, n, num_panels(n),
                                            bias_in, n, "");
  if (call.empty()) return call.out;
  const int64_t M = call.M, K = call.K, panels = packed.size(0);
  const float* bias = call.bias_ptr();
  const float* xs = call.x.data_ptr<float>();
  const float* ws = packed.data_ptr<float>();
  float* os = call.out.data_ptr<float>();

  const int64_t pass = rows_per_pass(M, K), chunk = M > kChunkRowsUpTo ? kLongChunk : kChunk;
  // Threads split the panels; each goes over its panels once per pass of rows, so that
  // a pass's rows stay in its L2 while the panels stream through.
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(pass * kPanel);
    for (int64_t r0 = 0; r0 < M; r0 += pass) {
      const int64_t m = std::min(pass, M - r0);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t cols = std::min(kPanel, n - p * kPanel);
        const float* bias_p = bias == nullptr ? nullptr : bias + p * kPanel;
        float* out_p = os + r0 * n + p * kPanel;
        // Few rows (short chunks) store through the buffer, as they always have: their
        // time is the weight stream's, and storing straight into the output measured no
        // faster there (within noise, if anything slower); many rows save the copy.
        const bool direct = cols == kPanel && K > 0 && chunk == kLongChunk;
        if (K == 0) std::fill(acc.begin(), acc.end(), 0.0f);
        multiply_panel(m, K, chunk, xs + r0 * K, ws + p * K * kPanel, ws + end * K * kPanel, acc.data(),
                       direct ? out_p : nullptr, n, bias_p);
        if (!direct) write_out(m, cols, acc.data(), bias_p, out_p, n);
      }
    }
  });
  return call.out;
}

// SwiGLU on one packed weight: out[M, n] = silu(x @ gate + b_gate) * (x @ up + b_up),
// the [M, 2n] product never written out. pack_gate_up packs gate_up_t [K, 2n] (gate
// columns, then up columns, as the model fuses them) panel pair by panel pair: panel
// 2p holds gate columns [48p, 48p + 48), panel 2p + 1 the same columns of up, each
// zero-padded past n. A thread takes whole pairs, multiplies both panels exactly as
// packed_linear would (the same sums in the same order), and writes silu(g) * u.
at::Tensor pack_gate_up(const at::Tensor& gate_up_t, int64_t n) {
  TORCH_CHECK(gate_up_t.dim() == 2 && gate_up_t.size(1) == 2 * n, "pack_gate_up: gate_up_t must be [K, 2 * ",
              n, "] (gate columns then up columns), got ", gate_up_t.sizes());
  TORCH_CHECK(gate_up_t.scalar_type() == at::kFloat, "pack_gate_up: gate_up_t must be float32, got ",
              gate_up_t.scalar_type());
  const at::Tensor w = gate_up_t.contiguous();
  const int64_t K = w.size(0), pairs = num_panels(n);
  at::Tensor packed = at::zeros({2 * pairs, K, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, 2 * pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t col0 = (p / 2) * kPanel, cols = std::min(kPanel, n - col0);
      const float* from = src + (p % 2) * n + col0;  // gate, or up
      for (int64_t k = 0; k < K; ++k)
        std::memcpy(dst + (p * K + k) * kPanel, from + k * 2 * n, cols * sizeof(float));
    }
  });
  return packed;
}

// out[rows, cols] = silu(gate + bg) * (up + bu), gate and up with row stride kPanel
// (bias pointers null when there is none); out has row stride ldo.
void write_swiglu(int64_t rows, int64_t cols, const float* gate, const float* up, const float* bg,
                  const float* bu, float* out, int64_t ldo) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* g = gate + i * kPanel;
    const float* u = up + i * kPanel;
    float* o = out + i * ldo;
    // The same operations as packed_linear's bias add then silu_mul, vector for vector.
    int64_t j = 0;
    for (; j + kLanes <= cols; j += kLanes) {
      v16f gv = load16(g + j), uv = load16(u + j);
      if (bg != nullptr) {
        gv += load16(bg + j);
        uv += load16(bu + j);
      }
      store16(o + j, gv / (1.f + kvops::exp16(-gv)) * uv);
    }
    for (; j < cols; ++j) {
      const float gj = g[j] + (bg == nullptr ? 0.f : bg[j]);
      const float uj = u[j] + (bu == nullptr ? 0.f : bu[j]);
      o[j] = gj / (1.f + std::exp(-gj)) * uj;
    }
  }
}

at::Tensor packed_swiglu(const at::Tensor& x_in, const at::Tensor& packed, int64_t n,
                         const c10::optional<at::Tensor>& bias_in) {
  const PackedCall call = check_packed_call("packed_swiglu", "pack_gate_up", x_in, packed, n,
                                            2 * num_panels(n), bias_in, 2 * n, " (gate then up)");
  if (call.empty()) return call.out;
  const int64_t M = call.M, K = call.K, pairs = num_panels(n);
  const float* bias = call.bias_ptr();
  const float* xs = call.x.data_ptr<float>();
  const float* ws = packed.data_ptr<float>();
  float* os = call.out.data_ptr<float>();
  const int64_t pass = rows_per_pass(M, K), chunk = M > kChunkRowsUpTo ? kLongChunk : kChunk;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(pass * kPanel), up(pass * kPanel);
    const float* stream_end = ws + 2 * end * K * kPanel;
    for (int64_t r0 = 0; r0 < M; r0 += pass) {
      const int64_t m = std::min(pass, M - r0);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t cols = std::min(kPanel, n - p * kPanel);
        const float* w_gate = ws + 2 * p * K * kPanel;
        if (K == 0) {
          std::fill(gate.begin(), gate.end(), 0.0f);
          std::fill(up.begin(), up.end(), 0.0f);
        }
        multiply_panel(m, K, chunk, xs + r0 * K, w_gate, stream_end, gate.data(), nullptr, kPanel, nullptr);
        multiply_panel(m, K, chunk, xs + r0 * K, w_gate + K * kPanel, stream_end, up.data(), nullptr, kPanel,
                       nullptr);
        write_swiglu(m, cols, gate.data(), up.data(), bias == nullptr ? nullptr : bias + p * kPanel,
                     bias == nullptr ? nullptr : bias + n + p * kPanel, os + r0 * n + p * kPanel, n);
      }
    }
  });
  return call.out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvops, m) {
  m.def("pack_weight(Tensor w_t) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int n, Tensor? bias=None) -> Tensor");
  m.def("pack_gate_up(Tensor gate_up_t, int n) -> Tensor");
  m.def("packed_swiglu(Tensor x, Tensor packed, int n, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvops, CPU, m) {
  m.impl("pack_weight", &pack_weight);
  m.impl("packed_linear", &packed_linear);
  m.impl("pack_gate_up", &pack_gate_up);
  m.impl("packed_swiglu", &packed_swiglu);
}
