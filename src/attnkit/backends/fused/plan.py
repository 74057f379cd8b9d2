"""What the fused kernel evaluates per element, from a call's masks and biases (a ``Plan``).

The kernel knows four kinds of structure, each exact (not a promise about where a function is
False, but the function itself):

* a band of offsets ``band_lo <= j - i <= band_hi``: ``is_causal`` (bottom-right),
  ``masks.causal_fn`` (either alignment), ``masks.window_fn``, and their ``masks.all_of``;
* a block layout: ``backends.sparse.block_sparse`` (the tile sizes then divide its block, so
  every tile is all visible or skipped);
* a relative bias table ``(h, n_i + n_j - 1)``: a bias function declared ``relative`` (ALiBi,
  T5-style buckets), evaluated once on every offset (``tiled.relative.Relative``);
* dense tensors: a bool mask and a float bias broadcastable to ``(b, h, i, j)``, read through
  their strides (a broadcast axis costs no copy).

These are read from the structure a mask function *is* (``masks.exact_structure``: attnkit's
``causal_fn``, ``window_fn``, ``block_sparse`` and their ``all_of`` are callable data whose
numbers can be read), so a band is never taken from a declaration that only promises where a
function is False. Any other mask
or bias function is evaluated once on the whole ``(b, h, i, j)`` grid (``materialize``) and
read as a dense tensor, when that fits in ``MATERIALIZE_BYTES``; ``why_not`` refuses it
otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit._numerics import compute_dtype
from attnkit.backends.tiled.relative import Relative
from attnkit.masks import (
    Band,
    Structure,
    causal_offset,
    checked_bias,
    checked_mask,
    exact_structure,
    materialize,
    structure_of,
)

__all__ = [
    "MATERIALIZE_BYTES",
    "NO_LIMIT",
    "Plan",
    "evaluated_whole",
    "exact_parts",
    "materialized_bytes",
    "plan",
]

MATERIALIZE_BYTES = 1 << 28  # 256 MiB: the largest mask or bias a function may be evaluated into
NO_LIMIT = (2**63 - 1) // 4  # fused.h NO_LIMIT: an open side of the band


@dataclass(frozen=True)
class Plan:
    """Everything the kernel needs besides q, k, v and a bias tensor (see the module docstring).

    ``mask`` is bool and ``relative`` in the compute dtype; ``layout`` is ``(query blocks, key
    blocks)`` of ``layout_block`` positions (the tile sizes divide it). ``structure``: the band
    and layout to plan tiles by (``masks.tile_plan``; None: every tile), the same structure the
    cost model and the tiled backend plan the call's tiles by."""

    scale: float
    band_lo: int = -NO_LIMIT
    band_hi: int = NO_LIMIT
    mask: Tensor | None = None
    relative: Tensor | None = None
    layout: Tensor | None = None
    layout_block: int = 1
    structure: Structure | None = None

    def describe(self) -> str:
        """The structure in words (for ``explain`` and error messages)."""
        parts = []
        if self.band_lo > -NO_LIMIT or self.band_hi < NO_LIMIT:
            lo = "-inf" if self.band_lo <= -NO_LIMIT else str(self.band_lo)
            hi = "inf" if self.band_hi >= NO_LIMIT else str(self.band_hi)
            parts.append(f"band {lo} <= j - i <= {hi}")
        if self.layout is not None:
            parts.append(f"block layout of {self.layout_block}")
        if self.relative is not None:
            parts.append("relative bias table")
        if self.mask is not None:
            parts.append("dense mask")
        return ", ".join(parts) or "no structure"


def exact_parts(fn) -> list[tuple[str, tuple]] | None:
    """The mask function as exact pieces: ``("band", (lo, hi))`` on offsets ``j - i`` and
    ``("layout", (layout, block))``, read from the structure it is exactly
    (``masks.exact_structure``), or None when it is not such a function."""
    structure = exact_structure(fn)
    return None if structure is None else _pieces(structure)


