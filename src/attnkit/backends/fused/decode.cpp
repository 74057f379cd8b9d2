// One decoding step of attention over a KV cache (attnkit.backends.fused.decode): one query per
// head against the first ``length`` cached keys, as flash-decoding (Dao, Haziza, Massa, Sizov
// 2023, "Flash-Decoding for long-context inference"):
//
//     for each (batch, key head, chunk of keys), in parallel:    state = empty (per query head)
//         for each tile of the chunk:
//             s = q_g k_t^T * scale * log2(e)   (key_mask False: blocked)   all g heads at once
//             state = update(state, s), acc += p v_t                        all g heads at once
//     for each (batch, query head):  merge the chunks' states, output = finish(state)
//
// With one query position there is no matmul to feed: a step reads every cached key and value
// once and does two multiply-adds per value read, so it is bound by memory, and the work is
// split along the keys (the chunks) so that even one sequence with a few key heads runs on every
// thread. Each task serves all g = h / h_kv query heads of its key head, so a key or value row
// is read from memory once per group (grouped-query attention, Ainslie et al. 2023). bfloat16
// caches are read as bfloat16 and widened to float32 in registers; all arithmetic is float32.
//
// Shape vocabulary (fused.h): b batch, h query heads, hk key/value heads, g = h / hk, j keys,
// d head width. The online softmax is fused.h's (``logits_row``, ``update``, ``finish``).
#include <torch/extension.h>

#include "fused.h"

