"""The tiled forward: for each block of queries, the online softmax over its key tiles.

    for each query block:  state = empty
        for each key tile:  s = q k_t^T * scale * log2(e) + bias_t * log2(e)   (masked: blocked)
                            state = update(state, s, v_t, shift(state, s))
        output, lse = finish(state)

Without a bias the shift is lazy (``softmax.lazy_shift``); with one it is the exact running
maximum, which lets ``skipping.needed`` leave out the heads whose weights are negligible.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit._numerics import blocked, compute_dtype
from attnkit.backends.tiled.layout import flat, head_tile, heads, rows, unflat, unrows
from attnkit.backends.tiled.layout import keys as key_rows
from attnkit.backends.tiled.skipping import can_skip, needed, row_max
from attnkit.backends.tiled.softmax import (
    LAZY_SHIFT,
    LOG2E,
    State,
    exact_shift,
    finish,
    lazy_shift,
    update,
)
from attnkit.backends.tiled.tiles import KeyTiles, Spec, Tiles

__all__ = ["forward"]


class _Reach:
    """Which output entries of a query block see a non-finite value (``KeyTiles.bad``):
    ``(b * h_kv, rows, dv)`` bool, or None while there are none. A key is seen where its
    logit is above the blocked minimum: masked keys and ``-inf`` scores are not."""

    def __init__(self, tiles: Tiles, keys: KeyTiles) -> None:
        self.tiles, self.keys, self.mask = tiles, keys, None

    def add(self, s: Tensor, sel) -> None:
        """Count the logits ``s`` ``(b * h_kv, rows, bj)`` of tile ``sel`` (before ``update``)."""
        bad = self.keys.bad
        if bad is None:
            return
        bad_t = key_rows(bad, sel).to(s.dtype)  # (b * h_kv, bj, dv)
        seen = (s > self.tiles.blocked).to(s.dtype)  # NaN scores are above nothing: see below
        seen = seen.masked_fill_(torch.isnan(s), 1.0)
        reach = torch.bmm(seen, bad_t) > 0  # (b * h_kv, rows, dv)
        self.mask = reach if self.mask is None else self.mask | reach


def _lazy_block(
    tiles: Tiles, q_blk: Tensor, keys: KeyTiles, i0: int, i1: int, reach: _Reach
) -> State:
    """The online softmax of one query block without a bias.

    A logit is at most ``max |q2_i| * max |k_j|`` in size (Cauchy-Schwarz): a fully visible tile
    where that bound is below ``LAZY_SHIFT`` needs no maximum while the shift is 0.
    """
    state = State()
    q_top = float(q_blk.norm(dim=-1).max())
    for sel, declared in tiles.groups(i0, i1):
        allowed = tiles.allowed(slice(i0, i1), sel, declared)
        if allowed is not None and not bool(allowed.any()):
            continue  # a tile that evaluates all blocked costs nothing more
        _, k_tt, v_t, _, k_top = keys.get(sel)
        small = allowed is None and q_top * k_top < LAZY_SHIFT
        s = tiles.logits(q_blk, k_tt, allowed, None)
        reach.add(s, sel)
        state = update(state, s, v_t, lazy_shift(state, s, small), None, tiles.blocked)
    return state


def _exact_block(
    tiles: Tiles, q_blk: Tensor, keys: KeyTiles, i0: int, i1: int, reach: _Reach
) -> State:
    """The online softmax of one query block with a bias (exact running maximum)."""
    nb, dv = tiles.nb, keys.v.shape[-1]
    state = State()
    q_norm = q_blk.norm(dim=-1)  # (b * h_kv, rows)
    k_norm = keys.norm
    assert k_norm is not None
    for sel, declared in tiles.order(i0, i1):
        allowed = tiles.allowed(slice(i0, i1), sel, declared)
        if allowed is not None and not bool(allowed.any()):
            continue
        bias = tiles.bias(slice(i0, i1), sel)
        _, k_tt, v_t, _, _ = keys.get(sel)
        lo, hi = 0, tiles.hk  # the key heads to compute: all, unless some are negligible
        if keys.bad is None and can_skip(tiles, allowed, bias, sel):  # skipping would hide them
            top = row_max(tiles, bias, i0, i1, sel)
            k_sel = k_norm[:, sel]
            lo, hi = needed(tiles, q_norm, k_sel, top, state.m)
        if lo == hi:
            continue
        if (lo, hi) == (0, tiles.hk):  # every head: the whole tensors, no copies
            s = tiles.logits(q_blk, k_tt, allowed, bias, (slice(i0, i1), sel))
            reach.add(s, sel)
            state = update(state, s, v_t, exact_shift(state, s), tiles.flush_below, tiles.blocked)
            continue
        # Some heads only (never with a score_mod: see can_skip): update those rows.
        state = state.filled(q_blk, dv, tiles.blocked)
        m, l, acc = state.m, state.l, state.acc
        assert m is not None and l is not None and acc is not None
        part = State(heads(m, nb, lo, hi), heads(l, nb, lo, hi), heads(acc, nb, lo, hi))
        q_h, k_th, v_h = (heads(t, nb, lo, hi) for t in (q_blk, k_tt, v_t))
        s = tiles.logits(q_h, k_th, allowed, head_tile(bias, lo, hi))
        new = update(part, s, v_h, exact_shift(part, s), tiles.flush_below, tiles.blocked)
        for old, t in ((m, new.m), (l, new.l), (acc, new.acc)):
            assert t is not None
            unflat(old, nb)[:, lo:hi].copy_(unflat(t, nb))
    return state


def forward(
    q: Tensor, k: Tensor, v: Tensor, spec: Spec, sinks: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Output ``(b, h, i, dv)`` and natural log-sum-exp ``(b, h, i)`` in the compute dtype, and
    where the output must read NaN because a row sees a non-finite value (``(b, h, i, dv)``
    bool, None when nowhere): the output itself reads those values as 0. ``sinks`` ``(h,)``
    join every row's denominator (``softmax.finish``); the log-sum-exp includes them."""
    dv = v.shape[-1]
    rows_in = q.shape[:-1].numel()  # query rows (a width d = 0 still has rows: scores of 0)
    if rows_in == 0 or k.shape[2] == 0:  # nothing to attend: zeros, as the reference gives
        dtype = compute_dtype(q.dtype)
        out = q.new_zeros(*q.shape[:-1], dv, dtype=dtype)
        lse = q.new_full(q.shape[:-1], blocked(dtype), dtype=dtype)
        if sinks is not None and rows_in:  # only the sink in each denominator
            lse = sinks.to(dtype).view(-1, 1).expand_as(lse).clone()  # (h, 1) -> (b, h, i)
        return out, lse, None
    tiles = Tiles(spec, q, k)
    g, dtype, nb = tiles.g, tiles.dtype, tiles.nb
    q_r = flat(rows(q.to(dtype), g))  # (b * h_kv, i * g, d)
    k, v = flat(k.to(dtype)), flat(v.to(dtype))  # (b * h_kv, j, d)
    bh, n_rows = q_r.shape[:2]
    keys = KeyTiles(k, v, bounds=True)
    out = q_r.new_empty(bh, n_rows, dv)
    lse = q_r.new_empty(bh, n_rows)
    poisoned = None
    if keys.bad is not None:
        poisoned = torch.zeros(bh, n_rows, dv, dtype=torch.bool, device=q.device)
    block = _exact_block if spec.has_bias else _lazy_block
    for i0 in range(0, tiles.ni, spec.block_q):
        i1 = min(tiles.ni, i0 + spec.block_q)
        r0, r1 = i0 * g, i1 * g
        q_blk = tiles.queries(q_r[:, r0:r1]) * (spec.scale * LOG2E)  # base-2 scale folded in
        reach = _Reach(tiles, keys)
        state = block(tiles, q_blk, keys, i0, i1, reach)
        sink = tiles.sink_rows(sinks, i0, i1)
        blk_out, blk_lse = finish(state, q_blk, dv, tiles.blocked, sink)
        out[:, r0:r1] = tiles.queries(blk_out)
        lse[:, r0:r1] = tiles.queries(blk_lse)
        if poisoned is not None and reach.mask is not None:
            poisoned[:, r0:r1] = tiles.queries(reach.mask.expand(bh, r1 - r0, dv))
    out4, lse4 = unflat(out, nb), unflat(lse.unsqueeze(-1), nb)
    if poisoned is not None:
        poisoned = unrows(unflat(poisoned, nb), g)
    return unrows(out4, g), unrows(lse4, g).squeeze(-1), poisoned
