// Matrix products with weights kept in GGUF's quantised block formats (see attnkit.quant).
//
// A weight W (n, k) stays as the n rows of GGUF blocks it was stored in (uint8, (n, row_bytes));
// the products de-quantise blocks on the fly, so a decoding step reads 5 to 6 times fewer bytes
// than with the float32 weight. The block layouts, as gguf/quants.py (the reference these
// functions are tested against) and ggml-quants.c read them:
//
//   kind  id  values  bytes  layout                                          value
//   F32    0    1       4    float32                                         w
//   F16    1    1       2    float16                                         w
//   Q4_0   2   32      18    f16 d, qs[16]                                   (q - 8) d
//   Q4_1   3   32      20    f16 d, f16 m, qs[16]                            q d + m
//   Q8_0   8   32      34    f16 d, int8 q[32]                               q d
//   Q6_K  14  256     210    ql[128], qh[64], int8 sc[16], f16 d             (d sc) (q - 32)
//   BF16  30    1       2    bfloat16 (the high half of a float32)           w
//
// Q4_0 / Q4_1: byte j of qs holds element j in its low nibble and element j + 16 in its high
// nibble. Q6_K: 6-bit q = low 4 bits from ql, high 2 bits from qh; each half h of the block
// (elements 128 h .. 128 h + 127) reads ql[64 h ..] and qh[32 h ..]; element 128 h + 32 s + l
// (s = 0..3, l = 0..31) takes nibble s / 2 of ql[64 h + 32 (s % 2) + l] and bits 2 s, 2 s + 1
// of qh[32 h + l]; sc[e / 16] scales element e.
//
// Shape vocabulary: m rows of x (tokens), n rows of W (output features), k values per row
// (input features). The products read 32 values at a time (a "unit": one Q4/Q8 block, an
// eighth of a Q6_K block, 32 plain values), de-quantised in registers by one small function per
// kind and instruction set, each next to its scalar twin:
//
//   dequantize(w, kind, k)       (n, k) float32, equal to gguf.quants.dequantize
//   qmatmul(x, w, kind, out)     out = x @ dequantize(w)^T, float32 accumulation:
//     m <= MATVEC_ROWS (decoding): each thread takes a range of W's rows and accumulates
//       x . w with FMAs unit by unit, W read once at memory speed;
//     larger m (prefill): each thread de-quantises a tile of W's rows into its own float32
//       buffer and multiplies it with torch's float32 matmul (MKL where torch has it).
//   embedding(ids, w, kind, k)   the selected rows de-quantised (a token embedding lookup)
//
// Vector paths: AVX-512 where CPU_CAPABILITY_AVX512 is defined, AVX2 + FMA + F16C where
// CPU_CAPABILITY_AVX2 is (jit.py sets them by the CPU class torch dispatches to), the scalar
// twins otherwise.
#include <torch/extension.h>

#include "fused.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <array>
#include <cstring>
#include <sstream>

// dequantize() must equal gguf's numpy bit for bit: Q4_1's q d + m is a product rounded to
// float32 and then a sum, never one fused multiply-add (the matrix products use FMAs by
// explicit intrinsics, which this does not affect).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace attnkit_fused {

namespace {

constexpr int64_t UNIT = 32;        // values de-quantised at a time
constexpr int64_t MATVEC_ROWS = 8;  // x rows up to which qmatmul takes the matrix-vector path

enum Kind : int64_t { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q6_K = 14, BF16 = 30 };

struct Format {
  const char* name;
  int64_t values;  // per block
  int64_t bytes;   // per block
};

// The block formats by ggml type id (gguf.GGMLQuantizationType), or nullptr.
const Format* format(int64_t kind) {
  static const Format f32{"F32", 1, 4}, f16{"F16", 1, 2}, q4_0{"Q4_0", 32, 18},
      q4_1{"Q4_1", 32, 20}, q8_0{"Q8_0", 32, 34}, q6_k{"Q6_K", 256, 210}, bf16{"BF16", 1, 2};
  switch (kind) {
    case F32: return &f32;
    case F16: return &f16;
    case Q4_0: return &q4_0;
    case Q4_1: return &q4_1;
    case Q8_0: return &q8_0;
    case Q6_K: return &q6_k;
    case BF16: return &bf16;
    default: return nullptr;
  }
}

inline float half(const uint8_t* p) {  // a little-endian float16 (GGUF's scales)
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline float bfloat(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()));
}