namespace attnkit_fused {

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = 2 * Vec::size();  // values per step along d: one bfloat16 vector
constexpr int64_t TILE = 256;           // keys per online-softmax update (scores stay in L1)
constexpr int64_t MIN_CHUNK = 256;      // fewer keys per task: the merge costs more than it saves
constexpr int64_t TASKS_PER_THREAD = 4;
constexpr int64_t HEADS = 8;            // query heads whose dot products are kept in registers

static_assert(at::vec::Vectorized<at::BFloat16>::size() == W, "bfloat16 vector = two floats");

// Values [0, W) of a row from p (n of them exist; zero past n) as two float vectors.
inline std::pair<Vec, Vec> load_pair(const float* p, int64_t n) {
  if (n >= W) return {Vec::loadu(p), Vec::loadu(p + Vec::size())};
  if (n <= Vec::size()) return {Vec::loadu(p, n), Vec(0.0f)};
  return {Vec::loadu(p), Vec::loadu(p + Vec::size(), n - Vec::size())};
}

inline std::pair<Vec, Vec> load_pair(const at::BFloat16* p, int64_t n) {
  using BVec = at::vec::Vectorized<at::BFloat16>;
  const BVec x = n >= W ? BVec::loadu(p) : BVec::loadu(p, n);
  auto [lo, hi] = at::vec::convert_to_float<at::BFloat16>(x);
  return {lo, hi};
}

// How many chunks each (batch, key head) pair's keys are split into: one for short caches and
// a single thread, else enough that there are TASKS_PER_THREAD tasks per thread, never chunks
// shorter than MIN_CHUNK keys.
int64_t chunk_count(int64_t length, int64_t pairs, int64_t threads) {
  if (threads <= 1) return 1;
  const int64_t want = (TASKS_PER_THREAD * threads + pairs - 1) / pairs;
  return std::clamp<int64_t>(want, 1, std::max<int64_t>(1, length / MIN_CHUNK));
}

struct Problem {
  int64_t nb, h, hk, g, d, d_p, length, chunks, chunk;
  float scale2;
  const float* q;
  int64_t q_sb, q_sh;
  const bool* mask;
  int64_t mask_sb, mask_sj;
};

// One task: query heads [hk * g, (hk + 1) * g) of batch row b against keys [j0, j1). Leaves the
// unnormalised state in m (g), l (g), acc (g x d_p).
template <typename kv_t>
void chunk_state(const Problem& pr, const kv_t* k_head, int64_t k_sj, const kv_t* v_head,
                 int64_t v_sj, int64_t b, int64_t hk, int64_t j0, int64_t j1, float* m, float* l,
                 float* acc, float* q_rows, float* s) {
  const int64_t g = pr.g, d = pr.d, d_p = pr.d_p;
  for (int64_t r = 0; r < g; r++) {  // the group's queries, zero-padded to d_p
    const float* src = pr.q + b * pr.q_sb + (hk * g + r) * pr.q_sh;
    std::copy(src, src + d, q_rows + r * d_p);
    std::fill(q_rows + r * d_p + d, q_rows + (r + 1) * d_p, 0.0f);
  }
  // State(): m = blocked, l = 0, acc = 0 (softmax.py, the first-tile convention)
  std::fill(m, m + g, std::numeric_limits<float>::lowest());
  std::fill(l, l + g, 0.0f);
  std::fill(acc, acc + g * d_p, 0.0f);
  const bool* mask = pr.mask == nullptr ? nullptr : pr.mask + b * pr.mask_sb;
  for (int64_t t0 = j0; t0 < j1; t0 += TILE) {
    const int64_t n = std::min(TILE, j1 - t0);
    // s = q k_t^T: each key row is loaded once and multiplied by every query of the group
    for (int64_t r0 = 0; r0 < g; r0 += HEADS) {
      const int64_t rn = std::min(HEADS, g - r0);
      for (int64_t c = 0; c < n; c++) {
        const kv_t* key = k_head + (t0 + c) * k_sj;
        Vec dot[HEADS];
        for (int64_t r = 0; r < rn; r++) dot[r] = Vec(0.0f);
        for (int64_t e = 0; e < d; e += W) {
          auto [k0, k1] = load_pair(key + e, d - e);
          for (int64_t r = 0; r < rn; r++) {
            const float* qr = q_rows + (r0 + r) * d_p + e;
            dot[r] = at::vec::fmadd(Vec::loadu(qr), k0, dot[r]);
            dot[r] = at::vec::fmadd(Vec::loadu(qr + Vec::size()), k1, dot[r]);
          }
        }
        for (int64_t r = 0; r < rn; r++) {
          s[(r0 + r) * TILE + c] = at::vec::vec_reduce_all<float>(
              [](Vec& a, Vec& b) { return a + b; }, dot[r]);
        }
      }
    }
    // the logits and the online softmax, one query head at a time (fused.h)
    const bool* tile_mask = mask == nullptr ? nullptr : mask + t0 * pr.mask_sj;
    for (int64_t r = 0; r < g; r++) {
      float* s_row = s + r * TILE;
      const float top = logits_row<float>(s_row, n, pr.scale2, nullptr, nullptr, 0, tile_mask,
                                          pr.mask_sj, 0, n);
      update<float>(s_row, n, top, m[r], l[r], acc + r * d_p, d_p);
    }
    // acc += p v_t: each value row is loaded once and added to every query head of the group.
    // A masked key is skipped, not weighted by 0: a NaN there must not reach the output.
    for (int64_t c = 0; c < n; c++) {
      if (tile_mask != nullptr && !tile_mask[c * pr.mask_sj]) continue;
      const kv_t* value = v_head + (t0 + c) * v_sj;
      for (int64_t e = 0; e < d; e += W) {
        auto [v0, v1] = load_pair(value + e, d - e);
        for (int64_t r = 0; r < g; r++) {
          const Vec p(s[r * TILE + c]);
          float* a = acc + r * d_p + e;
          at::vec::fmadd(p, v0, Vec::loadu(a)).store(a);
          at::vec::fmadd(p, v1, Vec::loadu(a + Vec::size())).store(a + Vec::size());
        }
      }
    }
  }
}

template <typename kv_t>
void decode_kernel(const Problem& pr, const Tensor& key, const Tensor& value, float* out) {
  const kv_t* k_data = key.data_ptr<kv_t>();
  const kv_t* v_data = value.data_ptr<kv_t>();
  const int64_t g = pr.g, d_p = pr.d_p, tasks = pr.nb * pr.hk * pr.chunks;
  // The chunks' states, merged below (only when a pair's keys are split).
  std::vector<float> part_m, part_l, part_acc;
  if (pr.chunks > 1) {
    part_m.resize(tasks * g), part_l.resize(tasks * g), part_acc.resize(tasks * g * d_p);
  }
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    note_thread();
    std::vector<float> q_rows(g * d_p), s(g * TILE), m(g), l(g), acc(g * d_p);
    for (int64_t task = begin; task < end; task++) {
      const int64_t b = task / (pr.hk * pr.chunks), hk = (task / pr.chunks) % pr.hk;
      const int64_t c = task % pr.chunks;
      const int64_t j0 = c * pr.chunk, j1 = std::min(pr.length, j0 + pr.chunk);
      const kv_t* k_head = k_data + b * key.stride(0) + hk * key.stride(1);
      const kv_t* v_head = v_data + b * value.stride(0) + hk * value.stride(1);
      const bool split = pr.chunks > 1;
      float* tm = split ? part_m.data() + task * g : m.data();
      float* tl = split ? part_l.data() + task * g : l.data();
      float* ta = split ? part_acc.data() + task * g * d_p : acc.data();
      chunk_state<kv_t>(pr, k_head, key.stride(2), v_head, value.stride(2), b, hk, j0, j1, tm,
                        tl, ta, q_rows.data(), s.data());
      if (split) continue;
      for (int64_t r = 0; r < g; r++) {
        float lse, top, log_l;
        finish<float>(tm[r], tl[r], ta + r * d_p, pr.d,
                      out + (b * pr.h + hk * g + r) * pr.d, lse, top, log_l);
      }
    }
  });
  if (pr.chunks == 1) return;
  // Merge (flash-decoding's reduction): m = max_c m_c, l = sum_c l_c 2^(m_c - m),
  // acc = sum_c acc_c 2^(m_c - m); then finish as one state.
  at::parallel_for(0, pr.nb * pr.h, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(d_p);
    for (int64_t row = begin; row < end; row++) {
      const int64_t b = row / pr.h, h = row % pr.h, hk = h / g, r = h % g;
      const int64_t first = (b * pr.hk + hk) * pr.chunks;
      float m = std::numeric_limits<float>::lowest(), l = 0.0f;
      for (int64_t c = 0; c < pr.chunks; c++) m = nan_max(m, part_m[(first + c) * g + r]);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t c = 0; c < pr.chunks; c++) {
        const int64_t x = (first + c) * g + r;
        const float w = std::exp2(part_m[x] - m);
        l += part_l[x] * w;
        const float* a = part_acc.data() + x * d_p;
        at::vec::map2([w](Vec x, Vec y) { return at::vec::fmadd(Vec(w), y, x); }, acc.data(),
                      acc.data(), a, d_p);
      }
      float lse, top, log_l;
      finish<float>(m, l, acc.data(), pr.d, out + row * pr.d, lse, top, log_l);
    }
  });
}

}  // namespace

