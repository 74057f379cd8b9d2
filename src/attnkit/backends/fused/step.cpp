// One forward step of a Llama decoder whose matrices stay in GGUF blocks, as one call: the new
// tokens go through every layer here, so a step costs one Python call instead of about
// 30 x 10 module calls. Two entry points share the layer loop (``forward`` below) and differ in
// where the keys and values live:
//
//   llama_step        one new token per row of a batch over dense caches (b, h_kv, L, d)
//                     (attnkit.models.llama_step.step, for generate / stream / chat);
//   llama_paged_step  the packed new tokens of several sequences, each with its own count and
//                     cached length, over a paged pool (N, s, h_kv, d) through block tables
//                     (attnkit.models.llama_step.paged_step, for attnkit serve).
//
// Both compute what the modules compute (attnkit.models.llama and attnkit.serve.forward, the
// references), in float32 with the exact de-quantised weights:
//
//     x = embed[ids]                                                          (t, e)
//     for each layer:
//         q, k, v = in_proj(rms_norm(x, attn_norm))     q (t, h, d), k, v (t, h_kv, d)
//         q, k = rope(q, pos), rope(k, pos)             the model's cos/sin tables, per token
//         cache[slot of each token] = k, v
//         x = x + out_proj(attention(q, cache))          decode.cpp's or paged.cpp's kernel
//         x = x + down(silu(gate(y)) * up(y)), y = rms_norm(x, ffn_norm)
//     logits = output(rms_norm(x[rows asked for], norm))
//
// The products are matvec.h's: up to STEP_ROWS rows of x take the row kernels (W read once,
// de-quantised in registers; each product, or the two of gate/up, is one parallel region with
// W's rows split statically over torch's intra-op threads); more rows (a prefill chunk, a wide
// batch) take the tile path (a tile of W de-quantised, then torch's matmul). The few
// element-wise passes in between (norms, RoPE, SwiGLU, residuals) touch t x e floats and stay
// on the calling thread.
//
// Shape vocabulary: t new tokens (rows), b sequences, e embed_dim, h query heads, h_kv key/value
// heads, d head width, f ffn_dim, V vocabulary, L cache positions, l layers, N blocks of s
// positions.
#include "fused.h"
#include "interleaved.h"
#include "matvec.h"
#include "quant.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <sstream>
#include <type_traits>

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
  const float* xsum;    // unit_sums of x (Q4_1's m sum(x) term; the row kernels only)
  const float* placed;  // x in nibble_order (interleaved Q4 kinds; the row kernels only)
  float* out;
};

// The jobs' products. Up to STEP_ROWS rows of x: the jobs' rows of W, concatenated, shared
// out over the threads in one region. More: each part by the tile path, in turn.
void products(std::initializer_list<Job> jobs, int64_t m) {
  if (m > STEP_ROWS) {
    for (const Job& j : jobs) {
      for (const Part& p : j.mat->parts) {
        tiles(p.kind, j.x, m, p.w, p.row_bytes, p.n, j.mat->k, j.out + p.first, j.mat->n);
      }
    }
    return;
  }
  int64_t total = 0, k = 1;
  for (const Job& j : jobs) total += j.mat->n, k = std::max(k, j.mat->k);
  const int64_t threads = at::get_num_threads();
  // Each thread owns an equal share of the rows, as consecutive rows (one stream through W for
  // the memory prefetchers), and takes it piece by piece from a shared cursor; a thread done
  // with its share takes pieces of the others'. So a thread that starts late (its core was
  // busy with another thread, say a server's event loop) leaves part of its share to the
  // others instead of holding them at the region's end.
  // Shares and pieces are whole sets of interleaved rows (interleaved.h: 32 rows) where the
  // matrices' rows are: one row of x multiplies a set's four groups at once, and a piece that
  // cut a group would have two threads multiply all of it.
  constexpr int64_t rows_of_set = SET * GROUP;
  const int64_t grain = std::max<int64_t>(1, 16384 / k);  // rows: about 16k values of work
  const int64_t share = (total + threads * rows_of_set - 1) / (threads * rows_of_set) * rows_of_set;
  const int64_t piece = std::max(rows_of_set, std::min(grain, share) / rows_of_set * rows_of_set);
  struct alignas(64) Cursor {
    std::atomic<int64_t> next;
    int64_t end;
  };
  std::unique_ptr<Cursor[]> cursors(new Cursor[threads]);
  for (int64_t t = 0; t < threads; t++) {
    cursors[t].next.store(std::min(total, t * share), std::memory_order_relaxed);
    cursors[t].end = std::min(total, (t + 1) * share);
  }
  auto run = [&](int64_t r0, int64_t r1) {
    int64_t base = 0;
    for (const Job& j : jobs) {
      for (const Part& p : j.mat->parts) {
        const int64_t lo = std::max(r0, base + p.first);
        const int64_t hi = std::min(r1, base + p.first + p.n);
        if (lo < hi) {
          rows_range(p.kind, j.x, m, j.xsum, j.placed, p.w, p.n, p.row_bytes, j.mat->k,
                     lo - base - p.first, hi - base - p.first, j.out + p.first, j.mat->n);
        }
      }
      base += j.mat->n;
    }
  };
  if (threads == 1) {  // alone: one stream through every row
    note_thread();
    run(0, total);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    note_thread();
    for (int64_t v = 0; v < threads; v++) {  // its own shares first, then the others'
      Cursor& c = cursors[(t0 + v) % threads];
      for (int64_t r0 = c.next.fetch_add(piece); r0 < c.end; r0 = c.next.fetch_add(piece)) {
        run(r0, std::min(c.end, r0 + piece));
      }
    }
    (void)t1;
  });
}