// ---------------------------------------------------------------------------------------------
// Scalar twins: unit u of a row (32 values) into out[32]. These are the reference the vector
// versions below follow line for line, and the portable path.

void unit_q4_0_scalar(const uint8_t* row, int64_t u, float* out) {
  const uint8_t* b = row + u * 18;  // f16 d, qs[16]
  const float d = half(b);
  for (int l = 0; l < 16; l++) {
    out[l] = d * static_cast<float>((b[2 + l] & 0x0F) - 8);
    out[l + 16] = d * static_cast<float>((b[2 + l] >> 4) - 8);
  }
}

void unit_q4_1_scalar(const uint8_t* row, int64_t u, float* out) {
  const uint8_t* b = row + u * 20;  // f16 d, f16 m, qs[16]
  const float d = half(b), m = half(b + 2);
  for (int l = 0; l < 16; l++) {
    out[l] = d * static_cast<float>(b[4 + l] & 0x0F) + m;
    out[l + 16] = d * static_cast<float>(b[4 + l] >> 4) + m;
  }
}

void unit_q8_0_scalar(const uint8_t* row, int64_t u, float* out) {
  const uint8_t* b = row + u * 34;  // f16 d, int8 q[32]
  const float d = half(b);
  for (int l = 0; l < 32; l++) out[l] = static_cast<float>(static_cast<int8_t>(b[2 + l])) * d;
}

void unit_q6_k_scalar(const uint8_t* row, int64_t u, float* out) {
  const uint8_t* b = row + (u / 8) * 210;  // ql[128], qh[64], int8 sc[16], f16 d
  const int64_t h = (u % 8) / 4, s = u % 4;  // elements 128 h + 32 s + (0..31)
  const uint8_t* ql = b + 64 * h + 32 * (s % 2);
  const uint8_t* qh = b + 128 + 32 * h;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * h + 2 * s;
  const float d = half(b + 208);
  const float dl[2] = {d * static_cast<float>(sc[0]), d * static_cast<float>(sc[1])};
  for (int l = 0; l < 32; l++) {
    const int q = ((ql[l] >> (4 * (s / 2))) & 0x0F) | (((qh[l] >> (2 * s)) & 3) << 4);
    out[l] = dl[l / 16] * static_cast<float>(q - 32);
  }
}

void unit_f32_scalar(const uint8_t* row, int64_t u, float* out) {
  std::memcpy(out, row + u * UNIT * 4, UNIT * 4);
}

void unit_f16_scalar(const uint8_t* row, int64_t u, float* out) {
  for (int l = 0; l < 32; l++) out[l] = half(row + (u * UNIT + l) * 2);
}

void unit_bf16_scalar(const uint8_t* row, int64_t u, float* out) {
  for (int l = 0; l < 32; l++) out[l] = bfloat(row + (u * UNIT + l) * 2);
}

// One value of a plain row (F32, F16, BF16: the values past the last whole unit).
inline float plain_value(const uint8_t* row, int64_t kind, int64_t e) {
  if (kind == F32) {
    float v;
    std::memcpy(&v, row + 4 * e, 4);
    return v;
  }
  return kind == F16 ? half(row + 2 * e) : bfloat(row + 2 * e);
}

// ---------------------------------------------------------------------------------------------
// The vector types: a Unit is 32 de-quantised values in registers (2 AVX-512 vectors, 4 AVX2
// vectors, or 32 floats on the portable path).

#if defined(CPU_CAPABILITY_AVX512)

constexpr int VL = 16;
using V = __m512;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset(float a) { return _mm512_set1_ps(a); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(V a) { return _mm512_reduce_add_ps(a); }

#elif defined(CPU_CAPABILITY_AVX2)

constexpr int VL = 8;
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset(float a) { return _mm256_set1_ps(a); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V a) { _mm256_storeu_ps(p, a); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(V a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#else

constexpr int VL = 1;
using V = float;
inline V vzero() { return 0.0f; }
inline V vset(float a) { return a; }
inline V vload(const float* p) { return *p; }
inline void vstore(float* p, V a) { *p = a; }
inline V vfma(V a, V b, V c) { return a * b + c; }
inline float vsum(V a) { return a; }

#endif

constexpr int NV = UNIT / VL;  // vectors per unit
struct Unit {
  V v[NV];
};

// The vector twins. Each returns unit u of a row as in its scalar twin above.

#if defined(CPU_CAPABILITY_AVX512)

// 16 bytes (int8) to 16 floats.
inline V i8_to_float(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }

// The 16 bytes of Q4 nibbles widened to one int32 lane per byte: lane j holds elements j (low
// nibble) and j + 16 (high nibble).
inline __m512i nibbles(const uint8_t* qs) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
}
inline V low_nibbles(__m512i q) { return _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0x0F))); }
inline V high_nibbles(__m512i q) { return _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)); }

