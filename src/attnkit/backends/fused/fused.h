// The pieces the fused forward (forward.cpp) and backward (backward.cpp) share: the problem
// description, the tile matmul, and one row of a tile's logits. The names follow the Python
// tiled backend (src/attnkit/backends/tiled/): Spec, logits, update, finish.
//
// Shape vocabulary: b batch, h query heads, hk key/value heads (g = h / hk per key head),
// i queries, j keys, d query/key width, dv value width.
//
// Scores are kept in base 2, as in tiled/softmax.py: log2(e) is folded into the scale, so a
// weight is exp2(s - m) and the natural log-sum-exp is (m + log2 l) * ln 2.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#if defined(__SSE2__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <bitset>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <limits>
#include <map>
#include <string>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace attnkit_fused {

using at::Tensor;

// Which of torch's intra-op threads ran part of the latest forward or backward (bit t: the
// thread at::get_thread_num() == t), so a test can check that the kernel runs on every thread
// torch uses (``threads_used``) without timing it.
inline std::atomic<uint64_t> threads_seen{0};
inline void begin_parallel() { threads_seen.store(0, std::memory_order_relaxed); }
inline void note_thread() {
  const int t = std::min(at::get_thread_num(), 63);
  threads_seen.fetch_or(uint64_t(1) << t, std::memory_order_relaxed);
}
inline int64_t threads_used() {
  return static_cast<int64_t>(std::bitset<64>(threads_seen.load()).count());
}

// Subnormal floats (below 2^-126) read and written as zero inside an attention kernel's
// parallel region, and the thread's own mode restored after it (its other work keeps IEEE
// subnormals). A weight exp2(s - m) that far below the row's largest (1) is far below
// float32's rounding of the row sum, so outputs move by at most that; but Intel cores take a
// slow microcode assist for every subnormal result or operand, and a bias that spreads a row's
// scores (ALiBi's steep heads) made the forward up to twice as slow there
// (docs/benchmarks.md, section auto-amx). The x86 SSE control register's FTZ
// and DAZ bits; elsewhere nothing changes.
class SubnormalsAsZero {
 public:
#if defined(__SSE2__)
  SubnormalsAsZero() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | FTZ_DAZ); }
  ~SubnormalsAsZero() { _mm_setcsr(saved_); }
#endif
  SubnormalsAsZero(const SubnormalsAsZero&) = delete;
  SubnormalsAsZero& operator=(const SubnormalsAsZero&) = delete;

 private:
#if defined(__SSE2__)
  static constexpr unsigned int FTZ_DAZ = 0x8040;  // flush to zero (bit 15), denormals are zero (bit 6)
  unsigned int saved_;
#endif
};

// An allocator of whole cache lines: std::vector's own buffers are aligned to 16 bytes, so a
// row of 16 floats that starts a multiple of 64 bytes into one straddles two lines, and every
// vector load of it costs two (the products' 8-row kernels spent a third longer on x so).
template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(std::size_t n) {
    const std::size_t bytes = std::max<std::size_t>(64, (n * sizeof(T) + 63) / 64 * 64);
    void* p = std::aligned_alloc(64, bytes);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) { std::free(p); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};
using Floats = std::vector<float, LineAllocator<float>>;  // zeroed, 64-byte aligned

constexpr double LOG2E = 1.4426950408889634;  // softmax.py LOG2E
constexpr double LN2 = 0.6931471805599453;     // softmax.py LN2
constexpr int64_t NO_LIMIT = std::numeric_limits<int64_t>::max() / 4;

