"""The key tiles a tiled kernel visits for a call, for the cost model (``cost.py``): which
tiles declared structure leaves (the call's ``TilePlan``, the one the backends read),
which of them an undeclared mask blocks (sampled), and the pairs a relative bias makes
negligible. ``work`` is the cost model's per-call record (``cost._Work``): the call and its
sizes ``b, h, i, j``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit._numerics import compute_dtype
from attnkit._structure import Band, Structure, structure_of, tile_plan
from attnkit.backends.tiled.skipping import NEGLIGIBLE_MARGIN
from attnkit.backends.tiled.softmax import LOG2E
from attnkit.masks import causal_offset
from attnkit.registry import AttentionCall

__all__ = ["Visit", "negligible_pairs", "tiles_visited", "windowed"]


@dataclass(frozen=True)
class Visit:
    """The tiles one call visits (``tiles_visited``)."""

    tiles: int  # key tiles visited (their matmuls run)
    pairs: float  # (i, j) pairs in them, per (b, h)
    evaluated: float  # pairs where the mask function is evaluated, per (b, h)
    groups: int  # query blocks with at least one tile
    masked: float = 0.0  # pairs of the evaluated tiles kept (not all blocked), per (b, h)
    spans: list[tuple[int, int, int, int, bool]] | None = None  # the tiles, when listed


def _mask_structure(call: AttentionCall) -> tuple[Structure, object]:
    """The mask structure ``tiled`` sees (the mask function AND the causal band) and the
    undeclared mask function to sample, if any."""
    fn = call.mask if callable(call.mask) else None
    parts = []
    if fn is not None:
        parts.append(structure_of(fn))
    if call.is_causal:
        parts.append(Structure(band=Band(None, 0, causal_offset(call.n_queries, call.n_keys))))
    structure = Structure(parts=tuple(parts)) if parts else Structure()
    undeclared = fn if fn is not None and not _declares_all(structure_of(fn)) else None
    return structure, undeclared


def _declares_all(s: Structure) -> bool:
    """Whether a structure's ``classify`` is exact: bands and block layouts say where the
    function is True, not only where it is False."""
    if s.parts:
        return all(_declares_all(p) for p in s.parts)
    return (s.band is not None or s.layout is not None) and s.tile is None


def tiles_visited(work, bq: int, bk: int, gather: bool) -> Visit:
    structure, undeclared = _mask_structure(work.call)
    i, j = work.i, work.j
    if not structure.skips and undeclared is None:
        nq, nk = math.ceil(i / bq), math.ceil(j / bk)
        return Visit(nq * nk, float(i * j), 0.0, nq)  # every tile, fully visible
    plan = tile_plan(structure, i, j, bq, bk)  # the plan the backend will read
    tiles: list[tuple[int, int, int, int, bool]] = [  # i0, i1, j0, j1, evaluated
        (r * bq, min(i, (r + 1) * bq), j0, j1, not full)
        for r, row in enumerate(plan.rows)
        for j0, j1, full in row
    ]
    evaluated = sum((t[1] - t[0]) * (t[3] - t[2]) for t in tiles if t[4])
    if undeclared is not None and tiles:
        kept = _sampled(undeclared, tiles, work)
        tiles = [t for t, keep in zip(tiles, kept, strict=True) if keep]
    pairs = float(sum((t[1] - t[0]) * (t[3] - t[2]) for t in tiles))
    masked = float(sum((t[1] - t[0]) * (t[3] - t[2]) for t in tiles if t[4]))
    groups = len({t[0] for t in tiles})
    count = groups if gather else len(tiles)
    return Visit(count, pairs, float(evaluated), groups, masked=masked, spans=tiles)


def _sampled(fn, tiles: list[tuple[int, int, int, int, bool]], work) -> list[bool]:
    """Whether each tile has a visible pair among 8 x 8 sample points of the mask function
    (batch 0, head 0): ``tiled`` skips a tile that evaluates all blocked."""
    device = work.call.query.device
    t = torch.tensor([x[:4] for x in tiles], dtype=torch.float64)  # (T, 4)
    steps = torch.linspace(0, 1, 8, dtype=torch.float64)
    rows = (t[:, :1] + steps * (t[:, 1:2] - 1 - t[:, :1])).round().long()  # (T, 8)
    cols = (t[:, 2:3] + steps * (t[:, 3:4] - 1 - t[:, 2:3])).round().long()  # (T, 8)
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    try:
        with torch.no_grad():
            seen = fn(
                zero, zero, rows.to(device).view(1, -1, 8, 1), cols.to(device).view(1, -1, 1, 8)
            )
        seen = seen.expand(1, len(tiles), 8, 8).reshape(len(tiles), -1).any(dim=1)  # (tiles,)
        return [bool(x) for x in seen.cpu()]
    except Exception:
        return [True] * len(tiles)


def _largest_norm(t: Tensor) -> float:
    """The largest row norm of ``t`` ``(..., n, d)``, estimated from at most 1024 rows spread
    over it (reading the whole tensor would cost as much as a small call), plus a quarter."""
    flat = t.detach().reshape(-1, t.shape[-1])
    step = max(1, flat.shape[0] // 1024)
    return 1.25 * float(flat[::step].float().norm(dim=-1).amax()) if flat.numel() else 0.0


def negligible_pairs(work, visit: Visit, bq: int, bk: int) -> float:
    """Pairs per (b, h) of the heads ``tiled`` leaves out as negligible (``skipping.needed``):
    where a relative bias puts a whole tile more than the dtype's negligible bits plus twice
    the Cauchy-Schwarz bound ``max |q| max |k| scale`` below its rows' largest bias. Tiles
    with a mask are never left out; the heads kept are a contiguous range, as there."""
    call = work.call
    i, j = work.i, work.j
    if i == 0 or j == 0:
        return 0.0  # no query or no key: no pairs to leave out
    spans = visit.spans
    if spans is None:
        spans = [
            (i0, min(i, i0 + bq), j0, min(j, j0 + bk), False)
            for i0 in range(0, i, bq)
            for j0 in range(0, j, bk)
        ]
    with torch.no_grad():
        heads = torch.arange(work.h, device=call.query.device).view(1, -1, 1, 1)
        offsets = torch.arange(i + j - 1, device=call.query.device).view(1, 1, 1, -1)
        last = torch.full((1, 1, 1, 1), i - 1, device=call.query.device)
        zero = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=call.query.device)
        try:  # bias[h, o]: key j - i = o - (i - 1)
            table = call.bias(zero, heads, last, offsets).double().reshape(-1, i + j - 1)
        except Exception:
            return 0.0
        norms = [_largest_norm(t) for t in (call.query, call.key)]
        bound = norms[0] * norms[1] * abs(call.scale)  # |q . k| <= |q| |k|
    if table.shape[0] != work.h or not math.isfinite(bound):
        return 0.0
    mantissa = round(-math.log2(torch.finfo(compute_dtype(call.query.dtype)).eps)) + 1
    margin = (mantissa + NEGLIGIBLE_MARGIN + 1) / LOG2E + 2 * bound  # natural units
    top = table.amax(dim=1)  # (h,): the largest bias any row can reach
    left = 0.0
    for i0, i1, j0, j1, masked in spans:
        if masked:
            continue
        lo, hi = j0 - (i1 - 1) + (i - 1), (j1 - 1) - i0 + (i - 1)
        negligible = (table[:, lo : hi + 1].amax(dim=1) < top - margin).tolist()
        kept = [h for h, small in enumerate(negligible) if not small]
        skipped = work.h - (kept[-1] - kept[0] + 1) if kept else work.h
        left += (i1 - i0) * (j1 - j0) * skipped / work.h
    return left


def windowed(fn) -> bool:
    """Whether a mask function's structure includes a band with a finite left edge."""
    if fn is None:
        return False
    stack = [structure_of(fn)]
    while stack:
        s = stack.pop()
        if s.band is not None and s.band.left is not None:
            return True
        stack.extend(s.parts)
    return False