inline Unit unit_q4_0(const uint8_t* row, int64_t u) {
  const uint8_t* b = row + u * 18;
  const V d = vset(half(b)), eight = vset(8.0f);
  const __m512i q = nibbles(b + 2);
  return {{_mm512_mul_ps(d, _mm512_sub_ps(low_nibbles(q), eight)),      // (q - 8) is exact
           _mm512_mul_ps(d, _mm512_sub_ps(high_nibbles(q), eight))}};
}

// fused: q d + m as one FMA (the products); else rounded twice, as gguf (dequantize).
template <bool fused>
inline Unit unit_q4_1(const uint8_t* row, int64_t u) {
  const uint8_t* b = row + u * 20;
  const V d = vset(half(b)), m = vset(half(b + 2));
  const __m512i q = nibbles(b + 4);
  const V low = low_nibbles(q), high = high_nibbles(q);
  if constexpr (fused) return {{_mm512_fmadd_ps(d, low, m), _mm512_fmadd_ps(d, high, m)}};
  return {{_mm512_add_ps(_mm512_mul_ps(d, low), m), _mm512_add_ps(_mm512_mul_ps(d, high), m)}};
}

inline Unit unit_q8_0(const uint8_t* row, int64_t u) {
  const uint8_t* b = row + u * 34;
  const V d = vset(half(b));
  const __m128i* q = reinterpret_cast<const __m128i*>(b + 2);
  return {{_mm512_mul_ps(i8_to_float(_mm_loadu_si128(q)), d),
           _mm512_mul_ps(i8_to_float(_mm_loadu_si128(q + 1)), d)}};
}

inline Unit unit_q6_k(const uint8_t* row, int64_t u) {
  const uint8_t* b = row + (u / 8) * 210;
  const int64_t h = (u % 8) / 4, s = u % 4;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * h + 2 * s;
  const float d = half(b + 208);
  const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (s % 2)));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
  const __m256i low = _mm256_and_si256(
      _mm256_srl_epi16(ql, _mm_cvtsi32_si128(static_cast<int>(4 * (s / 2)))), _mm256_set1_epi8(0x0F));
  const __m256i top = _mm256_and_si256(
      _mm256_srl_epi16(qh, _mm_cvtsi32_si128(static_cast<int>(2 * s))), _mm256_set1_epi8(3));
  const __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(top, 4)),
                                    _mm256_set1_epi8(32));  // -32..31
  return {{_mm512_mul_ps(vset(d * static_cast<float>(sc[0])), i8_to_float(_mm256_castsi256_si128(q))),
           _mm512_mul_ps(vset(d * static_cast<float>(sc[1])), i8_to_float(_mm256_extracti128_si256(q, 1)))}};
}

inline Unit unit_f32(const uint8_t* row, int64_t u) {
  const float* p = reinterpret_cast<const float*>(row) + u * UNIT;
  return {{vload(p), vload(p + 16)}};
}

inline Unit unit_f16(const uint8_t* row, int64_t u) {
  const __m256i* p = reinterpret_cast<const __m256i*>(row + u * UNIT * 2);
  return {{_mm512_cvtph_ps(_mm256_loadu_si256(p)), _mm512_cvtph_ps(_mm256_loadu_si256(p + 1))}};
}

inline Unit unit_bf16(const uint8_t* row, int64_t u) {  // bfloat16 bits << 16 = float32 bits
  const __m256i* p = reinterpret_cast<const __m256i*>(row + u * UNIT * 2);
  auto widen = [](__m256i x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
  };
  return {{widen(_mm256_loadu_si256(p)), widen(_mm256_loadu_si256(p + 1))}};
}

#elif defined(CPU_CAPABILITY_AVX2)

