// The products of quantised W and float32 x that quant.cpp and the fused decoding step
// (step.cpp) are made of: ``matvec`` (rows of W times a few rows of x, each block de-quantised
// once into registers for all of them), ``matvec_range`` (a range of W's rows, blocked for the
// L2 cache) and the tile path (de-quantise a tile of W, then torch's matmul) for many rows of x.
// The block formats and their de-quantising are quant.h's.
#pragma once

#include "quant.h"

#include <numeric>

namespace attnkit_fused::quant {

// Whether the products sum a kind's 32-value blocks as d (x . q) (+ m sum(x) for Q4_1): one
// multiply per value and the scale once per block, as ggml's dot products do (without
// quantising x). Q6_K (two scales per unit) and plain rows multiply de-quantised values. With
// AVX-512, Q4_0, Q4_1 and Q8_0 take matvec_exact instead (below).
template <int64_t KIND>
constexpr bool block_dot = KIND == Q4_0 || KIND == Q4_1 || KIND == Q8_0;

// out[r, c] = x[r] . W[c] for rows c in [c0, c1) of W and R rows of x (x rows ldx apart, out
// rows ldo apart; xsum: each x row's sums over units, for Q4_1's m): each unit of W is
// de-quantised once into registers and multiplied into R accumulators.
#if defined(CPU_CAPABILITY_AVX512)
// How far ahead of its use W is asked for where 8 rows of x make reading it slow enough that
// the CPU's prefetchers fall behind: about two rows of 1,536 Q4_1 values (960 bytes each);
// one row ahead was measurably slower (docs/benchmarks.md, "Tuning the decoding kernels").
constexpr int64_t AHEAD_BYTES = 2048;

// Q4_0, Q4_1 and Q8_0 with AVX-512: each block is de-quantised exactly as gguf does into two
// vectors of 16 values, and each row of x needs two FMAs per block (no per-block scale, no
// m sum(x) term): the product is x . (the exact de-quantised row) in float32.
//   Q4_0 / Q4_1: the block's 16 possible values ((q - 8) d, or q d + m rounded twice) make a
//     table and the 32 nibbles pick from it (vpermps reads an index's low 4 bits, so a byte's
//     low nibble needs no mask);
//   Q8_0: q d, exact in float32 (8 bits of q times 11 of d).
// Q8_0 as x . q per block, then times d (``matvec``), costs three multiply-adds per row and
// block where this costs two, and it reads 4 rows of x at a time; this takes 8.
template <int64_t KIND>
constexpr bool exact_rows = KIND == Q4_0 || KIND == Q4_1 || KIND == Q8_0;

template <int64_t KIND, int R>
void matvec_exact(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int64_t k,
                  int64_t c0, int64_t c1, float* out, int64_t ldo) {
  const int64_t units = k / UNIT;
  constexpr int64_t bytes = block_bytes<KIND>;
  constexpr int64_t at = KIND == Q4_1 ? 4 : 2;  // where q begins
  const __m512 levels = KIND == Q4_1
      ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
      : _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512i second = _mm512_set1_epi32(1);  // lane 1 of a vector, in every lane
  for (int64_t c = c0; c < c1; c++) {
    const uint8_t* row = w + c * row_bytes;
    // Per row: the sums of the low and the high nibbles, with even and odd blocks apart (four
    // independent FMA chains per row: enough to hide their latency for one row).
    __m512 acc[R][4];
    for (int r = 0; r < R; r++)
      for (int a = 0; a < 4; a++) acc[r][a] = _mm512_setzero_ps();
    // Unit u of the row de-quantised: elements 0..15 in w0, 16..31 in w1.
    auto values = [&](int64_t u, __m512& w0, __m512& w1) {
      const uint8_t* b = row + u * bytes;
      // The block's first four bytes widened at once: d, then Q4_1's m (for Q4_0 and Q8_0
      // the first values, unused). Read one scale at a time, the two took six instructions
      // where these take four: one row of x (a decoding step) is bound by this work, not by
      // reading W.
      uint32_t scales;
      std::memcpy(&scales, b, 4);
      const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(scales)));
      const __m512 d = _mm512_broadcastss_ps(dm);
      if constexpr (KIND == Q8_0) {
        const __m128i* q = reinterpret_cast<const __m128i*>(b + at);
        w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), d);
        w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), d);
      } else {
        __m512 table = _mm512_mul_ps(levels, d);
        if constexpr (KIND == Q4_1) {
          table = _mm512_add_ps(table, _mm512_permutexvar_ps(second, _mm512_castps128_ps512(dm)));
        }
        const __m512i q =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + at)));
        w0 = _mm512_permutexvar_ps(q, table);
        w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
      }
    };
    auto multiply = [&](int64_t u, __m512 w0, __m512 w1, auto slot) {
      constexpr int S = decltype(slot)::value;
      for (int r = 0; r < R; r++) {
        const float* xu = x + r * ldx + u * UNIT;
        acc[r][S] = _mm512_fmadd_ps(_mm512_loadu_ps(xu), w0, acc[r][S]);
        acc[r][S + 1] = _mm512_fmadd_ps(_mm512_loadu_ps(xu + 16), w1, acc[r][S + 1]);
      }
    };
    // Each unit is de-quantised ahead of its products: two units ahead here, one step of two
    // units below. Made in order, a unit's 2 R FMAs fill the CPU's scheduler waiting for its
    // values, and the next unit's values wait behind them. The FMAs are the same, in the same
    // order: the same bits.
    //
    // Units u0, u0 + 2, ... into chains S and S + 1.
    auto add_every_other = [&](int64_t u0, auto slot) {
      if (u0 >= units) return;
      __m512 w0, w1, v0, v1;
      values(u0, w0, w1);
      v0 = w0, v1 = w1;
      if (u0 + 2 < units) values(u0 + 2, v0, v1);
      for (int64_t u = u0; u < units; u += 2) {
        __builtin_prefetch(row + u * bytes + AHEAD_BYTES, 0, 3);
        __m512 n0 = v0, n1 = v1;
        if (u + 4 < units) values(u + 4, n0, n1);
        multiply(u, w0, w1, slot);
        w0 = v0, w1 = v1, v0 = n0, v1 = n1;
      }
    };
    if constexpr (R <= 4) {
      // Two units a step (chains 0, 1 and 2, 3).
      __m512 a0, a1, b0, b1;
      if (units > 0) values(0, a0, a1);
      if (units > 1) values(1, b0, b1);
      int64_t u = 0;
      for (; u + 2 <= units; u += 2) {
        // A batch reads W slowly enough for the CPU's prefetchers to fall behind (as below);
        // one row of x reads it at memory speed, and they keep up.
        if constexpr (R > 1) __builtin_prefetch(row + u * bytes + AHEAD_BYTES, 0, 3);
        __m512 na0 = a0, na1 = a1, nb0 = b0, nb1 = b1;
        if (u + 2 < units) values(u + 2, na0, na1);
        if (u + 3 < units) values(u + 3, nb0, nb1);
        multiply(u, a0, a1, std::integral_constant<int, 0>{});
        multiply(u + 1, b0, b1, std::integral_constant<int, 2>{});
        a0 = na0, a1 = na1, b0 = nb0, b1 = nb1;
      }
      if (u < units) multiply(u, a0, a1, std::integral_constant<int, 0>{});
      for (int r = 0; r < R; r++) {
        const __m512 total = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]),
                                           _mm512_add_ps(acc[r][2], acc[r][3]));
        out[r * ldo + c] = _mm512_reduce_add_ps(total);
      }
    } else {
      // 8 rows of x: the four chains of 8 rows would not fit the 32 registers, so the even
      // blocks go first (chains 0 and 1), then the odd ones (2 and 3) from the L1 cache: each
      // chain adds the same terms in the same order as above, and the sums are the same bits
      // as with 1, 2 or 4 rows. W is read slowly enough here for the CPU's prefetchers to fall
      // behind: the rows ahead are asked for.
      __m512 even[R];
      add_every_other(0, std::integral_constant<int, 0>{});
      for (int r = 0; r < R; r++) even[r] = _mm512_add_ps(acc[r][0], acc[r][1]);
      add_every_other(1, std::integral_constant<int, 2>{});
      for (int r = 0; r < R; r++) {
        const __m512 total = _mm512_add_ps(even[r], _mm512_add_ps(acc[r][2], acc[r][3]));
        out[r * ldo + c] = _mm512_reduce_add_ps(total);
      }
    }
  }
}
#endif

