"""The tiled backward: recompute each tile's weights from the saved log-sum-exp.

Only the output and ``lse`` are saved by the forward; each tile's probabilities are recomputed
as ``p = exp2(s - lse2)`` (FlashAttention section 3.1, "recomputation"), in the loop order of
FlashAttention-2 (Dao 2023, Algorithm 2): key tiles outside, the query tiles that keep each
one inside (``TilePlan.by_key``), as the fused kernel's ``backward.cpp`` runs it::

    D = rowsum(dO * O)                                   (once, every row)
    for each key tile t:  for each query tile that keeps it:
        p = exp2(s - lse2);  dV_t += p^T dO;  dS = p * (dO v_t^T - D)
        dK_t += dS^T q;  dQ += dS k_t

Extra memory is O(n * block): one tile of scores per step, never ``i x j``. Queries are held in
the engine's order (``Tiles.in_order``: each query tile reversed for a relative bias) for the
whole loop, so a query tile is a view of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import Tensor

from attnkit._numerics import compute_dtype
from attnkit.backends.tiled.layout import (
    add_keys,
    bmm,
    flat,
    head_tile,
    heads,
    rows,
    unflat,
    unrows,
)
from attnkit.backends.tiled.layout import keys as keys_of
from attnkit.backends.tiled.skipping import can_skip, needed, row_max
from attnkit.backends.tiled.softmax import LOG2E, exp2_shifted
from attnkit.backends.tiled.tiles import KeyTiles, Sel, Spec, Tiles
from attnkit.registry import ScoreModification

__all__ = ["backward", "visits"]


def _sum_to(t: Tensor, shape: torch.Size) -> Tensor:
    """Sum a (b, h, bi, bj) tile over the axes where ``shape`` has size 1 (broadcast axes)."""
    dims = [d for d in range(4) if shape[d] == 1 and t.shape[d] != 1]
    return t.sum(dim=dims, keepdim=True) if dims else t


def _add_dbias(dbias: Tensor, ds: Tensor, tiles: Tiles, qs: Sel, sel: Sel) -> None:
    """Add a tile's ``dS`` ``(b * h_kv, rows, bj)`` into ``dbias`` (the bias tensor's shape);
    a bias tensor never comes with a relative bias, so the queries are in their own order."""
    tile = _sum_to(unrows(unflat(ds, tiles.nb), tiles.g), dbias.shape)  # (b?, h?, bi?, bj?)
    if dbias.shape[2] != 1 and not isinstance(qs, slice):  # gathered queries
        dst = torch.zeros_like(dbias[:, :, : tile.shape[2]])
        _add_keys_of(dst, tile, sel)
        dbias.index_add_(2, tiles.order_of_queries[qs], dst)
        return
    _add_keys_of(dbias[:, :, qs] if dbias.shape[2] != 1 else dbias, tile, sel)


def _add_keys_of(dst: Tensor, tile: Tensor, sel: Sel) -> None:
    """``dst[..., sel] += tile`` over the last axis (summed when ``dst``'s is broadcast)."""
    if dst.shape[3] == 1:
        dst.add_(tile.sum(dim=3, keepdim=True))
    elif isinstance(sel, slice):
        dst[:, :, :, sel].add_(tile)
    else:
        dst.index_add_(3, sel, tile)


def _recording(modification: ScoreModification, record: dict[str, Tensor]) -> ScoreModification:
    """``modification`` with its score_mod run with autograd on, its input (the engine's scores,
    detached: the same memory) and output kept in ``record`` for ``_through_mod``."""
    score_mod = modification.score_mod
    assert score_mod is not None

    def recorded(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        s = s.detach().requires_grad_()  # (b, h_kv, rows, bj), natural units
        with torch.enable_grad():
            out = score_mod(s, b, h, i, j)
        record["in"], record["out"] = s, out
        return out.detach()

    return replace(modification, score_mod=recorded)


def _through_mod(
    tiles: Tiles, ds: Tensor, record: dict[str, Tensor], leaves: tuple, dleaves: list
) -> Tensor:
    """``ds`` (row layout, d loss / d modified score) -> d loss / d score, by the chain rule
    through the score_mod, in the engine's layout (no copy); the gradients of the tensors it
    captured are added to ``dleaves``."""
    grad_out = unflat(ds, tiles.nb)  # (b, h_kv, rows, bj), a view
    grads = torch.autograd.grad(
        record["out"], (record["in"], *leaves), grad_out, retain_graph=True, allow_unused=True
    )
    for k, g in enumerate(grads[1:]):
        if g is not None:  # summed in place into our own copy (g may alias grad_out)
            dleaves[k] = g.clone() if dleaves[k] is None else dleaves[k].add_(g)
    return grads[0].flatten(0, 1)  # (b * h_kv, rows, bj)


# Visited (key tile, query tile) pairs, ``(j0, j1, i0, i1)``, while ``visits`` records them.
_VISITS: list[tuple[int, int, int, int]] | None = None


@contextlib.contextmanager
def visits() -> Iterator[list[tuple[int, int, int, int]]]:
    """Record the ``(j0, j1, i0, i1)`` key x query tiles the backward visits, in order (a
    gathered group is listed one query tile at a time): the loop order, for tests."""
    global _VISITS
    previous, _VISITS = _VISITS, []
    try:
        yield _VISITS
    finally:
        _VISITS = previous


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
    # every row-layout tensor in the engine's query order (Tiles.in_order)
    q_c = tiles.in_order(flat(rows(q.to(dtype), g)))  # (b * h_kv, i * g, d)
    k, v = flat(k.to(dtype)), flat(v.to(dtype))  # (b * h_kv, j, d)
    do = tiles.in_order(flat(rows(grad_out.to(dtype), g))).contiguous()  # (b * h_kv, i * g, dv)
    out_r = tiles.in_order(flat(rows(out.to(dtype), g)))  # (b * h_kv, i * g, dv)
    lse_r = tiles.in_order(flat(rows(lse.to(dtype).unsqueeze(-1), g))).squeeze(-1)
    # A row that saw no key: every score is the blocked minimum; with lse2 = 0, p = exp2(min) = 0.
    lse2 = torch.where(lse_r <= tiles.blocked * 0.5, 0.0, lse_r * LOG2E)  # (b * h_kv, i * g)
    q2 = q_c * (spec.scale * LOG2E)  # base-2 scale folded in
    delta = (do * out_r).sum(dim=-1, keepdim=True)  # D = rowsum(dO * O), (b * h_kv, i * g, 1)
    # A NaN row (NaN lse) would spread NaN through blocked positions too: zero them there.
    nan_rows = bool(torch.isnan(lse2).any())  # NaN stays NaN in lse2
    keys = KeyTiles(k, v, bounds=spec.has_bias)
    q_norm = q2.norm(dim=-1) if spec.has_bias else None  # (b * h_kv, i * g)
    dq, dk, dv = torch.zeros_like(q_c), torch.zeros_like(k), torch.zeros_like(v)
    dbias = None
    if want_dbias and spec.bias is not None:
        dbias = torch.zeros(spec.bias.shape, dtype=dtype, device=q.device)
    dleaves: list[Tensor | None] = [None] * len(leaves)
    record: dict[str, Tensor] = {}  # the score_mod's input and output on the current tile
    modification = None if spec.score_mod is None else _recording(tiles.modification, record)
    offsets, kept = tiles.plan.by_key()  # the query tiles of each key tile
    offsets_l, kept_l = offsets.tolist(), kept.tolist()
    for kb in range(len(offsets_l) - 1):
        column = kept_l[offsets_l[kb] : offsets_l[kb + 1]]  # (i0, i1, full) of each query tile
        groups = tiles.query_groups(kb, column)
        for qs, sel, declared in groups:
            if _VISITS is not None:
                _VISITS.extend(_visited(qs, sel, column if len(groups) == 1 else None))
            allowed = tiles.allowed(qs, sel, declared)
            if allowed is not None and not bool(allowed.any()):
                continue
            bias = tiles.bias(qs, sel)
            k_t, k_tt, _, v_tt, _ = keys.get(sel)
            r = tiles.rows_of(qs)  # the rows of these queries
            q_t, q2_t, do_t, lse2_t, delta_t = (
                keys_of(x, r) for x in (q_c, q2, do, lse2, delta)
            )  # views for a query tile (layout.keys reads rows of any (n, rows, ...) tensor)
            lo, hi = 0, tiles.hk  # the key heads to compute: all, unless some are negligible
            if (
                dbias is None
                and q_norm is not None
                and isinstance(qs, slice)
                and can_skip(tiles, allowed, bias, sel)
            ):
                assert keys.norm is not None and bias is not None and isinstance(sel, slice)
                top = row_max(tiles, bias, qs.start, qs.stop, sel)
                lo, hi = needed(tiles, q_norm[:, r], keys.norm[:, sel], top, lse2_t)
            if lo == hi:
                continue
            q_h, q2_h, do_h, k_h, k_th, v_th = (
                heads(t, nb, lo, hi) for t in (q_t, q2_t, do_t, k_t, k_tt, v_tt)
            )  # the tensors themselves when all heads are computed
            record.clear()
            # s = q k_t^T (modified, masked); p = exp2(s - lse2)
            s, slope = tiles.logits_and_slope(
                q2_h, k_th, allowed, head_tile(bias, lo, hi), (qs, sel), modification
            )
            p = exp2_shifted(s, heads(lse2_t, nb, lo, hi), tiles.flush_below, tiles.blocked)
            dp = bmm(do_h, v_th)  # dP = dO v_t^T, (b * heads, rows, bj)
            ds = dp.sub_(heads(delta_t, nb, lo, hi)).mul_(p)  # dS = p * (dP - D)
            if record:  # through the score modification, into what it captured
                ds = _through_mod(tiles, ds, record, leaves, dleaves)
            if nan_rows and allowed is not None:
                hidden = ~head_tile(allowed, lo, hi).expand_as(unflat(s, nb))
                unflat(p, nb).masked_fill_(hidden, 0.0)
                unflat(ds, nb).masked_fill_(hidden, 0.0)
            if dbias is not None:  # the bias is added after the cap: its gradient is ds here
                _add_dbias(dbias, ds, tiles, qs, sel)
            if slope is not None:  # through the cap: d capped / d raw = 1 - tanh^2
                ds.mul_(slope)
            # dV_t += p^T dO;  dK_t += dS^T q;  dQ += dS k_t
            add_keys(dv, sel, nb, lo, hi, bmm(p.transpose(1, 2), do_h))
            add_keys(dk, sel, nb, lo, hi, bmm(ds.transpose(1, 2), q_h))
            add_keys(dq, r, nb, lo, hi, bmm(ds, k_h))
    dq.mul_(spec.scale)
    dk.mul_(spec.scale)
    if keys.bad is not None:
        dv.masked_fill_(keys.bad, 0.0)
    dsinks = None
    if sinks is not None:  # d loss / d sink = -sum over rows of exp2(sink2 - lse2) * D
        sink = tiles.sink_rows(sinks, 0, tiles.ni)  # (b * h_kv, i * g), row r: head kv * g + r % g
        per_row = torch.exp2(sink - lse2) * delta.squeeze(-1)
        dsinks = -per_row.view(nb, tiles.hk, tiles.ni, g).sum(dim=(0, 2)).reshape(-1)  # (h,)
    dq = tiles.in_order(dq)  # back to the queries' own order
    return unrows(unflat(dq, nb), g), unflat(dk, nb), unflat(dv, nb), dbias, dsinks, dleaves


def _visited(qs: Sel, sel: Sel, column: list[list[int]] | None) -> list[tuple[int, int, int, int]]:
    """The ``(j0, j1, i0, i1)`` tiles of one group (``visits``): each query tile of the
    ``column`` when the group is all of them (gathered), else the group's own."""
    assert isinstance(sel, slice)
    if column is None:
        assert isinstance(qs, slice)
        return [(sel.start, sel.stop, qs.start, qs.stop)]
    return [(sel.start, sel.stop, i0, i1) for i0, i1, _ in column]
