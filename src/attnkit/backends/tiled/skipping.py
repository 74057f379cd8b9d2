"""Skipping negligible heads of a tile before its matmuls (with a bias).

A logit is at most ``|q2_i| |k_j| + bias_ij`` (Cauchy-Schwarz, base 2). Where that bound lies
more than ``negligible`` bits below a row's floor for every row of a (batch, key head) slice of
a tile, every weight of the slice is below ``2^-negligible`` of the row's largest: the floor is
the running maximum (forward; it only grows, and nearest keys are visited first so it starts
high) or the log-sum-exp (backward). With ``negligible`` = mantissa bits + 40 (64 for float32,
93 for float64), the skipped weights together change a row's sum by under ``n * 2^-64`` of it,
below float32's rounding unit (2^-24) for any ``n < 2^40``. ALiBi's steep heads are such
slices for distant keys.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnkit.backends.tiled.softmax import LOG2E
from attnkit.backends.tiled.tiles import Sel, Tiles

__all__ = ["NEGLIGIBLE_MARGIN", "can_skip", "needed", "row_max"]

NEGLIGIBLE_MARGIN = 40  # bits beyond the mantissa below which a weight is negligible


def negligible_bits(dtype: torch.dtype) -> int:
    """64 for float32, 93 for float64: mantissa bits + ``NEGLIGIBLE_MARGIN``."""
    mantissa = round(-math.log2(torch.finfo(dtype).eps)) + 1
    return mantissa + NEGLIGIBLE_MARGIN


def can_skip(tiles: Tiles, allowed: Tensor | None, bias: Tensor | None, sel: Sel) -> bool:
    """Whether ``needed`` may drop slices of this tile: a bias, no mask, a contiguous tile, and
    no soft-capping or score modification (the bounds are those of the raw logits)."""
    raw = tiles.spec.softcap is None and tiles.spec.score_mod is None
    return raw and bias is not None and allowed is None and isinstance(sel, slice)


def row_max(tiles: Tiles, bias: Tensor, i0: int, i1: int, sel: slice) -> Tensor:
    """The largest bias of each row of a tile, natural units: ``(b?, h_kv?, rows?)``."""
    if tiles.relative is not None and bias.dim() == 5:
        return tiles.relative.row_max(i0, i1, sel.start, sel.stop)
    return bias.amax(dim=-1)


def needed(
    tiles: Tiles, q_norm: Tensor, k_norm: Tensor, top: Tensor, floor: Tensor | None
) -> tuple[int, int]:
    """The key heads ``[lo, hi)`` of a tile that can hold a weight that is not negligible.

    ``q_norm`` ``(b * h_kv, rows)`` (base-2 scaled queries), ``k_norm`` ``(b * h_kv, bj)`` of
    the tile's keys, ``top`` the tile's ``row_max``, ``floor`` ``(b * h_kv, rows)`` (``None``
    before any tile: every head is needed). The range covers every needed head of every batch
    (it may hold some that are not: computing those changes nothing), so it is a view, never a
    gather. Returns ``(0, h_kv)`` when every head is needed, ``lo == hi`` when none is.
    """
    if floor is None:
        return 0, tiles.hk
    bh, rows = q_norm.shape
    top = (top * LOG2E).expand(tiles.nb, tiles.hk, rows).reshape(bh, rows)  # (b * h_kv, rows)
    bound = torch.addcmul(top, q_norm, k_norm.amax(dim=-1, keepdim=True)).add_(1.0)
    below = floor - negligible_bits(tiles.dtype)
    need = ~(bound < below).all(dim=-1)  # (b * h_kv,); NaN: needed
    heads = need.view(tiles.nb, tiles.hk).any(dim=0).nonzero().flatten().tolist()
    return (heads[0], heads[-1] + 1) if heads else (0, 0)
