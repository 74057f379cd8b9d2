// The GGUF block formats that quant.cpp's products and the fused decoding step (step.cpp) read,
// and the per-instruction-set "widening" of stored bits to 32 floats: each block de-quantised
// exactly as gguf does (matvec.h multiplies them). quant.cpp's header comment describes the
// block layouts and the two product paths; this file only holds the pieces.
#pragma once

#include "fused.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstring>
#include <sstream>

// dequantize() must equal gguf's numpy bit for bit: Q4_1's q d + m is a product rounded to
// float32 and then a sum, never one fused multiply-add (the compiler may not contract them;
// the products' FMAs are explicit intrinsics, which this does not affect).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace attnkit_fused::quant {

constexpr int64_t UNIT = 32;        // values de-quantised at a time

enum Kind : int64_t { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q6_K = 14, BF16 = 30 };

struct Format {
  const char* name;
  int64_t values;  // per block
  int64_t bytes;   // per block
};

// The block formats by ggml type id (gguf.GGMLQuantizationType), or nullptr.
inline const Format* format(int64_t kind) {
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
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction; c10::Half's portable conversion takes dozens
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

inline float bfloat(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()));
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
// The instruction sets. A Unit is 32 values in registers: 2 AVX-512 vectors, 4 AVX2 vectors or
// 32 floats. What differs between the sets is how stored bits become 32 floats: the "widening"
// functions below, the scalar twins first (the portable path, and the reference each vector
// version follows); the arithmetic on the floats is written once, after them.
//
//   nibbles(qs, offset)   Q4: 16 bytes -> elements 0..15 (low nibbles), 16..31 (high), minus offset
//   int8s(q)              Q8_0: 32 int8
//   q6_bits(ql, qh, s)    Q6_K: a unit's 6-bit q - 32 (ql nibble s / 2, qh bits 2 s, 2 s + 1)
//   halves, bfloats, floats: 32 plain values

// The scalar twins (the portable path, and the reference the vector versions follow).
namespace scalar {

inline void nibbles(const uint8_t* qs, int offset, float* out) {
  for (int l = 0; l < 16; l++) {
    out[l] = static_cast<float>((qs[l] & 0x0F) - offset);
    out[l + 16] = static_cast<float>((qs[l] >> 4) - offset);
  }
}

inline void int8s(const uint8_t* q, float* out) {
  for (int l = 0; l < 32; l++) out[l] = static_cast<float>(static_cast<int8_t>(q[l]));
}

inline void q6_bits(const uint8_t* ql, const uint8_t* qh, int s, float* out) {
  for (int l = 0; l < 32; l++) {
    const int q = ((ql[l] >> (4 * (s / 2))) & 0x0F) | (((qh[l] >> (2 * s)) & 3) << 4);
    out[l] = static_cast<float>(q - 32);
  }
}

inline void halves(const uint8_t* p, float* out) {
  for (int l = 0; l < 32; l++) out[l] = half(p + 2 * l);
}

inline void bfloats(const uint8_t* p, float* out) {
  for (int l = 0; l < 32; l++) out[l] = bfloat(p + 2 * l);
}

inline void floats(const uint8_t* p, float* out) { std::memcpy(out, p, 32 * 4); }

}  // namespace scalar

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// Q6_K: 32 six-bit values of sub-block ``s`` as signed bytes (-32..31), low nibbles from ``ql``
// and the top two bits from ``qh`` (both paths widen them from here).
inline __m256i q6_bytes(const uint8_t* ql, const uint8_t* qh, int s) {
  const __m256i low = _mm256_and_si256(
      _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql)),
                       _mm_cvtsi32_si128(4 * (s / 2))),
      _mm256_set1_epi8(0x0F));
  const __m256i top = _mm256_and_si256(
      _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh)),
                       _mm_cvtsi32_si128(2 * s)),
      _mm256_set1_epi8(3));
  return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(top, 4)), _mm256_set1_epi8(32));
}
#endif

#if defined(CPU_CAPABILITY_AVX512)

constexpr int VL = 16;
using V = __m512;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset(float a) { return _mm512_set1_ps(a); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(V a) { return _mm512_reduce_add_ps(a); }
struct Unit {
  V v[2];
};

inline V int32s(__m512i q) { return _mm512_cvtepi32_ps(q); }

inline Unit nibbles(const uint8_t* qs, int offset) {  // lane j: byte j, elements j and j + 16
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  const __m512i o = _mm512_set1_epi32(offset);
  return {{int32s(_mm512_sub_epi32(_mm512_and_si512(q, _mm512_set1_epi32(0x0F)), o)),
           int32s(_mm512_sub_epi32(_mm512_srli_epi32(q, 4), o))}};
}

inline Unit int8s(const uint8_t* q) {
  const __m128i* p = reinterpret_cast<const __m128i*>(q);
  return {{int32s(_mm512_cvtepi8_epi32(_mm_loadu_si128(p))),
           int32s(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)))}};
}

