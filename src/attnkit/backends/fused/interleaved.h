// Rows of W interleaved by eight: the layout the decoding step multiplies Q4_0, Q4_1 and Q8_0
// weights in where the CPU has AVX2 but not AVX-512.
//
// GGUF stores each row of W as its own run of blocks, so a product reads one row at a time and
// ends with a sum across a vector's lanes. With AVX2 that row-at-a-time product leaves most of
// the core's FMAs idle for 8 rows of x (docs/benchmarks.md, "Tuning the decoding kernels",
// has the measurements behind this file's choices). Here the rows of W
// go in groups of 8 (GROUP), and a group's blocks are interleaved so that one vector holds the
// same element of all 8 rows:
//
//   kind  per block of a group (8 rows x 32 values)                  bytes (= 8 blocks)
//   Q4_0  d[8] f16, qs[4][8] u32                                     16 + 128 = 144
//   Q4_1  d[8] f16, m[8] f16, qs[4][8] u32                           32 + 128 = 160
//   Q8_0  d[8] f16, q[8][8] u32                                      16 + 256 = 272
//
// where qs[t][j] is bytes 4 t .. 4 t + 3 of row j's own block, as one little-endian word: its
// nibble at bits 8 b .. 8 b + 3 is element 4 t + b, and at 8 b + 4 .. 8 b + 7 element
// 4 t + b + 16 (GGUF's low and high nibbles of byte 4 t + b); q[t][j] is elements
// 4 t .. 4 t + 3 of row j, the int8 at bits 8 b .. 8 b + 7 element 4 t + b.
// Groups go by fours ("sets": 32 rows, the last set of a matrix may hold fewer groups) whose
// blocks alternate: a set's unit 0 of its groups 0, 1, 2, 3, then unit 1 of each, and so on.
// One row of x multiplies a set's four groups at once and so reads the set as one stream (a
// stream per group read from memory was slower than GGUF's rows; one stream is not). Set s
// is the bytes of rows 32 s .. 32 s + 31 of the (n, row_bytes) tensor: the same bytes,
// rearranged (``interleave``).
//
// A product then multiplies 8 rows' element e, as exact small integers (the nibbles, minus 8
// for Q4_0, or the int8 values) in one vector, into one sum per row of x with a broadcast
// x[r][e]: no sum across lanes, and one vector of W serves every row of x. A Q4 word gives its
// 8 nibbles without a shuffle: the one at position i (bits 4 i .. 4 i + 3) is masked in place
// and converted, q 2^4i, and x comes with each unit's values in position order, scaled by
// 2^-4i (``nibble_order``): x 2^-4i times q 2^4i is x q exactly (powers of two), so the
// product is the one of x and q. A Q8_0 word's int8 at byte b is shifted (b < 3) and masked to
// the word's top byte, q 2^24; the block's sum so comes 2^24 times the exact one, and its scale
// d 2^-24 (both exact). The block's scales come in once per block, as in the
// GGUF-row kernels (matvec.h's ``matvec``): s = x . q over its 32 values, then d s (and
// m sum(x) for Q4_1) added to the output. Each output (row r of x, row c of W) is so one fixed
// sequence of FMAs, block by block (within a block in the order the values are read), however
// many rows of x or groups of W a call takes at once: a row's result is the same bits alone
// and in a batch. Against float64, the products of SmolLM2's matrices are as close as when
// each value was de-quantised first (largest relative error 0.2-0.7e-6 against 0.5-1.1e-6).
// Serving steps, of one sequence and of eight, were faster in these words than with the rows'
// bytes interleaved one by one.
//
// Without AVX2 the same arithmetic runs on 8 floats with std::fma: the same bits, slowly (a
// build that prefers GGUF's layout only meets this one in tests).
#pragma once

#include "matvec.h"

#include <cmath>

