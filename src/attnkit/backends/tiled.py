"""Backend "tiled": FlashAttention's algorithm in PyTorch (Dao et al. 2022, arXiv:2205.14135).

The scores ``(b, h, i, j)`` are never built. Queries are cut into blocks of ``block_q`` rows and,
for each block, the keys into tiles of ``block_k``; a running maximum ``m`` and sum ``l`` make
the softmax exact one tile at a time (the *online softmax*, Milakov & Gimelshein 2018;
FlashAttention Algorithm 1)::

    for each key tile t:      s    = q k_t^T * scale + bias_t       (masked: finite minimum)
                              m'   = max(m, rowmax(s))
                              p    = exp(s - m')
                              l    = l * exp(m - m') + rowsum(p)
                              acc  = acc * exp(m - m') + p v_t ;  m = m'
    output = acc / l,         lse  = m + log(l)                      (the log-sum-exp per row)

Only the output and ``lse`` are saved for backward, which recomputes each tile's probabilities
``p = exp(s - lse)`` (FlashAttention section 3.1, "recomputation"; the loop order of
FlashAttention-2, Dao 2023, Algorithm 2)::

    D = rowsum(dO * O);  dV_t += p^T dO;  dS = p * (dO v_t^T - D);  dQ += dS k_t;  dK_t += dS^T q

Extra memory is O(n * block): one tile of scores per step, never ``i x j``.

Without a bias the forward does not need the exact maximum: any per-row shift ``c`` gives the
same ``acc / l`` as long as ``exp(s - c)`` neither overflows nor loses the row's largest weight.
The shift stays 0 while a row's tile maxima lie within 40 bits of it and moves (with the
rescaling above) only when a tile's maximum passes it by more than that, so the usual tile
costs one pass less over the scores and no rescaling (``_lazy_step``). With a bias the running
maximum is kept exact: skipping (below) compares against it.

Work is done in base 2 (``exp2``, with ``log2(e)`` folded into the scale) as FlashAttention does:
on CPU ``torch.exp`` is 14-40x slower on underflowing inputs and ~5x slower on ``-inf``.
``exp2`` is fast on the finite minimum but, on some CPUs, still 3-4x slower where its result is
subnormal or underflows (logits more than 126 below the row maximum: distant keys under ALiBi),
so those logits are set to the finite minimum before ``exp2`` (their weights are below 2^-126
of the largest and become exact zeros). Blocked scores get the finite minimum, never ``-inf``.
With a bias, whole (batch, head) slices of a tile can be known to be negligible before their
matmul: a logit is at most ``|q_i| |k_j| * scale + bias_ij`` (Cauchy-Schwarz), so where that
bound is more than 64 bits (float32; 93 for float64) below the row's running maximum (forward,
nearest keys visited first) or its log-sum-exp (backward) for every row, every weight of the
slice is below 2^-64 (2^-93) of the row's largest and the slice is skipped. Together the
dropped weights are under ``n * 2^-64`` of the row's sum, below float32's rounding unit (2^-24)
for any ``n < 2^40`` (see ``_Tiles.needed``). ALiBi's steep heads skip most distant tiles.
Each tile's matmuls are 3-D ``bmm`` calls over the flattened (batch, head) axis (an odd batch
is split into an even ``bmm`` and one ``mm``, see ``_bmm``).

A bias function declared ``relative`` (``structure.relative``: it depends only on the head and
``j - i``, as ALiBi and T5 buckets do) is evaluated once per pass on the call's offsets, not per
tile; each tile's bias is then a strided view of that row, with the query rows of every block
processed in reverse order so that the view's strides are non-negative (``_Relative``).

Masks and biases: bool tensors and float tensors broadcastable to ``(b, h, i, j)`` are sliced per
tile; mask and bias *functions* ``fn(b, h, i, j)`` are evaluated per tile. Tiles a mask function
declares all-blocked (``attnkit.backends.structure``: causal, windows) are skipped unevaluated;
other tiles that evaluate all-blocked are skipped after evaluation. Causal attention:
``is_causal`` is bottom-right; top-left is ``mask=masks.causal_fn(0)``.

Grouped-query attention (``h_kv`` dividing ``h``) shares K and V without copying: the ``g``
query heads of a key head are laid out as extra rows, ``(b, h, i, d) -> (b, h_kv, i * g, d)``
("row layout", row ``r`` = query ``r // g`` of head ``kv * g + r % g``), so one matmul per tile
serves the whole group.

A fully masked query row gives output 0 and zero (finite) gradients, like the reference.
Not supported (``why_not`` says so): ``dropout_p > 0`` (the dropout mask is not replayed per
tile) and ``return_weights`` (the weights are never built). Gradients do not flow into a bias
*function*'s parameters: pass a learnable bias as a tensor.

For ring attention (one K/V shard at a time, several devices), the block step is public:
``forward_blocks`` (normalised partial output and log-sum-exp for one shard), ``merge`` (combine
two partial results) and ``backward_blocks`` (gradients for one shard given the *global* output
and log-sum-exp). ``tiled_attention`` is the differentiable whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from attnkit.backends.registry import AttentionCall, BackendUnavailable, register_backend
from attnkit.backends.structure import all_of, is_relative, key_ranges, tile_state
from attnkit.masks import BiasFn, MaskFn, causal_fn

__all__ = [
    "BLOCK_K",
    "BLOCK_K_BIAS",
    "BLOCK_Q",
    "BLOCK_Q_BIAS",
    "backward_blocks",
    "forward_blocks",
    "merge",
    "run_call",
    "tiled_attention",
    "why_not",
]

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e))
LN2 = 0.6931471805599453  # ln(2): log(x) = log2(x) * ln(2)
# Without a bias, 256 x 256 tiles: interleaved fwd+bwd against 128 x 512 (the earlier default)
# at b * h = 8, n = 4096 / 8192: 2,733 / 10,993 ms against 2,843 / 12,325 (forward within 2 %).
BLOCK_Q = 256
BLOCK_K = 256
# With a bias, 256 x 512 tiles: the skipping of negligible heads (``_Tiles.needed``) is finer
# than with 512 rows and the per-tile bias work still amortises; interleaved at n = 2048, b = 2:
# ALiBi 1,051 / 1,138 / 1,135 ms and relative buckets 1,311 / 1,344 / 1,341 ms for 256 / 128 /
# 512 rows (at n = 4096 256 and 512 rows are within 2 %).
BLOCK_Q_BIAS = 256
BLOCK_K_BIAS = 512
# Weights below 2^-(mantissa bits + 40) of a row's largest are negligible (``_Tiles.needed``):
# 64 for float32, 93 for float64. Skipping only slices that would underflow (126) computed 5 %
# more of ALiBi at n = 2048 and was 5 % slower.
NEGLIGIBLE_MARGIN = 40
# Without a bias, the forward's per-row shift moves only when a tile's maximum passes it by
# more than this many bits (``_lazy_step``).
LAZY_SHIFT = 40.0


@dataclass(frozen=True)
class _Spec:
    """Everything about one attention problem except the q, k, v tensors (all 4-D local)."""

    scale: float
    mask: Tensor | None = None  # bool, broadcastable to (b, h, i, j) of this shard
    mask_fn: MaskFn | None = None  # absolute positions
    bias: Tensor | None = None  # float, broadcastable to (b, h, i, j) of this shard
    bias_fn: BiasFn | None = None  # absolute positions
    q_offset: int = 0
    k_offset: int = 0
    block_q: int = BLOCK_Q
    block_k: int = BLOCK_K
    gather: bool = False  # visit each query block's key ranges as one gathered group (sparse)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # float32, or float64 for float64


def _blocked(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).min


# Row layout for grouped-query attention (see the module docstring).


def _rows(x: Tensor, g: int) -> Tensor:
    """(b, h, i, d) -> (b, h_kv, i * g, d); a no-op view when g == 1."""
    if g == 1:
        return x
    b, h, i, d = x.shape
    x = x.unflatten(1, (h // g, g)).transpose(2, 3)  # (b, h_kv, i, g, d)
    return x.reshape(b, h // g, i * g, d)  # (b, h_kv, i * g, d)


def _unrows(x: Tensor, g: int) -> Tensor:
    """(b, h_kv, i * g, d) -> (b, h, i, d)."""
    if g == 1:
        return x
    b, hk, r, d = x.shape
    x = x.view(b, hk, r // g, g, d).transpose(2, 3)  # (b, h_kv, g, i, d)
    return x.reshape(b, hk * g, r // g, d)  # (b, h, i, d)


def _tile_rows(t: Tensor, g: int, bi: int, bj: int) -> Tensor:
    """A tile broadcastable to (b, h, bi, bj) -> broadcastable to (b, h_kv, bi * g, bj)."""
    if g == 1:
        return t
    nb, nh = t.shape[0], t.shape[1]
    t = t.expand(nb, nh, bi, bj)
    if nh == 1:
        return t.unsqueeze(3).expand(nb, 1, bi, g, bj).reshape(nb, 1, bi * g, bj)
    return _rows(t, g)  # (b, h_kv, bi * g, bj)


def _untile_rows(t: Tensor, g: int) -> Tensor:
    """(b, h_kv, bi * g, bj) -> (b, h, bi, bj)."""
    return _unrows(t, g)


def _flip_queries(x: Tensor, g: int) -> Tensor:
    """Reverse the query order of a row-layout block ``(n, rows, ...)``, keeping each query's
    ``g`` rows in order (a copy)."""
    return x.unflatten(1, (-1, g)).flip(1).flatten(1, 2)


def _sliding_max(t: Tensor, w: int) -> Tensor:
    """``out[..., y] = max(t[..., y : y + w])`` for ``t`` ``(..., L)``: ``(..., L - w + 1)``.

    Van Herk / Gil-Werman: cut ``t`` into blocks of ``w``; a window meets at most two blocks,
    so it is the max of a suffix maximum of one and a prefix maximum of the next. O(L), not O(L w).
    """
    n = t.shape[-1]
    pad = -n % w
    blocks = torch.nn.functional.pad(t, (0, pad), value=-math.inf).unflatten(-1, (-1, w))
    prefix = blocks.cummax(dim=-1).values.flatten(-2)
    suffix = blocks.flip(-1).cummax(dim=-1).values.flip(-1).flatten(-2)
    return torch.maximum(suffix[..., : n - w + 1], prefix[..., w - 1 : n])


class _Relative:
    """A bias function declared ``relative`` (``structure.relative``), evaluated once per call.

    Its values on every offset ``x = j - i`` of the call form one row per head,
    ``table[h, x - x_min]``, ``x_min = (k_offset) - (q_offset + n_i - 1)``. Tile entry
    ``(i, j)`` is ``table[h, j - i - x_min]``: constant along diagonals (Toeplitz), which no
    strided view can express (one stride would be negative). With the tile's query rows in
    *reverse* order (row ``r`` = query ``i1 - 1 - r``) the index becomes ``base + r + c``, a
    Hankel pattern: a view with strides ``(1, 1)``, added to the scores with no copy.
    """

    def __init__(self, fn: BiasFn, tiles: _Tiles) -> None:
        spec, device = tiles.spec, tiles.b_idx.device
        self.ni, self.g, self.hk = tiles.ni, tiles.g, tiles.hk
        self.length = tiles.ni + tiles.nj - 1  # offsets x_min .. x_min + length - 1
        x_min = spec.k_offset - (spec.q_offset + tiles.ni - 1)
        x = torch.arange(x_min, x_min + self.length, device=device).view(1, 1, 1, -1)
        zero = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
        values = torch.as_tensor(fn(zero, tiles.h_idx, zero, x))  # fn(0, x) = bias at offset x
        want = (1, tiles.h, 1, self.length)
        try:
            values = values.expand(want)
        except RuntimeError:
            raise ValueError(
                f"bias_fn is declared relative but returned shape {tuple(values.shape)} for "
                f"(b, h, i, j) = (1, {tiles.h}, 1, {self.length}) offsets; expected a shape "
                f"broadcastable to {want}"
            ) from None
        self.table = values.reshape(tiles.h, self.length).to(tiles.dtype).contiguous()
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
            maxes = self._maxes[w] = _sliding_max(self.table, w)
        return self._view(maxes, i0, i1, j0, ()).reshape(1, self.hk, -1)


# One tile of scores.


class _Tiles:
    """Builds the base-2 logits of one (query block, key group) tile and lists the key groups."""

    def __init__(self, spec: _Spec, q: Tensor, k: Tensor) -> None:
        self.spec = spec
        self.nb, self.h, self.ni, _ = q.shape
        self.nj = k.shape[2]
        self.g = self.h // k.shape[1]
        self.hk = k.shape[1]  # key heads
        self.dtype = _compute_dtype(q.dtype)
        self.blocked = _blocked(self.dtype)
        self.underflow = math.log2(torch.finfo(self.dtype).tiny)  # -126 (float32), -1022 (64)
        bits = round(-math.log2(torch.finfo(self.dtype).eps)) + 1  # mantissa: 24 (float32), 53
        self.negligible = bits + NEGLIGIBLE_MARGIN  # 64 (float32), 93 (float64)
        # Only a bias spreads logits that far below the row maximum; without one, skip the pass.
        self.flush = spec.bias is not None or spec.bias_fn is not None
        device = q.device
        self.b_idx = torch.arange(self.nb, device=device).view(-1, 1, 1, 1)
        self.h_idx = torch.arange(self.h, device=device).view(1, -1, 1, 1)
        # A relative bias function (and no bias tensor) is evaluated once, and query blocks are
        # then processed with their rows in reverse order (``_Relative``; ``reverse``).
        self.relative = None
        if spec.bias is None and is_relative(spec.bias_fn):
            self.relative = _Relative(spec.bias_fn, self)
        self.reverse = self.relative is not None

    def queries(self, x: Tensor) -> Tensor:
        """A row-layout block ``(n, rows, ...)`` in this call's row order: reversed queries
        when ``reverse`` (its own inverse), else ``x`` itself."""
        return _flip_queries(x, self.g) if self.reverse else x

    def groups(self, i0: int, i1: int) -> list[tuple[slice | Tensor, bool | None]]:
        """Key groups for queries [i0, i1): (slice or index tensor, tile state), local indices."""
        spec, qo, ko = self.spec, self.spec.q_offset, self.spec.k_offset
        fn = spec.mask_fn
        ranges = [(0, self.nj)]
        if fn is not None:
            ranges = [
                (lo - ko, hi - ko) for lo, hi in key_ranges(fn, i0 + qo, i1 + qo, ko, ko + self.nj)
            ]
        tiles: list[tuple[int, int, bool | None]] = []
        for lo, hi in ranges:
            for j0 in range(lo, hi, spec.block_k):
                j1 = min(hi, j0 + spec.block_k)
                state = True if fn is None else tile_state(fn, i0 + qo, i1 + qo, j0 + ko, j1 + ko)
                if state is not False:
                    tiles.append((j0, j1, state))
        if not spec.gather or len(tiles) <= 1:
            return [(slice(j0, j1), state) for j0, j1, state in tiles]
        # Sparse layouts: one group of all kept keys, gathered (contiguous runs stay a slice).
        runs: list[list[int]] = []
        for j0, j1, _ in tiles:
            if runs and runs[-1][1] == j0:
                runs[-1][1] = j1
            else:
                runs.append([j0, j1])
        state = True if all(s is True for _, _, s in tiles) else None
        if len(runs) == 1:
            return [(slice(runs[0][0], runs[0][1]), state)]
        device = self.b_idx.device
        idx = torch.cat([torch.arange(a, b, device=device) for a, b in runs])
        return [(idx, state)]

    def _slice(self, t: Tensor, i0: int, i1: int, sel: slice | Tensor) -> Tensor:
        """Tile of a tensor broadcastable to (b, h, i, j)."""
        if t.shape[2] != 1:
            t = t[:, :, i0:i1].flip(2) if self.reverse else t[:, :, i0:i1]
        if t.shape[3] != 1:
            t = t[:, :, :, sel] if isinstance(sel, slice) else t.index_select(3, sel)
        return t

    def _positions(self, i0: int, i1: int, sel: slice | Tensor) -> tuple[Tensor, Tensor]:
        device = self.b_idx.device
        qo, ko = self.spec.q_offset, self.spec.k_offset
        i = torch.arange(i0 + qo, i1 + qo, device=device)
        i = (i.flip(0) if self.reverse else i).view(1, 1, -1, 1)
        j = torch.arange(sel.start, sel.stop, device=device) if isinstance(sel, slice) else sel
        return i, (j + ko).view(1, 1, 1, -1)

    def allowed(self, i0: int, i1: int, sel: slice | Tensor, state: bool | None) -> Tensor | None:
        """Bool tile (broadcastable, row layout) of allowed positions; None = all allowed."""
        spec = self.spec
        parts = []
        if spec.mask is not None:
            parts.append(self._slice(spec.mask, i0, i1, sel))
        if spec.mask_fn is not None and state is None:
            i, j = self._positions(i0, i1, sel)
            parts.append(spec.mask_fn(self.b_idx, self.h_idx, i, j))
        if not parts:
            return None
        allowed = parts[0]
        for p in parts[1:]:
            allowed = allowed & p
        bj = sel.stop - sel.start if isinstance(sel, slice) else sel.numel()
        return _tile_rows(allowed, self.g, i1 - i0, bj)

    def bias(self, i0: int, i1: int, sel: slice | Tensor) -> Tensor | None:
        """Float tile (broadcastable, row layout) of the bias, in natural units; None = none.

        For a relative bias function and a contiguous tile: a 5-D view
        ``(1, h_kv, i1 - i0, g, bj)`` (``_Relative.tile``) instead.
        """
        spec = self.spec
        if self.relative is not None and isinstance(sel, slice):
            return self.relative.tile(i0, i1, sel.start, sel.stop)
        parts = []
        if spec.bias is not None:
            parts.append(self._slice(spec.bias, i0, i1, sel))
        if spec.bias_fn is not None:
            i, j = self._positions(i0, i1, sel)
            parts.append(spec.bias_fn(self.b_idx, self.h_idx, i, j))
        if not parts:
            return None
        bias = parts[0] if len(parts) == 1 else parts[0] + parts[1]
        bj = sel.stop - sel.start if isinstance(sel, slice) else sel.numel()
        return _tile_rows(bias.to(self.dtype), self.g, i1 - i0, bj)

    def logits(
        self, q2: Tensor, k_tt: Tensor, allowed: Tensor | None, bias: Tensor | None
    ) -> Tensor:
        """Base-2 logits ``(b * h_kv, rows, bj)`` of a tile.

        ``q2`` ``(b * h_kv, rows, d)`` is the query block already multiplied by
        ``scale * log2(e)``; ``k_tt`` ``(b * h_kv, d, bj)`` the key tile, transposed;
        ``allowed`` and ``bias`` as returned by ``allowed`` and ``bias``.
        """
        s = _bmm(q2, k_tt)  # (b * h_kv, rows, bj)
        if bias is None and allowed is None:
            return s
        s4 = _unflat(s, self.nb)  # (b, h_kv, rows, bj), same memory
        if bias is not None and bias.dim() == 5:  # a relative view (1, h_kv, queries, g, bj)
            s4.view(*s4.shape[:2], -1, self.g, s4.shape[3]).add_(bias, alpha=LOG2E)
        elif bias is not None:
            s4.add_(bias, alpha=LOG2E)
        if allowed is not None:
            s4.masked_fill_(~allowed, self.blocked)
        return s

    def can_skip(self, allowed: Tensor | None, bias: Tensor | None, sel: slice | Tensor) -> bool:
        """Whether ``needed`` may drop slices of this tile: a bias, no mask, a contiguous tile."""
        return self.flush and bias is not None and allowed is None and isinstance(sel, slice)

    def row_max(self, bias: Tensor, i0: int, i1: int, sel: slice) -> Tensor:
        """The largest bias of each row of a tile, natural units: ``(b?, h_kv?, rows?)``."""
        if bias.dim() == 5:
            return self.relative.row_max(i0, i1, sel.start, sel.stop)  # type: ignore[union-attr]
        return bias.amax(dim=-1)

    def needed(self, q_norm: Tensor, k_norm: Tensor, top: Tensor, floor: Tensor) -> tuple[int, int]:
        """The key heads ``[lo, hi)`` of a tile that can hold a weight that is not negligible.

        A logit is at most ``|q2_i| |k_j| + bias_ij`` (Cauchy-Schwarz, base 2). Where that bound
        lies more than ``negligible`` bits (64 for float32, 93 for float64) below ``floor`` for
        every row of a (batch, head) slice, each weight of the slice is below 2^-64 of the row's
        largest: ``floor`` is the running maximum (forward; it only grows) or the log-sum-exp
        (backward). Skipping the slice changes a row's sum by less than ``n * 2^-64`` of it,
        below the float32 rounding unit for ``n < 2^40``. ALiBi's steep heads are such slices
        for distant keys. The range returned covers every needed head of every batch (it may
        hold some that are not: computing those changes nothing), so it is a view, never a
        gather.

        ``q_norm`` ``(b * h_kv, rows)``, ``k_norm`` ``(b * h_kv, bj)`` of the tile's keys,
        ``top`` the tile's ``row_max``, ``floor`` ``(b * h_kv, rows)``. Returns ``(lo, hi)``:
        ``(0, h_kv)`` when every head is needed, ``lo == hi`` when none is.
        """
        bh, rows = q_norm.shape
        hk = self.hk
        top = (top * LOG2E).expand(self.nb, hk, rows).reshape(bh, rows)
        bound = torch.addcmul(top, q_norm, k_norm.amax(dim=-1, keepdim=True)).add_(1.0)
        need = ~(bound < floor - self.negligible).all(dim=-1)  # (b * h_kv,); NaN: needed
        heads = need.view(self.nb, hk).any(dim=0).nonzero().flatten().tolist()
        return (heads[0], heads[-1] + 1) if heads else (0, 0)

    def order(self, i0: int, i1: int) -> list[tuple[slice | Tensor, bool | None]]:
        """``groups``, nearest keys first when a bias may let later tiles be skipped (the
        running maximum then starts high); the result is the same in any order."""
        groups = self.groups(i0, i1)
        if not self.flush or self.spec.gather:
            return groups
        centre = (i0 + i1) / 2 + self.spec.q_offset - self.spec.k_offset

        def distance(group: tuple[slice | Tensor, bool | None]) -> float:
            sel = group[0]
            return abs((sel.start + sel.stop) / 2 - centre) if isinstance(sel, slice) else 0.0

        return sorted(groups, key=distance)

    def exp2_shifted(self, s: Tensor, shift: Tensor) -> Tensor:
        """``exp2(s - shift)`` in place; ``shift`` ``(b * h_kv, rows)``; with a bias, exact zeros
        below 2^-126.

        Logits that would underflow are set to the blocked minimum first: on CPU ``exp2`` is
        3-4x slower on inputs whose result is subnormal or zero (typical with ALiBi: distant
        keys), but fast on the finite minimum. Those weights are below 2^-126 (float32;
        2^-1022 for float64) of the row maximum's: dropping them changes nothing measurable.
        """
        s.sub_(shift.unsqueeze(-1))
        if self.flush:
            torch.nn.functional.threshold_(s, self.underflow, self.blocked)
        return s.exp2_()


def _bmm(a: Tensor, b: Tensor) -> Tensor:
    """``torch.bmm``, with an odd batch of more than one split into an even ``bmm`` and one
    ``mm``: a batched matmul shares the batch out among the threads, so 3 matrices on 2 threads
    take as long as 4, while a single ``mm`` uses both threads (27 % faster for 3 heads of
    512 x 512 x 64 on 2 cores). Skipping heads (``_Tiles.needed``) makes odd batches common."""
    n = a.shape[0]
    if n % 2 == 0 or n == 1:
        return torch.bmm(a, b)
    out = torch.empty(n, a.shape[1], b.shape[2], dtype=a.dtype, device=a.device)
    torch.bmm(a[:-1], b[:-1], out=out[:-1])
    torch.mm(a[-1], b[-1], out=out[-1])
    return out


def _keys(t: Tensor, sel: slice | Tensor) -> Tensor:
    """Rows ``sel`` of a ``(b * h_kv, j, d)`` tensor (a view for a slice)."""
    return t[:, sel] if isinstance(sel, slice) else t.index_select(1, sel)


def _blocks(
    block_q: int | None, block_k: int | None, bias: Tensor | None, bias_fn: BiasFn | None
) -> tuple[int, int]:
    """The tile sizes: as given, else ``BLOCK_Q_BIAS x BLOCK_K_BIAS`` with a bias and
    ``BLOCK_Q x BLOCK_K`` without."""
    plain = bias is None and bias_fn is None
    if block_q is None:
        block_q = BLOCK_Q if plain else BLOCK_Q_BIAS
    if block_k is None:
        block_k = BLOCK_K if plain else BLOCK_K_BIAS
    return block_q, block_k


def _flat(t: Tensor) -> Tensor:
    """(b, h, n, d) -> (b * h, n, d), a view when the two leading axes can merge."""
    return t.flatten(0, 1)


def _unflat(t: Tensor, nb: int) -> Tensor:
    """(b * h, ...) -> (b, h, ...), the inverse of ``_flat`` (a view)."""
    return t.view(nb, -1, *t.shape[1:])


def _heads(t: Tensor, nb: int, lo: int, hi: int) -> Tensor:
    """Heads ``[lo, hi)`` of a ``(b * h, ...)`` tensor, as ``(b * (hi - lo), ...)``: ``t`` itself
    for all heads, a view for b = 1, else a copy."""
    if lo == 0 and hi * nb == t.shape[0]:
        return t
    return _unflat(t, nb)[:, lo:hi].flatten(0, 1)


def _add_heads(dst: Tensor, nb: int, lo: int, hi: int, value: Tensor) -> None:
    """``dst[(batch, heads lo:hi)] += value``, ``value`` as returned by ``_heads``."""
    if lo == 0 and hi * nb == dst.shape[0]:
        dst.add_(value)
    else:
        _unflat(dst, nb)[:, lo:hi].add_(_unflat(value, nb))


def _head_tile(t: Tensor | None, lo: int, hi: int) -> Tensor | None:
    """Heads ``[lo, hi)`` of a tile broadcastable to ``(b, h, r, c)`` (a view), or None."""
    return t if t is None or t.shape[1] == 1 else t[:, lo:hi]


def _add_keys(dst: Tensor, sel: slice | Tensor, nb: int, lo: int, hi: int, value: Tensor) -> None:
    """``dst[(batch, heads lo:hi), keys sel] += value`` for ``dst`` ``(b * h, j, d)`` and
    ``value`` ``(b * (hi - lo), len(sel), d)``; ``sel`` a slice or an index tensor."""
    if lo == 0 and hi * nb == dst.shape[0]:  # every head
        if isinstance(sel, slice):
            dst[:, sel].add_(value)
        else:
            dst.index_add_(1, sel, value)
        return
    rows = _unflat(dst, nb)[:, lo:hi]  # a view
    if isinstance(sel, slice):
        rows[:, :, sel].add_(_unflat(value, nb))
    else:
        rows.index_add_(2, sel, _unflat(value, nb))


# The block step, public for ring attention.


def forward_blocks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    mask: Tensor | None = None,
    mask_fn: MaskFn | None = None,
    bias: Tensor | None = None,
    bias_fn: BiasFn | None = None,
    q_offset: int = 0,
    k_offset: int = 0,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of ``q`` over one shard of keys: the normalised output and the log-sum-exp.

    Args:
        q: ``(b, h, i, d)``; k: ``(b, h_kv, j, d)``; v: ``(b, h_kv, j, dv)``, ``h_kv`` dividing
            ``h``. No autograd (use ``tiled_attention`` for a differentiable call).
        scale: multiplies ``q @ k^T``.
        mask / bias: bool / float tensors broadcastable to this shard's ``(b, h, i, j)``.
        mask_fn / bias_fn: functions ``fn(b, h, i, j)`` of *absolute* positions: query ``r`` of
            ``q`` is position ``q_offset + r``, key ``c`` of ``k`` is ``k_offset + c``. Causal
            attention over shards is ``mask_fn=masks.causal_fn(offset)`` with global positions.
        block_q, block_k: tile sizes (``None``: ``BLOCK_Q x BLOCK_K``; ``BLOCK_Q_BIAS x
            BLOCK_K_BIAS`` with a bias).

    Returns:
        ``out (b, h, i, dv)`` in the compute dtype (float32, float64 for float64 inputs) and
        ``lse (b, h, i)``, the natural log-sum-exp of each row's scaled, biased scores over the
        visible keys of this shard. A row that sees no key here has ``out = 0`` and
        ``lse = finfo(dtype).min`` (finite), which ``merge`` treats as "no contribution".
    """
    block_q, block_k = _blocks(block_q, block_k, bias, bias_fn)
    spec = _Spec(
        scale, _pad4(mask), mask_fn, _pad4(bias), bias_fn, q_offset, k_offset, block_q, block_k
    )
    with torch.no_grad():  # the block step is the math of a backward, never differentiated
        out, lse = _forward(q, k, v, spec)
    return out, lse


def merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine attention over two disjoint key sets into attention over their union.

    ``out_x (..., i, dv)`` and ``lse_x (..., i)`` are as returned by ``forward_blocks``. With
    ``lse = log(exp(lse_a) + exp(lse_b))``, the union's output is
    ``exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b`` (FlashAttention's rescaling rule).
    """
    m = torch.maximum(lse_a, lse_b)
    wa = torch.exp(lse_a - m)
    wb = torch.exp(lse_b - m)
    total = wa + wb
    lse = m + torch.log(total)
    out = out_a * (wa / total).unsqueeze(-1) + out_b * (wb / total).unsqueeze(-1)
    return out, lse


def backward_blocks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    *,
    scale: float,
    mask: Tensor | None = None,
    mask_fn: MaskFn | None = None,
    bias: Tensor | None = None,
    bias_fn: BiasFn | None = None,
    q_offset: int = 0,
    k_offset: int = 0,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients for one K/V shard, given the *global* ``out`` and ``lse`` of these queries.

    ``out``/``lse`` are the final results over all shards (after ``merge``), ``grad_out`` the
    gradient of the loss with respect to ``out``. Returns ``dq`` (this shard's contribution:
    sum it over shards), ``dk`` and ``dv`` (complete for this shard), in the compute dtype.
    Other arguments as in ``forward_blocks``.
    """
    block_q, block_k = _blocks(block_q, block_k, bias, bias_fn)
    spec = _Spec(
        scale, _pad4(mask), mask_fn, _pad4(bias), bias_fn, q_offset, k_offset, block_q, block_k
    )
    with torch.no_grad():
        dq, dk, dv, _ = _backward(q, k, v, out, lse, grad_out, spec, want_dbias=False)
    return dq, dk, dv


def _online_step(
    tiles: _Tiles, s: Tensor, v_t: Tensor, m: Tensor | None, l: Tensor, acc: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """One tile of the online softmax: logits ``s`` ``(n, rows, bj)`` -> new ``m, l, acc``.

    ``m=None`` marks the first tile of a query block (nothing to rescale; ``l`` and ``acc``
    are then ignored)."""
    m_new = s.amax(dim=-1) if m is None else torch.maximum(m, s.amax(dim=-1))
    # A row blocked in every tile so far has m_new = blocked and gets p = 1 here: that garbage
    # is scaled by exp2(blocked - m) = 0 once a visible key arrives, or zeroed at the end if none
    # ever does.
    p = tiles.exp2_shifted(s, m_new)  # (n, rows, bj), in place
    if m is None:
        return m_new, p.sum(dim=-1), _bmm(p, v_t)
    alpha = torch.exp2(m - m_new)
    l = torch.addcmul(p.sum(dim=-1), l, alpha)
    acc = torch.baddbmm(acc * alpha.unsqueeze(-1), p, v_t)
    return m_new, l, acc


class _KeyTiles:
    """The key and value tiles of a call, made once per tile and reused by every query block:
    ``(k_t, k_t^T, v_t, v_t^T, largest |k_j|)``, views for a slice (``inf`` without
    ``bounds``)."""

    def __init__(self, k: Tensor, v: Tensor, bounds: bool) -> None:
        self.k, self.v = k, v
        self.norm = k.norm(dim=-1) if bounds else None  # (b * h_kv, j)
        self.cache: dict[tuple[int, int], tuple[Tensor, Tensor, Tensor, Tensor, float]] = {}

    def get(self, sel: slice | Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, float]:
        key = (sel.start, sel.stop) if isinstance(sel, slice) else None
        hit = self.cache.get(key) if key is not None else None
        if hit is None:
            top = math.inf if self.norm is None else float(_keys(self.norm, sel).max())
            k_t, v_t = _keys(self.k, sel), _keys(self.v, sel)
            hit = (k_t, k_t.mT, v_t, v_t.mT, top)
            if key is not None:
                self.cache[key] = hit
        return hit


def _lazy_block(
    tiles: _Tiles, q_blk: Tensor, keys: _KeyTiles, i0: int, i1: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The online softmax of one query block without a bias (``_lazy_step``): returns
    ``(m, l, acc)`` with ``m`` the rows' shift, as ``_exact_block`` does.

    A logit is at most ``max |q2_i| * max |k_j|`` in size (Cauchy-Schwarz): a fully visible tile
    where that bound is below ``LAZY_SHIFT`` needs no maximum while the shift is 0 (its weights
    lie between 2^-40 and 2^40).
    """
    m = l = acc = None
    q_top = float(q_blk.norm(dim=-1).max())
    for sel, state in tiles.groups(i0, i1):
        allowed = tiles.allowed(i0, i1, sel, state)
        if allowed is not None and not bool(allowed.any()):
            continue
        _, k_tt, v_t, _, k_top = keys.get(sel)
        small = allowed is None and q_top * k_top < LAZY_SHIFT
        s = tiles.logits(q_blk, k_tt, allowed, None)
        m, l, acc = _lazy_step(s, v_t, m, l, acc, small)
    if l is None or acc is None:  # no visible key at all
        bh, rows = q_blk.shape[:2]
        l = torch.zeros(bh, rows, dtype=q_blk.dtype, device=q_blk.device)
        acc = torch.zeros(bh, rows, keys.v.shape[-1], dtype=q_blk.dtype, device=q_blk.device)
        return torch.full_like(l, tiles.blocked), l, acc
    return (torch.zeros_like(l) if m is None else m), l, acc


def _lazy_step(
    s: Tensor,
    v_t: Tensor,
    m: Tensor | None,
    l: Tensor | None,
    acc: Tensor | None,
    small: bool = False,
) -> tuple[Tensor | None, Tensor, Tensor]:
    """One tile of the online softmax with a lazy shift (no bias): ``(m, l, acc)`` -> new.

    The weights are ``exp2(s - m)`` for a per-row shift ``m`` that changes only when a tile's
    maximum exceeds it by more than ``LAZY_SHIFT`` bits (the weights stay below 2^40, and the
    largest of a row at least 2^-40: float32 keeps its full precision); ``m=None`` stands for
    a shift of 0, the usual case, which saves a pass over the tile and every rescaling.
    ``l=None`` marks the first tile of a block. ``small``: the caller knows that every logit of
    the tile is below ``LAZY_SHIFT``, so with a shift of 0 the maximum is not needed at all.
    Only for tiles without a bias (``needed`` wants the exact running maximum).
    """
    if not (small and m is None):
        top = s.amax(dim=-1)  # (n, rows)
        if l is None or acc is None:  # first tile: shift 0 where the maximum is near 0
            near = (top > -LAZY_SHIFT) & (top < LAZY_SHIFT)
            m = None if bool(near.all()) else torch.where(near, 0.0, top)
        else:
            ref = 0.0 if m is None else m
            grow = top > ref + LAZY_SHIFT
            if bool(grow.any()):  # a new maximum far above the shift: move it, rescale
                m = torch.where(grow, top, ref)
                alpha = torch.exp2(ref - m)  # 0 for rows blocked so far: clears their garbage
                l, acc = l * alpha, acc * alpha.unsqueeze(-1)
        if m is not None:
            s.sub_(m.unsqueeze(-1))
    p = s.exp2_()
    if l is None or acc is None:
        return m, p.sum(dim=-1), _bmm(p, v_t)
    return m, l + p.sum(dim=-1), torch.baddbmm(acc, p, v_t)


def _exact_block(
    tiles: _Tiles, q_blk: Tensor, keys: _KeyTiles, i0: int, i1: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The online softmax of one query block with a bias: ``(m, l, acc)``, ``m`` the exact
    running maximum, which lets ``needed`` leave out the heads whose weights are negligible."""
    nb, bh, rows = tiles.nb, q_blk.shape[0], q_blk.shape[1]
    m = torch.full((bh, rows), tiles.blocked, dtype=q_blk.dtype, device=q_blk.device)
    l = torch.zeros_like(m)
    acc = torch.zeros(bh, rows, keys.v.shape[-1], dtype=q_blk.dtype, device=q_blk.device)
    q_norm = q_blk.norm(dim=-1)  # (b * h_kv, rows)
    k_norm = keys.norm
    assert k_norm is not None
    first = True  # no tile computed yet: m, l, acc hold their initial values
    for sel, state in tiles.order(i0, i1):
        allowed = tiles.allowed(i0, i1, sel, state)
        if allowed is not None and not bool(allowed.any()):
            continue  # a tile that evaluates all blocked costs nothing more
        bias = tiles.bias(i0, i1, sel)
        _, k_tt, v_t, _, _ = keys.get(sel)
        lo, hi = 0, tiles.hk  # the key heads to compute: all, unless some are negligible
        if tiles.can_skip(allowed, bias, sel):
            top = tiles.row_max(bias, i0, i1, sel)
            lo, hi = tiles.needed(q_norm, _keys(k_norm, sel), top, m)
        if lo == hi:
            continue
        if (lo, hi) == (0, tiles.hk):  # every head: the whole tensors, no copies
            s = tiles.logits(q_blk, k_tt, allowed, bias)
            m, l, acc = _online_step(tiles, s, v_t, None if first else m, l, acc)
        else:
            part = [_heads(t, nb, lo, hi) for t in (q_blk, k_tt, v_t, m, l, acc)]
            s = tiles.logits(part[0], part[1], allowed, _head_tile(bias, lo, hi))
            new = _online_step(tiles, s, *part[2:])
            for old, t in zip((m, l, acc), new, strict=True):
                _unflat(old, nb)[:, lo:hi].copy_(_unflat(t, nb))
        first = False
    return m, l, acc


def _forward(q: Tensor, k: Tensor, v: Tensor, spec: _Spec) -> tuple[Tensor, Tensor]:
    tiles = _Tiles(spec, q, k)
    g, dtype, blocked, nb = tiles.g, tiles.dtype, tiles.blocked, tiles.nb
    q_r = _flat(_rows(q.to(dtype), g))  # (b * h_kv, i * g, d)
    k, v = _flat(k.to(dtype)), _flat(v.to(dtype))  # (b * h_kv, j, d)
    bh, rows = q_r.shape[:2]
    keys = _KeyTiles(k, v, bounds=True)
    out = torch.empty(bh, rows, v.shape[-1], dtype=dtype, device=q.device)
    lse = torch.empty(bh, rows, dtype=dtype, device=q.device)
    for i0 in range(0, tiles.ni, spec.block_q):
        i1 = min(tiles.ni, i0 + spec.block_q)
        r0, r1 = i0 * g, i1 * g
        q_blk = tiles.queries(q_r[:, r0:r1]) * (spec.scale * LOG2E)  # base-2 scale folded in
        if tiles.flush:
            m, l, acc = _exact_block(tiles, q_blk, keys, i0, i1)
        else:
            m, l, acc = _lazy_block(tiles, q_blk, keys, i0, i1)
        seen = m > blocked  # rows with at least one visible key
        blk_out = torch.where(seen.unsqueeze(-1), acc / l.clamp_min(1e-30).unsqueeze(-1), 0)
        blk_lse = torch.where(seen, (m + torch.log2(l.clamp_min(1e-30))) * LN2, blocked)
        out[:, r0:r1] = tiles.queries(blk_out)
        lse[:, r0:r1] = tiles.queries(blk_lse)
    out4, lse4 = _unflat(out, nb), _unflat(lse.unsqueeze(-1), nb)
    return _unrows(out4, g), _unrows(lse4, g).squeeze(-1)


def _sum_to(t: Tensor, shape: torch.Size) -> Tensor:
    """Sum a (b, h, bi, bj) tile over the axes where ``shape`` has size 1 (broadcast axes)."""
    dims = [d for d in range(4) if shape[d] == 1 and t.shape[d] != 1]
    return t.sum(dim=dims, keepdim=True) if dims else t


def _backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    spec: _Spec,
    want_dbias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    tiles = _Tiles(spec, q, k)
    g, dtype = tiles.g, tiles.dtype
    nb = tiles.nb
    q_c = _flat(_rows(q.to(dtype), g))  # (b * h_kv, i * g, d)
    k, v = _flat(k.to(dtype)), _flat(v.to(dtype))  # (b * h_kv, j, d)
    do = _flat(_rows(grad_out.to(dtype), g))  # (b * h_kv, i * g, dv)
    out_r = _flat(_rows(out.to(dtype), g))  # (b * h_kv, i * g, dv)
    lse_r = _flat(_rows(lse.to(dtype).unsqueeze(-1), g)).squeeze(-1)  # (b * h_kv, i * g)
    # A row that saw no key: every score is the blocked minimum; with lse2 = 0, p = exp2(min) = 0.
    lse2 = torch.where(lse_r > tiles.blocked * 0.5, lse_r * LOG2E, 0.0)
    keys = _KeyTiles(k, v, bounds=tiles.flush)
    k_norm = keys.norm  # (b * h_kv, j): bounds for skipping, with a bias
    dq = torch.zeros_like(q_c)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    dbias = None
    if want_dbias and spec.bias is not None:
        dbias = torch.zeros(spec.bias.shape, dtype=dtype, device=q.device)
    for i0 in range(0, tiles.ni, spec.block_q):
        i1 = min(tiles.ni, i0 + spec.block_q)
        r0, r1 = i0 * g, i1 * g
        q_blk, do_blk = tiles.queries(q_c[:, r0:r1]), tiles.queries(do[:, r0:r1]).contiguous()
        q2_blk = q_blk * (spec.scale * LOG2E)
        out_blk, lse_blk = tiles.queries(out_r[:, r0:r1]), tiles.queries(lse2[:, r0:r1])
        delta = (do_blk * out_blk).sum(dim=-1, keepdim=True)  # D = rowsum(dO * O)
        dq_blk = torch.zeros_like(q_blk) if tiles.reverse else dq[:, r0:r1]
        q_norm = q2_blk.norm(dim=-1) if tiles.flush else None  # (b * h_kv, rows)
        for sel, state in tiles.groups(i0, i1):
            allowed = tiles.allowed(i0, i1, sel, state)
            if allowed is not None and not bool(allowed.any()):
                continue
            bias = tiles.bias(i0, i1, sel)
            k_t, k_tt, _, v_tt, _ = keys.get(sel)
            lo, hi = 0, tiles.hk  # the key heads to compute: all, unless some underflow
            if dbias is None and k_norm is not None and tiles.can_skip(allowed, bias, sel):
                top = tiles.row_max(bias, i0, i1, sel)
                lo, hi = tiles.needed(q_norm, _keys(k_norm, sel), top, lse_blk)
            if lo == hi:
                continue
            q_h, q2_h, do_h, k_h, k_th, v_th = (
                _heads(t, nb, lo, hi) for t in (q_blk, q2_blk, do_blk, k_t, k_tt, v_tt)
            )  # the tensors themselves when all heads are computed
            s = tiles.logits(q2_h, k_th, allowed, _head_tile(bias, lo, hi))
            p = tiles.exp2_shifted(s, _heads(lse_blk, nb, lo, hi))  # recomputed
            dp = _bmm(do_h, v_th)  # (b * heads, rows, bj)
            ds = dp.sub_(_heads(delta, nb, lo, hi)).mul_(p)  # d loss / d scores
            _add_heads(dq_blk, nb, lo, hi, _bmm(ds, k_h))
            _add_keys(dv, sel, nb, lo, hi, _bmm(p.transpose(1, 2), do_h))
            _add_keys(dk, sel, nb, lo, hi, _bmm(ds.transpose(1, 2), q_h))
            if dbias is not None:
                tile = _sum_to(_untile_rows(_unflat(ds, nb), g), dbias.shape)  # (b?, h?, bi?, bj?)
                rows = slice(i0, i1) if dbias.shape[2] != 1 else slice(None)
                if dbias.shape[3] == 1:
                    dbias[:, :, rows].add_(tile.sum(dim=3, keepdim=True))
                elif isinstance(sel, slice):
                    dbias[:, :, rows, sel].add_(tile)
                else:
                    dbias[:, :, rows].index_add_(3, sel, tile)
        if tiles.reverse:
            dq[:, r0:r1] = tiles.queries(dq_blk)
    dq.mul_(spec.scale)
    dk.mul_(spec.scale)
    return _unrows(_unflat(dq, nb), g), _unflat(dk, nb), _unflat(dv, nb), dbias


class _TiledAttention(torch.autograd.Function):
    """Forward saves only q, k, v, the output and the log-sum-exp; backward recomputes tiles."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, spec: _Spec):  # type: ignore[override]
        spec = replace(spec, bias=bias)
        out, lse = _forward(q, k, v, spec)
        out = out.to(q.dtype)
        ctx.spec = spec
        ctx.save_for_backward(q, k, v, bias, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        q, k, v, bias, out, lse = ctx.saved_tensors
        spec = replace(ctx.spec, bias=bias)
        want_dbias = bias is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dbias = _backward(q, k, v, out, lse, grad_out, spec, want_dbias)
        if dbias is not None:
            dbias = dbias.to(bias.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias, None


def tiled_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    mask: Tensor | None = None,
    mask_fn: MaskFn | None = None,
    bias: Tensor | None = None,
    bias_fn: BiasFn | None = None,
    is_causal: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    gather: bool = False,
) -> Tensor:
    """Differentiable tiled attention on 4-D inputs ``(b, h, i, d)``; see the module docstring.

    ``is_causal`` is aligned bottom-right (as ``scaled_dot_product_attention``). Gradients flow
    to ``q``, ``k``, ``v`` and a ``bias`` tensor. ``gather=True`` visits all the key ranges a
    query block may see as one group (gathered when they are not contiguous): fewer, larger
    matmuls for sparse layouts (the ``sparse`` backend).
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if is_causal:
        mask_fn = all_of(mask_fn, causal_fn(k.shape[2] - q.shape[2]))
    block_q, block_k = _blocks(block_q, block_k, bias, bias_fn)
    spec = _Spec(
        scale, _pad4(mask), mask_fn, None, bias_fn, block_q=block_q, block_k=block_k, gather=gather
    )
    return _TiledAttention.apply(q, k, v, _pad4(bias), spec)


# The registry entry: AttentionCall (any leading dims) -> 4-D tiled_attention.


def _pad4(t: Tensor | None) -> Tensor | None:
    """A mask or bias of rank <= 4 as 4-D (leading singleton axes added)."""
    return None if t is None else t.reshape((1,) * (4 - t.ndim) + tuple(t.shape))


def _as4d(t: Tensor, ndim: int, lead: tuple[int, ...]) -> Tensor:
    """A tensor broadcastable to (*lead, h, i, x), as 4-D (b, h, i, x) with b = prod(lead)."""
    t = t.reshape((1,) * (ndim - t.ndim) + tuple(t.shape))
    if ndim <= 4:
        return _pad4(t)
    if all(s == 1 for s in t.shape[:-3]):
        return t.reshape(1, *t.shape[-3:])
    t = t.expand(*lead, *t.shape[-3:])  # a broadcast leading axis is copied here, only here
    return t.reshape(-1, *t.shape[-3:])


def why_not(call: AttentionCall) -> str | None:
    if call.return_weights:
        return "return_weights=True: the tiled backend never builds the attention weights"
    if call.dropout_p > 0.0:
        return (
            f"dropout_p={call.dropout_p}: the tiled backend cannot replay a dropout mask tile by "
            "tile in its backward; use backend='math' or 'torch' for dropout"
        )
    if callable(call.bias) and torch.is_grad_enabled():
        probe = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=call.query.device)
        if call.bias(probe, probe, probe, probe).requires_grad:
            return (
                "the bias function's output requires grad: the tiled backend does not "
                "differentiate through bias functions; pass the bias as a tensor"
            )
    return None


def run_call(
    call: AttentionCall,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    gather: bool = False,
    extra_mask_fn: MaskFn | None = None,
) -> Tensor:
    """Serve an ``AttentionCall`` (any leading dims) with ``tiled_attention``; used by ``sparse``.

    ``extra_mask_fn`` is ANDed with the call's mask (the sparse backend's layout).
    """
    q, k, v = call.query, call.key, call.value
    ndim = q.ndim
    lead = tuple(q.shape[:-3])
    q4, k4, v4 = (_as4d(t, ndim, lead) for t in (q, k, v))
    mask_fn = all_of(call.mask if callable(call.mask) else None, extra_mask_fn)
    mask_t = None if call.mask is None or callable(call.mask) else _as4d(call.mask, ndim, lead)
    bias_fn = call.bias if callable(call.bias) else None
    bias_t = None if call.bias is None or bias_fn is not None else _as4d(call.bias, ndim, lead)
    out = tiled_attention(
        q4,
        k4,
        v4,
        scale=call.scale,
        mask=mask_t,
        mask_fn=mask_fn,
        bias=bias_t,
        bias_fn=bias_fn,
        is_causal=call.is_causal,
        block_q=block_q,
        block_k=block_k,
        gather=gather,
    )
    return out.reshape(*q.shape[:-1], v.shape[-1])


def run(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    reason = why_not(call)
    if reason is not None:
        raise BackendUnavailable(f"backend 'tiled' cannot serve this call: {reason}")
    return run_call(call), None


register_backend(
    "tiled",
    run,
    why_not,
    description="FlashAttention in PyTorch: online softmax over tiles, recomputing backward",
)


def _why_not_functions(call: AttentionCall) -> str | None:
    if not (callable(call.mask) or callable(call.bias)):
        return "auto's route for calls with a mask or bias function; this call has none"
    return why_not(call)


register_backend(
    "tiled-functions",
    run,
    _why_not_functions,
    description="the tiled backend, for auto: calls with mask or bias functions (see AUTO_ORDER)",
)
