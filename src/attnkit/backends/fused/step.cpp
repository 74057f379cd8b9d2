// One decoding step of a Llama decoder whose matrices stay in GGUF blocks, as one call
// (attnkit.models.llama_step): the new token of each row goes through every layer here, so a
// token costs one Python call instead of about 30 x 10 module calls. It computes what the
// modules compute (attnkit.models.llama, the reference), in float32 with the exact
// de-quantised weights:
//
//     x = embed[ids]                                                          (b, e)
//     for each layer:
//         q, k, v = in_proj(rms_norm(x, attn_norm))     q (b, h, d), k, v (b, h_kv, d)
//         q, k = rope(q, pos), rope(k, pos)             the model's cos/sin tables
//         cache.key[:, :, length], cache.value[:, :, length] = k, v
//         x = x + out_proj(decode(q, cache, length + 1))       flash-decoding (decode.cpp)
//         x = x + down(silu(gate(y)) * up(y)), y = rms_norm(x, ffn_norm)
//     logits = output(rms_norm(x, norm))                                      (b, V)
//
// The products are quant.h's row kernels (W read once, de-quantised in registers); each
// product, or the two of gate/up, is one parallel region with W's rows split statically over
// torch's intra-op threads; the attention is decode.cpp's, called as a function. The few
// element-wise passes in between (norms, RoPE, SwiGLU, residuals) touch b x e floats and stay
// on the calling thread.
//
// Shape vocabulary: b rows (one new token each), e embed_dim, h query heads, h_kv key/value
// heads, d head width, f ffn_dim, V vocabulary, L cache positions, l layers.
#include <torch/extension.h>

#include "fused.h"
#include "quant.h"

#include <sstream>