namespace attnkit_fused::quant {

constexpr int64_t INTERLEAVED = 256;  // a kind's flag: its rows interleaved by GROUP
constexpr int64_t GROUP = 8;

constexpr bool interleavable(int64_t kind) { return kind == Q4_0 || kind == Q4_1 || kind == Q8_0; }

// The block format of a kind the products take: a GGUF type, or INTERLEAVED + Q4_0, Q4_1 or
// Q8_0 (rows interleaved by GROUP); nullptr for any other.
inline const Format* layout_format(int64_t kind) {
  if (kind < 0 || !(kind & INTERLEAVED)) return format(kind);
  return interleavable(kind & ~INTERLEAVED) ? format(kind & ~INTERLEAVED) : nullptr;
}

// Whether this build's decoding step is faster with interleaved rows (attnkit.models.llama_step
// asks once, through the binding ``interleaves``): with AVX-512 the row kernels' 16-value table
// (matvec_exact) is already near the FMA peak, and the portable path gains nothing.
constexpr bool prefers_interleaved() {
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
  return true;
#else
  return false;
#endif
}

// Whether the products of W of this kind (either layout) read the unit sums of x: interleaved
// Q4_1 always (its tiles add m sum(x) per block), GGUF's rows as matvec.h's row kernels do.
constexpr bool reads_unit_sums(int64_t kind) {
  return kind == (INTERLEAVED | Q4_1) || needs_unit_sums(kind);
}

// Bytes of a block's scales (d, and m for Q4_1): a group's block holds 8 of each first.
constexpr int64_t head_bytes(int64_t kind) { return kind == Q4_1 ? 4 : 2; }

constexpr int64_t SET = 4;  // groups a set holds (its last may hold fewer)

// Where group g of an interleaved W (``groups`` groups of rows row_bytes long, blocks of
// block_bytes) keeps its unit 0, and how far apart its units are.
struct GroupAt {
  int64_t offset, unit_stride;
};
inline GroupAt group_at(int64_t g, int64_t groups, int64_t row_bytes, int64_t block_bytes) {
  const int64_t set = g / SET, in_set = std::min(SET, groups - set * SET);
  return {set * SET * GROUP * row_bytes + (g % SET) * GROUP * block_bytes,
          in_set * GROUP * block_bytes};
}

// W's n rows (row_bytes each, GGUF blocks of ``kind``, n a multiple of GROUP) interleaved.
inline void interleave_rows(int64_t kind, const uint8_t* w, int64_t n, int64_t row_bytes,
                            uint8_t* out) {
  const Format& f = *format(kind);
  const int64_t units = row_bytes / f.bytes, head = head_bytes(kind), body = f.bytes - head;
  const int64_t groups = n / GROUP;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) {
      const GroupAt at = group_at(g, groups, row_bytes, f.bytes);
      for (int64_t u = 0; u < units; u++) {
        uint8_t* o = out + at.offset + u * at.unit_stride;
        for (int64_t j = 0; j < GROUP; j++) {
          const uint8_t* b = w + (g * GROUP + j) * row_bytes + u * f.bytes;
          std::memcpy(o + 2 * j, b, 2);                                      // d
          if (kind == Q4_1) std::memcpy(o + 2 * GROUP + 2 * j, b + 2, 2);  // m
          uint8_t* values = o + GROUP * head;  // word t (bytes 4 t .. 4 t + 3) of the 8 rows
          for (int64_t e = 0; e < body; e++) values[(e / 4 * GROUP + j) * 4 + e % 4] = b[head + e];
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// 8 lanes: one element of a group's 8 rows.

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
using Lanes = __m256;
inline Lanes lanes_zero() { return _mm256_setzero_ps(); }
inline Lanes lanes_set(float a) { return _mm256_set1_ps(a); }
inline Lanes lanes_fma(Lanes a, Lanes b, Lanes c) { return _mm256_fmadd_ps(a, b, c); }
inline Lanes lanes_mul(Lanes a, Lanes b) { return _mm256_mul_ps(a, b); }
inline Lanes lanes_add(Lanes a, Lanes b) { return _mm256_add_ps(a, b); }
inline void lanes_store(float* p, Lanes a) { _mm256_storeu_ps(p, a); }
inline Lanes lanes_load(const float* p) { return _mm256_loadu_ps(p); }
inline Lanes lanes_halves(const uint8_t* p) {  // 8 float16
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// 8 words: word t of a group's 8 rows.
using Words = __m256i;
inline Words words_load(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
// Each word's nibble at bits shift .. shift + 3, as a float.
inline Lanes words_nibble(Words v, int shift) {
  const __m256i q = _mm256_srli_epi32(v, shift);
  return _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(0x0F)));
}
// Each word's int8 at byte b, as a float.
inline Lanes words_byte(Words v, int b) {
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * b), 24));
}
// Each word's nibble at position I (bits 4 I .. 4 I + 3), minus 8 for Q4_0, times 2^4I (I = 7:
// times 1, so that the integer stays positive before the conversion): exact integers.
template <int I, bool MINUS_8>
inline Lanes words_placed(Words v) {
  __m256i q = I == 7 ? _mm256_srli_epi32(v, 28)
                     : _mm256_and_si256(v, _mm256_set1_epi32(0xF << 4 * I));
  if constexpr (MINUS_8) q = _mm256_sub_epi32(q, _mm256_set1_epi32(8 << 4 * (I % 7)));
  return _mm256_cvtepi32_ps(q);
}
// Each word's int8 at byte B in the top byte, times 2^24: an exact integer.
template <int B>
inline Lanes words_int8(Words v) {
  const __m256i top = _mm256_set1_epi32(static_cast<int>(0xFF000000u));
  if constexpr (B == 0) return _mm256_cvtepi32_ps(_mm256_slli_epi32(v, 24));
  if constexpr (B == 3) return _mm256_cvtepi32_ps(_mm256_and_si256(v, top));
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_slli_epi32(v, 24 - 8 * B), top));
}
#else
struct Lanes {
  float v[GROUP];
};
inline Lanes lanes_zero() { return Lanes{}; }
inline Lanes lanes_set(float a) {
  Lanes l;
  for (float& v : l.v) v = a;
  return l;
}
inline Lanes lanes_fma(Lanes a, Lanes b, Lanes c) {
  for (int j = 0; j < GROUP; j++) c.v[j] = std::fma(a.v[j], b.v[j], c.v[j]);
  return c;
}
inline Lanes lanes_mul(Lanes a, Lanes b) {
  for (int j = 0; j < GROUP; j++) a.v[j] *= b.v[j];
  return a;
}
inline Lanes lanes_add(Lanes a, Lanes b) {
  for (int j = 0; j < GROUP; j++) a.v[j] += b.v[j];
  return a;
}
inline void lanes_store(float* p, Lanes a) { std::memcpy(p, a.v, sizeof(a.v)); }
inline Lanes lanes_load(const float* p) {
  Lanes l;
  std::memcpy(l.v, p, sizeof(l.v));
  return l;
}
inline Lanes lanes_halves(const uint8_t* p) {
  Lanes l;
  for (int j = 0; j < GROUP; j++) l.v[j] = half(p + 2 * j);
  return l;
}
struct Words {
  uint32_t v[GROUP];
};
inline Words words_load(const uint8_t* p) {
  Words w;
  std::memcpy(w.v, p, sizeof(w.v));
  return w;
}
inline Lanes words_nibble(Words v, int shift) {
  Lanes l;
  for (int j = 0; j < GROUP; j++) l.v[j] = static_cast<float>((v.v[j] >> shift) & 0x0F);
  return l;
}
inline Lanes words_byte(Words v, int b) {
  Lanes l;
  for (int j = 0; j < GROUP; j++) l.v[j] = static_cast<int8_t>(v.v[j] >> 8 * b);
  return l;
}
template <int I, bool MINUS_8>
inline Lanes words_placed(Words v) {
  Lanes l;
  for (int j = 0; j < GROUP; j++) {
    int32_t q = static_cast<int32_t>(I == 7 ? v.v[j] >> 28 : v.v[j] & (0xFu << 4 * I));
    if constexpr (MINUS_8) q -= 8 << 4 * (I % 7);
    l.v[j] = static_cast<float>(q);
  }
  return l;
}
template <int B>
inline Lanes words_int8(Words v) {
  Lanes l;
  for (int j = 0; j < GROUP; j++) {
    l.v[j] = static_cast<float>(static_cast<int32_t>((v.v[j] << (24 - 8 * B)) & 0xFF000000u));
  }
  return l;
}
#endif