inline Unit q6_bits(const uint8_t* ql, const uint8_t* qh, int s) {
  const __m256i q = q6_bytes(ql, qh, s);
  return {{int32s(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))),
           int32s(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)))}};
}

inline Unit halves(const uint8_t* p) {
  const __m256i* h = reinterpret_cast<const __m256i*>(p);
  return {{_mm512_cvtph_ps(_mm256_loadu_si256(h)), _mm512_cvtph_ps(_mm256_loadu_si256(h + 1))}};
}

inline Unit bfloats(const uint8_t* p) {  // bfloat16 bits << 16 = float32 bits
  const __m256i* h = reinterpret_cast<const __m256i*>(p);
  auto widen = [](__m256i x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
  };
  return {{widen(_mm256_loadu_si256(h)), widen(_mm256_loadu_si256(h + 1))}};
}

inline Unit floats(const uint8_t* p) {
  const float* f = reinterpret_cast<const float*>(p);
  return {{vload(f), vload(f + 16)}};
}

#elif defined(CPU_CAPABILITY_AVX2)

constexpr int VL = 8;
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset(float a) { return _mm256_set1_ps(a); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V a) { _mm256_storeu_ps(p, a); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(V a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
struct Unit {
  V v[4];
};

inline V int32s(__m256i q) { return _mm256_cvtepi32_ps(q); }
inline __m128i load8(const uint8_t* p) {
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
}

inline Unit nibbles(const uint8_t* qs, int offset) {  // lane j: byte j, elements j and j + 16
  const __m256i q0 = _mm256_cvtepu8_epi32(load8(qs)), q1 = _mm256_cvtepu8_epi32(load8(qs + 8));
  const __m256i o = _mm256_set1_epi32(offset), f = _mm256_set1_epi32(0x0F);
  return {{int32s(_mm256_sub_epi32(_mm256_and_si256(q0, f), o)),
           int32s(_mm256_sub_epi32(_mm256_and_si256(q1, f), o)),
           int32s(_mm256_sub_epi32(_mm256_srli_epi32(q0, 4), o)),
           int32s(_mm256_sub_epi32(_mm256_srli_epi32(q1, 4), o))}};
}

inline Unit int8s(const uint8_t* q) {
  return {{int32s(_mm256_cvtepi8_epi32(load8(q))), int32s(_mm256_cvtepi8_epi32(load8(q + 8))),
           int32s(_mm256_cvtepi8_epi32(load8(q + 16))),
           int32s(_mm256_cvtepi8_epi32(load8(q + 24)))}};
}

inline Unit q6_bits(const uint8_t* ql, const uint8_t* qh, int s) {
  const __m256i q = q6_bytes(ql, qh, s);
  const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
  return {{int32s(_mm256_cvtepi8_epi32(q0)), int32s(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(q0, q0))),
           int32s(_mm256_cvtepi8_epi32(q1)), int32s(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(q1, q1)))}};
}

inline Unit halves(const uint8_t* p) {
  const __m128i* h = reinterpret_cast<const __m128i*>(p);
  return {{_mm256_cvtph_ps(_mm_loadu_si128(h)), _mm256_cvtph_ps(_mm_loadu_si128(h + 1)),
           _mm256_cvtph_ps(_mm_loadu_si128(h + 2)), _mm256_cvtph_ps(_mm_loadu_si128(h + 3))}};
}

inline Unit bfloats(const uint8_t* p) {  // bfloat16 bits << 16 = float32 bits
  const __m128i* h = reinterpret_cast<const __m128i*>(p);
  auto widen = [](__m128i x) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
  };
  return {{widen(_mm_loadu_si128(h)), widen(_mm_loadu_si128(h + 1)),
           widen(_mm_loadu_si128(h + 2)), widen(_mm_loadu_si128(h + 3))}};
}

inline Unit floats(const uint8_t* p) {
  const float* f = reinterpret_cast<const float*>(p);
  return {{vload(f), vload(f + 8), vload(f + 16), vload(f + 24)}};
}

#else  // the portable path: the scalar twins themselves

