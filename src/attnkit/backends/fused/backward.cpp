// The fused backward: the tiled backward (src/attnkit/backends/tiled/backward.py) as one C++
// loop, recomputing each tile's weights from the saved log-sum-exp (FlashAttention section 3.1;
// the loop order of FlashAttention-2, Dao 2023, Algorithm 2: key tiles outside, queries inside):
//
//     D = rowsum(dO * O)                      (given, ``delta``)
//     p = exp2((s - m) - log2 l);  dV_t += p^T dO;  dS = p * (dO v_t^T - D);  dQ += dS k_t;  dK_t += dS^T q
//
// Everything runs transposed (rows = keys, columns = queries: s^T = k_t q^T), so that each of
// the five matmuls reads its operands as stored, without a transposed copy of a tile:
//
//     s^T = k_t q^T      dP^T = v_t dO^T      dV_t += P^T dO      dK_t += dS^T q      dQ^T += k_t^T dS^T
//
// Work is split over (batch, query head): each owns its dQ and its own dK, dV (summed over the
// query heads of a key head afterwards), so no two threads write the same memory.
#include "fused.h"

namespace attnkit_fused {

namespace {

template <typename scalar_t, typename acc_t>
void backward_kernel(const Spec<acc_t>& sp, const Tensor& k, const Tensor& v, const Tensor& k_t,
                     const Tensor& q_t, const Tensor& do_t, const Tensor& do_rows,
                     const Tensor& q_rows, const Tensor& shift, const Tensor& delta,
                     const Tensor& dq_t, const Tensor& dk, const Tensor& dv, const Opt& dbias,
                     bool nan_rows) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr bool packed = std::is_same_v<scalar_t, at::BFloat16>;
  constexpr int64_t step = column_step<scalar_t>();
  const int64_t g = sp.h / sp.hk;
  const int64_t d_p = k.size(3), dv_p = v.size(3), nj_p = k.size(2);
  const int64_t ld_qt = q_t.size(3) / step, ld_dot = do_t.size(3) / step;  // = n_i padded
  const int64_t ld_do = do_rows.size(3) / step, ld_qr = q_rows.size(3) / step;
  const int64_t ni_p = ld_qt;
  const acc_t blocked = sp.blocked();
  acc_t* dbias_data = dbias ? dbias->data_ptr<acc_t>() : nullptr;
  // Skipping (skipping.py): not when the bias gradient is wanted (it would drop small parts).
  const bool skipping = sp.relative != nullptr && sp.q_norm != nullptr && dbias_data == nullptr;