// f(std::integral_constant<int, i>{}) for i = 0 .. N - 1: a word's values in turn.
template <typename F, int... I>
inline void for_each_index(F& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
inline void for_index(F&& f) {
  for_each_index(f, std::make_integer_sequence<int, N>{});
}

// Value I of each word of a group's unit, as the products multiply it: Q4's nibble at position
// I (words_placed), Q8_0's int8 at byte I (words_int8).
template <int64_t KIND, int I>
inline Lanes word_value(Words v) {
  if constexpr (KIND == Q8_0) {
    return words_int8<I>(v);
  } else {
    return words_placed<I, KIND == Q4_0>(v);
  }
}

// x as the interleaved Q4 products read it: each unit's 32 values in the order of the nibble
// positions of its words (position i of word t: element 4 t + i / 2, plus 16 for odd i), each
// scaled by 2^-4i (i < 7) to meet the nibble masked in place (words_placed). The scaling is
// exact unless a value is below 2^-98 in magnitude (then it loses bits as a subnormal).
inline void nibble_order(const float* x, int64_t m, int64_t k, float* out) {
  static constexpr float scale[8] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f,
                                     0x1p-16f, 0x1p-20f, 0x1p-24f, 1.0f};
  for (int64_t at = 0; at < m * k; at += UNIT) {  // unit by unit (k is a multiple of UNIT)
    const float* xu = x + at;
    float* o = out + at;
    for (int t = 0; t < UNIT / 8; t++) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
      const __m128 low = _mm_loadu_ps(xu + 4 * t), high = _mm_loadu_ps(xu + 4 * t + UNIT / 2);
      const __m256 v = _mm256_set_m128(_mm_unpackhi_ps(low, high), _mm_unpacklo_ps(low, high));
      _mm256_storeu_ps(o + 8 * t, _mm256_mul_ps(v, _mm256_loadu_ps(scale)));
#else
      for (int b = 0; b < 4; b++) {
        o[8 * t + 2 * b] = xu[4 * t + b] * scale[2 * b];
        o[8 * t + 2 * b + 1] = xu[4 * t + b + UNIT / 2] * scale[2 * b + 1];
      }
#endif
    }
  }
}

