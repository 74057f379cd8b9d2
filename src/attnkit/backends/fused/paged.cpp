// Attention over a paged KV cache (attnkit.backends.fused.paged): the new tokens of several
// sequences, each with its own number of new tokens and its own cached length, against keys and
// values read through block tables from one pool (attnkit.serve.paged.paged_attention is the
// reference math). The loop is decode.cpp's flash-decoding, widened to several query positions
// and to keys that live in blocks:
//
//     for each (sequence, key head, block of queries, chunk of keys), in parallel:
//         state = empty (per query row: a query position and a query head of the group)
//         for each tile of the chunk (key rows found through the block table):
//             s = q_g k_t^T * scale * log2(e)   (causal: blocked past each row's position)
//             state = update(state, s), acc += p v_t
//     for each (sequence, key head, block of queries, row):  merge the chunks, finish
//
// A row is a pair (query position k, query head r of the key head's group), so that a key or
// value row read from the pool serves all g = h / hk query heads and every query of the block
// (grouped-query attention; a prefill chunk reuses each key for QUERY_ROWS rows). Keys are
// split into chunks at fixed positions (CHUNK), so that one long sequence keeps every thread
// busy (decoding) and a row's result is the same bits however the batch is made, and no key
// past a block's last query is read (causal alignment bottom-right, as in the reference: query
// k of i new tokens sees keys [0, length - i + k]). K/V rows are never gathered into a
// contiguous tensor: a tile's rows are found through the table and read in place (the
// portable build transposes key tiles into an L1 buffer for the scores). bfloat16 and float16
// pools are widened in registers; all arithmetic is float32.
//
// Shape vocabulary (paged.py): b sequences, t new tokens packed, h query heads, hk key/value
// heads, g = h / hk, d head width, N blocks, s positions per block, m blocks per table row.
// The online softmax is fused.h's (``logits_row``, ``update``, ``finish``).
#include "fused.h"
#include "kv_tiles.h"

