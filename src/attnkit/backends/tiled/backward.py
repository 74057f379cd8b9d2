"""The tiled backward: recompute each tile's weights from the saved log-sum-exp.

Only the output and ``lse`` are saved by the forward; each tile's probabilities are recomputed
as ``p = exp2(s - lse2)`` (FlashAttention section 3.1, "recomputation"; the loop order of
FlashAttention-2, Dao 2023, Algorithm 2)::

    D = rowsum(dO * O);  dV_t += p^T dO;  dS = p * (dO v_t^T - D);  dQ += dS k_t;  dK_t += dS^T q

Extra memory is O(n * block): one tile of scores per step, never ``i x j``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit._numerics import compute_dtype
from attnkit.backends.tiled.layout import (
    add_heads,
    add_keys,
    bmm,
    flat,
    head_tile,
    heads,
    rows,
    unflat,
    unrows,
)
from attnkit.backends.tiled.skipping import can_skip, needed, row_max
from attnkit.backends.tiled.softmax import LOG2E, exp2_shifted
from attnkit.backends.tiled.tiles import KeyTiles, Sel, Spec, Tiles

__all__ = ["backward"]


def _sum_to(t: Tensor, shape: torch.Size) -> Tensor:
    """Sum a (b, h, bi, bj) tile over the axes where ``shape`` has size 1 (broadcast axes)."""
    dims = [d for d in range(4) if shape[d] == 1 and t.shape[d] != 1]
    return t.sum(dim=dims, keepdim=True) if dims else t


def _add_dbias(dbias: Tensor, ds: Tensor, tiles: Tiles, i0: int, i1: int, sel: Sel) -> None:
    """Add a tile's ``dS`` ``(b * h_kv, rows, bj)`` into ``dbias`` (the bias tensor's shape)."""
    tile = _sum_to(unrows(unflat(ds, tiles.nb), tiles.g), dbias.shape)  # (b?, h?, bi?, bj?)
    span = slice(i0, i1) if dbias.shape[2] != 1 else slice(None)
    if dbias.shape[3] == 1:
        dbias[:, :, span].add_(tile.sum(dim=3, keepdim=True))
    elif isinstance(sel, slice):
        dbias[:, :, span, sel].add_(tile)
    else:
        dbias[:, :, span].index_add_(3, sel, tile)


def _recording_mod(tiles: Tiles, i0: int, i1: int, sel: Sel, record: dict[str, Tensor]):
    """A ``mod`` for ``Tiles.logits`` that applies the score_mod with autograd on and keeps its
    input and output in ``record``, for ``_through_mod``."""

    def mod(s: Tensor) -> Tensor:
        scores = tiles.heads_layout(s).requires_grad_()  # (b, h, bi, bj), natural units
        with torch.enable_grad():
            out = tiles.score_mod(scores, i0, i1, sel)
        record["in"], record["out"] = scores, out
        return tiles.rows_layout(out.detach().to(scores.dtype))

    return mod


def _through_mod(
    tiles: Tiles, ds: Tensor, record: dict[str, Tensor], leaves: tuple, dleaves: list
) -> Tensor:
    """``ds`` (row layout, d loss / d modified score) -> d loss / d score, by the chain rule
    through the score_mod; the gradients of the tensors it captured are added to ``dleaves``."""
    grad_out = unrows(unflat(ds, tiles.nb), tiles.g)  # (b, h, bi, bj)
    grads = torch.autograd.grad(
        record["out"], (record["in"], *leaves), grad_out, retain_graph=True, allow_unused=True
    )
    for k, g in enumerate(grads[1:]):
        if g is not None:
            dleaves[k] = g if dleaves[k] is None else dleaves[k] + g
    return flat(rows(grads[0], tiles.g)).contiguous()


def backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    spec: Spec,
    want_dbias: bool,
    sinks: Tensor | None = None,
    leaves: tuple[Tensor, ...] = (),
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, list]:
    """``(dq, dk, dv, dbias, dsinks)`` in the compute dtype; ``dbias`` only for a bias tensor
    when ``want_dbias`` (its gradient disables head skipping, which would drop its small
    parts), ``dsinks`` when ``sinks`` are given, and the gradients of ``leaves``, the tensors a
    score_mod captured (None where it does not reach one).

    A sink is a key with logit ``sink_h`` and value 0, so its weight ``exp(sink_h - lse)``
    enters only through the row's log-sum-exp, and its gradient is
    ``-sum_i exp(sink_h - lse_i) * D_i`` with ``D = rowsum(dO * O)``. With ``softcap`` the
    gradient of ``q.k`` is multiplied by ``1 - tanh^2`` (recomputed from the capped scores,
    before the bias is added); the bias's own gradient is taken before that factor.

    ``out`` is the output before non-finite values of ``v`` were turned into NaN, and
    ``grad_out`` is zero where they were: those entries carry no gradient, as in the
    reference, and neither do the non-finite entries of ``v`` themselves."""
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:  # nothing was attended
        dtype = compute_dtype(q.dtype)
        dbias = None
        if want_dbias and spec.bias is not None:
            dbias = torch.zeros(spec.bias.shape, dtype=dtype, device=q.device)
        zeros = (torch.zeros(t.shape, dtype=dtype, device=t.device) for t in (q, k, v))
        dsinks = None if sinks is None else torch.zeros(sinks.shape, dtype=dtype)
        return (*zeros, dbias, dsinks, [None] * len(leaves))  # type: ignore[return-value]
    tiles = Tiles(spec, q, k)
    g, dtype, nb = tiles.g, tiles.dtype, tiles.nb
    q_c = flat(rows(q.to(dtype), g))  # (b * h_kv, i * g, d)
    k, v = flat(k.to(dtype)), flat(v.to(dtype))  # (b * h_kv, j, d)
    do = flat(rows(grad_out.to(dtype), g))  # (b * h_kv, i * g, dv)
    out_r = flat(rows(out.to(dtype), g))  # (b * h_kv, i * g, dv)
    lse_r = flat(rows(lse.to(dtype).unsqueeze(-1), g)).squeeze(-1)  # (b * h_kv, i * g)
    # A row that saw no key: every score is the blocked minimum; with lse2 = 0, p = exp2(min) = 0.
    lse2 = torch.where(lse_r <= tiles.blocked * 0.5, 0.0, lse_r * LOG2E)  # NaN stays NaN
    keys = KeyTiles(k, v, bounds=spec.has_bias)
    dq, dk, dv = torch.zeros_like(q_c), torch.zeros_like(k), torch.zeros_like(v)
    dbias = None
    if want_dbias and spec.bias is not None:
        dbias = torch.zeros(spec.bias.shape, dtype=dtype, device=q.device)
    dsink_rows = None if sinks is None else torch.zeros_like(lse2)  # (b * h_kv, i * g)
    dleaves: list[Tensor | None] = [None] * len(leaves)
    for i0 in range(0, tiles.ni, spec.block_q):
        i1 = min(tiles.ni, i0 + spec.block_q)
        r0, r1 = i0 * g, i1 * g
        q_blk, do_blk = tiles.queries(q_c[:, r0:r1]), tiles.queries(do[:, r0:r1]).contiguous()
        q2_blk = q_blk * (spec.scale * LOG2E)
        out_blk, lse_blk = tiles.queries(out_r[:, r0:r1]), tiles.queries(lse2[:, r0:r1])
        delta = (do_blk * out_blk).sum(dim=-1, keepdim=True)  # D = rowsum(dO * O)
        # A NaN row (NaN lse) would spread NaN through blocked positions too: zero them there.
        nan_rows = bool(torch.isnan(lse_blk).any())
        if dsink_rows is not None:  # d loss / d sink, per row: -exp2(sink2 - lse2) * D
            sink = tiles.sink_rows(sinks, i0, i1)
            weight = torch.exp2(sink - lse_blk) * delta.squeeze(-1)
            dsink_rows[:, r0:r1] = tiles.queries(weight.unsqueeze(-1)).squeeze(-1)
        dq_blk = torch.zeros_like(q_blk) if tiles.reverse else dq[:, r0:r1]
        q_norm = q2_blk.norm(dim=-1) if spec.has_bias else None  # (b * h_kv, rows)
        for sel, declared in tiles.groups(i0, i1):
            allowed = tiles.allowed(i0, i1, sel, declared)
            if allowed is not None and not bool(allowed.any()):
                continue
            bias = tiles.bias(i0, i1, sel)
            k_t, k_tt, _, v_tt, _ = keys.get(sel)
            lo, hi = 0, tiles.hk  # the key heads to compute: all, unless some are negligible
            if dbias is None and q_norm is not None and can_skip(tiles, allowed, bias, sel):
                assert keys.norm is not None and bias is not None
                top = row_max(tiles, bias, i0, i1, sel)
                lo, hi = needed(tiles, q_norm, keys.norm[:, sel], top, lse_blk)
            if lo == hi:
                continue
            q_h, q2_h, do_h, k_h, k_th, v_th = (
                heads(t, nb, lo, hi) for t in (q_blk, q2_blk, do_blk, k_t, k_tt, v_tt)
            )  # the tensors themselves when all heads are computed
            record: dict[str, Tensor] = {}
            mod = None if spec.score_mod is None else _recording_mod(tiles, i0, i1, sel, record)
            s, slope = tiles.logits_and_slope(q2_h, k_th, allowed, head_tile(bias, lo, hi), mod)
            p = exp2_shifted(s, heads(lse_blk, nb, lo, hi), tiles.flush_below, tiles.blocked)
            dp = bmm(do_h, v_th)  # (b * heads, rows, bj)
            ds = dp.sub_(heads(delta, nb, lo, hi)).mul_(p)  # d loss / d scores
            if record:  # through the score modification, into what it captured
                ds = _through_mod(tiles, ds, record, leaves, dleaves)
            if nan_rows and allowed is not None:
                hidden = ~head_tile(allowed, lo, hi).expand_as(unflat(s, nb))
                unflat(p, nb).masked_fill_(hidden, 0.0)
                unflat(ds, nb).masked_fill_(hidden, 0.0)
            if dbias is not None:  # the bias is added after the cap: its gradient is ds here
                _add_dbias(dbias, ds, tiles, i0, i1, sel)
            if slope is not None:  # through the cap: d capped / d raw = 1 - tanh^2
                ds.mul_(slope)
            add_heads(dq_blk, nb, lo, hi, bmm(ds, k_h))
            add_keys(dv, sel, nb, lo, hi, bmm(p.transpose(1, 2), do_h))
            add_keys(dk, sel, nb, lo, hi, bmm(ds.transpose(1, 2), q_h))
        if tiles.reverse:
            dq[:, r0:r1] = tiles.queries(dq_blk)
    dq.mul_(spec.scale)
    dk.mul_(spec.scale)
    if keys.bad is not None:
        dv.masked_fill_(keys.bad, 0.0)
    dsinks = None
    if dsink_rows is not None:  # rows -> heads: sum over batch and queries, head kv * g + r % g
        per_row = dsink_rows.view(nb, tiles.hk, tiles.ni, g)
        dsinks = -per_row.sum(dim=(0, 2)).reshape(-1)  # (h,)
    return unrows(unflat(dq, nb), g), unflat(dk, nb), unflat(dv, nb), dbias, dsinks, dleaves