// Whether the products of W of this kind read x in nibble_order: the interleaved Q4 kinds.
constexpr bool reads_nibble_order(int64_t kind) {
  return kind == (INTERLEAVED | Q4_0) || kind == (INTERLEAVED | Q4_1);
}

// Units ahead of its reading a tile asks for its bytes (group_tile): of 4, 8 and 16, the one
// that kept both 1 and 8 rows of x at or above GGUF's rows with W read from memory.
constexpr int64_t AHEAD = 8;

// A group's block: its scales as lanes (d, and the offset: m for Q4_1, -8 for Q4_0).
template <int64_t KIND>
struct GroupBlock {
  const uint8_t* values;
  Lanes d, offset;
  void load(const uint8_t* b) {  // the group's block
    d = lanes_halves(b);
    if constexpr (KIND == Q4_1) offset = lanes_halves(b + 2 * GROUP);
    if constexpr (KIND == Q4_0) offset = lanes_set(-8.0f);
    values = b + GROUP * head_bytes(KIND);
  }
  // Elements p and p + 16 (Q4), exactly gguf's values: q d is exact in float32, so Q4_1's one
  // FMA rounds as gguf's product-then-sum does.
  void pair(int p, Lanes& w0, Lanes& w1) const {
    const Words v = words_load(values + p / 4 * GROUP * 4);  // word p / 4, byte p % 4
    const Lanes low = words_nibble(v, 8 * (p % 4)), high = words_nibble(v, 8 * (p % 4) + 4);
    if constexpr (KIND == Q4_0) {  // (q - 8) d: a zero keeps d's sign, as gguf's
      w0 = lanes_mul(lanes_add(low, offset), d);
      w1 = lanes_mul(lanes_add(high, offset), d);
    } else {
      w0 = lanes_fma(low, d, offset);
      w1 = lanes_fma(high, d, offset);
    }
  }
  // Element e (Q8_0), q d exactly as gguf's.
  Lanes element(int e) const {
    const Words v = words_load(values + e / 4 * GROUP * 4);  // word e / 4, byte e % 4
    return lanes_mul(words_byte(v, e % 4), d);
  }
};

