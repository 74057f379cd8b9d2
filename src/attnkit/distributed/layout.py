"""How a long sequence is split across the ranks of a ring: contiguous and zigzag layouts.

Shape vocabulary: ``b`` batch, ``h`` heads, ``n`` positions of the full sequence, ``n_r`` the
positions rank ``r`` holds, ``d`` head width. The sequence axis is ``dim`` (``-2`` by default,
the ``(b, h, n, d)`` layout of attention inputs).

The sequence is cut into pieces with ``torch.tensor_split`` semantics, so lengths that do not
divide evenly are allowed: the first pieces are one position longer.

**contiguous**: ``W`` pieces, rank ``r`` holds piece ``r``. Simple, but with causal attention
rank 0 attends to almost nothing while rank ``W - 1`` attends to everything::

    positions  0 1 | 2 3 | 4 5 | 6 7        W = 4, n = 8
    rank         0     1     2     3

**zigzag** (load-balanced causal attention; Brandon et al. 2023, "Striped Attention", and the
"zigzag" variant of ring-flash-attention): ``2W`` chunks, rank ``r`` holds chunks ``r`` and
``2W - 1 - r``, so every rank holds one early and one late chunk and does the same causal work::

    chunks     0  1  2  3  4  5  6  7         W = 4, n = 16 (chunks of 2 positions)
    rank       0  1  2  3  3  2  1  0

A rank's shard is described by its *segments*: ``(start, length)`` runs of global positions, in
the order they are stored locally (one segment for contiguous, two for zigzag).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

Layout = Literal["contiguous", "zigzag"]
Segments = tuple[tuple[int, int], ...]  # ((start, length), ...) in local storage order

LAYOUTS = ("contiguous", "zigzag")

__all__ = [
    "LAYOUTS",
    "Layout",
    "Segments",
    "shard_lengths",
    "shard_segments",
    "shard_sequence",
    "unshard_sequence",
]


def _check(n: int, world_size: int, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"sequence length must be a non-negative int, got {n!r}")


def _piece_lengths(n: int, pieces: int) -> list[int]:
    """Lengths of ``torch.tensor_split(x, pieces)``: the first ``n % pieces`` are one longer."""
    base, extra = divmod(n, pieces)
    return [base + (1 if p < extra else 0) for p in range(pieces)]


def shard_segments(n: int, world_size: int, rank: int, layout: Layout = "contiguous") -> Segments:
    """The global positions rank ``rank`` holds, as ``((start, length), ...)`` runs."""
    _check(n, world_size, layout)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    pieces = world_size if layout == "contiguous" else 2 * world_size
    lengths = _piece_lengths(n, pieces)
    starts = [sum(lengths[:p]) for p in range(pieces)]
    chunks = (rank,) if layout == "contiguous" else (rank, 2 * world_size - 1 - rank)
    return tuple((starts[c], lengths[c]) for c in chunks)


def shard_lengths(n: int, world_size: int, layout: Layout = "contiguous") -> list[int]:
    """How many positions each rank holds for a sequence of ``n``."""
    shard_segments(n, world_size, 0, layout)  # checks the arguments, even for world_size < 1
    return [
        sum(length for _, length in shard_segments(n, world_size, r, layout))
        for r in range(world_size)
    ]


def shard_sequence(
    x: Tensor, world_size: int, rank: int, *, layout: Layout = "contiguous", dim: int = -2
) -> Tensor:
    """Rank ``rank``'s shard of the full sequence ``x`` (sequence axis ``dim``).

    ``(b, h, n, d) -> (b, h, n_r, d)``. Contiguous shards are views; zigzag shards are copies
    (two chunks concatenated).
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    segments = shard_segments(x.shape[dim], world_size, rank, layout)
    parts = [x.narrow(dim, start, length) for start, length in segments]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)  # (b, h, n_r, d)


def unshard_sequence(
    shards: Sequence[Tensor], *, layout: Layout = "contiguous", dim: int = -2
) -> Tensor:
    """Inverse of ``shard_sequence``: the full sequence from every rank's shard, in rank order.

    ``[(b, h, n_0, d), (b, h, n_1, d), ...] -> (b, h, n, d)``. Differentiable (it is made of
    ``narrow`` and ``cat``), so it also reassembles gradients.
    """
    world_size = len(shards)
    if world_size == 0:
        raise ValueError("shards must hold one tensor per rank, got an empty sequence")
    n = sum(s.shape[dim] for s in shards)
    expected = shard_lengths(n, world_size, layout)
    got = [s.shape[dim] for s in shards]
    if got != expected:
        raise ValueError(
            f"shard lengths {got} along dim {dim} are not a {layout} layout of n={n} over "
            f"{world_size} ranks (expected {expected})"
        )
    pieces: list[tuple[int, Tensor]] = []  # (global start, piece)
    for rank, shard in enumerate(shards):
        offset = 0
        for start, length in shard_segments(n, world_size, rank, layout):
            pieces.append((start, shard.narrow(dim, offset, length)))
            offset += length
    pieces.sort(key=lambda piece: piece[0])
    return torch.cat([piece for _, piece in pieces], dim=dim)  # (b, h, n, d)