namespace attnkit_fused {

namespace {

using namespace quant;
using Vec = at::vec::Vectorized<float>;

// One matrix (n, k) as consecutive row blocks ("parts"), each in its own block format: a
// ConcatLinear ([q; k; v] stored in two types) or a single QuantizedLinear.
struct Part {
  const uint8_t* w;
  int64_t kind, n, row_bytes, first;  // first: the matrix row of the part's row 0
};
struct Matrix {
  std::vector<Part> parts;
  int64_t n = 0, k = 0;
};

// One product of a region: out (m, mat.n) = x (m, k) @ mat^T.
struct Job {
  const Matrix* mat;
  const float* x;
  const float* xsum;  // unit_sums of x (Q4_1's m sum(x) term)
  float* out;
};

// The jobs' rows, concatenated, split statically over the threads in one region.
void products(std::initializer_list<Job> jobs, int64_t m) {
  int64_t total = 0, k = 1;
  for (const Job& j : jobs) total += j.mat->n, k = std::max(k, j.mat->k);
  const int64_t grain = std::max<int64_t>(1, 16384 / k);  // rows: about 16k values of work
  at::parallel_for(0, total, grain, [&](int64_t r0, int64_t r1) {
    note_thread();
    int64_t base = 0;
    for (const Job& j : jobs) {
      for (const Part& p : j.mat->parts) {
        const int64_t lo = std::max(r0, base + p.first), hi = std::min(r1, base + p.first + p.n);
        if (lo < hi) {
          matvec_range(p.kind, j.x, m, j.xsum, p.w, p.row_bytes, j.mat->k, lo - base - p.first,
                       hi - base - p.first, j.out + p.first, j.mat->n);
        }
      }
      base += j.mat->n;
    }
  });
}

// y = x / sqrt(mean(x^2) + eps) * weight for m rows of e (norms.RMSNorm).
void rms_norm(const float* x, int64_t m, int64_t e, const float* weight, float eps, float* y) {
  for (int64_t r = 0; r < m; r++) {
    const float* xr = x + r * e;
    // The mean square summed in double: within rounding of torch's pairwise float32 sum,
    // where a plain float32 loop drifts (its error, carried through 30 layers, shows in the
    // logits).
    double ss = 0.0;
    for (int64_t c = 0; c < e; c++) ss += static_cast<double>(xr[c]) * xr[c];
    const float mean_square = static_cast<float>(ss / static_cast<double>(e));
    const float inv = 1.0f / std::sqrt(mean_square + eps);
    for (int64_t c = 0; c < e; c++) y[r * e + c] = weight[c] * (xr[c] * inv);
  }
}

// RoPE in place on n heads of width d (positional.RotaryEmbedding.apply, the "half" pairing):
// x[c] cos[c] - x[c + d/2] sin[c] and x[c + d/2] cos[c + d/2] + x[c] sin[c + d/2].
void rope(float* x, int64_t n, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  for (int64_t head = 0; head < n; head++) {
    float* v = x + head * d;
    for (int64_t c = 0; c < half; c++) {
      const float x1 = v[c], x2 = v[c + half];
      v[c] = x1 * cos[c] + (-x2) * sin[c];
      v[c + half] = x2 * cos[c + half] + x1 * sin[c + half];
    }
  }
}

template <typename kv_t>
void store_row(const float* src, int64_t d, kv_t* dst) {
  for (int64_t c = 0; c < d; c++) dst[c] = static_cast<kv_t>(src[c]);
}

// ---------------------------------------------------------------------------------------------
// Checks: every error names the argument, its shape and what was expected, before any work.

std::string shape(const Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

int64_t named_size(const Named& sizes, const char* name) {
  const auto it = sizes.find(name);
  TORCH_CHECK(it != sizes.end(), "llama_step: sizes has no '", name,
              "' (expected e, h, h_kv, d, ffn, vocab, layers, length)");
  TORCH_CHECK(it->second > 0 || std::string(name) == "length", "llama_step: sizes['", name,
              "'] must be positive, got ", it->second);
  return it->second;
}

double number(const NamedF& numbers, const char* name) {
  const auto it = numbers.find(name);
  TORCH_CHECK(it != numbers.end(), "llama_step: numbers has no '", name,
              "' (expected eps, scale)");
  return it->second;
}

void check_floats(const char* arg, const Tensor& t, std::vector<int64_t> want) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.sizes() == at::IntArrayRef(want),
              "llama_step: ", arg, " must be a contiguous float32 CPU tensor of shape ",
              at::IntArrayRef(want), ", got ", t.scalar_type(), " of shape ", shape(t));
}

// The matrices of the call: weights[w] are the parts, parts[x] how many make matrix x.
std::vector<Matrix> matrices(const std::vector<Tensor>& weights, const std::vector<int64_t>& kinds,
                             const std::vector<int64_t>& parts,
                             const std::vector<std::pair<int64_t, int64_t>>& want) {
  TORCH_CHECK(parts.size() == want.size(), "llama_step: parts must count the parts of ",
              want.size(), " matrices (5 per layer and the output), got ", parts.size());
  TORCH_CHECK(kinds.size() == weights.size(), "llama_step: kinds (", kinds.size(),
              ") must give one ggml type per weight (", weights.size(), ")");
  std::vector<Matrix> out(want.size());
  size_t w = 0;
  for (size_t x = 0; x < want.size(); x++) {
    Matrix& mat = out[x];
    std::tie(mat.n, mat.k) = want[x];
    TORCH_CHECK(parts[x] > 0 && w + parts[x] <= weights.size(), "llama_step: matrix ", x,
                " needs ", parts[x], " parts, but only ", weights.size() - w,
                " weights are left (parts must be positive and sum to len(weights))");
    int64_t first = 0;
    for (int64_t p = 0; p < parts[x]; p++, w++) {
      const Tensor& t = weights[w];
      const Format* f = format(kinds[w]);
      TORCH_CHECK(f != nullptr, "llama_step: kinds[", w, "] = ", kinds[w],
                  " is not a supported GGUF type");
      TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kByte && t.dim() == 2 &&
                      t.is_contiguous(),
                  "llama_step: weights[", w, "] must be a contiguous uint8 (n, row_bytes) CPU "
                  "tensor of GGUF blocks, got ", t.scalar_type(), " of shape ", shape(t));
      TORCH_CHECK(mat.k % f->values == 0 && t.size(1) == mat.k / f->values * f->bytes,
                  "llama_step: weights[", w, "] of shape ", shape(t), " (", f->name,
                  ") must have rows of ", mat.k, " values for matrix ", x, " of shape (",
                  mat.n, ", ", mat.k, ")");
      mat.parts.push_back({t.data_ptr<uint8_t>(), kinds[w], t.size(0), t.size(1), first});
      first += t.size(0);
    }
    TORCH_CHECK(first == mat.n, "llama_step: the parts of matrix ", x, " have ", first,
                " rows in all, expected (", mat.n, ", ", mat.k, ")");
  }
  TORCH_CHECK(w == weights.size(), "llama_step: parts count ", w, " weights, got ",
              weights.size());
  return out;
}

// ---------------------------------------------------------------------------------------------