// acc[r][g] = x[r] . (G groups of a set from ``w``: unit u of group g at w + u unit_stride +
// g GROUP block_bytes), R rows of x ldx apart (xsum: their unit sums, ``lds`` apart; Q4_1's
// m sum(x) term). Per unit, as the GGUF-row kernels (matvec.h's ``matvec``) compute a block:
// s = x . q over the block's 32 values (q the exact small integers: nibbles, minus 8 for Q4_0,
// or int8), one FMA chain per lane over elements 0 .. 31 in order, then
// acc += d s (and, Q4_1, acc += m sum(x)): the same order however many rows of x or groups of W
// a call takes. The scales stay out of the inner loop: per 8 values and R rows, R FMAs and
// no de-quantising multiply.
template <int64_t KIND, int R, int G>
inline void group_tile(const float* x, int64_t ldx, const float* xsum, int64_t lds,
                       const uint8_t* w, int64_t unit_stride, int64_t units, float* acc) {
  constexpr int64_t bytes = GROUP * block_bytes<KIND>, head = GROUP * head_bytes(KIND);
  // acc (R x G lanes) stays in memory: the registers hold the units' sums s.
  for (int i = 0; i < R * G; i++) lanes_store(acc + i * GROUP, lanes_zero());
  for (int64_t u = 0; u < units; u++) {
    const uint8_t* unit = w + u * unit_stride;
    // The tile's bytes AHEAD units on, asked for now: with fewer than a set's 4 groups the
    // tile reads a slice of each unit's bytes, a pattern the CPU's prefetchers do not follow.
    for (int64_t line = 0; line < G * bytes; line += 64)
      __builtin_prefetch(unit + AHEAD * unit_stride + line, 0, 3);
    const float* xu = x + u * UNIT;
    Lanes s[R][G];
    for (int r = 0; r < R; r++)
      for (int g = 0; g < G; g++) s[r][g] = lanes_zero();
    // Word by word, its values in turn (8 nibbles of Q4, 4 int8 of Q8_0), each an exact integer
    // times a power of two (word_value); x in the same order: nibble_order's for Q4, its own for
    // Q8_0 (whose s comes 2^24 times the block's sum: its scale is 2^-24 times d below).
    constexpr int per_word = KIND == Q8_0 ? 4 : 8;
    for (int t = 0; t < UNIT / per_word; t++) {
      Words v[G];
      for (int g = 0; g < G; g++) v[g] = words_load(unit + g * bytes + head + t * 4 * GROUP);
      for_index<per_word>([&](auto index) {
        constexpr int i = decltype(index)::value;
        Lanes q[G];
        for (int g = 0; g < G; g++) q[g] = word_value<KIND, i>(v[g]);
        for (int r = 0; r < R; r++) {
          const Lanes xe = lanes_set(xu[r * ldx + per_word * t + i]);
          for (int g = 0; g < G; g++) s[r][g] = lanes_fma(xe, q[g], s[r][g]);
        }
      });
    }
    for (int g = 0; g < G; g++) {
      Lanes d = lanes_halves(unit + g * bytes);
      if constexpr (KIND == Q8_0) d = lanes_mul(d, lanes_set(0x1p-24f));  // exact
      for (int r = 0; r < R; r++) {
        float* a = acc + (r * G + g) * GROUP;
        Lanes t = lanes_fma(d, s[r][g], lanes_load(a));
        if constexpr (KIND == Q4_1) {
          const Lanes m = lanes_halves(unit + g * bytes + 2 * GROUP);
          t = lanes_fma(m, lanes_set(xsum[r * lds + u]), t);
        }
        lanes_store(a, t);
      }
    }
    // acc is memory here: without this the compiler keeps it in registers across the units
    // and spills the sums s instead, which slows the inner loop.
    __asm__ volatile("" : : "r"(acc) : "memory");
  }
}

