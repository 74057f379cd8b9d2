"""Tile iteration: which key tiles a query block visits, and the base-2 logits of one tile.

For the query block ``[i0, i1)``, a mask function's declared structure (``masks.Structure``)
gives the key ranges some query may see; they are cut into tiles of ``block_k`` keys, and tiles
the structure declares all blocked are never visited. Every other mask and bias, tensor or
function, is read one tile at a time (``allowed``, ``bias``), never as an ``i x j`` tensor.
Blocked scores get the dtype's finite minimum, never ``-inf``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit._numerics import all_finite, blocked, compute_dtype
from attnkit._structure import tile_plan
from attnkit.backends.tiled.layout import bmm, flip_queries, keys, tile_rows, unflat
from attnkit.backends.tiled.relative import Relative
from attnkit.backends.tiled.softmax import LOG2E
from attnkit.masks import (
    BiasFn,
    MaskFn,
    checked_bias,
    checked_mask,
    pad_to_rank,
    structure_of,
)
from attnkit.registry import ScoreModification

__all__ = ["BLOCK_K", "BLOCK_K_BIAS", "BLOCK_Q", "BLOCK_Q_BIAS", "KeyTiles", "Spec", "Tiles"]

# Tile sizes (measured choices: docs/concepts/efficient.md, "Tile sizes").
BLOCK_Q = 256
BLOCK_K = 256
BLOCK_Q_BIAS = 256  # with a bias: finer head skipping, and per-tile bias work still amortises
BLOCK_K_BIAS = 512

Sel = slice | Tensor  # the keys (or queries) of a tile: a contiguous slice, or gathered indices
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
"""``score_mod(score, b, h, i, j) -> score``: FlexAttention's score modification; ``score`` is
the scaled (soft-capped, then biased) score of a tile in the engine's own layout ``(b, h_kv,
bi * g, bj)`` (``(b, h, bi, bj)`` when ``g = 1``), with ``b, h, i, j`` broadcastable index
tensors of absolute positions that say which element each is (``Tiles.index``)."""


@dataclass(frozen=True)
class Spec:
    """Everything about one attention problem except the q, k, v tensors (all 4-D, local)."""

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
    softcap: float | None = None  # q.k * scale becomes softcap * tanh(. / softcap), before bias
    score_mod: ScoreMod | None = None  # score_mod(score, b, h, i, j) -> score, natural units

    @property
    def has_bias(self) -> bool:
        """Whether scores are more than ``q k^T * scale``: a bias tensor or function, or a score
        modification (their spread calls for the exact running maximum)."""
        return self.bias is not None or self.bias_fn is not None or self.score_mod is not None


def tile_sizes(block_q: int | None, block_k: int | None, has_bias: bool) -> tuple[int, int]:
    """The tile sizes: as given, else ``BLOCK_Q_BIAS x BLOCK_K_BIAS`` with a bias and
    ``BLOCK_Q x BLOCK_K`` without."""
    if block_q is None:
        block_q = BLOCK_Q_BIAS if has_bias else BLOCK_Q
    if block_k is None:
        block_k = BLOCK_K_BIAS if has_bias else BLOCK_K
    return block_q, block_k


class Tiles:
    """The tiles of one call: the key groups of each query block, and each tile's logits."""

    def __init__(self, spec: Spec, q: Tensor, k: Tensor) -> None:
        self.spec = spec
        self.nb, self.h, self.ni, _ = q.shape
        self.nj = k.shape[2]
        self.hk = k.shape[1]  # key heads
        self.g = self.h // self.hk
        self.dtype = compute_dtype(q.dtype)
        self.blocked = blocked(self.dtype)
        # Only a bias spreads logits far below the row maximum: flush those (``exp2_shifted``).
        self.flush_below = math.log2(torch.finfo(self.dtype).tiny) if spec.has_bias else None
        device = q.device
        self.b_idx = torch.arange(self.nb, device=device).view(-1, 1, 1, 1)
        self.h_idx = torch.arange(self.h, device=device).view(1, -1, 1, 1)
        # A relative bias function (and no bias tensor) is evaluated once; query blocks are then
        # processed with their rows in reverse order (see ``relative``).
        self.relative = None
        if spec.bias is None and spec.bias_fn is not None and structure_of(spec.bias_fn).relative:
            shape = (self.h, self.hk, self.ni, self.nj)
            self.relative = Relative(
                spec.bias_fn, shape, spec.q_offset, spec.k_offset, self.dtype, device
            )
        self.reverse = self.relative is not None
        # The engine's query order: each query tile's rows reversed when ``reverse``. A query
        # selection ``qs`` (a slice or index tensor) indexes this order; its positions are
        # ``order[qs]``.
        self.order_of_queries = torch.arange(self.ni, device=device)
        if self.reverse:
            self.order_of_queries = torch.cat(
                [
                    self.order_of_queries[i0 : i0 + spec.block_q].flip(0)
                    for i0 in range(0, self.ni, spec.block_q)
                ]
            )
        self._indices: tuple[Tensor, Tensor, Tensor] | None = None  # ``indices``
        self.modification = ScoreModification(spec.softcap, spec.bias, spec.bias_fn, spec.score_mod)
        structure = None if spec.mask_fn is None else structure_of(spec.mask_fn)
        self.plan = tile_plan(
            structure, self.ni, self.nj, spec.block_q, spec.block_k, spec.q_offset, spec.k_offset
        )

    def index(self, qs: Sel, sel: Sel) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The ``(b, h, i, j)`` of each score of a tile in the engine's layout ``(b, h_kv,
        rows, bj)`` (row ``r`` is query ``r // g`` of head ``kv * g + r % g``), as index
        tensors broadcastable to it: ``b (b, 1, 1, 1)``, ``h (1, h_kv, rows, 1)`` (``(1, h_kv,
        1, 1)`` when ``g = 1``), ``i (1, 1, rows, 1)``, ``j (1, 1, 1, bj)``; what a score
        modification is called with, on the engine's own scores (no layout copy).

        The call's index tensors are made once (``indices``); a tile's are views of them for
        contiguous tiles (gathered ones select their rows or keys), so a call with many tiles
        builds no index tensor per tile."""
        h_rows, i_rows, j_all = self.indices()
        g = self.g
        r = self.rows_of(qs)  # the rows of these queries, in the engine's order
        i = i_rows[r] if isinstance(r, slice) else i_rows.index_select(0, r)
        j = j_all[sel] if isinstance(sel, slice) else j_all.index_select(0, sel)
        h = h_rows if g == 1 else h_rows[:, :, : i.shape[0]]  # rows repeat with period g
        return self.b_idx, h, i.view(1, 1, -1, 1), j.view(1, 1, 1, -1)

    def indices(self) -> tuple[Tensor, Tensor, Tensor]:
        """The call's index tensors, made on first use and kept: the head of each row ``h``
        (``(1, h_kv, i * g, 1)``, ``(1, h_kv, 1, 1)`` when ``g = 1``), the absolute query
        position of each row in the engine's order ``(i * g,)`` and the absolute key
        positions ``(j,)``."""
        if self._indices is None:
            g, device = self.g, self.b_idx.device
            h = torch.arange(self.hk, device=device).view(1, -1, 1, 1) * g  # (1, h_kv, 1, 1)
            if g > 1:
                h = h + torch.arange(g, device=device).repeat(self.ni).view(1, 1, -1, 1)
            i = (self.order_of_queries + self.spec.q_offset).repeat_interleave(g)  # (i * g,)
            j = torch.arange(self.nj, device=device) + self.spec.k_offset  # (j,)
            self._indices = (h, i, j)
        return self._indices

    def in_order(self, x: Tensor) -> Tensor:
        """A row-layout tensor ``(n, i * g, ...)`` in the engine's query order (each query
        tile's rows reversed when ``reverse``; its own inverse), else ``x`` itself."""
        if not self.reverse:
            return x
        g, step = self.g, self.spec.block_q * self.g
        return torch.cat(
            [flip_queries(x[:, r0 : r0 + step], g) for r0 in range(0, x.shape[1], step)], dim=1
        )

    def rows_of(self, qs: Sel) -> Sel:
        """The rows of a row-layout tensor in the engine's order that hold queries ``qs``."""
        g = self.g
        if isinstance(qs, slice):
            return slice(qs.start * g, qs.stop * g)
        return (qs.view(-1, 1) * g + torch.arange(g, device=qs.device)).flatten()

    def query_groups(self, kb: int, column: list[list[int]]) -> list[tuple[Sel, Sel, bool | None]]:
        """The backward's groups of key tile ``kb``: ``(queries, keys, state)`` for each query
        tile ``(i0, i1, full)`` of its ``column`` (``TilePlan.by_key``); with ``gather``, all of
        them as one group of gathered queries (fewer, larger matmuls), as ``groups`` gathers
        keys."""
        spec = self.spec
        j0 = kb * spec.block_k
        keys_sel = slice(j0, min(self.nj, j0 + spec.block_k))
        tiles = [(slice(i0, i1), keys_sel, True if full else None) for i0, i1, full in column]
        if not spec.gather or len(tiles) <= 1:
            return tiles
        state = True if all(t[2] is True for t in tiles) else None
        runs: list[list[int]] = []
        for qs, _, _ in tiles:
            if runs and runs[-1][1] == qs.start:
                runs[-1][1] = qs.stop
            else:
                runs.append([qs.start, qs.stop])
        if len(runs) == 1 and not self.reverse:  # (reversed tiles: one slice is one tile)
            return [(slice(runs[0][0], runs[0][1]), keys_sel, state)]
        device = self.b_idx.device
        idx = torch.cat([torch.arange(a, b, device=device) for a, b in runs])
        return [(idx, keys_sel, state)]

    def sink_rows(self, sinks: Tensor | None, i0: int, i1: int) -> Tensor | None:
        """The base-2 sink logit of each row of query block ``[i0, i1)``: ``(b * h_kv, rows)``
        (row ``r`` belongs to head ``kv * g + r % g``, whatever the query order)."""
        if sinks is None:
            return None
        per_kv = sinks.to(self.dtype).view(self.hk, self.g) * LOG2E  # (h_kv, g)
        rows = per_kv.repeat(1, i1 - i0)  # (h_kv, (i1 - i0) * g)
        return rows.expand(self.nb, *rows.shape).reshape(self.nb * self.hk, -1)

    def queries(self, x: Tensor) -> Tensor:
        """A row-layout block ``(n, rows, ...)`` in this call's row order: reversed queries
        when ``reverse`` (its own inverse), else ``x`` itself."""
        return flip_queries(x, self.g) if self.reverse else x

    def groups(self, i0: int, i1: int) -> list[tuple[Sel, bool | None]]:
        """Key groups for queries ``[i0, i1)`` (a query tile of ``block_q``): ``(keys, state)``
        with local key indices and the declared state (True: all visible, None: evaluate the
        mask), the kept tiles of the call's ``TilePlan``."""
        spec = self.spec
        row = self.plan.rows[i0 // spec.block_q]
        tiles = [(j0, j1, True if full else None) for j0, j1, full in row]
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

    def order(self, i0: int, i1: int) -> list[tuple[Sel, bool | None]]:
        """``groups``, nearest keys first when a bias may let later tiles be skipped (the
        running maximum then starts high); the result is the same in any order."""
        groups = self.groups(i0, i1)
        if not self.spec.has_bias or self.spec.gather:
            return groups
        centre = (i0 + i1) / 2 + self.spec.q_offset - self.spec.k_offset

        def distance(group: tuple[Sel, bool | None]) -> float:
            sel = group[0]
            return abs((sel.start + sel.stop) / 2 - centre) if isinstance(sel, slice) else 0.0

        return sorted(groups, key=distance)

    def _slice(self, t: Tensor, qs: Sel, sel: Sel) -> Tensor:
        """Tile of a tensor broadcastable to (b, h, i, j), queries in the engine's order."""
        if t.shape[2] != 1:
            if isinstance(qs, slice):
                t = t[:, :, qs].flip(2) if self.reverse else t[:, :, qs]
            else:
                t = t.index_select(2, self.order_of_queries[qs])
        if t.shape[3] != 1:
            t = t[:, :, :, sel] if isinstance(sel, slice) else t.index_select(3, sel)
        return t

    def _positions(self, qs: Sel, sel: Sel) -> tuple[Tensor, Tensor]:
        """Absolute query positions ``(1, 1, bi, 1)`` and key positions ``(1, 1, 1, bj)``."""
        device = self.b_idx.device
        qo, ko = self.spec.q_offset, self.spec.k_offset
        i = self.order_of_queries[qs] + qo
        j = torch.arange(sel.start, sel.stop, device=device) if isinstance(sel, slice) else sel
        return i.view(1, 1, -1, 1), (j + ko).view(1, 1, 1, -1)

    def _grid(self, i: Tensor, j: Tensor) -> tuple[int, ...]:
        """The (b, h, i, j) shape a mask or bias function's tile broadcasts to."""
        return tuple(torch.broadcast_shapes(self.b_idx.shape, self.h_idx.shape, i.shape, j.shape))

    def allowed(self, qs: Sel, sel: Sel, state: bool | None) -> Tensor | None:
        """Bool tile (broadcastable, row layout) of allowed positions; None = all allowed."""
        spec = self.spec
        parts = []
        if spec.mask is not None:
            parts.append(self._slice(spec.mask, qs, sel))
        if spec.mask_fn is not None and state is None:
            i, j = self._positions(qs, sel)
            values = spec.mask_fn(self.b_idx, self.h_idx, i, j)
            parts.append(pad_to_rank(checked_mask(values, self._grid(i, j)), 4))
        if not parts:
            return None
        allowed = parts[0]
        for p in parts[1:]:
            allowed = allowed & p
        return tile_rows(allowed, self.g, _width(qs), _width(sel))

    def bias(self, qs: Sel, sel: Sel) -> Tensor | None:
        """Float tile (broadcastable, row layout) of the bias, in natural units; None = none.

        For a relative bias function and a contiguous tile: a 5-D view
        ``(1, h_kv, i1 - i0, g, bj)`` (``Relative.tile``) instead.
        """
        spec = self.spec
        if self.relative is not None and isinstance(sel, slice) and isinstance(qs, slice):
            return self.relative.tile(qs.start, qs.stop, sel.start, sel.stop)
        parts = []
        if spec.bias is not None:
            parts.append(self._slice(spec.bias, qs, sel))
        if spec.bias_fn is not None:
            i, j = self._positions(qs, sel)
            values = spec.bias_fn(self.b_idx, self.h_idx, i, j)
            parts.append(pad_to_rank(checked_bias(values, self._grid(i, j)), 4))
        if not parts:
            return None
        bias = parts[0] if len(parts) == 1 else parts[0] + parts[1]
        return tile_rows(bias.to(self.dtype), self.g, _width(qs), _width(sel))

    def logits(
        self,
        q2: Tensor,
        k_tt: Tensor,
        allowed: Tensor | None,
        bias: Tensor | None,
        at: tuple[Sel, Sel] | None = None,
    ) -> Tensor:
        """Base-2 logits ``(b * h_kv, rows, bj)`` of a tile: scores, then the call's score
        modification (soft-capping, bias, score_mod: ``ScoreModification.apply``), then the
        mask, in that order (the reference's).

        ``q2`` ``(b * h_kv, rows, d)`` is the query block already multiplied by
        ``scale * log2(e)``; ``k_tt`` ``(b * h_kv, d, bj)`` the key tile, transposed;
        ``allowed`` and ``bias`` as returned by ``allowed`` and ``bias``; ``at`` the tile's
        ``(queries, keys)``, needed with a score_mod (``index``).
        """
        return self._logits(q2, k_tt, allowed, bias, at, self.modification, False)[0]

    def logits_and_slope(
        self,
        q2: Tensor,
        k_tt: Tensor,
        allowed: Tensor | None,
        bias: Tensor | None,
        at: tuple[Sel, Sel] | None = None,
        modification: ScoreModification | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """``logits`` and, with soft-capping, its slope ``d capped / d raw = 1 - tanh^2``
        ``(b * h_kv, rows, bj)`` (None without): the backward's chain rule through the cap.
        ``modification`` replaces the call's (the backward records its score_mod)."""
        modification = self.modification if modification is None else modification
        return self._logits(q2, k_tt, allowed, bias, at, modification, True)

    def _logits(
        self,
        q2: Tensor,
        k_tt: Tensor,
        allowed: Tensor | None,
        bias: Tensor | None,
        at: tuple[Sel, Sel] | None,
        modification: ScoreModification,
        with_slope: bool,
    ) -> tuple[Tensor, Tensor | None]:
        softcap, score_mod = modification.softcap, modification.score_mod
        # A score_mod reads natural units: the matmul gives them (its alpha undoes log2(e)),
        # and the modified scores are brought to base 2 once, after it.
        unit = LOG2E if score_mod is None else 1.0
        s = bmm(q2, k_tt, 1.0 / LOG2E if score_mod is not None else 1.0)  # (b * h_kv, rows, bj)
        if bias is None and allowed is None and softcap is None and score_mod is None:
            return s, None
        slope = None
        if bias is not None or softcap is not None or score_mod is not None:
            index = None
            if score_mod is not None:
                assert at is not None, "a score_mod needs the tile's positions"
                index = self.index(*at)
            s4, slope = modification.apply(
                unflat(s, self.nb), bias, index, unit=unit, slope=with_slope, inplace=True
            )  # (b, h_kv, rows, bj), the same memory as s unless a score_mod made new scores
            if score_mod is not None:
                s4 = s4 * LOG2E  # a new tensor: the score_mod's result may be kept by autograd
            s = s4.flatten(0, 1)
            if slope is not None:
                slope = slope.flatten(0, 1)
        if allowed is not None:
            unflat(s, self.nb).masked_fill_(~allowed, self.blocked)
        return s, slope


def _width(sel: Sel) -> int:
    return sel.stop - sel.start if isinstance(sel, slice) else sel.numel()


class KeyTiles:
    """The key and value tiles of a call, made once per tile and reused by every query block:
    ``(k_t, k_t^T, v_t, v_t^T, largest |k_j|)``, views for a slice (``inf`` without
    ``bounds``). ``norm`` ``(b * h_kv, j)`` holds every ``|k_j|`` when ``bounds``.

    Non-finite entries of ``v`` are read as 0 (``bad`` marks them, None when there are none):
    the rows that can see them become NaN afterwards (``attnkit._numerics``)."""

    def __init__(self, k: Tensor, v: Tensor, bounds: bool) -> None:
        bad = None if all_finite(v) else ~torch.isfinite(v)  # (b * h_kv, j, dv)
        self.bad = bad if bad is not None and bool(bad.any()) else None
        self.k, self.v = k, (v if self.bad is None else v.masked_fill(bad, 0.0))
        self.norm = k.norm(dim=-1) if bounds else None  # (b * h_kv, j)
        self.cache: dict[tuple[int, int], tuple[Tensor, Tensor, Tensor, Tensor, float]] = {}

    def get(self, sel: Sel) -> tuple[Tensor, Tensor, Tensor, Tensor, float]:
        key = (sel.start, sel.stop) if isinstance(sel, slice) else None
        hit = self.cache.get(key) if key is not None else None
        if hit is None:
            norm = None if self.norm is None else keys(self.norm, sel)
            top = math.inf if norm is None or norm.numel() == 0 else float(norm.max())
            k_t, v_t = keys(self.k, sel), keys(self.v, sel)
            hit = (k_t, k_t.mT, v_t, v_t.mT, top)
            if key is not None:
                self.cache[key] = hit
        return hit