// 8 bytes (int8, the low half of q) to 8 floats.
inline V i8_to_float(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)); }
inline __m128i upper8(__m128i q) { return _mm_unpackhi_epi64(q, q); }

// Bytes qs[8 h .. 8 h + 7] of Q4 nibbles widened to one int32 lane per byte: lane j holds
// elements 8 h + j (low nibble) and 8 h + j + 16 (high nibble).
inline __m256i nibbles(const uint8_t* qs, int h) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * h)));
}
inline V low_nibbles(__m256i q) { return _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(0x0F))); }
inline V high_nibbles(__m256i q) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)); }

inline Unit unit_q4_0(const uint8_t* row, int64_t u) {
  const uint8_t* b = row + u * 18;
  const V d = vset(half(b)), eight = vset(8.0f);
  const __m256i q0 = nibbles(b + 2, 0), q1 = nibbles(b + 2, 1);
  auto value = [&](V q) { return _mm256_mul_ps(d, _mm256_sub_ps(q, eight)); };  // q - 8: exact
  return {{value(low_nibbles(q0)), value(low_nibbles(q1)), value(high_nibbles(q0)),
           value(high_nibbles(q1))}};
}

// fused: q d + m as one FMA (the products); else rounded twice, as gguf (dequantize).
template <bool fused>
inline Unit unit_q4_1(const uint8_t* row, int64_t u) {
  const uint8_t* b = row + u * 20;
  const V d = vset(half(b)), m = vset(half(b + 2));
  const __m256i q0 = nibbles(b + 4, 0), q1 = nibbles(b + 4, 1);
  auto value = [&](V q) {
    if constexpr (fused) return _mm256_fmadd_ps(d, q, m);
    return _mm256_add_ps(_mm256_mul_ps(d, q), m);
  };
  return {{value(low_nibbles(q0)), value(low_nibbles(q1)), value(high_nibbles(q0)),
           value(high_nibbles(q1))}};
}

inline Unit unit_q8_0(const uint8_t* row, int64_t u) {
  const uint8_t* b = row + u * 34;
  const V d = vset(half(b));
  const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
  const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
  return {{_mm256_mul_ps(i8_to_float(q0), d), _mm256_mul_ps(i8_to_float(upper8(q0)), d),
           _mm256_mul_ps(i8_to_float(q1), d), _mm256_mul_ps(i8_to_float(upper8(q1)), d)}};
}

inline Unit unit_q6_k(const uint8_t* row, int64_t u) {
  const uint8_t* b = row + (u / 8) * 210;
  const int64_t h = (u % 8) / 4, s = u % 4;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * h + 2 * s;
  const float d = half(b + 208);
  const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (s % 2)));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
  const __m256i low = _mm256_and_si256(
      _mm256_srl_epi16(ql, _mm_cvtsi32_si128(static_cast<int>(4 * (s / 2)))), _mm256_set1_epi8(0x0F));
  const __m256i top = _mm256_and_si256(
      _mm256_srl_epi16(qh, _mm_cvtsi32_si128(static_cast<int>(2 * s))), _mm256_set1_epi8(3));
  const __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(top, 4)),
                                    _mm256_set1_epi8(32));  // -32..31
  const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
  const V d0 = vset(d * static_cast<float>(sc[0])), d1 = vset(d * static_cast<float>(sc[1]));
  return {{_mm256_mul_ps(d0, i8_to_float(q0)), _mm256_mul_ps(d0, i8_to_float(upper8(q0))),
           _mm256_mul_ps(d1, i8_to_float(q1)), _mm256_mul_ps(d1, i8_to_float(upper8(q1)))}};
}

inline Unit unit_f32(const uint8_t* row, int64_t u) {
  const float* p = reinterpret_cast<const float*>(row) + u * UNIT;
  return {{vload(p), vload(p + 8), vload(p + 16), vload(p + 24)}};
}

inline Unit unit_f16(const uint8_t* row, int64_t u) {
  const __m128i* p = reinterpret_cast<const __m128i*>(row + u * UNIT * 2);
  return {{_mm256_cvtph_ps(_mm_loadu_si128(p)), _mm256_cvtph_ps(_mm_loadu_si128(p + 1)),
           _mm256_cvtph_ps(_mm_loadu_si128(p + 2)), _mm256_cvtph_ps(_mm_loadu_si128(p + 3))}};
}