template <int64_t KIND, int R>
void matvec(const float* x, int64_t ldx, const float* xsum, const uint8_t* w, int64_t row_bytes,
            int64_t k, int64_t c0, int64_t c1, float* out, int64_t ldo) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (exact_rows<KIND>) {
    matvec_exact<KIND, R>(x, ldx, w, row_bytes, k, c0, c1, out, ldo);
    return;
  }
#endif
  const int64_t units = k / UNIT, bytes = format(KIND)->bytes;
  for (int64_t c = c0; c < c1; c++) {
    const uint8_t* row = w + c * row_bytes;
    V acc[R][NV];
    float offset[R] = {};  // sum over blocks of m sum(x) (Q4_1)
    for (int r = 0; r < R; r++)
      for (int v = 0; v < NV; v++) acc[r][v] = vzero();
    // acc[r][slot] += x_r . unit u; blocks alternate between two slots (two FMA chains).
    auto add_unit = [&](int64_t u, int slot) {
      if constexpr (block_dot<KIND>) {
        const uint8_t* b = row + u * bytes;
        const Unit q = KIND == Q8_0 ? int8s(b + 2) : KIND == Q4_0 ? nibbles(b + 2, 8)
                                                                  : nibbles(b + 4, 0);
        const V d = vset(half(b));
        for (int r = 0; r < R; r++) {
          const float* xu = x + r * ldx + u * UNIT;
          V t = vmul(vload(xu), q.v[0]);  // x . q
          for (int v = 1; v < NV; v++) t = vfma(vload(xu + v * VL), q.v[v], t);
          acc[r][slot] = vfma(t, d, acc[r][slot]);
        }
        if constexpr (KIND == Q4_1) {
          const float m = half(b + 2);
          for (int r = 0; r < R; r++) offset[r] += m * xsum[r * units + u];
        }
      } else {
        const Unit wu = unit<KIND>(row, u);
        for (int r = 0; r < R; r++) {
          const float* xu = x + r * ldx + u * UNIT;
          for (int v = 0; v < NV; v++) acc[r][v] = vfma(vload(xu + v * VL), wu.v[v], acc[r][v]);
        }
      }
    };
    int64_t u = 0;
    for (; u + 2 <= units; u += 2) {
      add_unit(u, 0);
      add_unit(u + 1, 1);
    }
    if (u < units) add_unit(u, 0);
    for (int r = 0; r < R; r++) {
      V total = acc[r][0];
      for (int v = 1; v < NV; v++) total = vadd(total, acc[r][v]);
      float sum = vsum(total) + offset[r];
      for (int64_t e = units * UNIT; e < k; e++) sum += x[r * ldx + e] * plain_value(row, KIND, e);
      out[r * ldo + c] = sum;
    }
  }
}