  at::parallel_for(0, sp.nb * sp.h, 1, [&](int64_t begin, int64_t end) {
    note_thread();
    const SubnormalsAsZero subnormals;
    const int64_t bk = sp.block_k + 1, bq = sp.block_q + 1;
    std::vector<acc_t> s(bk * bq), dp(bk * bq);
    std::vector<scalar_t> p_op(packed ? bk * bq : 0), ds_op(packed ? bk * bq : 0);
    std::vector<scalar_t> ds_pairs(packed ? (bk + 1) * bq * 2 : 0);
    for (int64_t item = begin; item < end; item++) {
      const int64_t b = item / sp.h, h = item % sp.h, hk = h / g;
      const int64_t bh = b * sp.h + h, bhk = b * sp.hk + hk;
      const scalar_t* k_head = k.data_ptr<scalar_t>() + bhk * nj_p * d_p;
      const scalar_t* v_head = v.data_ptr<scalar_t>() + bhk * nj_p * dv_p;
      const scalar_t* kt_head = k_t.data_ptr<scalar_t>() + bhk * k_t.stride(1);
      const scalar_t* qt_head = q_t.data_ptr<scalar_t>() + bh * q_t.stride(1);
      const scalar_t* dot_head = do_t.data_ptr<scalar_t>() + bh * do_t.stride(1);
      const scalar_t* do_head = do_rows.data_ptr<scalar_t>() + bh * do_rows.stride(1);
      const scalar_t* qr_head = q_rows.data_ptr<scalar_t>() + bh * q_rows.stride(1);
      // the forward's row maximum m and log2 l, apart (forward.cpp ``finish``)
      const acc_t* top_head = shift.data_ptr<acc_t>() + bh * sp.ni;
      const acc_t* log_l_head = top_head + sp.nb * sp.h * sp.ni;
      const acc_t* delta_head = delta.data_ptr<acc_t>() + bh * sp.ni;
      acc_t* dqt_head = dq_t.data_ptr<acc_t>() + bh * dq_t.stride(1);
      acc_t* dk_head = dk.data_ptr<acc_t>() + bh * dk.stride(1);
      acc_t* dv_head = dv.data_ptr<acc_t>() + bh * dv.stride(1);
      const acc_t* kn = skipping ? sp.k_norm + bhk * sp.nj : nullptr;
      const acc_t* qn = skipping ? sp.q_norm + bh * sp.ni : nullptr;
      for (int64_t kb = 0, j0 = 0; j0 < sp.nj; kb++, j0 += sp.block_k) {
        const int64_t j1 = std::min(sp.nj, j0 + sp.block_k), rows = j1 - j0;
        const int64_t rows_p = packed ? rows + (rows & 1) : rows;
        const acc_t k_top = skipping ? *std::max_element(kn + j0, kn + j1) : acc_t(0);
        // the query tiles that keep this key tile (the plan by key: TilePlan.by_key)
        for (const KeyTile& t : planned_tiles(sp, kb)) {
          const int64_t i0 = t.j0, i1 = t.j1, cols = i1 - i0;
          const int64_t cols_p = packed ? cols + (cols & 1) : cols;
          const bool full = t.full;
          if (!full && !mask_any(sp, b, h, i0, i1, j0, j1)) continue;
          if (skipping) {  // skipping.py ``needed`` against the log-sum-exp
            acc_t top = relative_top(sp, h, i0, i1, j0, j1, true) * static_cast<acc_t>(LOG2E);
            acc_t bound = top + *std::max_element(qn + i0, qn + i1) * k_top + 1;
            acc_t lse2 = std::numeric_limits<acc_t>::infinity();
            for (int64_t i = i0; i < i1; i++) lse2 = std::min(lse2, top_head[i] + log_l_head[i]);
            if (bound < lse2 - sp.negligible) {
              continue;
            }
          }
          // s^T = k_t q^T; p^T = exp2((s^T - m) - log2 l) (masked: 0)
          matmul(rows, cols, d_p, k_head + j0 * d_p, d_p, qt_head + i0 * step, ld_qt, s.data(),
                 cols, false);
          // dP^T = v_t dO^T
          matmul(rows, cols, dv_p, v_head + j0 * dv_p, dv_p, dot_head + i0 * step, ld_dot,
                 dp.data(), cols, false);
          for (int64_t r = 0; r < rows; r++) {
            const int64_t j = j0 + r;
            acc_t* s_row = s.data() + r * cols;
            acc_t* ds_row = dp.data() + r * cols;
            int64_t lo = 0, hi = cols;
            if (!full) lo = j - sp.band_hi - i0, hi = j - sp.band_lo + 1 - i0;
            // the relative table is stored reversed: entry (i, j) at i - j + n_j - 1
            const acc_t* rel = sp.relative ? sp.relative + h * sp.rel_length() +
                                                 (i0 - j + sp.nj - 1)
                                           : nullptr;
            const acc_t* bias = sp.bias ? sp.bias + b * sp.bias_sb + h * sp.bias_sh +
                                              i0 * sp.bias_si + j * sp.bias_sj
                                        : nullptr;
            const bool* mask = sp.mask ? sp.mask + b * sp.mask_sb + h * sp.mask_sh +
                                             i0 * sp.mask_si + j * sp.mask_sj
                                       : nullptr;
            logits_row(s_row, cols, sp.scale2, rel, bias, sp.bias_si, mask, sp.mask_si, lo, hi);
            // p = exp2(s - lse2) (backward.py ``exp2_shifted``), lse2 = m + log2 l subtracted
            // a part at a time; dS = p * (dP - D)
            at::vec::map3([](Vec x, Vec m, Vec log_l) { return ((x - m) - log_l).exp2(); },
                          s_row, s_row, top_head + i0, log_l_head + i0, cols);
            if (nan_rows) {  // a NaN row must not spread through its blocked positions
              for (int64_t c = 0; c < cols; c++) {
                if (c < lo || c >= hi || (mask && !mask[c * sp.mask_si])) s_row[c] = 0;
              }
            }
            at::vec::map3([](Vec x, Vec p, Vec dd) { return p * (x - dd); }, ds_row, ds_row,
                          s_row, delta_head + i0, cols);
            if (nan_rows) {
              for (int64_t c = 0; c < cols; c++) {
                if (s_row[c] == acc_t(0)) ds_row[c] = 0;
              }
            }
            if (dbias_data != nullptr) {  // d loss / d bias = dS (natural units)
              acc_t* dst = dbias_data + (bh * sp.ni + i0) * sp.nj + j;
              for (int64_t c = 0; c < cols; c++) dst[c * sp.nj] = ds_row[c];
            }
            if constexpr (packed) {
              as_operand(s_row, p_op.data() + r * cols_p, cols, cols_p);
              as_operand(ds_row, ds_op.data() + r * cols_p, cols, cols_p);
            }
          }
          if constexpr (packed) {
            for (int64_t r = 0; r < rows_p; r += 2) {  // dS^T as a packed B operand
              const acc_t* second = r + 1 < rows ? dp.data() + (r + 1) * cols : nullptr;
              as_packed_pair(dp.data() + r * cols, second, ds_pairs.data() + r * cols, cols);
            }
            // dV_t += P^T dO;  dK_t += dS^T q;  dQ^T += k_t^T dS^T
            matmul(rows, dv_p, cols_p, p_op.data(), cols_p, do_head + i0 * ld_do, ld_do,
                   dv_head + j0 * dv_p, dv_p, true);
            matmul(rows, d_p, cols_p, ds_op.data(), cols_p, qr_head + i0 * ld_qr, ld_qr,
                   dk_head + j0 * d_p, d_p, true);
            matmul(d_p, cols, rows_p, kt_head + j0, nj_p, ds_pairs.data(), cols,
                   dqt_head + i0, ni_p, true);
          } else {
            matmul(rows, dv_p, cols, s.data(), cols, do_head + i0 * ld_do, ld_do,
                   dv_head + j0 * dv_p, dv_p, true);
            matmul(rows, d_p, cols, dp.data(), cols, qr_head + i0 * ld_qr, ld_qr,
                   dk_head + j0 * d_p, d_p, true);
            matmul(d_p, cols, rows, kt_head + j0, nj_p, dp.data(), cols, dqt_head + i0, ni_p,
                   true);
          }
        }
      }
    }
  });
}

}  // namespace