inline Unit unit_bf16(const uint8_t* row, int64_t u) {  // bfloat16 bits << 16 = float32 bits
  const __m128i* p = reinterpret_cast<const __m128i*>(row + u * UNIT * 2);
  auto widen = [](__m128i x) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
  };
  return {{widen(_mm_loadu_si128(p)), widen(_mm_loadu_si128(p + 1)),
           widen(_mm_loadu_si128(p + 2)), widen(_mm_loadu_si128(p + 3))}};
}

#else  // the portable path: the scalar twins themselves

#define SCALAR_UNIT(name)                                 \
  inline Unit unit_##name(const uint8_t* row, int64_t u) { \
    Unit out;                                             \
    unit_##name##_scalar(row, u, out.v);                  \
    return out;                                           \
  }
SCALAR_UNIT(q4_0)
template <bool fused>
SCALAR_UNIT(q4_1)
SCALAR_UNIT(q8_0)
SCALAR_UNIT(q6_k)
SCALAR_UNIT(f32)
SCALAR_UNIT(f16)
SCALAR_UNIT(bf16)
#undef SCALAR_UNIT

#endif

// Unit u of a row of kind KIND. fused: the matrix products may round q d + m once (an FMA);
// dequantize rounds the product and the sum apart, as gguf does.
template <int64_t KIND, bool fused = false>
inline Unit unit(const uint8_t* row, int64_t u) {
  if constexpr (KIND == Q4_0) return unit_q4_0(row, u);
  if constexpr (KIND == Q4_1) return unit_q4_1<fused>(row, u);
  if constexpr (KIND == Q8_0) return unit_q8_0(row, u);
  if constexpr (KIND == Q6_K) return unit_q6_k(row, u);
  if constexpr (KIND == F32) return unit_f32(row, u);
  if constexpr (KIND == F16) return unit_f16(row, u);
  if constexpr (KIND == BF16) return unit_bf16(row, u);
}

// Calls f.template operator()<KIND>() for a runtime kind (checked before).
template <typename F>
void with_kind(int64_t kind, F&& f) {
  switch (kind) {
    case F32: return f(std::integral_constant<int64_t, F32>{});
    case F16: return f(std::integral_constant<int64_t, F16>{});
    case Q4_0: return f(std::integral_constant<int64_t, Q4_0>{});
    case Q4_1: return f(std::integral_constant<int64_t, Q4_1>{});
    case Q8_0: return f(std::integral_constant<int64_t, Q8_0>{});
    case Q6_K: return f(std::integral_constant<int64_t, Q6_K>{});
    case BF16: return f(std::integral_constant<int64_t, BF16>{});
  }
}

// One row of W de-quantised into out[k].
template <int64_t KIND>
void dequantize_row(const uint8_t* row, int64_t k, float* out) {
  const int64_t units = k / UNIT;
  for (int64_t u = 0; u < units; u++) {
    const Unit w = unit<KIND>(row, u);
    for (int v = 0; v < NV; v++) vstore(out + u * UNIT + v * VL, w.v[v]);
  }
  for (int64_t e = units * UNIT; e < k; e++) out[e] = plain_value(row, KIND, e);  // plain kinds
}

// out[r, c] = x[r] . W[c] for rows c in [c0, c1) of W and R rows of x (r = 0..R-1, x rows ldx
// apart, out rows ldo apart): each unit of W is de-quantised once and multiplied into R
// accumulators.
template <int64_t KIND, int R>
void matvec(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int64_t k,
            int64_t c0, int64_t c1, float* out, int64_t ldo) {
  const int64_t units = k / UNIT;
  for (int64_t c = c0; c < c1; c++) {
    const uint8_t* row = w + c * row_bytes;
    V acc[R][NV];
    for (int r = 0; r < R; r++)
      for (int v = 0; v < NV; v++) acc[r][v] = vzero();
    for (int64_t u = 0; u < units; u++) {
      const Unit wu = unit<KIND, true>(row, u);
      for (int r = 0; r < R; r++) {
        const float* xu = x + r * ldx + u * UNIT;
        for (int v = 0; v < NV; v++) acc[r][v] = vfma(vload(xu + v * VL), wu.v[v], acc[r][v]);
      }
    }
    for (int r = 0; r < R; r++) {
      V total = acc[r][0];
      for (int v = 1; v < NV; v++) total = total + acc[r][v];
      float sum = vsum(total);
      for (int64_t e = units * UNIT; e < k; e++) sum += x[r * ldx + e] * plain_value(row, KIND, e);
      out[r * ldo + c] = sum;
    }
  }
}

