"""How the tiled backend lays out heads: the row layout of grouped-query attention, and the
flattened ``(b * h_kv)`` axis its matmuls run over.

Grouped-query attention (``h_kv`` dividing ``h``) shares K and V without copying: the ``g``
query heads of a key head are laid out as extra rows, ``(b, h, i, d) -> (b, h_kv, i * g, d)``
("row layout": row ``r`` = query ``r // g`` of head ``kv * g + r % g``), so one matmul per tile
serves the whole group. Every tile's matmul is a 3-D ``bmm`` over the flattened
``(b * h_kv)`` axis; a range of key heads ``[lo, hi)`` of that axis is a view for ``b = 1``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "add_heads",
    "add_keys",
    "bmm",
    "flat",
    "flip_queries",
    "head_tile",
    "heads",
    "keys",
    "rows",
    "tile_rows",
    "unflat",
    "unrows",
]


def rows(x: Tensor, g: int) -> Tensor:
    """(b, h, i, d) -> (b, h_kv, i * g, d); a no-op view when g == 1."""
    if g == 1:
        return x
    b, h, i, d = x.shape
    x = x.unflatten(1, (h // g, g)).transpose(2, 3)  # (b, h_kv, i, g, d)
    return x.reshape(b, h // g, i * g, d)  # (b, h_kv, i * g, d)


def unrows(x: Tensor, g: int) -> Tensor:
    """(b, h_kv, i * g, d) -> (b, h, i, d), the inverse of ``rows``."""
    if g == 1:
        return x
    b, hk, r, d = x.shape
    x = x.view(b, hk, r // g, g, d).transpose(2, 3)  # (b, h_kv, g, i, d)
    return x.reshape(b, hk * g, r // g, d)  # (b, h, i, d)


def tile_rows(t: Tensor, g: int, bi: int, bj: int) -> Tensor:
    """A tile broadcastable to (b, h, bi, bj) -> broadcastable to (b, h_kv, bi * g, bj)."""
    if g == 1:
        return t
    nb, nh = t.shape[0], t.shape[1]
    t = t.expand(nb, nh, bi, bj)  # (b, h or 1, bi, bj)
    if nh == 1:
        # (b, 1, bi, g, bj) -> (b, 1, bi * g, bj): each row g times
        return t.unsqueeze(3).expand(nb, 1, bi, g, bj).reshape(nb, 1, bi * g, bj)
    return rows(t, g)  # (b, h_kv, bi * g, bj)


def flip_queries(x: Tensor, g: int) -> Tensor:
    """Reverse the query order of a row-layout block ``(n, rows, ...)``, keeping each query's
    ``g`` rows in order (a copy)."""
    return x.unflatten(1, (-1, g)).flip(1).flatten(1, 2)  # via (n, queries, g, ...)


def flat(t: Tensor) -> Tensor:
    """(b, h, n, d) -> (b * h, n, d), a view when the two leading axes can merge."""
    return t.flatten(0, 1)


def unflat(t: Tensor, nb: int) -> Tensor:
    """(b * h, ...) -> (b, h, ...), the inverse of ``flat`` (a view)."""
    return t.view(nb, t.shape[0] // nb, *t.shape[1:])  # not -1: t may hold no element


def bmm(a: Tensor, b: Tensor, alpha: float = 1.0) -> Tensor:
    """``torch.bmm`` (times ``alpha``, inside the matmul: no pass of its own), with an odd
    batch of more than one split into an even ``bmm`` and one ``mm``: a batched matmul shares
    its batch out among the threads, so 3 matrices on 2 threads take as long as 4, while a
    single ``mm`` uses every thread. Skipping heads makes odd batches common."""
    n = a.shape[0]
    if alpha == 1.0 and (n % 2 == 0 or n == 1):
        return torch.bmm(a, b)
    out = torch.empty(n, a.shape[1], b.shape[2], dtype=a.dtype, device=a.device)
    if n % 2 == 0 or n == 1:
        return torch.baddbmm(out, a, b, beta=0.0, alpha=alpha, out=out)
    torch.baddbmm(out[:-1], a[:-1], b[:-1], beta=0.0, alpha=alpha, out=out[:-1])
    torch.addmm(out[-1], a[-1], b[-1], beta=0.0, alpha=alpha, out=out[-1])
    return out


def keys(t: Tensor, sel: slice | Tensor) -> Tensor:
    """Rows ``sel`` of a ``(b * h_kv, j, ...)`` tensor (a view for a slice)."""
    return t[:, sel] if isinstance(sel, slice) else t.index_select(1, sel)


def heads(t: Tensor, nb: int, lo: int, hi: int) -> Tensor:
    """Heads ``[lo, hi)`` of a ``(b * h, ...)`` tensor, as ``(b * (hi - lo), ...)``: ``t`` itself
    for all heads, a view for b = 1, else a copy."""
    if lo == 0 and hi * nb == t.shape[0]:
        return t
    return unflat(t, nb)[:, lo:hi].flatten(0, 1)


def add_heads(dst: Tensor, nb: int, lo: int, hi: int, value: Tensor) -> None:
    """``dst[(batch, heads lo:hi)] += value``, ``value`` as returned by ``heads``."""
    if lo == 0 and hi * nb == dst.shape[0]:
        dst.add_(value)
    else:
        unflat(dst, nb)[:, lo:hi].add_(unflat(value, nb))


def head_tile(t: Tensor | None, lo: int, hi: int) -> Tensor | None:
    """Heads ``[lo, hi)`` of a tile broadcastable to ``(b, h, r, c)`` (a view), or None."""
    return t if t is None or t.shape[1] == 1 else t[:, lo:hi]


def add_keys(dst: Tensor, sel: slice | Tensor, nb: int, lo: int, hi: int, value: Tensor) -> None:
    """``dst[(batch, heads lo:hi), keys sel] += value`` for ``dst`` ``(b * h, j, d)`` and
    ``value`` ``(b * (hi - lo), len(sel), d)``; ``sel`` a slice or an index tensor."""
    if lo == 0 and hi * nb == dst.shape[0]:  # every head
        if isinstance(sel, slice):
            dst[:, sel].add_(value)
        else:
            dst.index_add_(1, sel, value)
        return
    dst4 = unflat(dst, nb)[:, lo:hi]  # a view
    if isinstance(sel, slice):
        dst4[:, :, sel].add_(unflat(value, nb))
    else:
        dst4.index_add_(2, sel, unflat(value, nb))
