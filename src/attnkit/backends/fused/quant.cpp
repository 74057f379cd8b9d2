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
// eighth of a Q6_K block, 32 plain values), de-quantised in registers: per instruction set, a
// few small functions widen stored bits to 32 floats (each with its scalar twin), and one
// function per kind scales them as its layout says:
//
//   dequantize(w, kind, k)       (n, k) float32, equal to gguf.quants.dequantize
//   qmatmul(x, w, kind, out)     out = x @ dequantize(w)^T, float32 accumulation:
//     m <= MATVEC_ROWS (decoding; STEP_ROWS for Q4 with AVX-512, row_path_rows): each thread
//       takes a range of W's rows and accumulates x . w with FMAs unit by unit, W read once at
//       memory speed;
//     larger m (prefill): each thread de-quantises a tile of W's rows into its own float32
//       buffer and multiplies it with torch's float32 matmul (MKL where torch has it).
//   embedding(ids, w, kind, k)   the selected rows de-quantised (a token embedding lookup)
//
// Vector paths: AVX-512 where CPU_CAPABILITY_AVX512 is defined, AVX2 + FMA + F16C where
// CPU_CAPABILITY_AVX2 is (jit.py sets them by the CPU class torch dispatches to), the scalar
// twins otherwise.
#include "fused.h"

#include "interleaved.h"
#include "matvec.h"
#include "quant.h"

#include <sstream>

namespace attnkit_fused {

namespace {

using namespace quant;

// Rows of x up to which qmatmul takes the row kernels: with interleaved rows, and with AVX-512
// the Q4 table kernels, they outrun de-quantising a tile for torch's matmul up to STEP_ROWS (as
// in the step); elsewhere the tile path from MATVEC_ROWS.
inline int64_t row_path_rows(int64_t kind) {
  if (kind & INTERLEAVED) return STEP_ROWS;  // as in the step
#if defined(CPU_CAPABILITY_AVX512)
  if (kind == Q4_0 || kind == Q4_1) return STEP_ROWS;
#endif
  (void)kind;
  return MATVEC_ROWS;
}

// The matrix-vector path: rows of W split over torch's intra-op threads (matvec.h matvec_range).
void qmatmul_rows(int64_t kind, const float* x, int64_t m, const uint8_t* w, int64_t row_bytes,
                  int64_t n, int64_t k, float* out) {
  std::vector<float> xsum(reads_unit_sums(kind) ? m * (k / UNIT) : 0);  // (m, units)
  if (reads_unit_sums(kind)) unit_sums(x, m, k, xsum.data());
  std::vector<float> placed(reads_nibble_order(kind) ? m * k : 0);  // (m, k)
  if (reads_nibble_order(kind)) nibble_order(x, m, k, placed.data());
  // Rows: about 16k values of work, in whole sets of interleaved rows (interleaved.h).
  const int64_t grain = std::max<int64_t>(SET * GROUP, 16384 / k / (SET * GROUP) * SET * GROUP);
  at::parallel_for(0, n, grain, [&](int64_t c0, int64_t c1) {
    note_thread();
    rows_range(kind, x, m, xsum.data(), placed.data(), w, n, row_bytes, k, c0, c1, out, n);
  });
}

// ---------------------------------------------------------------------------------------------
// Checks: every error names the argument, its shape and what was expected, before any work.

std::string shape(const Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

// The block format of kind: a GGUF type, or (where grouped_ok) INTERLEAVED + Q4_0, Q4_1 or
// Q8_0 for rows interleaved by GROUP (interleaved.h).
const Format& checked_format(const char* fn, int64_t kind, bool grouped_ok = false) {
  const Format* f = grouped_ok ? layout_format(kind) : format(kind);
  TORCH_CHECK(f != nullptr, fn, ": kind = ", kind,
              " is not a supported GGUF type (expected one of F32 = 0, F16 = 1, Q4_0 = 2, "
              "Q4_1 = 3, Q8_0 = 8, Q6_K = 14, BF16 = 30",
              grouped_ok ? "; or 256 + Q4_0, Q4_1 or Q8_0 for rows interleaved by 8)" : ")");
  return *f;
}

// Interleaved rows come in whole groups.
void check_groups(const char* fn, const Tensor& w, int64_t kind) {
  TORCH_CHECK(!(kind & INTERLEAVED) || w.size(0) % GROUP == 0, fn, ": w of shape ", shape(w),
              " is interleaved by ", GROUP, " rows (kind = ", kind, ") but has ", w.size(0),
              " rows, not a multiple of ", GROUP);
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

}  // namespace

// ---------------------------------------------------------------------------------------------
// The entry points.

Tensor dequantize(const Tensor& w, int64_t kind, int64_t k) {
  const Format& f = checked_format("dequantize", kind, true);
  check_w("dequantize", w);
  check_groups("dequantize", w, kind);
  const int64_t row_bytes = checked_row_bytes("dequantize", f, k, w);
  const int64_t n = w.size(0);
  Tensor out = at::empty({n, k}, at::kFloat);  // (n, k)
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  if (kind & INTERLEAVED) {
    with_interleaved_kind(kind, [&](auto kc) {
      at::parallel_for(0, n / GROUP, 1, [&](int64_t g0, int64_t g1) {
        for (int64_t g = g0; g < g1; g++) {
          dequantize_group<decltype(kc)::value>(wp, n, row_bytes, g, k, op + g * GROUP * k, k);
        }
      });
    });
    return out;
  }
  with_kind(kind, [&](auto kc) {
    constexpr int64_t KIND = decltype(kc)::value;
    at::parallel_for(0, n, std::max<int64_t>(1, 16384 / k), [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; c++) dequantize_row<KIND>(wp + c * row_bytes, k, op + c * k);
    });
  });
  return out;
}

void qmatmul(const Tensor& x, const Tensor& w, int64_t kind, const Tensor& out) {
  const Format& f = checked_format("qmatmul", kind, true);
  check_w("qmatmul", w);
  check_groups("qmatmul", w, kind);
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
  if (m <= row_path_rows(kind)) {
    qmatmul_rows(kind, xp, m, wp, w.size(1), n, k, op);
    return;
  }
  tiles(kind, xp, m, wp, w.size(1), n, k, op, n);
}

Tensor interleave(const Tensor& w, int64_t kind) {
  const Format& f = checked_format("interleave", kind);
  TORCH_CHECK(interleavable(kind), "interleave: kind = ", kind, " (", f.name,
              ") cannot be interleaved (expected Q4_0 = 2, Q4_1 = 3 or Q8_0 = 8)");
  check_w("interleave", w);
  TORCH_CHECK(w.size(0) % GROUP == 0, "interleave: w of shape ", shape(w), " has ", w.size(0),
              " rows, not a multiple of ", GROUP);
  TORCH_CHECK(w.size(1) % f.bytes == 0, "interleave: w of shape ", shape(w), " has rows of ",
              w.size(1), " bytes, not a whole number of ", f.name, " blocks of ", f.bytes,
              " bytes");
  Tensor out = at::empty_like(w);
  interleave_rows(kind, w.data_ptr<uint8_t>(), w.size(0), w.size(1), out.data_ptr<uint8_t>());
  return out;
}

bool interleaves() { return prefers_interleaved(); }

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

}  // namespace attnkit_fused