void llama_step(const Tensor& ids, const std::vector<int64_t>& positions, const Tensor& embed,
                int64_t embed_kind, const std::vector<Tensor>& weights,
                const std::vector<int64_t>& kinds, const std::vector<int64_t>& parts,
                const std::vector<Tensor>& norms, const std::vector<Tensor>& keys,
                const std::vector<Tensor>& values, const Tensor& cos, const Tensor& sin,
                const Opt& key_mask, const Named& sizes, const NamedF& numbers,
                const Tensor& logits) {
  const int64_t e = named_size(sizes, "e"), h = named_size(sizes, "h");
  const int64_t hk = named_size(sizes, "h_kv"), d = named_size(sizes, "d");
  const int64_t f = named_size(sizes, "ffn"), vocab = named_size(sizes, "vocab");
  const int64_t layers = named_size(sizes, "layers"), length = named_size(sizes, "length");
  const float eps = static_cast<float>(number(numbers, "eps"));
  const double scale = number(numbers, "scale");
  TORCH_CHECK(h % hk == 0 && d % 2 == 0, "llama_step: h_kv = ", hk, " must divide h = ", h,
              " and d = ", d, " must be even (RoPE)");
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1 &&
                  ids.is_contiguous() && ids.size(0) > 0,
              "llama_step: ids must be a contiguous int64 (b,) tensor, got ", ids.scalar_type(),
              " of shape ", shape(ids));
  const int64_t b = ids.size(0);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < b; r++) {
    TORCH_CHECK(id[r] >= 0 && id[r] < vocab, "llama_step: ids[", r, "] = ", id[r],
                " is outside the vocabulary 0..", vocab - 1);
  }
  TORCH_CHECK(static_cast<int64_t>(positions.size()) == b, "llama_step: positions must give one "
              "RoPE position per row (", b, "), got ", positions.size());
  const Format* ef = format(embed_kind);
  TORCH_CHECK(ef != nullptr && embed.device().is_cpu() && embed.scalar_type() == at::kByte &&
                  embed.is_contiguous() && embed.dim() == 2 && embed.size(0) == vocab &&
                  e % ef->values == 0 && embed.size(1) == e / ef->values * ef->bytes,
              "llama_step: embed must be the contiguous uint8 (vocab, row_bytes) = (", vocab,
              ", bytes of ", e, " values) blocks of a supported type, got kind ", embed_kind,
              ", ", embed.scalar_type(), " of shape ", shape(embed));
  const int64_t nq = h * d, nkv = hk * d, nqkv = nq + 2 * nkv;
  std::vector<std::pair<int64_t, int64_t>> want;
  for (int64_t l = 0; l < layers; l++) {
    want.insert(want.end(), {{nqkv, e}, {e, nq}, {f, e}, {f, e}, {e, f}});
  }
  want.push_back({vocab, e});
  const std::vector<Matrix> mats = matrices(weights, kinds, parts, want);
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * layers + 1, "llama_step: norms must "
              "hold attn_norm and ffn_norm of each layer and the final norm (", 2 * layers + 1,
              "), got ", norms.size());
  for (const Tensor& w : norms) check_floats("every norm weight", w, {e});
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == layers &&
                  static_cast<int64_t>(values.size()) == layers,
              "llama_step: keys and values must hold one cache tensor per layer (", layers,
              "), got ", keys.size(), " and ", values.size());
  const auto kv_dtype = keys[0].scalar_type();
  for (int64_t l = 0; l < layers; l++) {
    for (const Tensor* t : {&keys[l], &values[l]}) {
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == kv_dtype &&
                      (kv_dtype == at::kFloat || kv_dtype == at::kBFloat16) && t->dim() == 4 &&
                      t->size(0) == b && t->size(1) == hk && t->size(2) > length &&
                      t->size(3) == d && t->stride(3) == 1,
                  "llama_step: the cache of layer ", l, " must be (b, h_kv, L, d) = (", b, ", ",
                  hk, ", L > length = ", length, ", ", d, "), float32 or bfloat16 like layer 0's,"
                  " contiguous in d; got ", t->scalar_type(), " of shape ", shape(*t));
    }
  }
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == d && cos.sizes() == sin.sizes(),
              "llama_step: cos and sin must be (P, d) tables with d = ", d, ", got ", shape(cos),
              " and ", shape(sin));
  check_floats("cos", cos, {cos.size(0), d});
  check_floats("sin", sin, {cos.size(0), d});
  for (int64_t r = 0; r < b; r++) {
    TORCH_CHECK(positions[r] >= 0 && positions[r] < cos.size(0), "llama_step: positions[", r,
                "] = ", positions[r], " is outside the RoPE tables' 0..", cos.size(0) - 1);
  }
  const bool* mask = nullptr;
  if (key_mask) {
    TORCH_CHECK(key_mask->device().is_cpu() && key_mask->scalar_type() == at::kBool &&
                    key_mask->dim() == 2 && key_mask->size(0) == b &&
                    key_mask->size(1) == length + 1,
                "llama_step: key_mask must be bool (b, length + 1) = (", b, ", ", length + 1,
                "), got ", key_mask->scalar_type(), " of shape ", shape(*key_mask));
    mask = key_mask->data_ptr<bool>();
  }
  check_floats("logits", logits, {b, vocab});

  begin_parallel();
  // Activations, (b, width) each.
  std::vector<float> x(b * e), y(b * e), qkv(b * nqkv), attn(b * nq), proj(b * e),
      gate(b * f), up(b * f);
  std::vector<float> xsum(b * (std::max(e, std::max(nq, f)) / UNIT + 1));
  with_kind(embed_kind, [&](auto kc) {
    for (int64_t r = 0; r < b; r++) {
      dequantize_row<decltype(kc)::value>(embed.data_ptr<uint8_t>() + id[r] * embed.size(1), e,
                                          x.data() + r * e);
    }
  });
  auto sums = [&](const float* v, int64_t k) {
    unit_sums(v, b, k, xsum.data());
    return xsum.data();
  };
  for (int64_t l = 0; l < layers; l++) {
    const Matrix* m = mats.data() + 5 * l;  // in_proj, out_proj, gate, up, down
    rms_norm(x.data(), b, e, norms[2 * l].data_ptr<float>(), eps, y.data());
    products({{&m[0], y.data(), sums(y.data(), e), qkv.data()}}, b);
    const Tensor& key = keys[l];
    const Tensor& value = values[l];
    for (int64_t r = 0; r < b; r++) {
      float* row = qkv.data() + r * nqkv;  // [q (h, d) | k (h_kv, d) | v (h_kv, d)]
      const float* c = cos.data_ptr<float>() + positions[r] * d;
      const float* s = sin.data_ptr<float>() + positions[r] * d;
      rope(row, h, d, c, s);
      rope(row + nq, hk, d, c, s);
      for (int64_t g = 0; g < hk; g++) {
        const int64_t at_k = r * key.stride(0) + g * key.stride(1) + length * key.stride(2);
        const int64_t at_v = r * value.stride(0) + g * value.stride(1) + length * value.stride(2);
        if (kv_dtype == at::kBFloat16) {
          store_row(row + nq + g * d, d, key.data_ptr<at::BFloat16>() + at_k);
          store_row(row + nq + nkv + g * d, d, value.data_ptr<at::BFloat16>() + at_v);
        } else {
          store_row(row + nq + g * d, d, key.data_ptr<float>() + at_k);
          store_row(row + nq + nkv + g * d, d, value.data_ptr<float>() + at_v);
        }
      }
    }
    decode_into(qkv.data(), nqkv, d, b, h, key, value, length + 1, scale, mask,
                key_mask ? key_mask->stride(0) : 0, key_mask ? key_mask->stride(1) : 0,
                attn.data());
    products({{&m[1], attn.data(), sums(attn.data(), nq), proj.data()}}, b);
    for (int64_t c = 0; c < b * e; c++) x[c] = x[c] + proj[c];
    rms_norm(x.data(), b, e, norms[2 * l + 1].data_ptr<float>(), eps, y.data());
    const float* ys = sums(y.data(), e);
    products({{&m[2], y.data(), ys, gate.data()}, {&m[3], y.data(), ys, up.data()}}, b);
    // silu(gate) * up, silu(g) = g / (1 + exp(-g)), as torch's vectorised silu
    at::vec::map2([](Vec g, Vec u) { return g / (Vec(1.0f) + g.neg().exp()) * u; }, gate.data(),
                  gate.data(), up.data(), b * f);
    products({{&m[4], gate.data(), sums(gate.data(), f), proj.data()}}, b);
    for (int64_t c = 0; c < b * e; c++) x[c] = x[c] + proj[c];
  }
  rms_norm(x.data(), b, e, norms[2 * layers].data_ptr<float>(), eps, y.data());
  products({{&mats.back(), y.data(), sums(y.data(), e), logits.data_ptr<float>()}}, b);
}

}  // namespace

void bind_step(pybind11::module_& m) {
  m.def("llama_step", &llama_step, pybind11::arg("ids"), pybind11::arg("positions"),
        pybind11::arg("embed"), pybind11::arg("embed_kind"), pybind11::arg("weights"),
        pybind11::arg("kinds"), pybind11::arg("parts"), pybind11::arg("norms"),
        pybind11::arg("keys"), pybind11::arg("values"), pybind11::arg("cos"),
        pybind11::arg("sin"), pybind11::arg("key_mask"), pybind11::arg("sizes"),
        pybind11::arg("numbers"), pybind11::arg("logits"),
        "one decoding step of a quantised Llama decoder (writes the caches at length, logits)");
}

}  // namespace attnkit_fused