def _pieces(s: Structure) -> list[tuple[str, tuple]]:
    pieces = [piece for part in s.parts for piece in _pieces(part)]
    if s.band is not None:  # visible when -right <= (i + offset) - j <= left
        band = s.band
        lo = -NO_LIMIT if band.left is None else band.offset - band.left
        hi = NO_LIMIT if band.right is None else band.offset + band.right
        pieces.append(("band", (lo, hi)))
    if s.layout is not None:
        pieces.append(("layout", (s.layout.contiguous().cpu(), s.block)))
    return pieces


def _split(fn) -> tuple[list[tuple[str, tuple]], object | None]:
    """Exact pieces of a mask function and the rest to materialise (None: nothing)."""
    pieces = exact_parts(fn)
    if pieces is not None:
        layouts = [p for p in pieces if p[0] == "layout"]
        if len(layouts) <= 1:
            return pieces, None
    return [], fn


def evaluated_whole(mask_fn, bias_fn) -> tuple[bool, bool]:
    """Whether the mask function and the bias function are evaluated once on the whole grid
    (``materialize``) rather than read by the kernel as structure."""
    mask = mask_fn is not None and _split(mask_fn)[1] is not None
    return mask, bias_fn is not None and not structure_of(bias_fn).relative


def materialized_bytes(mask_fn, bias_fn, score_shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Upper bound of the bytes evaluating the call's non-exact functions would take."""
    n = math.prod(score_shape)
    total = 0
    mask, bias = evaluated_whole(mask_fn, bias_fn)
    if mask:
        total += n  # bool
    if bias:
        total += n * torch.empty(0, dtype=compute_dtype(dtype)).element_size()
    return total


def _band_and_layout(pieces: list[tuple[str, tuple]]) -> tuple[int, int, Tensor | None, int]:
    lo, hi, layout, block = -NO_LIMIT, NO_LIMIT, None, 1
    for kind, value in pieces:
        if kind == "band":
            lo, hi = max(lo, value[0]), min(hi, value[1])
        else:
            layout, block = value
    return lo, hi, layout, block


def plan(
    q: Tensor,
    k: Tensor,
    *,
    scale: float,
    mask: Tensor | None,
    mask_fn,
    bias: Tensor | None,
    bias_fn,
    is_causal: bool,
) -> tuple[Plan, Tensor | None]:
    """The plan of a 4-D call ``q (b, h, i, d)``, ``k (b, h_kv, j, d)`` and the dense bias
    tensor to pass (the given one, or a non-relative bias function evaluated)."""
    nb, h, ni, _ = q.shape
    nj = k.shape[2]
    dtype = compute_dtype(q.dtype)
    pieces, rest = _split(mask_fn) if mask_fn is not None else ([], None)
    if is_causal:
        pieces.append(("band", (-NO_LIMIT, causal_offset(ni, nj))))
    lo, hi, layout, block = _band_and_layout(pieces)
    shape = (nb, h, ni, nj)
    if rest is not None:
        evaluated = checked_mask(materialize(rest, shape, device=q.device), shape)
        mask = evaluated if mask is None else mask & evaluated
    relative = None
    if bias_fn is not None and structure_of(bias_fn).relative:
        table = Relative(bias_fn, (h, k.shape[1], ni, nj), 0, 0, dtype, q.device).table
        relative = table.contiguous()  # (h, i + j - 1): entry (i, j) at j - i + i - 1
    elif bias_fn is not None:
        bias = checked_bias(materialize(bias_fn, shape, device=q.device), shape)
    if mask is not None:
        mask = mask.expand(shape)
    parts = [] if mask_fn is None or rest is not None else [structure_of(mask_fn)]
    if is_causal:
        parts.append(Structure(band=Band(None, 0, causal_offset(ni, nj))))
    structure = Structure(parts=tuple(parts)) if parts else None
    return Plan(scale, lo, hi, mask, relative, layout, block, structure), bias