// y = x / sqrt(mean(x^2) + eps) * weight for m rows of e (norms.RMSNorm).
void rms_norm(const float* x, int64_t m, int64_t e, const float* weight, float eps, float* y) {
  for (int64_t r = 0; r < m; r++) {
    const float* xr = x + r * e;
    // The mean square summed in double: within rounding of torch's pairwise float32 sum,
    // where a plain float32 loop drifts (its error, carried through 30 layers, shows in the
    // logits). Eight sums of every eighth square (one vector of doubles), then added: a
    // single chain of e dependent additions made every row of a batch wait on it.
    double lanes[8] = {};
    int64_t c0 = 0;
    for (; c0 + 8 <= e; c0 += 8) {
      for (int j = 0; j < 8; j++) lanes[j] += static_cast<double>(xr[c0 + j]) * xr[c0 + j];
    }
    double ss = 0.0;
    for (int j = 0; j < 8; j++) ss += lanes[j];
    for (int64_t c = c0; c < e; c++) ss += static_cast<double>(xr[c]) * xr[c];
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
  if constexpr (std::is_same_v<kv_t, float>) {
    std::copy_n(src, d, dst);
  } else {
    for (int64_t c = 0; c < d; c++) dst[c] = static_cast<kv_t>(src[c]);
  }
}

// ---------------------------------------------------------------------------------------------
// Checks: every error names the argument, its shape and what was expected, before any work.

std::string shape(const Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

int64_t named_size(const Named& sizes, const char* name, const char* fn = "llama_step") {
  const auto it = sizes.find(name);
  TORCH_CHECK(it != sizes.end(), fn, ": sizes has no '", name,
              "' (expected e, h, h_kv, d, ffn, vocab, layers",
              std::string(fn) == "llama_step" ? ", length)" : ")");
  TORCH_CHECK(it->second > 0 || std::string(name) == "length", fn, ": sizes['", name,
              "'] must be positive, got ", it->second);
  return it->second;
}

double number(const NamedF& numbers, const char* name, const char* fn) {
  const auto it = numbers.find(name);
  TORCH_CHECK(it != numbers.end(), fn, ": numbers has no '", name, "' (expected eps, scale)");
  return it->second;
}

void check_floats(const char* fn, const char* arg, const Tensor& t, std::vector<int64_t> want) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.sizes() == at::IntArrayRef(want),
              fn, ": ", arg, " must be a contiguous float32 CPU tensor of shape ",
              at::IntArrayRef(want), ", got ", t.scalar_type(), " of shape ", shape(t));
}