// Whether the row kernels read the unit sums of x for W of this kind: Q4_1's block dot
// products (``matvec``) add m sum(x) per block; with AVX-512, ``matvec_exact`` puts m into the
// de-quantised values and reads none (so nobody computes them: 4 passes over x per layer).
constexpr bool needs_unit_sums(int64_t kind) {
#if defined(CPU_CAPABILITY_AVX512)
  (void)kind;
  return false;
#else
  return kind == Q4_1;
#endif
}

// The sums of x's units (m rows of k values: (m, k / UNIT)), which Q4_1's products need for
// the m sum(x) term of each block.
inline void unit_sums(const float* x, int64_t m, int64_t k, float* out) {
  // Each sum in order over its unit's values, 8 units at a time (the rows' units are
  // consecutive: m k / UNIT of them) so that 8 chains of additions are in flight, not one.
  const int64_t all = m * (k / UNIT);
  int64_t u = 0;
  for (; u + 8 <= all; u += 8) {
    float s[8] = {};
    for (int e = 0; e < UNIT; e++)
      for (int j = 0; j < 8; j++) s[j] += x[(u + j) * UNIT + e];
    std::copy_n(s, 8, out + u);
  }
  for (; u < all; u++) out[u] = std::accumulate(x + u * UNIT, x + (u + 1) * UNIT, 0.0f);
}