constexpr int VL = 1;
using V = float;
inline V vzero() { return 0.0f; }
inline V vset(float a) { return a; }
inline V vload(const float* p) { return *p; }
inline void vstore(float* p, V a) { *p = a; }
inline V vadd(V a, V b) { return a + b; }
inline V vmul(V a, V b) { return a * b; }
inline V vfma(V a, V b, V c) { return a * b + c; }
inline float vsum(V a) { return a; }
struct Unit {
  V v[32];
};

inline Unit nibbles(const uint8_t* qs, int offset) {
  Unit u;
  scalar::nibbles(qs, offset, u.v);
  return u;
}
inline Unit int8s(const uint8_t* q) {
  Unit u;
  scalar::int8s(q, u.v);
  return u;
}
inline Unit q6_bits(const uint8_t* ql, const uint8_t* qh, int s) {
  Unit u;
  scalar::q6_bits(ql, qh, s, u.v);
  return u;
}
inline Unit halves(const uint8_t* p) {
  Unit u;
  scalar::halves(p, u.v);
  return u;
}
inline Unit bfloats(const uint8_t* p) {
  Unit u;
  scalar::bfloats(p, u.v);
  return u;
}
inline Unit floats(const uint8_t* p) {
  Unit u;
  scalar::floats(p, u.v);
  return u;
}

#endif

constexpr int NV = UNIT / VL;  // vectors per unit

// ---------------------------------------------------------------------------------------------
// Unit u of a row of each kind, the products in gguf's order (de-quantised values equal gguf's
// bit for bit).

inline Unit scaled(Unit q, float d) {  // q d
  for (int v = 0; v < NV; v++) q.v[v] = vmul(q.v[v], vset(d));
  return q;
}

inline Unit unit_q4_0(const uint8_t* row, int64_t u) {  // f16 d, qs[16]: (q - 8) d
  const uint8_t* b = row + u * 18;
  return scaled(nibbles(b + 2, 8), half(b));
}

inline Unit unit_q4_1(const uint8_t* row, int64_t u) {  // f16 d, f16 m, qs[16]: q d + m
  const uint8_t* b = row + u * 20;
  const V d = vset(half(b)), m = vset(half(b + 2));
  Unit q = nibbles(b + 4, 0);
  for (int v = 0; v < NV; v++) q.v[v] = vadd(vmul(q.v[v], d), m);  // rounded twice, as gguf
  return q;
}

inline Unit unit_q8_0(const uint8_t* row, int64_t u) {  // f16 d, int8 q[32]: q d
  const uint8_t* b = row + u * 34;
  return scaled(int8s(b + 2), half(b));
}

// Q6_K: ql[128], qh[64], int8 sc[16], f16 d; unit u is elements 128 h + 32 s + (0..31) of
// block u / 8, scaled by (d sc[8 h + 2 s]) for its first 16 and (d sc[8 h + 2 s + 1]) after.
inline Unit unit_q6_k(const uint8_t* row, int64_t u) {
  const uint8_t* b = row + (u / 8) * 210;
  const int h = static_cast<int>(u % 8) / 4, s = static_cast<int>(u % 4);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * h + 2 * s;
  const float d = half(b + 208);
  const V dl[2] = {vset(d * static_cast<float>(sc[0])), vset(d * static_cast<float>(sc[1]))};
  Unit q = q6_bits(b + 64 * h + 32 * (s % 2), b + 128 + 32 * h, s);
  for (int v = 0; v < NV; v++) q.v[v] = vmul(dl[v / (NV / 2)], q.v[v]);
  return q;
}

template <int64_t KIND>
inline Unit unit(const uint8_t* row, int64_t u) {
  if constexpr (KIND == Q4_0) return unit_q4_0(row, u);
  if constexpr (KIND == Q4_1) return unit_q4_1(row, u);
  if constexpr (KIND == Q8_0) return unit_q8_0(row, u);
  if constexpr (KIND == Q6_K) return unit_q6_k(row, u);
  if constexpr (KIND == F32) return floats(row + u * UNIT * 4);
  if constexpr (KIND == F16) return halves(row + u * UNIT * 2);
  if constexpr (KIND == BF16) return bfloats(row + u * UNIT * 2);
}

// Bytes of one block of Q4_0, Q4_1 or Q8_0, for the kernels that read them as constants.
template <int64_t KIND>
constexpr int64_t block_bytes = KIND == Q4_1 ? 20 : KIND == Q8_0 ? 34 : 18;

// Calls f(std::integral_constant<int64_t, KIND>{}) for a runtime kind (checked before).
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

}  // namespace attnkit_fused::quant
