"""A bias function declared ``relative`` (``masks.Structure.relative``), evaluated once per call.

Such a function depends only on the head and the offset ``x = j - i`` (ALiBi, T5-style
buckets). Its values on every offset of the call form one row per head,
``table[h, x - x_min]``, ``x_min = k_offset - (q_offset + n_i - 1)``. Tile entry ``(i, j)`` is
``table[h, j - i - x_min]``: constant along diagonals (Toeplitz), which no strided view can
express (one stride would be negative). With the tile's query rows in *reverse* order (row
``r`` = query ``i1 - 1 - r``) the index becomes ``base + r + c``, a Hankel pattern: a view with
strides ``(1, 1)``, added to the scores with no copy. This is why the tiled backend processes
the query rows of every block in reverse order when such a bias is present.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnkit.masks import BiasFn

__all__ = ["Relative", "sliding_max"]


def sliding_max(t: Tensor, w: int) -> Tensor:
    """``out[..., y] = max(t[..., y : y + w])`` for ``t`` ``(..., L)``: ``(..., L - w + 1)``.

    Van Herk / Gil-Werman: cut ``t`` into blocks of ``w``; a window meets at most two blocks,
    so it is the max of a suffix maximum of one and a prefix maximum of the next. O(L), not O(L w).
    """
    n = t.shape[-1]
    pad = -n % w
    blocks = torch.nn.functional.pad(t, (0, pad), value=-math.inf)
    blocks = blocks.unflatten(-1, (-1, w))  # (..., blocks, w)
    prefix = blocks.cummax(dim=-1).values.flatten(-2)
    suffix = blocks.flip(-1).cummax(dim=-1).values.flip(-1).flatten(-2)
    return torch.maximum(suffix[..., : n - w + 1], prefix[..., w - 1 : n])


class Relative:
    """The bias table of one call and its per-tile views (see the module docstring).

    ``shape`` is ``(h, h_kv, n_i, n_j)``; query ``r`` of the call is position ``q_offset + r``,
    key ``c`` is ``k_offset + c``.
    """

    def __init__(
        self,
        fn: BiasFn,
        shape: tuple[int, int, int, int],
        q_offset: int,
        k_offset: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        h, self.hk, self.ni, nj = shape
        self.g = h // self.hk
        # offsets x_min .. x_min + length - 1; none when there is no query or no key
        self.length = self.ni + nj - 1 if self.ni and nj else 0
        x_min = k_offset - (q_offset + self.ni - 1)
        x = torch.arange(x_min, x_min + self.length, device=device).view(1, 1, 1, -1)
        zero = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
        h_idx = torch.arange(h, device=device).view(1, -1, 1, 1)
        values = torch.as_tensor(fn(zero, h_idx, zero, x))  # fn(0, x) = bias at offset x
        want = (1, h, 1, self.length)
        try:
            values = values.expand(want)
        except RuntimeError:
            raise ValueError(
                f"bias_fn is declared relative but returned shape {tuple(values.shape)} for "
                f"(b, h, i, j) = (1, {h}, 1, {self.length}) offsets; expected a shape "
                f"broadcastable to {want}"
            ) from None
        self.table = values.reshape(h, self.length).to(dtype).contiguous()  # (h, offsets)
        self._maxes: dict[int, Tensor] = {}  # sliding row maxima per tile width

    def _view(self, t: Tensor, i0: int, i1: int, j0: int, cols: tuple[int, ...]) -> Tensor:
        """``t`` ``(h, width)`` read at ``base + r (+ c)`` for reversed rows ``r`` of queries
        ``[i0, i1)`` from key ``j0``: shape ``(h_kv, i1 - i0, g, *cols)``."""
        width, g = t.shape[1], self.g
        base = j0 + self.ni - i1  # index of (row 0 = query i1 - 1, key j0)
        size = (self.hk, i1 - i0, g, *cols)
        stride = (g * width, 1, width, *(1 for _ in cols))
        return t.as_strided(size, stride, t.storage_offset() + base)

    def tile(self, i0: int, i1: int, j0: int, j1: int) -> Tensor:
        """The bias of queries ``[i0, i1)`` (rows reversed) x keys ``[j0, j1)``, natural units:
        a view ``(1, h_kv, i1 - i0, g, j1 - j0)``."""
        return self._view(self.table, i0, i1, j0, (j1 - j0,)).unsqueeze(0)

    def row_max(self, i0: int, i1: int, j0: int, j1: int) -> Tensor:
        """The largest bias of each (reversed) row of that tile: ``(1, h_kv, (i1 - i0) * g)``."""
        w = j1 - j0
        maxes = self._maxes.get(w)
        if maxes is None:
            maxes = self._maxes[w] = sliding_max(self.table, w)
        return self._view(maxes, i0, i1, j0, ()).reshape(1, self.hk, -1)  # (1, h_kv, rows g)