// Everything about one attention problem except q, k, v (tiles.py ``Spec``), already reduced to
// what the kernel evaluates per element:
//   * band: key j is visible from query i only when band_lo <= j - i <= band_hi (causal of
//     either alignment, windows; masks.Band turned into an interval of offsets j - i);
//   * plan: the call's tile plan (TilePlan.tensors for the forward, by_key for the backward):
//     the kept tiles of each query tile (or key tile), (start, end, full) each, in CSR form;
//     the band and any block layout are already in it, so tiles it leaves out are never seen;
//   * mask / bias: dense tensors viewed as (b, h, i, j) with strides (0 on broadcast axes);
//   * relative: a (h, n_i + n_j - 1) table, bias(i, j) = table[h, j - i + n_i - 1]
//     (tiled/relative.py, evaluated once per call).
template <typename acc_t>
struct Spec {
  int64_t nb = 0, h = 0, hk = 0, ni = 0, nj = 0, d = 0, dv = 0;
  acc_t scale2 = 0;  // scale * log2(e)
  int64_t block_q = 64, block_k = 256;
  int64_t band_lo = -NO_LIMIT, band_hi = NO_LIMIT;
  const int64_t* plan_offsets = nullptr;  // (tiles of the outer loop + 1)
  const int64_t* plan_tiles = nullptr;    // (T, 3): start, end, full
  const bool* mask = nullptr;
  int64_t mask_sb = 0, mask_sh = 0, mask_si = 0, mask_sj = 0;
  const acc_t* bias = nullptr;
  int64_t bias_sb = 0, bias_sh = 0, bias_si = 0, bias_sj = 0;
  const acc_t* relative = nullptr;  // (h, n_i + n_j - 1)
  // Skipping negligible tiles (tiled/skipping.py): |q2_i| (b, h, i) and |k_j| (b, hk, j).
  const acc_t* q_norm = nullptr;
  const acc_t* k_norm = nullptr;
  acc_t negligible = 0;  // bits below a row's floor under which a weight is negligible

  acc_t blocked() const { return std::numeric_limits<acc_t>::lowest(); }  // _numerics.blocked
  int64_t rel_length() const { return ni + nj - 1; }

  // Keys [lo, hi) of query i inside the band.
  int64_t band_first_key(int64_t i) const { return std::max<int64_t>(0, i + band_lo); }
  int64_t band_end_key(int64_t i) const { return std::min<int64_t>(nj, i + band_hi + 1); }
};

// A tile [j0, j1) of the inner loop (keys in the forward, queries in the backward), and
// whether every pair in it is visible (tiles.py ``groups``: True = all visible, else evaluate).
struct KeyTile {
  int64_t j0, j1;
  bool full;
};

// The kept tiles of the outer loop's tile ``outer`` (tiles.py ``groups``, from the TilePlan):
// full means every pair is visible by structure and no dense mask is read.
template <typename acc_t>
std::vector<KeyTile> planned_tiles(const Spec<acc_t>& sp, int64_t outer) {
  std::vector<KeyTile> tiles;
  for (int64_t t = sp.plan_offsets[outer]; t < sp.plan_offsets[outer + 1]; t++) {
    const int64_t* x = sp.plan_tiles + 3 * t;
    tiles.push_back({x[0], x[1], x[2] != 0 && sp.mask == nullptr});
  }
  return tiles;
}

// Whether any pair of queries [i0, i1) x keys [j0, j1) is allowed by the dense mask (a tile
// that evaluates all blocked is skipped before its matmul, as in forward.py).
template <typename acc_t>
inline bool mask_any(const Spec<acc_t>& sp, int64_t b, int64_t h, int64_t i0, int64_t i1,
                     int64_t j0, int64_t j1) {
  if (sp.mask == nullptr) return true;
  const bool* base = sp.mask + b * sp.mask_sb + h * sp.mask_sh;
  for (int64_t i = i0; i < i1; i++) {
    const bool* row = base + i * sp.mask_si;
    for (int64_t j = j0; j < j1; j++) {
      if (row[j * sp.mask_sj]) return true;
    }
  }
  return false;
}