namespace attnkit_fused {

namespace {

using namespace kv;

constexpr int64_t QUERY_ROWS = 64;  // rows (query positions x group heads) per task, at most
constexpr int64_t STREAM_AHEAD = 64;  // rows asked for ahead of the reading (32 to 128: alike)
// Keys per task: an item's keys are split at fixed positions, every CHUNK keys from key 0,
// whatever the batch. A row then meets the same tiles, chunks and merges (a chunk a row cannot
// see adds exact zeros) whether its query decodes alone, beside other sequences or in a prefill
// chunk split anywhere, and its result is the same bits: a greedy request gets the same tokens
// alone or batched, even where rounding keys to 16 bits would magnify a last-bit difference.
constexpr int64_t CHUNK = MIN_CHUNK;

// One unit of work before it is split along the keys: query positions [q0, q1) of sequence
// ``seq`` (their rows: every query head of key head ``hk``), which see keys [0, keys).
struct Item {
  int64_t seq, hk, q0, q1, keys, chunks, first_task;
};

// One task: an item's keys [j0, j1).
struct Task {
  int64_t item, j0, j1;
};

struct Problem {
  int64_t h, hk, g, d, d_p, s, rows_max;
  float scale2;
  const float* q;
  int64_t q_st, q_sh;
  const int64_t* tables;
  int64_t tables_sb;
  const int64_t* lengths;
  const int64_t* starts;  // (b + 1,): sequence n owns packed rows [starts[n], starts[n + 1])
  int64_t pool_sn, pool_ss, pool_sh;  // the pools' strides (N, s, hk); d is contiguous
};

// The pool rows of keys [t0, t0 + n) of one sequence and key head, through its block table:
// block by block (one division per tile, not one per key: a division costs more than a key's
// share of the scores when the heads are few).
template <typename kv_t>
inline void rows_of(const Problem& pr, const kv_t* pool, const int64_t* table, int64_t hk,
                    int64_t t0, int64_t n, const kv_t** rows) {
  int64_t block = t0 / pr.s, at = t0 % pr.s;
  const kv_t* base = pool + table[block] * pr.pool_sn + hk * pr.pool_sh;
  for (int64_t c = 0; c < n; c++) {
    rows[c] = base + at * pr.pool_ss;
    if (++at == pr.s && c + 1 < n) {
      at = 0;
      base = pool + table[++block] * pr.pool_sn + hk * pr.pool_sh;
    }
  }
}

// One key tile in float32, transposed, k_t (d_p x TILE), so that q k_t^T is a sum of whole rows
// (no sum across a vector's lanes); columns past n are zero (decode.cpp, rows by pointer).
// ``ask(keys)`` before each SQUARE keys: the rows read ahead (Stream).
template <typename kv_t, typename Ask>
void transposed_keys(const kv_t* const* k_rows, int64_t n, int64_t d, int64_t d_p, float* k_t,
                     float* square, Ask&& ask) {
  const int64_t n_p = (n + W - 1) / W * W;
  for (int64_t c0 = 0; c0 < n_p; c0 += SQUARE) {
    ask(std::min(SQUARE, n - c0));
    for (int64_t c = c0; c < c0 + SQUARE; c++) {
      float* row = square + (c - c0) * d_p;
      if (c < n) {
        widen_row(k_rows[c], d, d_p, row);
      } else {
        std::fill(row, row + d_p, 0.0f);
      }
    }
    for (int64_t e0 = 0; e0 < d_p; e0 += SQUARE) {
      at::vec::transpose_mxn<float, SQUARE, SQUARE>(square + e0, d_p, k_t + e0 * TILE + c0, TILE);
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// Lane i of the result: the sum of v[i]'s 16 lanes (pairs within 128-bit lanes, then quads,
// then across the four 128-bit lanes).
inline Vec lane_sums(const Vec* v) {
  __m512 a[8], c[4];
  for (int i = 0; i < 8; i++) {
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int j = 0; j < 4; j++) {
    c[j] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(u01, u23, _MM_SHUFFLE(3, 1, 3, 1)));
}
#elif defined(CPU_CAPABILITY_AVX2)
// Lane i of the result: the sum of v[i]'s 8 lanes (pairs, then quads, then the two halves).
inline Vec lane_sums(const Vec* v) {
  __m256 a[4];
  for (int i = 0; i < 4; i++) a[i] = _mm256_hadd_ps(v[2 * i], v[2 * i + 1]);
  const __m256 b0 = _mm256_hadd_ps(a[0], a[1]), b1 = _mm256_hadd_ps(a[2], a[3]);
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20),
                       _mm256_permute2f128_ps(b0, b1, 0x31));
}
#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// s[r][c] = q_r . k_c for R (at most HEADS) rows and keys [0, n), straight from the key rows
// as stored: each key row is read once for the R rows, and a vector's worth of keys (L = 16
// with AVX-512, 8 with AVX2) have their partial sums added up across lanes together. For a
// decoding step's few rows this costs about half of transposing the tile first
// (transposed_keys); prefill chunks take it too, so that a row's scores do not depend on how
// many rows share its task. Columns [n, n_p) are zero. ``ask(keys)`` before each L keys: the
// rows read ahead (Stream).
template <int R, typename kv_t, typename Ask>
void direct_scores(const float* q_rows, int64_t d, int64_t d_p, const kv_t* const* k_rows,
                   int64_t n, int64_t n_p, float* s, Ask&& ask) {
  constexpr int L = Vec::size();
  for (int64_t c0 = 0; c0 < n_p; c0 += L) {
    ask(std::min<int64_t>(L, n - c0));
    Vec t[R][L];
    for (int c = 0; c < L; c++) {
      Vec acc[R];
      for (int r = 0; r < R; r++) acc[r] = Vec(0.0f);
      if (c0 + c < n) {
        for (int64_t e = 0; e < d_p; e += W) {
          auto [k0, k1] = load_pair(k_rows[c0 + c] + e, d - e);
          for (int r = 0; r < R; r++) {
            const float* q = q_rows + r * d_p + e;
            acc[r] = at::vec::fmadd(Vec::loadu(q), k0, acc[r]);
            acc[r] = at::vec::fmadd(Vec::loadu(q + L), k1, acc[r]);
          }
        }
      }
      for (int r = 0; r < R; r++) t[r][c] = acc[r];
    }
    for (int r = 0; r < R; r++) lane_sums(t[r]).store(s + r * TILE + c0);
  }
}
#endif

// The key and value rows a thread reads, asked for STREAM_AHEAD rows ahead of its reading,
// across its tasks as one stream. A decoding step's tasks are a tile or two each (one key head
// of one sequence); asking for each tile only while the one before it was read left the memory
// idle at every task's start and after every short tile (docs/benchmarks.md, "Tuning the
// decoding kernels").
template <typename kv_t>
struct Stream {
  const Problem& pr;
  const std::vector<Item>& items;
  const std::vector<Task>& tasks;
  const kv_t* k_pool;
  const kv_t* v_pool;
  int64_t task, end, j;  // the next row to ask for: key j of task ``task``
  // Ask for the next n rows (keys and values) of the thread's tasks.
  void ask(int64_t n) {
    while (n > 0 && task < end) {
      const Task& tk = tasks[task];
      const Item& it = items[tk.item];
      const int64_t* table = pr.tables + it.seq * pr.tables_sb;
      for (; n > 0 && j < tk.j1; j++, n--) {
        const int64_t at =
            table[j / pr.s] * pr.pool_sn + (j % pr.s) * pr.pool_ss + it.hk * pr.pool_sh;
        prefetch_row(k_pool + at, pr.d);
        prefetch_row(v_pool + at, pr.d);
      }
      if (j >= tk.j1 && ++task < end) j = tasks[task].j0;
    }
  }
};

// Whether tasks transpose their key tiles (chunk_state): never with AVX-512 or AVX2, where the
// scores are summed from the key rows as stored (direct_scores), always in the portable build.
// One way for every task keeps a row's scores the same bits whether its query decodes alone or
// comes in a prefill chunk of many rows (see CHUNK).
inline bool transposes(int64_t rows) {
  (void)rows;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return false;
#else
  return true;
#endif
}

// Per-thread buffers of one task, sized for the call's largest item. A decoding step's items
// are g rows and read the keys as stored: buffers for a prefill chunk's 64 rows and a transposed
// tile, allocated and zeroed on every call and thread, took about a tenth of one sequence's
// attention.
struct Scratch {
  Floats q_rows, s, k_t, square;
  std::vector<const void*> k_rows, v_rows;  // this tile's rows in the pools
  Scratch(const Problem& pr)
      : q_rows(pr.rows_max * pr.d_p), s(pr.rows_max * TILE),
        k_t(transposes(pr.rows_max) ? pr.d_p * TILE : 0),
        square(transposes(pr.rows_max) ? SQUARE * pr.d_p : 0), k_rows(TILE), v_rows(TILE) {}
};

// One task: the item's rows against its keys [j0, j1). Leaves the unnormalised state in m
// (rows), l (rows), acc (rows x d_p). Row x = k * g + r: query position q0 + k, head hk * g + r.
// ``stream``: the thread's rows asked for ahead, moved on as this task reads its keys.
template <typename kv_t>
void chunk_state(const Problem& pr, const kv_t* k_pool, const kv_t* v_pool, const Item& it,
                 int64_t j0, int64_t j1, float* m, float* l, float* acc, Scratch& w,
                 Stream<kv_t>& stream) {
  const int64_t g = pr.g, d = pr.d, d_p = pr.d_p, rows = (it.q1 - it.q0) * g;
  const int64_t* table = pr.tables + it.seq * pr.tables_sb;
  const int64_t first = pr.starts[it.seq];
  // Query k of the sequence's i new tokens is position length - i + k: it sees keys up to it.
  const int64_t context = pr.lengths[it.seq] - (pr.starts[it.seq + 1] - first);
  for (int64_t k = it.q0; k < it.q1; k++) {
    for (int64_t r = 0; r < g; r++) {
      const float* src = pr.q + (first + k) * pr.q_st + (it.hk * g + r) * pr.q_sh;
      float* dst = w.q_rows.data() + ((k - it.q0) * g + r) * d_p;
      std::copy(src, src + d, dst);
      std::fill(dst + d, dst + d_p, 0.0f);
    }
  }
  // State(): m = blocked, l = 0, acc = 0 (softmax.py, the first-tile convention)
  std::fill(m, m + rows, std::numeric_limits<float>::lowest());
  std::fill(l, l + rows, 0.0f);
  std::fill(acc, acc + rows * d_p, 0.0f);
  auto k_rows = reinterpret_cast<const kv_t**>(w.k_rows.data());
  auto v_rows = reinterpret_cast<const kv_t**>(w.v_rows.data());
  float* s = w.s.data();
  for (int64_t t0 = j0; t0 < j1; t0 += TILE) {
    const int64_t n = std::min(TILE, j1 - t0), n_p = (n + W - 1) / W * W;
    rows_of(pr, k_pool, table, it.hk, t0, n, k_rows);
    rows_of(pr, v_pool, table, it.hk, t0, n, v_rows);
    // s = q k^T, every row against the tile
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    if (!transposes(rows)) {
      by_rows(rows, [&](auto R, int64_t r0) {  // one group of rows moves the stream on
        direct_scores<R>(w.q_rows.data() + r0 * d_p, d, d_p, k_rows, n, n_p, s + r0 * TILE,
                         [&](int64_t keys) {
                           if (r0 == 0) stream.ask(keys);
                         });
      });
    } else
#endif
    {
      transposed_keys(k_rows, n, d, d_p, w.k_t.data(), w.square.data(),
                      [&](int64_t keys) { stream.ask(keys); });
      by_rows(rows, [&](auto R, int64_t r0) {
        scores<R>(w.q_rows.data() + r0 * d_p, d, d_p, w.k_t.data(), n_p, s + r0 * TILE);
      });
    }
    // the logits (causal: keys [0, context + k] of the tile's columns) and the online softmax,
    // over the n_p columns padded to whole vectors (blocked past n): a row's sums then take
    // the same steps however many keys past its own the tile holds for the other rows.
    for (int64_t x = 0; x < rows; x++) {
      float* s_row = s + x * TILE;
      const int64_t visible_end = std::min(n, context + it.q0 + x / g + 1 - t0);
      const float top = logits_row<float>(s_row, n_p, pr.scale2, nullptr, nullptr, 0, nullptr, 0,
                                          0, visible_end);
      update<float>(s_row, n_p, top, m[x], l[x], acc + x * d_p, d_p);
    }
    // acc += p v_t
    by_rows(rows, [&](auto R, int64_t r0) {
      add_values<R>(
          s + r0 * TILE, [&](int64_t c) { return v_rows[c]; }, n, d, d_p,
          [](int64_t) { return true; }, acc + r0 * d_p);  // blocked keys have p = 0
    });
  }
}

template <typename kv_t>
void paged_kernel(const Problem& pr, const std::vector<Item>& items,
                  const std::vector<Task>& tasks, const Tensor& key_pool,
                  const Tensor& value_pool, float* out) {
  const kv_t* k_pool = key_pool.data_ptr<kv_t>();
  const kv_t* v_pool = value_pool.data_ptr<kv_t>();
  const int64_t g = pr.g, d_p = pr.d_p, rows_max = pr.rows_max;
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  // Where a row's output goes: packed row first + k, head hk * g + r.
  auto out_row = [&](const Item& it, int64_t x) {
    const int64_t k = it.q0 + x / g, head = it.hk * g + x % g;
    return out + ((pr.starts[it.seq] + k) * pr.h + head) * pr.d;
  };
  // The split items' chunk states, merged below (one slot of rows_max rows per task).
  bool any_split = false;
  for (const Item& it : items) any_split |= it.chunks > 1;
  Floats part_m, part_l, part_acc;
  if (any_split) {
    part_m.resize(n_tasks * rows_max), part_l.resize(n_tasks * rows_max);
    part_acc.resize(n_tasks * rows_max * d_p);
  }
  at::parallel_for(0, n_tasks, 1, [&](int64_t begin, int64_t end) {
    note_thread();
    const SubnormalsAsZero subnormals;
    Scratch w(pr);
    Floats m(rows_max), l(rows_max), acc(rows_max * d_p);
    Stream<kv_t> stream{pr, items, tasks, k_pool, v_pool, begin, end, tasks[begin].j0};
    stream.ask(STREAM_AHEAD);
    for (int64_t task = begin; task < end; task++) {
      const Task& tk = tasks[task];
      const Item& it = items[tk.item];
      const bool split = it.chunks > 1;
      float* tm = split ? part_m.data() + task * rows_max : m.data();
      float* tl = split ? part_l.data() + task * rows_max : l.data();
      float* ta = split ? part_acc.data() + task * rows_max * d_p : acc.data();
      chunk_state<kv_t>(pr, k_pool, v_pool, it, tk.j0, tk.j1, tm, tl, ta, w, stream);
      if (split) continue;
      for (int64_t x = 0; x < (it.q1 - it.q0) * g; x++) {
        float lse, top, log_l;
        finish<float>(tm[x], tl[x], ta + x * d_p, pr.d, out_row(it, x), lse, top, log_l);
      }
    }
  });
  if (!any_split) return;
  // Merge (flash-decoding's reduction): m = max_c m_c, l = sum_c l_c 2^(m_c - m),
  // acc = sum_c acc_c 2^(m_c - m); then finish as one state. One unit per split item and row.
  std::vector<std::pair<int64_t, int64_t>> merges;  // (item, row)
  for (int64_t i = 0; i < static_cast<int64_t>(items.size()); i++) {
    if (items[i].chunks == 1) continue;
    for (int64_t x = 0; x < (items[i].q1 - items[i].q0) * g; x++) merges.emplace_back(i, x);
  }
  at::parallel_for(0, static_cast<int64_t>(merges.size()), 16, [&](int64_t begin, int64_t end) {
    const SubnormalsAsZero subnormals;
    Floats acc(d_p);
    for (int64_t u = begin; u < end; u++) {
      const auto [i, x] = merges[u];
      const Item& it = items[i];
      float m = std::numeric_limits<float>::lowest(), l = 0.0f;
      for (int64_t c = 0; c < it.chunks; c++) {
        m = nan_max(m, part_m[(it.first_task + c) * rows_max + x]);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t c = 0; c < it.chunks; c++) {
        const int64_t slot = (it.first_task + c) * rows_max + x;
        const float wgt = std::exp2(part_m[slot] - m);
        l += part_l[slot] * wgt;
        const float* a = part_acc.data() + slot * d_p;
        at::vec::map2([wgt](Vec u, Vec v) { return at::vec::fmadd(Vec(wgt), v, u); },
                      acc.data(), acc.data(), a, d_p);
      }
      float lse, top, log_l;
      finish<float>(m, l, acc.data(), pr.d, out_row(it, x), lse, top, log_l);
    }
  });
}

}  // namespace

// paged()'s operands checked: shapes, types, and every block a table names for a sequence's
// keys within the pool (the kernel trusts them).
void paged_check(const Tensor& q, const Tensor& key_pool, const Tensor& value_pool,
                 const Tensor& block_tables, const Tensor& lengths, const Tensor& starts,
                 const Tensor& out) {
  for (const Tensor* x : {&q, &key_pool, &value_pool, &block_tables, &lengths, &starts, &out}) {
    TORCH_CHECK(x->device().is_cpu(), "fused paged: every tensor must be on the CPU");
  }
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1,
              "fused paged: q must be float32 (t, h, d), contiguous in d, got ", q.scalar_type(),
              " ", q.sizes());
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2);
  TORCH_CHECK(key_pool.dim() == 4 && key_pool.sizes() == value_pool.sizes(),
              "fused paged: the pools must be (N, s, h_kv, d) of one shape, got keys ",
              key_pool.sizes(), " and values ", value_pool.sizes());
  TORCH_CHECK(key_pool.strides() == value_pool.strides() && key_pool.stride(3) == 1,
              "fused paged: the pools must have the same strides and be contiguous in d");
  TORCH_CHECK(key_pool.scalar_type() == value_pool.scalar_type() &&
                  is_kv_type(key_pool.scalar_type()),
              "fused paged: the pools must both be float32, both bfloat16 or both float16, got ",
              key_pool.scalar_type(), " and ", value_pool.scalar_type());
  const int64_t n_blocks = key_pool.size(0), s = key_pool.size(1), hk = key_pool.size(2);
  TORCH_CHECK(key_pool.size(3) == d && hk > 0 && h % hk == 0, "fused paged: q (t, h, d) = ",
              q.sizes(), " needs pools (N, s, h_kv, d) with the same d and h_kv dividing h, got ",
              key_pool.sizes());
  const int64_t b = lengths.numel();
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong &&
                  block_tables.stride(1) == 1 && block_tables.size(0) == b,
              "fused paged: block_tables must be int64 (b, m) contiguous in m with b = ", b,
              ", got ", block_tables.scalar_type(), " ", block_tables.sizes());
  TORCH_CHECK(lengths.dim() == 1 && lengths.scalar_type() == at::kLong &&
                  lengths.is_contiguous() && starts.dim() == 1 &&
                  starts.scalar_type() == at::kLong && starts.is_contiguous() &&
                  starts.numel() == b + 1,
              "fused paged: lengths (b,) and starts (b + 1,) must be contiguous int64, got ",
              lengths.sizes(), " and ", starts.sizes());
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == q.sizes(),
              "fused paged: out must be contiguous float32 of q's shape ", q.sizes());
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* tab = block_tables.data_ptr<int64_t>();
  const int64_t m = block_tables.size(1);
  // Every row a task reads must exist: the kernel trusts these, so they are checked here.
  TORCH_CHECK(st[0] == 0 && st[b] == t, "fused paged: starts must run from 0 to t = ", t);
  for (int64_t n = 0; n < b; n++) {
    const int64_t i = st[n + 1] - st[n];
    TORCH_CHECK(i >= 0 && i <= len[n] && len[n] <= m * s, "fused paged: sequence ", n, " has ",
                i, " new tokens and length ", len[n], ": needs 0 <= new <= length <= m * s = ",
                m * s);
    for (int64_t x = 0; x < (len[n] + s - 1) / s; x++) {
      const int64_t block = tab[n * block_tables.stride(0) + x];
      TORCH_CHECK(block >= 0 && block < n_blocks, "fused paged: block_tables[", n, ", ", x,
                  "] = ", block, " is not a block of the pool (N = ", n_blocks, ")");
    }
  }
}

