// The pieces of attention over a KV cache that decode.cpp (one query per head over a dense
// cache) and paged.cpp (several query positions over a paged pool) share: the tile sizes, rows
// of keys or values read as float32 vectors (bfloat16 and float16 widened in registers), how
// long caches are split into chunks, asking for rows ahead of their use, the scores of a few
// query rows against a transposed key tile, the weighted sum of value rows (which takes a row's
// address from a function of its index: a stride in decode.cpp, a block table in paged.cpp),
// and blocks of rows kept in registers.
#pragma once

#include "fused.h"

namespace attnkit_fused::kv {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = 2 * Vec::size();  // values per step along d and j: one bfloat16 vector
constexpr int64_t TILE = 128;           // keys per online-softmax update (a tile stays in L1)
constexpr int64_t MIN_CHUNK = 256;      // fewer keys per task: the merge costs more than it saves
constexpr int64_t TASKS_PER_THREAD = 4;
constexpr int64_t HEADS = 4;            // query rows whose sums are kept in registers at once
constexpr int64_t SQUARE = 16;          // the transposed blocks of a key tile

static_assert(at::vec::Vectorized<at::BFloat16>::size() == W, "bfloat16 vector = two floats");
static_assert(at::vec::Vectorized<at::Half>::size() == W, "float16 vector = two floats");
static_assert(TILE % W == 0 && TILE % SQUARE == 0 && W % SQUARE == 0, "tiles of whole blocks");

// Values [0, W) of a row from p (n of them exist; zero past n) as two float vectors.
inline std::pair<Vec, Vec> load_pair(const float* p, int64_t n) {
  if (n >= W) return {Vec::loadu(p), Vec::loadu(p + Vec::size())};
  if (n <= Vec::size()) return {Vec::loadu(p, n), Vec(0.0f)};
  return {Vec::loadu(p), Vec::loadu(p + Vec::size(), n - Vec::size())};
}

// The same from 16-bit rows (bfloat16 or float16), widened in registers.
template <typename half_t,
          typename = std::enable_if_t<std::is_same_v<half_t, at::BFloat16> ||
                                      std::is_same_v<half_t, at::Half>>>
inline std::pair<Vec, Vec> load_pair(const half_t* p, int64_t n) {
  using HVec = at::vec::Vectorized<half_t>;
  const HVec x = n >= W ? HVec::loadu(p) : HVec::loadu(p, n);
  auto [lo, hi] = at::vec::convert_to_float<half_t>(x);
  return {lo, hi};
}

// A row of d values as float32, zero-padded to d_p (a multiple of W).
template <typename kv_t>
inline void widen_row(const kv_t* src, int64_t d, int64_t d_p, float* dst) {
  for (int64_t e = 0; e < d_p; e += W) {
    auto [lo, hi] = load_pair(src + e, d - e);
    lo.store(dst + e);
    hi.store(dst + e + Vec::size());
  }
}

// How many chunks a unit of work's keys are split into: one on a single thread, else enough
// that there are TASKS_PER_THREAD tasks per thread, never chunks shorter than MIN_CHUNK keys.
inline int64_t chunk_count(int64_t keys, int64_t units, int64_t threads) {
  if (threads <= 1) return 1;
  const int64_t want = (TASKS_PER_THREAD * threads + units - 1) / units;
  return std::clamp<int64_t>(want, 1, std::max<int64_t>(1, keys / MIN_CHUNK));
}

// Asks for the cache lines of one row of d values ahead of its use. The cache is read tile by
// tile with much arithmetic in between: without asking ahead, a step over a long cache that is
// no longer in the CPU's caches waits on memory row by row (a third of the bandwidth a plain
// read of it gets with one thread). Asked for into L2 (prefetcht1), not L1: a thread keeps
// STREAM_AHEAD rows in flight, more lines than L1 can wait on, and asking for them into L1
// left a cold cache read slower (docs/benchmarks.md, "Tuning the decoding kernels").
template <typename kv_t>
inline void prefetch_row(const kv_t* row, int64_t d) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t at = 0; at < d * static_cast<int64_t>(sizeof(kv_t)); at += 64) {
    __builtin_prefetch(p + at, 0, 2);
  }
}