// The step: out (b, h, d) = softmax(q k^T * scale) v over keys [0, length) of the cache, with
// key_mask (b, length) True where a key exists (left padding). See decode.py for the layouts.
void decode(const Tensor& q, const Tensor& key, const Tensor& value, int64_t length, double scale,
            const Opt& key_mask, const Tensor& out) {
  TORCH_CHECK(q.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu() &&
                  out.device().is_cpu(),
              "fused decode: every tensor must be on the CPU");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1,
              "fused decode: q must be float32 (b, h, d) contiguous in d, got ",
              q.scalar_type(), " ", q.sizes());
  const int64_t nb = q.size(0), h = q.size(1), d = q.size(2);
  TORCH_CHECK(key.dim() == 4 && value.dim() == 4 && key.sizes() == value.sizes(),
              "fused decode: key and value must be (b, h_kv, L, d) of one shape, got key ",
              key.sizes(), " and value ", value.sizes());
  TORCH_CHECK(key.scalar_type() == value.scalar_type() &&
                  (key.scalar_type() == at::kFloat || key.scalar_type() == at::kBFloat16),
              "fused decode: key and value must both be float32 or both bfloat16, got ",
              key.scalar_type(), " and ", value.scalar_type());
  TORCH_CHECK(key.stride(3) == 1 && value.stride(3) == 1,
              "fused decode: key and value must be contiguous in d");
  const int64_t hk = key.size(1);
  TORCH_CHECK(key.size(0) == nb && key.size(3) == d && hk > 0 && h % hk == 0,
              "fused decode: q (b, h, d) = ", q.sizes(), " needs key (b, h_kv, L, d) with the "
              "same b and d and h_kv dividing h, got ", key.sizes());
  TORCH_CHECK(length >= 0 && length <= key.size(2), "fused decode: length must be in [0, L = ",
              key.size(2), "], got ", length);
  if (key_mask) {
    TORCH_CHECK(key_mask->device().is_cpu() && key_mask->scalar_type() == at::kBool &&
                    key_mask->dim() == 2 && key_mask->size(0) == nb &&
                    key_mask->size(1) == length,
                "fused decode: key_mask must be bool (b, length) = (", nb, ", ", length,
                "), got ", key_mask->scalar_type(), " ", key_mask->sizes());
  }
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == q.sizes(),
              "fused decode: out must be contiguous float32 of q's shape ", q.sizes());

  Problem pr;
  pr.nb = nb, pr.h = h, pr.hk = hk, pr.g = h / hk, pr.d = d, pr.d_p = (d + W - 1) / W * W;
  pr.length = length;
  pr.chunks = chunk_count(length, nb * hk, at::get_num_threads());
  pr.chunk = std::max<int64_t>(1, (length + pr.chunks - 1) / pr.chunks);
  pr.scale2 = static_cast<float>(scale * LOG2E);
  pr.q = q.data_ptr<float>(), pr.q_sb = q.stride(0), pr.q_sh = q.stride(1);
  pr.mask = key_mask ? key_mask->data_ptr<bool>() : nullptr;
  pr.mask_sb = key_mask ? key_mask->stride(0) : 0;
  pr.mask_sj = key_mask ? key_mask->stride(1) : 0;
  begin_parallel();
  if (key.scalar_type() == at::kBFloat16) {
    decode_kernel<at::BFloat16>(pr, key, value, out.data_ptr<float>());
  } else {
    decode_kernel<float>(pr, key, value, out.data_ptr<float>());
  }
}

void bind_decode(pybind11::module_& m) {
  m.def("decode", &decode, "one decoding step over a KV cache (writes out)", pybind11::arg("q"),
        pybind11::arg("key"), pybind11::arg("value"), pybind11::arg("length"),
        pybind11::arg("scale"), pybind11::arg("key_mask"), pybind11::arg("out"));
}

}  // namespace attnkit_fused