// out = paged attention of q (t, h, d) over the pools (N, s, hk, d) through block_tables (b, m)
// int64, with lengths (b,) int64 keys per sequence and starts (b + 1,) int64 packed query rows
// per sequence (starts[n + 1] - starts[n] new tokens, at most lengths[n]). See paged.py.
void paged(const Tensor& q, const Tensor& key_pool, const Tensor& value_pool,
           const Tensor& block_tables, const Tensor& lengths, const Tensor& starts, double scale,
           const Tensor& out) {
  paged_check(q, key_pool, value_pool, block_tables, lengths, starts, out);
  const int64_t h = q.size(1), d = q.size(2);
  const int64_t s = key_pool.size(1), hk = key_pool.size(2);
  const int64_t b = lengths.numel();
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* tab = block_tables.data_ptr<int64_t>();
  Problem pr;
  pr.h = h, pr.hk = hk, pr.g = h / hk, pr.d = d, pr.d_p = (d + W - 1) / W * W, pr.s = s;
  const int64_t positions = std::max<int64_t>(1, QUERY_ROWS / pr.g);  // query positions per item
  pr.scale2 = static_cast<float>(scale * LOG2E);
  pr.q = q.data_ptr<float>(), pr.q_st = q.stride(0), pr.q_sh = q.stride(1);
  pr.tables = tab, pr.tables_sb = block_tables.stride(0);
  pr.lengths = len, pr.starts = st;
  pr.pool_sn = key_pool.stride(0), pr.pool_ss = key_pool.stride(1), pr.pool_sh = key_pool.stride(2);

  // The items: (sequence, key head, block of query positions); a block's last query bounds the
  // keys it reads. Then each item's keys are split into chunks (the tasks).
  std::vector<Item> items;
  int64_t rows = 1;  // the most rows of any item (a decoding step's: g)
  for (int64_t n = 0; n < b; n++) {
    const int64_t i = st[n + 1] - st[n], context = len[n] - i;
    for (int64_t head = 0; head < hk; head++) {
      for (int64_t q0 = 0; q0 < i; q0 += positions) {
        const int64_t q1 = std::min(i, q0 + positions);
        items.push_back({n, head, q0, q1, context + q1, 1, 0});
        rows = std::max(rows, (q1 - q0) * pr.g);
      }
    }
  }
  pr.rows_max = rows;  // the per-thread buffers and the chunks' slots hold this many rows
  std::vector<Task> tasks;
  for (int64_t x = 0; x < static_cast<int64_t>(items.size()); x++) {
    Item& it = items[x];
    it.chunks = std::max<int64_t>(1, (it.keys + CHUNK - 1) / CHUNK);
    it.first_task = static_cast<int64_t>(tasks.size());
    for (int64_t c = 0; c < it.chunks; c++) {
      tasks.push_back({x, c * CHUNK, std::min(it.keys, (c + 1) * CHUNK)});
    }
  }
  begin_parallel();
  with_kv_type(key_pool.scalar_type(), [&](auto kv) {
    paged_kernel<decltype(kv)>(pr, items, tasks, key_pool, value_pool, out.data_ptr<float>());
  });
}

}  // namespace attnkit_fused