// The matrix-vector path: rows of W split over torch's intra-op threads, x's rows taken 4, 2
// and 1 at a time.
template <int64_t KIND>
void qmatmul_rows(const float* x, int64_t m, const uint8_t* w, int64_t row_bytes, int64_t n,
                  int64_t k, float* out) {
  const int64_t grain = std::max<int64_t>(1, 16384 / k);  // rows: about 16k values of work
  at::parallel_for(0, n, grain, [&](int64_t c0, int64_t c1) {
    note_thread();
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) matvec<KIND, 4>(x + r * k, k, w, row_bytes, k, c0, c1, out + r * n, n);
    for (; r + 2 <= m; r += 2) matvec<KIND, 2>(x + r * k, k, w, row_bytes, k, c0, c1, out + r * n, n);
    for (; r < m; r++) matvec<KIND, 1>(x + r * k, k, w, row_bytes, k, c0, c1, out + r * n, n);
  });
}

// The matrix-matrix path: tiles of W's rows (and of x's rows when W alone gives too few tiles
// for the threads), each de-quantised into a thread's float32 buffer and multiplied by gemm:
// out[:, tile] = x @ tile^T.
template <int64_t KIND>
void qmatmul_tiles(const float* x, int64_t m, const uint8_t* w, int64_t row_bytes, int64_t n,
                   int64_t k, float* out) {
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
        for (int64_t c = c0; c < c1; c++)
          dequantize_row<KIND>(w + c * row_bytes, k, tile.data() + (c - c0) * k);
        held = nt;
      }
      // out[r0:r1, c0:c1] = x[r0:r1] @ tile^T: torch's float32 matmul (MKL where torch has it;
      // single-threaded inside this parallel region), written in place through strides.
      const Tensor x_rows = at::from_blob(const_cast<float*>(x) + r0 * k, {r1 - r0, k}, at::kFloat);
      const Tensor tile_t = at::from_blob(tile.data(), {k, c1 - c0}, {1, k}, at::kFloat);
      Tensor out_tile = at::from_blob(out + r0 * n + c0, {r1 - r0, c1 - c0}, {n, 1}, at::kFloat);
      at::mm_out(out_tile, x_rows, tile_t);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Checks: every error names the argument, its shape and what was expected, before any work.

std::string shape(const Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

const Format& checked_format(const char* fn, int64_t kind) {
  const Format* f = format(kind);
  TORCH_CHECK(f != nullptr, fn, ": kind = ", kind,
              " is not a supported GGUF type (expected one of F32 = 0, F16 = 1, Q4_0 = 2, "
              "Q4_1 = 3, Q8_0 = 8, Q6_K = 14, BF16 = 30)");
  return *f;
}

void check_w(const char* fn, const Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2, fn,
              ": w must be a uint8 (n, row_bytes) tensor of GGUF blocks, got ", w.scalar_type(),
              " of shape ", shape(w));
  TORCH_CHECK(w.is_contiguous(), fn, ": w of shape ", shape(w), " must be contiguous");
  TORCH_CHECK(w.device().is_cpu(), fn, ": w must be on the CPU, got ", w.device());
}

// The row length in bytes that k values of format f take (k checked against the block).
int64_t checked_row_bytes(const char* fn, const Format& f, int64_t k, const Tensor& w) {
  TORCH_CHECK(k > 0 && k % f.values == 0, fn, ": k = ", k, " must be a positive multiple of ",
              f.name, "'s block of ", f.values, " values");
  const int64_t need = k / f.values * f.bytes;
  TORCH_CHECK(w.size(1) == need, fn, ": w of shape ", shape(w), " has rows of ", w.size(1),
              " bytes; ", f.name, " with k = ", k, " needs ", need, " (", k / f.values,
              " blocks of ", f.bytes, " bytes)");
  return need;
}