#if defined(CPU_CAPABILITY_AVX512)
// The widest rows of x (k values) that matvec_exact takes 8 at a time. Its 8-row pass reads all
// of x's 8 rows for every row of W (even units, then odd ones): 8 rows of 1,536 floats (48 KiB)
// do not stay in a 32 KiB L1 cache, and every load of x then comes from L2. Wider rows go 4 at
// a time (24 KiB), which gives the same sums (the same four chains in the same order) and
// was faster for SmolLM2's 1,536-wide down projection, while its 576-wide products are fastest
// 8 at a time (docs/benchmarks.md, "Tuning the decoding kernels").
constexpr int64_t EIGHT_ROWS_K = 768;
#endif

// out[r, c] = x[r] . W[c] for rows c in [c0, c1) of W (``kind``, rows of row_bytes) and the m
// rows of x (k values each, contiguous; xsum: unit_sums of x), out rows ldo apart: x's rows
// taken 4, 2 and 1 at a time (and 8 for Q4_0, Q4_1 and Q8_0 with AVX-512), so each unit of W is
// de-quantised once for up to 4 (8) rows; a row's sum is the same whichever. W's rows
// go by blocks of about 128 KiB, each used by every group of x's rows while it is in the L2
// cache (so more than 4 rows of x do not read W from memory again per group).
inline void matvec_range(int64_t kind, const float* x, int64_t m, const float* xsum,
                         const uint8_t* w, int64_t row_bytes, int64_t k, int64_t c0, int64_t c1,
                         float* out, int64_t ldo) {
  const int64_t units = k / UNIT;
  const int64_t block = std::max<int64_t>(16, (128 * 1024) / std::max<int64_t>(1, row_bytes));
  with_kind(kind, [&](auto kc) {
    constexpr int64_t KIND = decltype(kc)::value;
    for (int64_t b0 = c0; b0 < c1; b0 += block) {
      const int64_t b1 = std::min(c1, b0 + block);
      auto rows = [&](auto group, int64_t r) {
        constexpr int R = decltype(group)::value;
        matvec<KIND, R>(x + r * k, k, xsum + r * units, w, row_bytes, k, b0, b1, out + r * ldo,
                        ldo);
      };
      int64_t r = 0;
#if defined(CPU_CAPABILITY_AVX512)
      if constexpr (exact_rows<KIND>) {  // a block's values serve 8 rows
        if (k <= EIGHT_ROWS_K) {
          for (; r + 8 <= m; r += 8) rows(std::integral_constant<int, 8>{}, r);
        }
      }
#endif
      for (; r + 4 <= m; r += 4) rows(std::integral_constant<int, 4>{}, r);
      for (; r + 2 <= m; r += 2) rows(std::integral_constant<int, 2>{}, r);
      for (; r < m; r++) rows(std::integral_constant<int, 1>{}, r);
    }
  });
}