// The matrices of the call: weights[w] are the parts, parts[x] how many make matrix x.
std::vector<Matrix> matrices(const char* fn, const std::vector<Tensor>& weights,
                             const std::vector<int64_t>& kinds, const std::vector<int64_t>& parts,
                             const std::vector<std::pair<int64_t, int64_t>>& want) {
  TORCH_CHECK(parts.size() == want.size(), fn, ": parts must count the parts of ", want.size(),
              " matrices (5 per layer and the output), got ", parts.size());
  TORCH_CHECK(kinds.size() == weights.size(), fn, ": kinds (", kinds.size(),
              ") must give one ggml type per weight (", weights.size(), ")");
  std::vector<Matrix> out(want.size());
  size_t w = 0;
  for (size_t x = 0; x < want.size(); x++) {
    Matrix& mat = out[x];
    std::tie(mat.n, mat.k) = want[x];
    TORCH_CHECK(parts[x] > 0 && w + parts[x] <= weights.size(), fn, ": matrix ", x, " needs ",
                parts[x], " parts, but only ", weights.size() - w,
                " weights are left (parts must be positive and sum to len(weights))");
    int64_t first = 0;
    for (int64_t p = 0; p < parts[x]; p++, w++) {
      const Tensor& t = weights[w];
      const bool grouped = kinds[w] >= 0 && (kinds[w] & INTERLEAVED);
      const Format* f = layout_format(kinds[w]);
      TORCH_CHECK(f != nullptr, fn, ": kinds[", w, "] = ", kinds[w],
                  " is not a supported GGUF type (or ", INTERLEAVED,
                  " + Q4_0, Q4_1 or Q8_0 for rows interleaved by ", GROUP, ")");
      TORCH_CHECK(!grouped || t.size(0) % GROUP == 0, fn, ": weights[", w, "] of shape ",
                  shape(t), " is interleaved by ", GROUP, " rows but has ", t.size(0),
                  " rows, not a multiple of ", GROUP);
      TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kByte && t.dim() == 2 &&
                      t.is_contiguous(),
                  fn, ": weights[", w, "] must be a contiguous uint8 (n, row_bytes) CPU "
                  "tensor of GGUF blocks, got ", t.scalar_type(), " of shape ", shape(t));
      TORCH_CHECK(mat.k % f->values == 0 && t.size(1) == mat.k / f->values * f->bytes, fn,
                  ": weights[", w, "] of shape ", shape(t), " (", f->name,
                  ") must have rows of ", mat.k, " values for matrix ", x, " of shape (",
                  mat.n, ", ", mat.k, ")");
      mat.parts.push_back({t.data_ptr<uint8_t>(), kinds[w], t.size(0), t.size(1), first});
      first += t.size(0);
    }
    TORCH_CHECK(first == mat.n, fn, ": the parts of matrix ", x, " have ", first,
                " rows in all, expected (", mat.n, ", ", mat.k, ")");
  }
  TORCH_CHECK(w == weights.size(), fn, ": parts count ", w, " weights, got ", weights.size());
  return out;
}

// What both steps take of the model, checked.
struct Model {
  int64_t e, h, hk, d, f, vocab, layers;
  float eps;
  double scale;
  const uint8_t* embed;
  int64_t embed_kind, embed_row_bytes;
  std::vector<Matrix> mats;  // per layer in_proj, out_proj, gate, up, down; then the output
  std::vector<const float*> norms;
  const float* cos;
  const float* sin;
  int64_t table_rows;  // positions the RoPE tables cover
};

