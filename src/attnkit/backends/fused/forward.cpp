// The fused forward: the tiled forward (src/attnkit/backends/tiled/forward.py) as one C++ loop.
//
//     for each (batch, head, query block):  state = empty
//         for each key tile the call's tile plan keeps for it (tiles.py ``groups``):
//             s = q k_t^T * scale * log2(e) + bias_t * log2(e)    (masked: blocked)
//             state = update(state, s, v_t, exact_shift(state, s))
//         output, lse = finish(state)
//
// The shift is always the exact running maximum (softmax.py ``exact_shift``): computing it costs
// one pass that the scaling needs anyway. With a relative bias, tiles whose largest possible
// logit lies ``negligible`` bits below every row's maximum are skipped before their matmul
// (skipping.py ``needed``), nearest keys first (tiles.py ``order``).
#include "fused.h"

namespace attnkit_fused {

namespace {

// The key tiles of query tile qb (the plan's row; tiles.py ``groups``), nearest keys first with
// a relative bias (tiles.py ``order``: the running maximum starts high).
template <typename acc_t>
std::vector<KeyTile> key_tiles(const Spec<acc_t>& sp, int64_t qb, int64_t i0, int64_t i1) {
  std::vector<KeyTile> tiles = planned_tiles(sp, qb);
  if (sp.relative != nullptr) {
    double centre = (i0 + i1) / 2.0;
    std::stable_sort(tiles.begin(), tiles.end(), [centre](const KeyTile& a, const KeyTile& b) {
      return std::abs((a.j0 + a.j1) / 2.0 - centre) < std::abs((b.j0 + b.j1) / 2.0 - centre);
    });
  }
  return tiles;
}

template <typename scalar_t, typename acc_t>
void forward_kernel(const Spec<acc_t>& sp, const Tensor& q, const Tensor& k_t, const Tensor& v,
                    const Tensor& out, const Tensor& lse, const Tensor& shift, const Opt& poisoned,
                    const Opt& bad) {
  constexpr bool packed = std::is_same_v<scalar_t, at::BFloat16>;
  constexpr int64_t step = column_step<scalar_t>();
  const int64_t g = sp.h / sp.hk, nqb = (sp.ni + sp.block_q - 1) / sp.block_q;
  const int64_t ni_p = q.size(2), d_p = q.size(3);
  const int64_t ld_kt = k_t.size(3) / step, ld_v = v.size(3) / step;  // B operands' columns
  const int64_t dv_p = ld_v;
  const scalar_t* q_data = q.data_ptr<scalar_t>();
  const scalar_t* kt_data = k_t.data_ptr<scalar_t>();
  const scalar_t* v_data = v.data_ptr<scalar_t>();
  acc_t* out_data = out.data_ptr<acc_t>();
  acc_t* lse_data = lse.data_ptr<acc_t>();
  acc_t* top_data = shift.data_ptr<acc_t>();  // shift[0]: m; shift[1]: log2 l (base 2)
  acc_t* log_l_data = top_data + sp.nb * sp.h * sp.ni;
  bool* poison_data = poisoned ? poisoned->data_ptr<bool>() : nullptr;
  const bool* bad_data = bad ? bad->data_ptr<bool>() : nullptr;
  const acc_t blocked = sp.blocked();
  const bool skipping = sp.relative != nullptr && sp.q_norm != nullptr && bad_data == nullptr;

  at::parallel_for(0, sp.nb * sp.h * nqb, 1, [&](int64_t begin, int64_t end) {
    note_thread();
    const SubnormalsAsZero subnormals;
    const int64_t bq = sp.block_q, bk = sp.block_k + 1;
    std::vector<acc_t> s(bq * bk), acc(bq * dv_p), m(bq), l(bq);
    std::vector<scalar_t> p_op(packed ? bq * (bk + 1) : 0);
    for (int64_t item = begin; item < end; item++) {
      const int64_t b = item / (sp.h * nqb), h = (item / nqb) % sp.h, qb = item % nqb;
      const int64_t hk = h / g, i0 = qb * sp.block_q, i1 = std::min(sp.ni, i0 + sp.block_q);
      const int64_t rows = i1 - i0;
      const scalar_t* q_blk = q_data + ((b * sp.h + h) * ni_p + i0) * d_p;
      const scalar_t* kt_head = kt_data + (b * sp.hk + hk) * k_t.stride(1);
      const scalar_t* v_head = v_data + (b * sp.hk + hk) * v.stride(1);
      // State(): m = blocked, l = 0, acc = 0 (softmax.py, the first-tile convention)
      std::fill(m.begin(), m.begin() + rows, blocked);
      std::fill(l.begin(), l.begin() + rows, acc_t(0));
      std::fill(acc.begin(), acc.begin() + rows * dv_p, acc_t(0));
      acc_t q_top = 0;
      if (skipping) {
        const acc_t* qn = sp.q_norm + (b * sp.h + h) * sp.ni;
        q_top = *std::max_element(qn + i0, qn + i1);
      }
      bool started = false;
      for (const KeyTile& t : key_tiles(sp, qb, i0, i1)) {
        if (!t.full && !mask_any(sp, b, h, i0, i1, t.j0, t.j1)) continue;
        if (skipping && started) {  // skipping.py ``needed``: bound below every row's floor?
          const acc_t* kn = sp.k_norm + (b * sp.hk + hk) * sp.nj;
          acc_t k_top = *std::max_element(kn + t.j0, kn + t.j1);
          acc_t top = relative_top(sp, h, i0, i1, t.j0, t.j1) * static_cast<acc_t>(LOG2E);
          acc_t bound = top + q_top * k_top + 1;
          acc_t floor = *std::min_element(m.begin(), m.begin() + rows);
          if (bound < floor - sp.negligible) continue;
        }
        started = true;
        const int64_t cols = t.j1 - t.j0, cols_p = packed ? cols + (cols & 1) : cols;
        // s = q k_t^T (tiles.py ``logits``: bmm(q2, k_tt))
        matmul(rows, cols, d_p, q_blk, d_p, kt_head + t.j0 * step, ld_kt, s.data(), cols, false);
        for (int64_t r = 0; r < rows; r++) {
          const int64_t i = i0 + r;
          acc_t* s_row = s.data() + r * cols;
          int64_t lo = 0, hi = cols;
          if (!t.full) lo = sp.band_first_key(i) - t.j0, hi = sp.band_end_key(i) - t.j0;
          const acc_t* rel =
              sp.relative ? sp.relative + h * sp.rel_length() + (t.j0 - i + sp.ni - 1) : nullptr;
          const acc_t* bias = sp.bias ? sp.bias + b * sp.bias_sb + h * sp.bias_sh +
                                            i * sp.bias_si + t.j0 * sp.bias_sj
                                      : nullptr;
          const bool* mask = sp.mask ? sp.mask + b * sp.mask_sb + h * sp.mask_sh +
                                           i * sp.mask_si + t.j0 * sp.mask_sj
                                     : nullptr;
          acc_t top = logits_row(s_row, cols, sp.scale2, rel, bias, sp.bias_sj, mask,
                                 sp.mask_sj, lo, hi);
          if (bad_data != nullptr) {  // forward.py ``_Reach``: rows that see a non-finite value
            const bool* bad_head = bad_data + (b * sp.hk + hk) * sp.nj * sp.dv;
            bool* poison_row = poison_data + ((b * sp.h + h) * sp.ni + i) * sp.dv;
            for (int64_t c = 0; c < cols; c++) {
              if (!(s_row[c] > blocked || std::isnan(s_row[c]))) continue;
              const bool* bad_key = bad_head + (t.j0 + c) * sp.dv;
              for (int64_t e = 0; e < sp.dv; e++) poison_row[e] |= bad_key[e];
            }
          }
          update(s_row, cols, top, m[r], l[r], acc.data() + r * dv_p, dv_p);
          if constexpr (packed) as_operand(s_row, p_op.data() + r * cols_p, cols, cols_p);
        }
        // acc += p v_t
        if constexpr (packed) {
          matmul(rows, dv_p, cols_p, p_op.data(), cols_p, v_head + t.j0 * ld_v, ld_v,
                 acc.data(), dv_p, true);
        } else {
          matmul(rows, dv_p, cols, s.data(), cols, v_head + t.j0 * ld_v, ld_v, acc.data(), dv_p,
                 true);
        }
      }
      for (int64_t r = 0; r < rows; r++) {
        const int64_t row = (b * sp.h + h) * sp.ni + i0 + r;
        finish(m[r], l[r], acc.data() + r * dv_p, sp.dv, out_data + row * sp.dv, lse_data[row],
               top_data[row], log_l_data[row]);
      }
    }
  });
}

}  // namespace

void forward(const Tensor& q, const Tensor& k_t, const Tensor& v, const Tensor& out,
             const Tensor& lse, const Tensor& shift, const Opt& poisoned, const Opt& bad,
             const Opt& mask, const Opt& bias, const Opt& relative, const Tensor& plan_offsets,
             const Tensor& plan_tiles, const Opt& q_norm, const Opt& k_norm, const Named& sizes,
             const NamedF& numbers) {
  TORCH_CHECK(q.is_contiguous() && k_t.is_contiguous() && v.is_contiguous(),
              "fused forward: q, k_t, v must be contiguous");
  TORCH_CHECK(out.is_contiguous() && lse.is_contiguous() && shift.is_contiguous(),
              "fused forward: outputs");
  TORCH_CHECK(!bad || bad->is_contiguous(), "fused forward: bad must be contiguous");
  begin_parallel();
  switch (q.scalar_type()) {
    case at::kFloat:
      forward_kernel<float, float>(
          make_spec<float>(mask, bias, relative, plan_offsets, plan_tiles, q_norm, k_norm, sizes, numbers), q, k_t,
          v, out, lse, shift, poisoned, bad);
      break;
    case at::kDouble:
      forward_kernel<double, double>(
          make_spec<double>(mask, bias, relative, plan_offsets, plan_tiles, q_norm, k_norm, sizes, numbers), q, k_t,
          v, out, lse, shift, poisoned, bad);
      break;
    case at::kBFloat16:
      forward_kernel<at::BFloat16, float>(
          make_spec<float>(mask, bias, relative, plan_offsets, plan_tiles, q_norm, k_norm, sizes, numbers), q, k_t,
          v, out, lse, shift, poisoned, bad);
      break;
    default:
      TORCH_CHECK(false, "fused forward: unsupported dtype ", q.scalar_type());
  }
}

}  // namespace attnkit_fused
