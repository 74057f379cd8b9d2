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
// once and does a few operations per value read. The work is split along the keys (the chunks)
// so that even one sequence with a few key heads runs on every thread. Each task serves all
// g = h / h_kv query heads of its key head, so a key or value row is read from memory once per
// group (grouped-query attention, Ainslie et al. 2023), and the g heads' sums stay in registers
// while a row is used. A key tile is transposed (widened to float32) once for the group, so
// that its scores are sums of whole vectors; value rows are read as stored. bfloat16 caches
// are widened to float32 in registers; all arithmetic is float32.
//
// Shape vocabulary (fused.h): b batch, h query heads, hk key/value heads, g = h / hk, j keys,
// d head width. The online softmax is fused.h's (``logits_row``, ``update``, ``finish``).
#include "fused.h"
#include "kv_tiles.h"

namespace attnkit_fused {

namespace {

using namespace kv;

struct Problem {
  int64_t nb, h, hk, g, d, d_p, length, chunks, chunk;
  float scale2;
  const float* q;
  int64_t q_sb, q_sh;
  const bool* mask;
  int64_t mask_sb, mask_sj;
};

// One key tile of the cache in float32, transposed, k_t (d_p x TILE), so that q k_t^T is a
// sum of whole rows (no sum across a vector's lanes); columns past n are zero. Row c of the
// next tile's keys and values (next_n rows at next_k, next_v) is asked for with row c.
template <typename kv_t>
void transposed_keys(const kv_t* k_rows, int64_t k_sj, int64_t n, int64_t d, int64_t d_p,
                     float* k_t, float* square, const kv_t* next_k, const kv_t* next_v,
                     int64_t v_sj, int64_t next_n) {
  const int64_t n_p = (n + W - 1) / W * W;
  for (int64_t c0 = 0; c0 < n_p; c0 += SQUARE) {
    for (int64_t c = c0; c < c0 + SQUARE; c++) {
      float* row = square + (c - c0) * d_p;
      if (c < next_n) {
        prefetch_row(next_k + c * k_sj, d);
        prefetch_row(next_v + c * v_sj, d);
      }
      if (c < n) {
        widen_row(k_rows + c * k_sj, d, d_p, row);
      } else {
        std::fill(row, row + d_p, 0.0f);
      }
    }
    for (int64_t e0 = 0; e0 < d_p; e0 += SQUARE) {
      at::vec::transpose_mxn<float, SQUARE, SQUARE>(square + e0, d_p, k_t + e0 * TILE + c0, TILE);
    }
  }
}

// One task: query heads [hk * g, (hk + 1) * g) of batch row b against keys [j0, j1). Leaves the
// unnormalised state in m (g), l (g), acc (g x d_p).
template <typename kv_t>
void chunk_state(const Problem& pr, const kv_t* k_head, int64_t k_sj, const kv_t* v_head,
                 int64_t v_sj, int64_t b, int64_t hk, int64_t j0, int64_t j1, float* m, float* l,
                 float* acc, float* q_rows, float* s, float* k_t, float* square) {
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
  for (int64_t c = 0; c < std::min(TILE, j1 - j0); c++) {  // the first tile's rows
    prefetch_row(k_head + (j0 + c) * k_sj, d);
    prefetch_row(v_head + (j0 + c) * v_sj, d);
  }
  for (int64_t t0 = j0; t0 < j1; t0 += TILE) {
    const int64_t n = std::min(TILE, j1 - t0), n_p = (n + W - 1) / W * W;
    const bool* tile_mask = mask == nullptr ? nullptr : mask + t0 * pr.mask_sj;
    const int64_t next = t0 + TILE, next_n = std::max<int64_t>(0, std::min(TILE, j1 - next));
    transposed_keys(k_head + t0 * k_sj, k_sj, n, d, d_p, k_t, square, k_head + next * k_sj,
                    v_head + next * v_sj, v_sj, next_n);
    // s = q k_t^T, every query head of the group against the tile
    by_rows(g, [&](auto R, int64_t r0) {
      scores<R>(q_rows + r0 * d_p, d, d_p, k_t, n_p, s + r0 * TILE);
    });
    // the logits and the online softmax, one query head at a time (fused.h)
    for (int64_t r = 0; r < g; r++) {
      float* s_row = s + r * TILE;
      const float top = logits_row<float>(s_row, n, pr.scale2, nullptr, nullptr, 0, tile_mask,
                                          pr.mask_sj, 0, n);
      update<float>(s_row, n, top, m[r], l[r], acc + r * d_p, d_p);
    }
    // acc += p v_t
    by_rows(g, [&](auto R, int64_t r0) {
      add_values<R>(
          s + r0 * TILE, [&](int64_t c) { return v_head + (t0 + c) * v_sj; }, n, d, d_p,
          [&](int64_t c) { return tile_mask == nullptr || tile_mask[c * pr.mask_sj]; },
          acc + r0 * d_p);
    });
  }
}

template <typename kv_t>
void decode_kernel(const Problem& pr, const Tensor& key, const Tensor& value, float* out) {
  const kv_t* k_data = key.data_ptr<kv_t>();
  const kv_t* v_data = value.data_ptr<kv_t>();
  const int64_t g = pr.g, d_p = pr.d_p, tasks = pr.nb * pr.hk * pr.chunks;
  // The chunks' states, merged below (only when a pair's keys are split).
  Floats part_m, part_l, part_acc;
  if (pr.chunks > 1) {
    part_m.resize(tasks * g), part_l.resize(tasks * g), part_acc.resize(tasks * g * d_p);
  }
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    note_thread();
    const SubnormalsAsZero subnormals;
    Floats q_rows(g * d_p), s(g * TILE), m(g), l(g), acc(g * d_p);
    Floats k_t(d_p * TILE), square(SQUARE * d_p);
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
                        tl, ta, q_rows.data(), s.data(), k_t.data(), square.data());
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
    const SubnormalsAsZero subnormals;
    Floats acc(d_p);
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

// The step: out = softmax(q k^T * scale) v over keys [0, length) of the cache, with key_mask
// (b, length) True where a key exists (left padding); q and out are (b, h, d) or (b, h, 1, d).
// See decode.py for the layouts.
void decode(const Tensor& q, const Tensor& key, const Tensor& value, int64_t length, double scale,
            const Opt& key_mask, const Tensor& out) {
  TORCH_CHECK(q.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu() &&
                  out.device().is_cpu(),
              "fused decode: every tensor must be on the CPU");
  TORCH_CHECK((q.dim() == 3 || (q.dim() == 4 && q.size(2) == 1)) &&
                  q.scalar_type() == at::kFloat && q.stride(-1) == 1,
              "fused decode: q must be float32 (b, h, d) or (b, h, 1, d), contiguous in d, got ",
              q.scalar_type(), " ", q.sizes());
  const int64_t nb = q.size(0), h = q.size(1), d = q.size(-1);
  TORCH_CHECK(key.dim() == 4 && value.dim() == 4 && key.sizes() == value.sizes(),
              "fused decode: key and value must be (b, h_kv, L, d) of one shape, got key ",
              key.sizes(), " and value ", value.sizes());
  TORCH_CHECK(key.scalar_type() == value.scalar_type() && is_kv_type(key.scalar_type()),
              "fused decode: key and value must both be float32, both bfloat16 or both float16, "
              "got ",
              key.scalar_type(), " and ", value.scalar_type());
  TORCH_CHECK(key.stride(3) == 1 && value.stride(3) == 1,
              "fused decode: key and value must be contiguous in d");
  const int64_t hk = key.size(1);
  TORCH_CHECK(key.size(0) == nb && key.size(3) == d && hk > 0 && h % hk == 0,
              "fused decode: q (b, h, [1,] d) = ", q.sizes(), " needs key (b, h_kv, L, d) with the "
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

  begin_parallel();
  decode_into(q.data_ptr<float>(), q.stride(0), q.stride(1), nb, h, key, value, length, scale,
              key_mask ? key_mask->data_ptr<bool>() : nullptr,
              key_mask ? key_mask->stride(0) : 0, key_mask ? key_mask->stride(1) : 0,
              out.data_ptr<float>());
}

void decode_into(const float* q, int64_t q_sb, int64_t q_sh, int64_t nb, int64_t h,
                 const Tensor& key, const Tensor& value, int64_t length, double scale,
                 const bool* key_mask, int64_t mask_sb, int64_t mask_sj, float* out) {
  Problem pr;
  const int64_t hk = key.size(1), d = key.size(3);
  pr.nb = nb, pr.h = h, pr.hk = hk, pr.g = h / hk, pr.d = d, pr.d_p = (d + W - 1) / W * W;
  pr.length = length;
  pr.chunks = chunk_count(length, nb * hk, at::get_num_threads());
  pr.chunk = std::max<int64_t>(1, (length + pr.chunks - 1) / pr.chunks);
  pr.scale2 = static_cast<float>(scale * LOG2E);
  pr.q = q, pr.q_sb = q_sb, pr.q_sh = q_sh;
  pr.mask = key_mask, pr.mask_sb = mask_sb, pr.mask_sj = mask_sj;
  with_kv_type(key.scalar_type(), [&](auto kv) {
    decode_kernel<decltype(kv)>(pr, key, value, out);
  });
}

}  // namespace attnkit_fused