// The largest relative bias over every offset j - i of a tile (skipping.py ``row_max``, one
// bound for the whole tile), natural units. ``flipped``: the table is stored in reverse (the
// backward reads it along queries).
template <typename acc_t>
inline acc_t relative_top(const Spec<acc_t>& sp, int64_t h, int64_t i0, int64_t i1, int64_t j0,
                          int64_t j1, bool flipped = false) {
  const acc_t* row = sp.relative + h * sp.rel_length();
  int64_t lo = j0 - (i1 - 1) + sp.ni - 1, hi = (j1 - 1) - i0 + sp.ni - 1;
  if (flipped) std::tie(lo, hi) = std::make_pair(sp.rel_length() - 1 - hi, sp.rel_length() - 1 - lo);
  acc_t top = std::numeric_limits<acc_t>::lowest();
  for (int64_t x = lo; x <= hi; x++) top = std::max(top, row[x]);
  return top;
}

// The tile matmul C[M x N] (+)= A[M x K] B[K x N], row-major, float (double) accumulation:
// oneDNN's batch-reduce GEMM through ATen (cpublas::brgemm) for float and bfloat16. A bfloat16
// B is packed in pairs of rows ("VNNI": B[k][n], B[k+1][n] adjacent; K even), so one
// instruction multiplies two bfloat16 pairs; ldb counts columns.
inline void matmul(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                   int64_t ldb, float* C, int64_t ldc, bool add) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add, A, B, C, false);
}

inline void matmul(int64_t M, int64_t N, int64_t K, const at::BFloat16* A, int64_t lda,
                   const at::BFloat16* B, int64_t ldb, float* C, int64_t ldc, bool add) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add, A, B, C, true);
}

inline void matmul(int64_t M, int64_t N, int64_t K, const double* A, int64_t lda,
                   const double* B, int64_t ldb, double* C, int64_t ldc, bool add) {
  for (int64_t m = 0; m < M; m++) {  // float64 is for checking, not speed: a plain loop
    double* c = C + m * ldc;
    if (!add) std::fill(c, c + N, 0.0);
    for (int64_t k = 0; k < K; k++) {
      double a = A[m * lda + k];
      const double* b = B + k * ldb;
      for (int64_t n = 0; n < N; n++) c[n] += a * b[n];
    }
  }
}

// Offset of column n0 in a B operand (packed bfloat16 B holds two values per column).
template <typename scalar_t>
constexpr int64_t column_step() {
  return std::is_same_v<scalar_t, at::BFloat16> ? 2 : 1;
}

// Rows of a float buffer as the matmul's A operand in scalar_t: the row itself for float and
// double, a converted copy for bfloat16 (padding columns [n, n_pad) are zero).
inline void as_operand(const float* src, at::BFloat16* dst, int64_t n, int64_t n_pad) {
  at::vec::convert(src, dst, n);
  for (int64_t c = n; c < n_pad; c++) dst[c] = at::BFloat16(0.0f);
}

// Two rows of a float buffer as one packed (VNNI) row of a bfloat16 B operand.
inline void as_packed_pair(const float* r0, const float* r1, at::BFloat16* dst, int64_t n) {
  for (int64_t c = 0; c < n; c++) {
    dst[2 * c] = at::BFloat16(r0[c]);
    dst[2 * c + 1] = at::BFloat16(r1 == nullptr ? 0.0f : r1[c]);
  }
}

// NaN-propagating maximum (a NaN score makes its row NaN, _numerics.py).
template <typename T>
inline T nan_max(T a, T b) {
  return (a != a || b != b) ? std::numeric_limits<T>::quiet_NaN() : std::max(a, b);
}