// s[r][c] = q_r . k_c for R rows and the keys [0, n_p): each key vector is loaded once for the
// R rows, whose sums stay in registers. Each sum runs over d in blocks of SUM_BLOCK terms, the
// blocks' sums then added up: with one chain of d roundings the decode kernel erred up to 3x as
// much as torch's float32 path (whose products sum in blocks) against float64.
constexpr int64_t SUM_BLOCK = 16;

template <int R>
inline void scores(const float* q_rows, int64_t d, int64_t d_p, const float* k_t, int64_t n_p,
                   float* s) {
  for (int64_t c = 0; c < n_p; c += W) {
    for (int64_t e0 = 0; e0 < d; e0 += SUM_BLOCK) {
      Vec lo[R], hi[R];
      for (int r = 0; r < R; r++) lo[r] = hi[r] = Vec(0.0f);
      for (int64_t e = e0; e < std::min(d, e0 + SUM_BLOCK); e++) {
        const Vec k0 = Vec::loadu(k_t + e * TILE + c);
        const Vec k1 = Vec::loadu(k_t + e * TILE + c + Vec::size());
        for (int r = 0; r < R; r++) {
          const Vec q(q_rows[r * d_p + e]);
          lo[r] = at::vec::fmadd(q, k0, lo[r]);
          hi[r] = at::vec::fmadd(q, k1, hi[r]);
        }
      }
      for (int r = 0; r < R; r++) {
        float* out = s + r * TILE + c;
        if (e0 > 0) {
          lo[r] = lo[r] + Vec::loadu(out);
          hi[r] = hi[r] + Vec::loadu(out + Vec::size());
        }
        lo[r].store(out);
        hi[r].store(out + Vec::size());
      }
    }
  }
}

// acc_r += sum_c p[r][c] v_c for R rows and keys [0, n), value row c at value(c) as stored
// (16-bit rows widened in registers): each value vector is loaded once for the R rows, whose sums
// stay in registers (two vectors of d per row), SUM_BLOCK keys at a time, then added to acc (as
// in ``scores``: one chain over a long cache's keys would lose accuracy with its length). A key
// with keep(c) false is skipped, not weighted by 0: a NaN there must not reach the output
// (0 * NaN is NaN).
template <int R, typename Value, typename Keep>
inline void add_values(const float* p, Value&& value, int64_t n, int64_t d, int64_t d_p,
                       Keep&& keep, float* acc) {
  for (int64_t e = 0; e < d_p; e += W) {
    for (int64_t c0 = 0; c0 < n; c0 += SUM_BLOCK) {
      Vec lo[R], hi[R];
      for (int r = 0; r < R; r++) lo[r] = hi[r] = Vec(0.0f);
      for (int64_t c = c0; c < std::min(n, c0 + SUM_BLOCK); c++) {
        if (!keep(c)) continue;
        auto [v0, v1] = load_pair(value(c) + e, d - e);
        for (int r = 0; r < R; r++) {
          const Vec w(p[r * TILE + c]);
          lo[r] = at::vec::fmadd(w, v0, lo[r]);
          hi[r] = at::vec::fmadd(w, v1, hi[r]);
        }
      }
      for (int r = 0; r < R; r++) {
        float* out = acc + r * d_p + e;
        (Vec::loadu(out) + lo[r]).store(out);
        (Vec::loadu(out + Vec::size()) + hi[r]).store(out + Vec::size());
      }
    }
  }
}

// Rows [0, rows) in blocks of up to HEADS: fn<R>(first row of the block).
template <typename Fn>
inline void by_rows(int64_t rows, Fn&& fn) {
  int64_t r0 = 0;
  for (; r0 + HEADS <= rows; r0 += HEADS) fn(std::integral_constant<int, HEADS>{}, r0);
  switch (rows - r0) {
    case 1: fn(std::integral_constant<int, 1>{}, r0); break;
    case 2: fn(std::integral_constant<int, 2>{}, r0); break;
    case 3: fn(std::integral_constant<int, 3>{}, r0); break;
    default: break;
  }
}
static_assert(HEADS == 4, "by_rows handles remainders of up to 3 rows");

}  // namespace attnkit_fused::kv