constexpr int64_t MATVEC_ROWS = 8;  // x rows up to which products take matvec_range

// Rows of x up to which the step's products (step.cpp), and qmatmul's Q4 products with AVX-512,
// take the row kernels (matvec_range) rather than the tile path: on SmolLM2 the row kernels
// were faster at every batch of decoding rows and for prefill chunks up to 256 tokens
// (docs/benchmarks.md, "Tuning the decoding kernels"); the server's steps hold at most 256 rows
// by default.
constexpr int64_t STEP_ROWS = 256;

// The matrix-matrix path: tiles of W's rows (and of x's rows when W alone gives too few tiles
// for the threads), each de-quantised into a thread's float32 buffer and multiplied by gemm:
// out[:, tile] = x @ tile^T, out rows ldo apart.
// rows(c0, c1, buffer) de-quantises W's rows [c0, c1) into buffer (rows k apart); c0 is a
// multiple of 16, and c1 too unless it is n.
template <typename Rows>
void matmul_tiles_of(const float* x, int64_t m, int64_t n, int64_t k, float* out, int64_t ldo,
                     Rows&& rows) {
  const int64_t threads = at::get_num_threads();
  // A tile of about 64k floats (256 KiB: in L2 while gemm reads it), 16 to 128 rows, small
  // enough that every thread gets several.
  int64_t tile_n = std::clamp<int64_t>(65536 / k, 16, 128);
  tile_n = std::min(tile_n, std::max<int64_t>(16, (n + 4 * threads - 1) / (4 * threads)));
  tile_n = (tile_n + 15) / 16 * 16;
  const int64_t n_tiles = (n + tile_n - 1) / tile_n;
  int64_t m_tiles = 1;
  if (n_tiles < 4 * threads) m_tiles = std::clamp<int64_t>(4 * threads / n_tiles, 1, m / 64 + 1);
  const int64_t tile_m = (m + m_tiles - 1) / m_tiles;
  m_tiles = (m + tile_m - 1) / tile_m;
  at::parallel_for(0, n_tiles * m_tiles, 1, [&](int64_t begin, int64_t end) {
    note_thread();
    std::vector<float> tile(tile_n * k);  // this thread's de-quantised rows of W
    int64_t held = -1;                    // the W tile in the buffer
    for (int64_t item = begin; item < end; item++) {
      const int64_t nt = item / m_tiles, mt = item % m_tiles;
      const int64_t c0 = nt * tile_n, c1 = std::min(n, c0 + tile_n);
      const int64_t r0 = mt * tile_m, r1 = std::min(m, r0 + tile_m);
      if (held != nt) {
        rows(c0, c1, tile.data());
        held = nt;
      }
      // out[r0:r1, c0:c1] = x[r0:r1] @ tile^T: torch's float32 matmul (MKL where torch has it;
      // single-threaded inside this parallel region), written in place through strides.
      const at::Tensor x_rows =
          at::from_blob(const_cast<float*>(x) + r0 * k, {r1 - r0, k}, at::kFloat);
      const at::Tensor tile_t = at::from_blob(tile.data(), {k, c1 - c0}, {1, k}, at::kFloat);
      at::Tensor out_tile =
          at::from_blob(out + r0 * ldo + c0, {r1 - r0, c1 - c0}, {ldo, 1}, at::kFloat);
      at::mm_out(out_tile, x_rows, tile_t);
    }
  });
}

template <int64_t KIND>
void matmul_tiles(const float* x, int64_t m, const uint8_t* w, int64_t row_bytes, int64_t n,
                  int64_t k, float* out, int64_t ldo) {
  matmul_tiles_of(x, m, n, k, out, ldo, [&](int64_t c0, int64_t c1, float* tile) {
    for (int64_t c = c0; c < c1; c++) {
      dequantize_row<KIND>(w + c * row_bytes, k, tile + (c - c0) * k);
    }
  });
}

}  // namespace attnkit_fused::quant