void check_float(const char* fn, const char* arg, const Tensor& t, int64_t rows, int64_t cols,
                 const char* expected) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2, fn, ": ", arg,
              " must be a float32 ", expected, " tensor, got ", t.scalar_type(), " of shape ",
              shape(t));
  TORCH_CHECK(t.device().is_cpu(), fn, ": ", arg, " must be on the CPU, got ", t.device());
  TORCH_CHECK((rows < 0 || t.size(0) == rows) && t.size(1) == cols, fn, ": ", arg,
              " of shape ", shape(t), " does not match: expected ", expected, " with ",
              rows < 0 ? "" : "rows = " + std::to_string(rows) + ", ", "columns = ", cols);
  TORCH_CHECK(t.is_contiguous(), fn, ": ", arg, " of shape ", shape(t), " must be contiguous");
}

// ---------------------------------------------------------------------------------------------
// The entry points.

Tensor dequantize(const Tensor& w, int64_t kind, int64_t k) {
  const Format& f = checked_format("dequantize", kind);
  check_w("dequantize", w);
  const int64_t row_bytes = checked_row_bytes("dequantize", f, k, w);
  const int64_t n = w.size(0);
  Tensor out = at::empty({n, k}, at::kFloat);  // (n, k)
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  with_kind(kind, [&](auto kc) {
    constexpr int64_t KIND = decltype(kc)::value;
    at::parallel_for(0, n, std::max<int64_t>(1, 16384 / k), [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; c++) dequantize_row<KIND>(wp + c * row_bytes, k, op + c * k);
    });
  });
  return out;
}

void qmatmul(const Tensor& x, const Tensor& w, int64_t kind, const Tensor& out) {
  const Format& f = checked_format("qmatmul", kind);
  check_w("qmatmul", w);
  TORCH_CHECK(w.size(1) % f.bytes == 0, "qmatmul: w of shape ", shape(w), " has rows of ",
              w.size(1), " bytes, not a whole number of ", f.name, " blocks of ", f.bytes,
              " bytes");
  const int64_t k = w.size(1) / f.bytes * f.values, n = w.size(0);
  check_float("qmatmul", "x", x, -1, k, "(m, k)");
  const int64_t m = x.size(0);
  check_float("qmatmul", "out", out, m, n, "(m, n)");
  begin_parallel();
  if (m == 0 || n == 0) return;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  with_kind(kind, [&](auto kc) {
    constexpr int64_t KIND = decltype(kc)::value;
    if (m <= MATVEC_ROWS) {
      qmatmul_rows<KIND>(xp, m, wp, w.size(1), n, k, op);
    } else {
      qmatmul_tiles<KIND>(xp, m, wp, w.size(1), n, k, op);
    }
  });
}

Tensor embedding(const Tensor& ids, const Tensor& w, int64_t kind, int64_t k) {
  const Format& f = checked_format("embedding", kind);
  check_w("embedding", w);
  const int64_t row_bytes = checked_row_bytes("embedding", f, k, w);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "embedding: ids must be a 1-D ",
              "int64 tensor, got ", ids.scalar_type(), " of shape ", shape(ids));
  const Tensor idx = ids.contiguous();
  const int64_t t = idx.size(0), n = w.size(0);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; i++) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "embedding: ids[", i, "] = ", ip[i],
                " is out of range for w with ", n, " rows");
  }
  Tensor out = at::empty({t, k}, at::kFloat);  // (t, k)
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  with_kind(kind, [&](auto kc) {
    constexpr int64_t KIND = decltype(kc)::value;
    for (int64_t i = 0; i < t; i++) dequantize_row<KIND>(wp + ip[i] * row_bytes, k, op + i * k);
  });
  return out;
}

}  // namespace

void bind_quant(pybind11::module_& m) {
  m.def("dequantize", &dequantize, pybind11::arg("w"), pybind11::arg("kind"), pybind11::arg("k"),
        "rows of GGUF blocks (uint8 (n, row_bytes)) to float32 (n, k), as gguf.quants.dequantize");
  m.def("qmatmul", &qmatmul, pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("kind"),
        pybind11::arg("out"),
        "out (m, n) = x (m, k) @ dequantize(w)^T, float32 accumulation, W kept in its blocks");
  m.def("embedding", &embedding, pybind11::arg("ids"), pybind11::arg("w"), pybind11::arg("kind"),
        pybind11::arg("k"), "rows ids of dequantize(w): float32 (len(ids), k)");
}

}  // namespace attnkit_fused