Model checked_model(const char* fn, const Tensor& embed, int64_t embed_kind,
                    const std::vector<Tensor>& weights, const std::vector<int64_t>& kinds,
                    const std::vector<int64_t>& parts, const std::vector<Tensor>& norms,
                    const Tensor& cos, const Tensor& sin, const Named& sizes,
                    const NamedF& numbers) {
  Model M;
  M.e = named_size(sizes, "e", fn), M.h = named_size(sizes, "h", fn);
  M.hk = named_size(sizes, "h_kv", fn), M.d = named_size(sizes, "d", fn);
  M.f = named_size(sizes, "ffn", fn), M.vocab = named_size(sizes, "vocab", fn);
  M.layers = named_size(sizes, "layers", fn);
  M.eps = static_cast<float>(number(numbers, "eps", fn));
  M.scale = number(numbers, "scale", fn);
  TORCH_CHECK(M.h % M.hk == 0 && M.d % 2 == 0, fn, ": h_kv = ", M.hk, " must divide h = ", M.h,
              " and d = ", M.d, " must be even (RoPE)");
  const Format* ef = format(embed_kind);
  TORCH_CHECK(ef != nullptr && embed.device().is_cpu() && embed.scalar_type() == at::kByte &&
                  embed.is_contiguous() && embed.dim() == 2 && embed.size(0) == M.vocab &&
                  M.e % ef->values == 0 && embed.size(1) == M.e / ef->values * ef->bytes,
              fn, ": embed must be the contiguous uint8 (vocab, row_bytes) = (", M.vocab,
              ", bytes of ", M.e, " values) blocks of a supported type, got kind ", embed_kind,
              ", ", embed.scalar_type(), " of shape ", shape(embed));
  M.embed = embed.data_ptr<uint8_t>(), M.embed_kind = embed_kind;
  M.embed_row_bytes = embed.size(1);
  const int64_t nq = M.h * M.d, nkv = M.hk * M.d;
  std::vector<std::pair<int64_t, int64_t>> want;
  for (int64_t l = 0; l < M.layers; l++) {
    want.insert(want.end(), {{nq + 2 * nkv, M.e}, {M.e, nq}, {M.f, M.e}, {M.f, M.e}, {M.e, M.f}});
  }
  want.push_back({M.vocab, M.e});
  M.mats = matrices(fn, weights, kinds, parts, want);
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * M.layers + 1, fn, ": norms must hold "
              "attn_norm and ffn_norm of each layer and the final norm (", 2 * M.layers + 1,
              "), got ", norms.size());
  for (const Tensor& w : norms) {
    check_floats(fn, "every norm weight", w, {M.e});
    M.norms.push_back(w.data_ptr<float>());
  }
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == M.d && cos.sizes() == sin.sizes(), fn,
              ": cos and sin must be (P, d) tables with d = ", M.d, ", got ", shape(cos),
              " and ", shape(sin));
  check_floats(fn, "cos", cos, {cos.size(0), M.d});
  check_floats(fn, "sin", sin, {cos.size(0), M.d});
  M.cos = cos.data_ptr<float>(), M.sin = sin.data_ptr<float>(), M.table_rows = cos.size(0);
  return M;
}

// ids (t,) int64 within the vocabulary and one RoPE position per row within the tables.
const int64_t* checked_ids(const char* fn, const Model& M, const Tensor& ids,
                           const int64_t* positions, int64_t n_positions) {
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1 &&
                  ids.is_contiguous() && ids.size(0) > 0,
              fn, ": ids must be a contiguous int64 (t,) tensor, got ", ids.scalar_type(),
              " of shape ", shape(ids));
  const int64_t t = ids.size(0);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < t; r++) {
    TORCH_CHECK(id[r] >= 0 && id[r] < M.vocab, fn, ": ids[", r, "] = ", id[r],
                " is outside the vocabulary 0..", M.vocab - 1);
  }
  TORCH_CHECK(n_positions == t, fn, ": positions must give one RoPE position per row (", t,
              "), got ", n_positions);
  for (int64_t r = 0; r < t; r++) {
    TORCH_CHECK(positions[r] >= 0 && positions[r] < M.table_rows, fn, ": positions[", r, "] = ",
                positions[r], " is outside the RoPE tables' 0..", M.table_rows - 1);
  }
  return id;
}

// ---------------------------------------------------------------------------------------------
// The layer loop both steps share. ``attend(l, qkv, attn)`` gets layer l's rows
// [q (h, d) | k (h_kv, d) | v (h_kv, d)] after RoPE (t rows, nqkv apart), stores the new keys
// and values and writes the attention (t, h * d) into attn. Logits (n_out, V) of rows
// ``out_rows`` (all t rows in order when null).