// out[r, c] = x[r] . W[c] for the m rows of x (k values each, contiguous; xsum: their unit
// sums, read for Q4_1; placed: x in nibble_order, read for Q4_0 and Q4_1) and rows c in
// [c0, c1) of an interleaved W (n rows, n a multiple of GROUP), out rows ldo apart. The groups
// covering [c0, c1) are multiplied whole and only the rows in range written. x's rows go 4, 2
// and 1 at a time, against 2, 2 and 4 groups of a set (4 to 8 sums in registers: enough chains
// in flight for the FMAs' latency, few enough that none is spilled); W goes by blocks of about
// 128 KiB of whole sets, each used by every set of x's rows while it is in the L2 cache.
template <int64_t KIND>
void interleaved_range(const float* x, int64_t m, const float* xsum, const float* placed,
                       const uint8_t* w, int64_t n, int64_t row_bytes, int64_t k, int64_t c0,
                       int64_t c1, float* out, int64_t ldo) {
  if constexpr (KIND != Q8_0) x = placed;  // the Q4 words' nibble order (nibble_order)
  const int64_t units = k / UNIT, groups = n / GROUP;
  const int64_t g0 = c0 / GROUP, g1 = std::min(groups, (c1 + GROUP - 1) / GROUP);
  const int64_t block = SET * std::max<int64_t>(1, (128 * 1024) / (SET * GROUP * row_bytes));
  auto tile = [&](auto rows, auto width, int64_t r, int64_t g) {
    constexpr int R = decltype(rows)::value, G = decltype(width)::value;
    const GroupAt at = group_at(g, groups, row_bytes, block_bytes<KIND>);
    alignas(32) float acc[R * G * GROUP];
    const float* sums = KIND == Q4_1 ? xsum + r * units : nullptr;
    group_tile<KIND, R, G>(x + r * k, k, sums, units, w + at.offset, at.unit_stride, units, acc);
    for (int i = 0; i < R; i++) {
      for (int j = 0; j < G; j++) {
        const int64_t c = (g + j) * GROUP;
        const float* lanes = acc + (i * G + j) * GROUP;
        float* o = out + (r + i) * ldo;
        if (c >= c0 && c + GROUP <= c1) {  // the group's 8 rows, as one vector
          lanes_store(o + c, lanes_load(lanes));
        } else {
          for (int64_t l = std::max<int64_t>(c, c0); l < std::min<int64_t>(c + GROUP, c1); l++)
            o[l] = lanes[l - c];
        }
      }
    }
  };
  // Groups [b0, b1) against R rows of x from r: G groups at a time where a set has them.
  auto rows = [&](auto R, auto G, int64_t r, int64_t b0, int64_t b1) {
    constexpr int64_t width = decltype(G)::value;
    for (int64_t g = b0; g < b1;) {
      const int64_t in_set = std::min(SET, groups - g / SET * SET), j = g % SET;
      if (width == SET && j == 0 && in_set == SET && g + SET <= b1) {
        tile(R, G, r, g), g += SET;
      } else if (width >= 2 && j % 2 == 0 && j + 2 <= in_set && g + 2 <= b1) {
        tile(R, std::integral_constant<int, 2>{}, r, g), g += 2;
      } else {
        tile(R, std::integral_constant<int, 1>{}, r, g), g += 1;
      }
    }
  };
  for (int64_t b0 = g0; b0 < g1; b0 = (b0 / block + 1) * block) {
    const int64_t b1 = std::min(g1, (b0 / block + 1) * block);
    int64_t r = 0;
    for (; r + 4 <= m; r += 4)
      rows(std::integral_constant<int, 4>{}, std::integral_constant<int, 2>{}, r, b0, b1);
    for (; r + 2 <= m; r += 2)
      rows(std::integral_constant<int, 2>{}, std::integral_constant<int, 2>{}, r, b0, b1);
    for (; r < m; r++)
      rows(std::integral_constant<int, 1>{}, std::integral_constant<int, 4>{}, r, b0, b1);
  }
}