// One row of a tile's base-2 logits, in place (tiles.py ``Tiles.logits``: scores, bias, mask,
// in that order): s = s * scale2 + (relative + bias) * log2(e); blocked outside the visible
// columns [lo, hi), where the dense mask is False, and where a bias is -inf. ``rel`` is
// contiguous along the row; ``bias`` and ``mask`` have strides. Returns the row's maximum.
template <typename acc_t>
inline acc_t logits_row(acc_t* s, int64_t n, acc_t scale2, const acc_t* rel, const acc_t* bias,
                        int64_t bias_stride, const bool* mask, int64_t mask_stride, int64_t lo,
                        int64_t hi) {
  using Vec = at::vec::Vectorized<acc_t>;
  const acc_t blocked = std::numeric_limits<acc_t>::lowest();
  const acc_t log2e = static_cast<acc_t>(LOG2E);
  lo = std::max<int64_t>(lo, 0);
  hi = std::min<int64_t>(hi, n);
  if (hi <= lo) {  // nothing visible in this row of the tile
    std::fill(s, s + n, blocked);
    return blocked;
  }
  const Vec vscale(scale2), vlog2e(log2e), vblocked(blocked);
  int64_t c = lo;
  if (rel != nullptr) {
    for (; c + Vec::size() <= hi; c += Vec::size()) {
      Vec x = Vec::loadu(s + c) * vscale + Vec::loadu(rel + c) * vlog2e;
      Vec::blendv(x, vblocked, x < vblocked).store(s + c);  // -inf bias: blocked
    }
    for (; c < hi; c++) s[c] = std::max(s[c] * scale2 + rel[c] * log2e, blocked);
  } else {
    at::vec::map([&](Vec x) { return x * vscale; }, s + lo, s + lo, hi - lo);
  }
  if (bias != nullptr) {
    for (c = lo; c < hi; c++) {
      acc_t x = s[c] + bias[c * bias_stride] * log2e;
      s[c] = x < blocked ? blocked : x;  // NaN stays NaN
    }
  }
  if (mask != nullptr) {
    for (c = lo; c < hi; c++) {
      if (!mask[c * mask_stride]) s[c] = blocked;
    }
  }
  std::fill(s, s + lo, blocked);
  std::fill(s + hi, s + n, blocked);
  return at::vec::reduce_all<acc_t>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, s + lo, hi - lo);
}

// The online softmax of one row (tiled/softmax.py, the same names), in base 2.
//
// update: m' = max(m, rowmax s), alpha = exp2(m - m') (``rescaled``), p = exp2(s - m') in
// place of s, l = l * alpha + rowsum(p), acc = acc * alpha (the caller then adds p v_t).
template <typename acc_t>
inline void rescaled(acc_t* acc, int64_t n, acc_t alpha) {
  using Vec = at::vec::Vectorized<acc_t>;
  if (alpha != acc_t(1)) at::vec::map([&](Vec x) { return x * Vec(alpha); }, acc, acc, n);
}

template <typename acc_t>
inline void update(acc_t* s, int64_t n, acc_t top, acc_t& m, acc_t& l, acc_t* acc, int64_t dv) {
  using Vec = at::vec::Vectorized<acc_t>;
  const acc_t m_new = nan_max(m, top);
  const acc_t alpha = std::exp2(m - m_new);
  const Vec shift(m_new);
  at::vec::map([&](Vec x) { return (x - shift).exp2(); }, s, s, n);
  const acc_t row_sum =
      at::vec::reduce_all<acc_t>([](Vec& a, Vec& b) { return a + b; }, s, n);
  l = l * alpha + row_sum;
  rescaled(acc, dv, alpha);
  m = m_new;
}

// finish: output = acc / l, lse = (m + log2 l) * ln 2; a row that saw no key gives 0 and
// blocked; a NaN or +inf maximum makes the row NaN. The backward reads m and log2 l apart
// (``top``, ``log_l``): p = exp2((s - m) - log2 l) rounds once where s is near m, where
// exp2(s - lse * log2 e) would round lse three times at the size of m.
template <typename acc_t>
inline void finish(acc_t m, acc_t l, const acc_t* acc, int64_t dv, acc_t* out, acc_t& lse,
                   acc_t& top, acc_t& log_l) {
  const acc_t blocked = std::numeric_limits<acc_t>::lowest();
  const bool seen = m > blocked;
  const bool broken = std::isnan(m) || m == std::numeric_limits<acc_t>::infinity();
  const acc_t l_r = std::max(l, acc_t(1e-30));
  for (int64_t e = 0; e < dv; e++) out[e] = seen ? acc[e] / l_r : acc_t(0);
  log_l = seen ? std::log2(l_r) : acc_t(0);
  lse = seen ? (m + log_l) * static_cast<acc_t>(LN2) : blocked;
  top = seen ? m : acc_t(0);  // a row that saw no key: p = exp2(blocked) = 0
  if (broken) {
    lse = std::numeric_limits<acc_t>::quiet_NaN();
    top = lse;
    std::fill(out, out + dv, lse);
  }
}