void backward(const Tensor& k, const Tensor& v, const Tensor& k_t, const Tensor& q_t,
              const Tensor& do_t, const Tensor& do_rows, const Tensor& q_rows, const Tensor& shift,
              const Tensor& delta, const Tensor& dq_t, const Tensor& dk, const Tensor& dv,
              const Opt& dbias, const Opt& mask, const Opt& bias, const Opt& relative,
              const Tensor& plan_offsets, const Tensor& plan_tiles, const Opt& q_norm,
              const Opt& k_norm, const Named& sizes, const NamedF& numbers) {
  for (const Tensor* t : {&k, &v, &k_t, &q_t, &do_t, &do_rows, &q_rows, &shift, &delta, &dq_t,
                          &dk, &dv}) {
    TORCH_CHECK(t->is_contiguous(), "fused backward: operands must be contiguous");
  }
  const bool nan_rows = numbers.at("nan_rows") != 0.0;
  begin_parallel();
  switch (k.scalar_type()) {
    case at::kFloat:
      backward_kernel<float, float>(
          make_spec<float>(mask, bias, relative, plan_offsets, plan_tiles, q_norm, k_norm, sizes, numbers), k, v,
          k_t, q_t, do_t, do_rows, q_rows, shift, delta, dq_t, dk, dv, dbias, nan_rows);
      break;
    case at::kDouble:
      backward_kernel<double, double>(
          make_spec<double>(mask, bias, relative, plan_offsets, plan_tiles, q_norm, k_norm, sizes, numbers), k, v,
          k_t, q_t, do_t, do_rows, q_rows, shift, delta, dq_t, dk, dv, dbias, nan_rows);
      break;
    case at::kBFloat16:
      backward_kernel<at::BFloat16, float>(
          make_spec<float>(mask, bias, relative, plan_offsets, plan_tiles, q_norm, k_norm, sizes, numbers), k, v,
          k_t, q_t, do_t, do_rows, q_rows, shift, delta, dq_t, dk, dv, dbias, nan_rows);
      break;
    default:
      TORCH_CHECK(false, "fused backward: unsupported dtype ", k.scalar_type());
  }
}

}  // namespace attnkit_fused