template <typename Attend>
void forward(const Model& M, const int64_t* id, int64_t t, const int64_t* pos, Attend&& attend,
             const int64_t* out_rows, int64_t n_out, float* logits) {
  const int64_t e = M.e, h = M.h, hk = M.hk, d = M.d, f = M.f;
  const int64_t nq = h * d, nkv = hk * d, nqkv = nq + 2 * nkv;
  begin_parallel();
  // Activations, (t, width) each.
  const int64_t rows = std::max(t, n_out);
  Floats x(t * e), y(rows * e), qkv(t * nqkv), attn(t * nq), proj(t * e), gate(t * f),
      up(t * f);
  const int64_t widest = std::max(e, std::max(nq, f));
  with_kind(M.embed_kind, [&](auto kc) {
    for (int64_t r = 0; r < t; r++) {
      dequantize_row<decltype(kc)::value>(M.embed + id[r] * M.embed_row_bytes, e,
                                          x.data() + r * e);
    }
  });
  // Whether some row kernel reads x's unit sums (matvec.h), or x in nibble order (interleaved.h).
  bool any_sums = false, any_placed = false;
  for (const Matrix& mat : M.mats) {
    for (const Part& p : mat.parts) {
      any_sums = any_sums || reads_unit_sums(p.kind);
      any_placed = any_placed || reads_nibble_order(p.kind);
    }
  }
  // What the row kernels read besides x: at most STEP_ROWS rows (more take the tile path).
  Floats xsum(rows * (widest / UNIT + 1));
  Floats placed(any_placed ? std::min(rows, STEP_ROWS) * widest : 0);
  // A product's job: the unit sums of x's m rows of k and x in nibble order, where a row kernel
  // reads them (the tile path needs neither).
  auto job = [&](const Matrix* mat, const float* x, int64_t m, float* out) -> Job {
    const bool rows = m <= STEP_ROWS;
    if (rows && any_sums) unit_sums(x, m, mat->k, xsum.data());
    if (rows && any_placed) nibble_order(x, m, mat->k, placed.data());
    return {mat, x, rows && any_sums ? xsum.data() : nullptr,
            rows && any_placed ? placed.data() : nullptr, out};
  };
  auto add_into_x = [&](const float* v) {  // the residual: x += v
    at::vec::map2([](Vec a, Vec b) { return a + b; }, x.data(), x.data(), v, t * e);
  };
  for (int64_t l = 0; l < M.layers; l++) {
    const Matrix* m = M.mats.data() + 5 * l;  // in_proj, out_proj, gate, up, down
    rms_norm(x.data(), t, e, M.norms[2 * l], M.eps, y.data());
    products({job(&m[0], y.data(), t, qkv.data())}, t);
    for (int64_t r = 0; r < t; r++) {
      float* row = qkv.data() + r * nqkv;
      const float* c = M.cos + pos[r] * d;
      const float* s = M.sin + pos[r] * d;
      rope(row, h, d, c, s);
      rope(row + nq, hk, d, c, s);
    }
    attend(l, qkv.data(), attn.data());
    products({job(&m[1], attn.data(), t, proj.data())}, t);
    add_into_x(proj.data());
    rms_norm(x.data(), t, e, M.norms[2 * l + 1], M.eps, y.data());
    const Job gate_job = job(&m[2], y.data(), t, gate.data());  // m[3] reads the same x
    products({gate_job, {&m[3], y.data(), gate_job.xsum, gate_job.placed, up.data()}}, t);
    // silu(gate) * up, silu(g) = g / (1 + exp(-g)), as torch's vectorised silu
    at::vec::map2([](Vec g, Vec u) { return g / (Vec(1.0f) + g.neg().exp()) * u; }, gate.data(),
                  gate.data(), up.data(), t * f);
    products({job(&m[4], gate.data(), t, proj.data())}, t);
    add_into_x(proj.data());
  }
  if (out_rows != nullptr) {  // the rows asked for, gathered (a row may be asked for twice)
    Floats picked(n_out * e);
    for (int64_t r = 0; r < n_out; r++) {
      std::copy_n(x.data() + out_rows[r] * e, e, picked.data() + r * e);
    }
    rms_norm(picked.data(), n_out, e, M.norms[2 * M.layers], M.eps, y.data());
  } else {
    rms_norm(x.data(), t, e, M.norms[2 * M.layers], M.eps, y.data());
  }
  products({job(&M.mats.back(), y.data(), n_out, logits)}, n_out);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The entry points.

void llama_step(const Tensor& ids, const std::vector<int64_t>& positions, const Tensor& embed,
                int64_t embed_kind, const std::vector<Tensor>& weights,
                const std::vector<int64_t>& kinds, const std::vector<int64_t>& parts,
                const std::vector<Tensor>& norms, const std::vector<Tensor>& keys,
                const std::vector<Tensor>& values, const Tensor& cos, const Tensor& sin,
                const Opt& key_mask, const Named& sizes, const NamedF& numbers,
                const Tensor& logits) {
  const char* fn = "llama_step";
  const Model M = checked_model(fn, embed, embed_kind, weights, kinds, parts, norms, cos, sin,
                                sizes, numbers);
  const int64_t length = named_size(sizes, "length");
  const int64_t* id = checked_ids(fn, M, ids, positions.data(),
                                  static_cast<int64_t>(positions.size()));
  const int64_t b = ids.size(0), hk = M.hk, d = M.d, nq = M.h * d, nkv = hk * d;
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == M.layers &&
                  static_cast<int64_t>(values.size()) == M.layers,
              "llama_step: keys and values must hold one cache tensor per layer (", M.layers,
              "), got ", keys.size(), " and ", values.size());
  const auto kv_dtype = keys[0].scalar_type();
  for (int64_t l = 0; l < M.layers; l++) {
    for (const Tensor* t : {&keys[l], &values[l]}) {
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == kv_dtype &&
                      is_kv_type(kv_dtype) && t->dim() == 4 &&
                      t->size(0) == b && t->size(1) == hk && t->size(2) > length &&
                      t->size(3) == d && t->stride(3) == 1,
                  "llama_step: the cache of layer ", l, " must be (b, h_kv, L, d) = (", b, ", ",
                  hk, ", L > length = ", length, ", ", d, "), float32, bfloat16 or float16 like "
                  "layer 0's, contiguous in d; got ", t->scalar_type(), " of shape ", shape(*t));
    }
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
  check_floats(fn, "logits", logits, {b, M.vocab});

  auto attend = [&](int64_t l, const float* qkv, float* attn) {
    const Tensor& key = keys[l];
    const Tensor& value = values[l];
    const int64_t nqkv = nq + 2 * nkv;
    for (int64_t r = 0; r < b; r++) {  // the new key and value rows at position length
      const float* row = qkv + r * nqkv;
      for (int64_t g = 0; g < hk; g++) {
        const int64_t at_k = r * key.stride(0) + g * key.stride(1) + length * key.stride(2);
        const int64_t at_v = r * value.stride(0) + g * value.stride(1) + length * value.stride(2);
        with_kv_type(kv_dtype, [&](auto kv) {
          using kv_t = decltype(kv);
          store_row(row + nq + g * d, d, key.data_ptr<kv_t>() + at_k);
          store_row(row + nq + nkv + g * d, d, value.data_ptr<kv_t>() + at_v);
        });
      }
    }
    decode_into(qkv, nqkv, d, b, M.h, key, value, length + 1, M.scale, mask,
                key_mask ? key_mask->stride(0) : 0, key_mask ? key_mask->stride(1) : 0, attn);
  };
  forward(M, id, b, positions.data(), attend, nullptr, b, logits.data_ptr<float>());
}