using Opt = std::optional<Tensor>;

// The Spec of a call from the tensors and named numbers the Python side passes (api.py
// ``_sizes``): sizes {b, h, hk, i, j, d, dv, block_q, block_k, band_lo, band_hi}, numbers
// {scale, negligible}. Absent tensors are None.
using Named = std::map<std::string, int64_t>;
using NamedF = std::map<std::string, double>;

template <typename acc_t>
Spec<acc_t> make_spec(const Opt& mask, const Opt& bias, const Opt& relative,
                      const Tensor& plan_offsets, const Tensor& plan_tiles, const Opt& q_norm,
                      const Opt& k_norm, const Named& sizes, const NamedF& numbers) {
  Spec<acc_t> sp;
  sp.nb = sizes.at("b"), sp.h = sizes.at("h"), sp.hk = sizes.at("hk");
  sp.ni = sizes.at("i"), sp.nj = sizes.at("j"), sp.d = sizes.at("d"), sp.dv = sizes.at("dv");
  sp.block_q = sizes.at("block_q"), sp.block_k = sizes.at("block_k");
  sp.band_lo = sizes.at("band_lo"), sp.band_hi = sizes.at("band_hi");
  sp.scale2 = static_cast<acc_t>(numbers.at("scale") * LOG2E);
  sp.negligible = static_cast<acc_t>(numbers.at("negligible"));
  TORCH_CHECK(plan_offsets.scalar_type() == at::kLong && plan_tiles.scalar_type() == at::kLong &&
                  plan_offsets.is_contiguous() && plan_tiles.is_contiguous(),
              "fused kernel: the tile plan must be contiguous int64 tensors");
  sp.plan_offsets = plan_offsets.data_ptr<int64_t>();
  sp.plan_tiles = plan_tiles.data_ptr<int64_t>();
  if (mask) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 4, "fused kernel: mask");
    sp.mask = mask->data_ptr<bool>();
    sp.mask_sb = mask->stride(0), sp.mask_sh = mask->stride(1);
    sp.mask_si = mask->stride(2), sp.mask_sj = mask->stride(3);
  }
  if (bias) {
    TORCH_CHECK(bias->dim() == 4, "fused kernel: bias must be 4-D");
    sp.bias = bias->data_ptr<acc_t>();
    sp.bias_sb = bias->stride(0), sp.bias_sh = bias->stride(1);
    sp.bias_si = bias->stride(2), sp.bias_sj = bias->stride(3);
  }
  if (relative) {
    TORCH_CHECK(relative->is_contiguous() && relative->size(1) == sp.rel_length(),
                "fused kernel: relative table must be (h, i + j - 1)");
    sp.relative = relative->data_ptr<acc_t>();
  }
  if (q_norm && k_norm) {
    sp.q_norm = q_norm->data_ptr<acc_t>();
    sp.k_norm = k_norm->data_ptr<acc_t>();
  }
  return sp;
}

void forward(const Tensor& q, const Tensor& k_t, const Tensor& v, const Tensor& out,
             const Tensor& lse, const Tensor& shift, const Opt& poisoned, const Opt& bad,
             const Opt& mask, const Opt& bias, const Opt& relative, const Tensor& plan_offsets,
             const Tensor& plan_tiles, const Opt& q_norm, const Opt& k_norm, const Named& sizes,
             const NamedF& numbers);