// Group g's 8 rows de-quantised into out (rows ldo apart, k values each): the values
// dequantize gives the rows in GGUF's layout, bit for bit.
template <int64_t KIND>
void dequantize_group(const uint8_t* w, int64_t n, int64_t row_bytes, int64_t g, int64_t k,
                      float* out, int64_t ldo) {
  const GroupAt at = group_at(g, n / GROUP, row_bytes, block_bytes<KIND>);
  float lanes[2][GROUP];
  for (int64_t u = 0; u < k / UNIT; u++) {
    GroupBlock<KIND> b;
    b.load(w + at.offset + u * at.unit_stride);
    auto put = [&](int64_t e, int s) {
      for (int64_t j = 0; j < GROUP; j++) out[j * ldo + u * UNIT + e] = lanes[s][j];
    };
    if constexpr (KIND == Q8_0) {
      for (int e = 0; e < UNIT; e++) {
        lanes_store(lanes[0], b.element(e));
        put(e, 0);
      }
    } else {
      for (int p = 0; p < UNIT / 2; p++) {
        Lanes w0, w1;
        b.pair(p, w0, w1);
        lanes_store(lanes[0], w0);
        lanes_store(lanes[1], w1);
        put(p, 0);
        put(p + UNIT / 2, 1);
      }
    }
  }
}

// Calls f(std::integral_constant<int64_t, KIND>{}) for the base kind of an interleaved kind.
template <typename F>
void with_interleaved_kind(int64_t kind, F&& f) {
  switch (kind & ~INTERLEAVED) {
    case Q4_0: return f(std::integral_constant<int64_t, Q4_0>{});
    case Q4_1: return f(std::integral_constant<int64_t, Q4_1>{});
    case Q8_0: return f(std::integral_constant<int64_t, Q8_0>{});
  }
}

// The tile path (more rows of x than STEP_ROWS) over an interleaved W: whole groups
// de-quantised into the tile (its rows begin at multiples of 16, and n is a multiple of 8).
template <int64_t KIND>
void interleaved_tiles(const float* x, int64_t m, const uint8_t* w, int64_t row_bytes, int64_t n,
                       int64_t k, float* out, int64_t ldo) {
  matmul_tiles_of(x, m, n, k, out, ldo, [&](int64_t c0, int64_t c1, float* tile) {
    for (int64_t c = c0; c < c1; c += GROUP)
      dequantize_group<KIND>(w, n, row_bytes, c / GROUP, k, tile + (c - c0) * k, k);
  });
}

// Products of either layout over rows [c0, c1): interleaved kinds here, GGUF's by matvec_range
// (placed: x in nibble_order where reads_nibble_order(kind)).
inline void rows_range(int64_t kind, const float* x, int64_t m, const float* xsum,
                       const float* placed, const uint8_t* w, int64_t n, int64_t row_bytes,
                       int64_t k, int64_t c0, int64_t c1, float* out, int64_t ldo) {
  if (kind & INTERLEAVED) {
    with_interleaved_kind(kind, [&](auto kc) {
      interleaved_range<decltype(kc)::value>(x, m, xsum, placed, w, n, row_bytes, k, c0, c1, out,
                                             ldo);
    });
  } else {
    matvec_range(kind, x, m, xsum, w, row_bytes, k, c0, c1, out, ldo);
  }
}

// The tile path of either layout.
inline void tiles(int64_t kind, const float* x, int64_t m, const uint8_t* w, int64_t row_bytes,
                  int64_t n, int64_t k, float* out, int64_t ldo) {
  if (kind & INTERLEAVED) {
    with_interleaved_kind(kind, [&](auto kc) {
      interleaved_tiles<decltype(kc)::value>(x, m, w, row_bytes, n, k, out, ldo);
    });
  } else {
    with_kind(kind, [&](auto kc) {
      matmul_tiles<decltype(kc)::value>(x, m, w, row_bytes, n, k, out, ldo);
    });
  }
}

}  // namespace attnkit_fused::quant
