"""Declared mask structure agrees with evaluating the mask: tile states and key ranges."""

from __future__ import annotations

import random

import torch

from attnkit import masks
from attnkit.backends.sparse import block_sparse, strided_layout
from attnkit.masks import all_of, structure_of


def tile_state(fn, i0, i1, j0, j1):
    return structure_of(fn).classify(i0, i1, j0, j1)


def key_ranges(fn, i0, i1, j0, j1):
    return structure_of(fn).visible_keys(i0, i1, j0, j1)


def _brute(fn, i0, i1, j0, j1):
    grid = masks.materialize(lambda b, h, i, j: fn(b, h, i + i0, j + j0), (1, 1, i1 - i0, j1 - j0))
    return grid[0, 0]


def test_tile_state_and_key_ranges_agree_with_evaluation() -> None:
    rng = random.Random(0)
    fns = [
        masks.causal_fn(0),
        masks.causal_fn(5),
        masks.window_fn(7, 2, 3),
        block_sparse(strided_layout(8, 2, 3), 8),
        all_of(masks.window_fn(20, 0), masks.causal_fn(-2)),
    ]
    for fn in fns:
        for _ in range(60):
            i0, j0 = rng.randrange(0, 50), rng.randrange(0, 50)
            i1, j1 = i0 + rng.randrange(1, 14), j0 + rng.randrange(1, 14)
            grid = _brute(fn, i0, i1, j0, j1)
            state = tile_state(fn, i0, i1, j0, j1)
            if state is True:
                assert bool(grid.all())
            elif state is False:
                assert not bool(grid.any())
            visible = torch.zeros(j1 - j0, dtype=torch.bool)
            for lo, hi in key_ranges(fn, i0, i1, j0, j1):
                assert j0 <= lo < hi <= j1
                visible[lo - j0 : hi - j0] = True
            assert not bool((grid.any(dim=0) & ~visible).any()), "a visible key left out"


def test_unknown_functions_are_evaluated() -> None:
    fn = lambda b, h, i, j: i == j  # noqa: E731
    assert tile_state(fn, 0, 4, 0, 4) is None
    assert key_ranges(fn, 0, 4, 0, 9) == [(0, 9)]