void backward(const Tensor& k, const Tensor& v, const Tensor& k_t, const Tensor& q_t,
              const Tensor& do_t, const Tensor& do_rows, const Tensor& q_rows, const Tensor& shift,
              const Tensor& delta, const Tensor& dq_t, const Tensor& dk, const Tensor& dv,
              const Opt& dbias, const Opt& mask, const Opt& bias, const Opt& relative,
              const Tensor& plan_offsets, const Tensor& plan_tiles, const Opt& q_norm,
              const Opt& k_norm, const Named& sizes, const NamedF& numbers);

// The types a KV cache or pool holds keys and values in (read as stored, widened to float32 in
// registers), and f(kv_t{}) called with the one a tensor holds (float for float32).
inline bool is_kv_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}
template <typename F>
void with_kv_type(at::ScalarType t, F&& f) {
  if (t == at::kBFloat16) return f(at::BFloat16{});
  if (t == at::kHalf) return f(at::Half{});
  return f(float{});
}

// decode.cpp's step without its checks (the caller checked): attention of query heads q (b, h, d)
// (rows q_sb and heads q_sh apart, contiguous in d) over keys [0, length) of the cache key,
// value (b, h_kv, L, d), float32, bfloat16 or float16, contiguous in d; key_mask (b, length) or
// nullptr; writes out (b, h, d), contiguous. Marks the threads it runs on (note_thread), resets
// nothing.
void decode_into(const float* q, int64_t q_sb, int64_t q_sh, int64_t nb, int64_t h,
                 const Tensor& key, const Tensor& value, int64_t length, double scale,
                 const bool* key_mask, int64_t mask_sb, int64_t mask_sj, float* out);

// paged.cpp's attention over a paged KV cache (see there), and its checks alone (which the
// attention runs first): the Llama step checks the tables before it writes any pool.
void paged_check(const Tensor& q, const Tensor& key_pool, const Tensor& value_pool,
                 const Tensor& block_tables, const Tensor& lengths, const Tensor& starts,
                 const Tensor& out);
void paged(const Tensor& q, const Tensor& key_pool, const Tensor& value_pool,
           const Tensor& block_tables, const Tensor& lengths, const Tensor& starts, double scale,
           const Tensor& out);

// decode.cpp's checked step over a dense KV cache (see there).
void decode(const Tensor& q, const Tensor& key, const Tensor& value, int64_t length, double scale,
            const Opt& key_mask, const Tensor& out);

// quant.cpp's products with GGUF block weights (see there).
Tensor dequantize(const Tensor& w, int64_t kind, int64_t k);
void qmatmul(const Tensor& x, const Tensor& w, int64_t kind, const Tensor& out);
Tensor embedding(const Tensor& ids, const Tensor& w, int64_t kind, int64_t k);
Tensor interleave(const Tensor& w, int64_t kind);
bool interleaves();

// step.cpp's quantised Llama steps, over a dense and over a paged KV cache (see there), and
// the rows up to which a step's products take the row kernels.
int64_t step_rows();
void llama_step(const Tensor& ids, const std::vector<int64_t>& positions, const Tensor& embed,
                int64_t embed_kind, const std::vector<Tensor>& weights,
                const std::vector<int64_t>& kinds, const std::vector<int64_t>& parts,
                const std::vector<Tensor>& norms, const std::vector<Tensor>& keys,
                const std::vector<Tensor>& values, const Tensor& cos, const Tensor& sin,
                const Opt& key_mask, const Named& sizes, const NamedF& numbers,
                const Tensor& logits);
void llama_paged_step(const Tensor& ids, const Tensor& positions, const Tensor& slots,
                      const Tensor& block_tables, const Tensor& lengths, const Tensor& starts,
                      const Tensor& out_rows, const Tensor& embed, int64_t embed_kind,
                      const std::vector<Tensor>& weights, const std::vector<int64_t>& kinds,
                      const std::vector<int64_t>& parts, const std::vector<Tensor>& norms,
                      const std::vector<Tensor>& key_pools,
                      const std::vector<Tensor>& value_pools, const Tensor& cos,
                      const Tensor& sin, const Named& sizes, const NamedF& numbers,
                      const Tensor& logits);

}  // namespace attnkit_fused