int64_t step_rows() { return quant::STEP_ROWS; }

void llama_paged_step(const Tensor& ids, const Tensor& positions, const Tensor& slots,
                      const Tensor& block_tables, const Tensor& lengths, const Tensor& starts,
                      const Tensor& out_rows, const Tensor& embed, int64_t embed_kind,
                      const std::vector<Tensor>& weights, const std::vector<int64_t>& kinds,
                      const std::vector<int64_t>& parts, const std::vector<Tensor>& norms,
                      const std::vector<Tensor>& key_pools,
                      const std::vector<Tensor>& value_pools, const Tensor& cos,
                      const Tensor& sin, const Named& sizes, const NamedF& numbers,
                      const Tensor& logits) {
  const char* fn = "llama_paged_step";
  const Model M = checked_model(fn, embed, embed_kind, weights, kinds, parts, norms, cos, sin,
                                sizes, numbers);
  for (const auto& [arg, x] : {std::pair<const char*, const Tensor*>{"positions", &positions},
                               {"slots", &slots}, {"out_rows", &out_rows}}) {
    TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == at::kLong && x->dim() == 1 &&
                    x->is_contiguous(),
                fn, ": ", arg, " must be a contiguous int64 1-D tensor, got ", x->scalar_type(),
                " of shape ", shape(*x));
  }
  const int64_t* id = checked_ids(fn, M, ids, positions.data_ptr<int64_t>(), positions.numel());
  const int64_t t = ids.size(0), hk = M.hk, d = M.d, nq = M.h * d, nkv = hk * d;
  TORCH_CHECK(static_cast<int64_t>(key_pools.size()) == M.layers &&
                  static_cast<int64_t>(value_pools.size()) == M.layers,
              fn, ": key_pools and value_pools must hold one pool per layer (", M.layers,
              "), got ", key_pools.size(), " and ", value_pools.size());
  const Tensor& first = key_pools[0];
  for (int64_t l = 0; l < M.layers; l++) {
    for (const Tensor* p : {&key_pools[l], &value_pools[l]}) {
      TORCH_CHECK(p->device().is_cpu() && p->scalar_type() == first.scalar_type() &&
                      is_kv_type(first.scalar_type()) && p->dim() == 4 &&
                      p->sizes() == first.sizes() && p->strides() == first.strides() &&
                      p->size(2) == hk && p->size(3) == d && p->stride(3) == 1,
                  fn, ": the pools of layer ", l, " must be (N, s, h_kv, d) with h_kv = ", hk,
                  ", d = ", d, ", float32, bfloat16 or float16, shaped and strided like ",
                  "layer 0's keys ", shape(first), ", contiguous in d; got ", p->scalar_type(),
                  " of shape ", shape(*p));
    }
  }
  const int64_t n_slots = first.size(0) * first.size(1), s = first.size(1);
  TORCH_CHECK(slots.numel() == t, fn, ": slots must give one pool slot per row (", t, "), got ",
              slots.numel());
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < t; r++) {
    TORCH_CHECK(slot[r] >= 0 && slot[r] < n_slots, fn, ": slots[", r, "] = ", slot[r],
                " is outside the pool's 0..", n_slots - 1, " (N * s)");
  }
  const int64_t n_out = out_rows.numel();
  const int64_t* rows = out_rows.data_ptr<int64_t>();
  TORCH_CHECK(n_out > 0, fn, ": out_rows must name at least one row");
  for (int64_t r = 0; r < n_out; r++) {
    TORCH_CHECK(rows[r] >= 0 && rows[r] < t, fn, ": out_rows[", r, "] = ", rows[r],
                " is not a row of the t = ", t, " new tokens");
  }
  check_floats(fn, "logits", logits, {n_out, M.vocab});
  // The tables, lengths and starts are checked by paged() on every layer before it reads; the
  // first layer's check runs before any pool is written (below), so a bad table writes nothing.
  const Tensor probe = at::empty({t, M.h, d}, at::kFloat);
  paged_check(probe, first, value_pools[0], block_tables, lengths, starts, probe);

  const int64_t nqkv = nq + 2 * nkv;
  auto attend = [&](int64_t l, const float* qkv, float* attn) {
    const Tensor& key = key_pools[l];
    const Tensor& value = value_pools[l];
    for (int64_t r = 0; r < t; r++) {  // the new key and value rows at their slots
      const float* row = qkv + r * nqkv;
      const int64_t base = (slot[r] / s) * key.stride(0) + (slot[r] % s) * key.stride(1);
      for (int64_t g = 0; g < hk; g++) {
        const int64_t at = base + g * key.stride(2);
        with_kv_type(key.scalar_type(), [&](auto kv) {
          using kv_t = decltype(kv);
          store_row(row + nq + g * d, d, key.data_ptr<kv_t>() + at);
          store_row(row + nq + nkv + g * d, d, value.data_ptr<kv_t>() + at);
        });
      }
    }
    const Tensor q = at::from_blob(const_cast<float*>(qkv), {t, M.h, d}, {nqkv, d, 1},
                                   at::kFloat);  // (t, h, d): the q part of each row
    const Tensor out = at::from_blob(attn, {t, M.h, d}, at::kFloat);
    paged(q, key, value, block_tables, lengths, starts, M.scale, out);
  };
  forward(M, id, t, positions.data_ptr<int64_t>(), attend, rows, n_out,
          logits.data_ptr<float>());
}

}  // namespace attnkit_fused
