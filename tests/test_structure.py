"""Declared mask structure agrees with evaluating the mask: tile states and key ranges."""

from __future__ import annotations

import random

import pytest
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


def test_to_string_draws_the_tiles_of_a_causal_layout() -> None:
    # Causal, 16 x 16 in tiles of 4: the diagonal tiles are partly visible, those below it
    # fully, those above it skipped.
    want = "\n".join(
        [
            "causal (k <= q + 0); 16 x 16, tiles of 4:",
            "|░   |",
            "|█░  |",
            "|██░ |",
            "|███░|",
        ]
    )
    assert structure_of(masks.causal_fn(0)).to_string(16, 16, block=4) == want
    # A window of 3 keys (left 2): query 4 still sees keys 2 and 3, query 8 sees none of 0-3.
    window = structure_of(masks.window_fn(2, 0, 0)).to_string(12, 12, block=4)
    assert window.splitlines()[1:] == ["|░  |", "|░░ |", "| ░░|"]
    assert masks.Structure().to_string(5, 9, block=4).splitlines() == [
        "no structure; 5 x 9, tiles of 4:",
        "|░░░|",
        "|░░░|",
    ]


def test_sparsity_counts_the_skipped_tiles() -> None:
    causal = structure_of(masks.causal_fn(0))
    assert causal.sparsity(16, 16, block=4) == 6 / 16  # the 6 tiles above the diagonal
    assert causal.sparsity(10, 10, block=4) == 3 / 9  # ragged last tiles
    assert masks.Structure().sparsity(100, 100, block=4) == 0.0
    # For bands and block layouts the declared skips are exactly the all-blocked tiles.
    rng = torch.Generator().manual_seed(2)
    fns = [
        masks.causal_fn(3),
        masks.window_fn(5, 2, 0),
        block_sparse(torch.rand(5, 6, generator=rng) > 0.5, 6),
    ]
    for fn in fns:
        for n_i, n_j, block in ((30, 36, 6), (29, 31, 4)):
            grid = _brute(fn, 0, n_i, 0, n_j)
            tiles = [
                not bool(grid[i0 : i0 + block, j0 : j0 + block].any())
                for i0 in range(0, n_i, block)
                for j0 in range(0, n_j, block)
            ]
            want = sum(tiles) / len(tiles)
            assert structure_of(fn).sparsity(n_i, n_j, block) == want, (fn, n_i, block)


def test_declare_replaces_the_given_fields_only() -> None:
    causal = masks.causal_fn(2)
    narrowed = masks.declare(causal, band=masks.Band(3, 0, 2))
    assert narrowed.structure.band == masks.Band(3, 0, 2)
    assert narrowed.fn is causal.fn  # unwrapped, not a function of a function
    assert structure_of(causal).band == masks.Band(None, 0, 2)  # the original is unchanged
    both = masks.declare(masks.relative(causal), block=16)
    assert both.structure.relative and both.structure.block == 16
    assert both.structure.band == masks.Band(None, 0, 2)  # kept from the function's own
    given = masks.declare(lambda b, h, i, j: i >= j, masks.Structure(block=8), block=32)
    assert given.structure == masks.Structure(block=32)
    grid = masks.materialize(narrowed, (1, 1, 6, 6))  # declaring changes no value
    i, j = torch.arange(6).view(6, 1), torch.arange(6).view(1, 6)
    assert torch.equal(grid[0, 0], j <= i + 2)


def test_structured_functions_print_their_name_and_structure() -> None:
    assert str(masks.causal_fn(2)) == "causal: causal (k <= q + 2)"
    assert masks.causal_fn(2).__name__ == "causal"
    assert str(masks.window_fn(3, 1, -2)) == "window: band (left 3, right 1, offset -2)"
    assert str(masks.Band(None, 2, 1)) == "band (left inf, right 2, offset 1)"
    both = all_of(masks.causal_fn(0), masks.window_fn(3))
    assert str(both) == "mask: all of (causal (k <= q + 0), band (left 3, right 0, offset 0))"
    layout = block_sparse(torch.ones(3, 2, dtype=torch.bool), 4)
    assert str(layout) == "mask: block layout 3 x 2 of 4"
    assert str(masks.declare(lambda b, h, i, j: i == j, block=64)) == "<lambda>: tiles of 64"
    assert str(masks.Structure()) == "no structure"


def test_relative_declares_only_that_the_bias_depends_on_h_and_j_minus_i() -> None:
    def slope(b, h, i, j):
        return (h + 1.0) * (j - i)

    declared = masks.relative(slope)
    assert declared.structure == masks.Structure(relative=True)
    assert not declared.structure.skips  # a bias declaration skips no tile
    assert str(declared) == "slope: relative (depends on h and j - i only)"
    grid = masks.materialize(declared, (2, 3, 5, 7))
    assert torch.equal(grid, masks.materialize(slope, (2, 3, 5, 7)))
    assert not structure_of(slope).relative


def test_block_layout_structure_agrees_with_evaluation() -> None:
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    block = 4
    layout = torch.rand(6, 7, generator=gen) > 0.55
    fn = block_sparse(layout, block)
    # On tiles of the layout's own block size, the states are exact: the picture is the layout.
    picture = structure_of(fn).to_string(24, 28, block=block).splitlines()[1:]
    assert picture == [
        "|" + "".join("█" if c else " " for c in row) + "|" for row in layout.tolist()
    ]
    for _ in range(200):
        i0, j0 = rng.randrange(0, 30), rng.randrange(0, 34)
        i1, j1 = i0 + rng.randrange(1, 10), j0 + rng.randrange(1, 10)
        grid = _brute(fn, i0, i1, j0, j1)
        state = tile_state(fn, i0, i1, j0, j1)
        inside = i1 <= 24 and j1 <= 28
        if inside:  # within the layout the tile state is exact
            want = True if bool(grid.all()) else False if not bool(grid.any()) else None
            assert state is want, (i0, i1, j0, j1)
        elif state is not None:
            assert bool(grid.all()) if state else not bool(grid.any())
        visible = torch.zeros(j1 - j0, dtype=torch.bool)
        for lo, hi in key_ranges(fn, i0, i1, j0, j1):
            visible[lo - j0 : hi - j0] = True
        seen = grid.any(dim=0)
        if inside:  # exactly the keys some query of the tile sees
            assert torch.equal(visible, seen), (i0, i1, j0, j1)
        else:
            assert not bool((seen & ~visible).any())


# One tile plan per call, read by every consumer.


def _plan_case(case: str, n: int):
    """(mask function, is_causal, tile sizes of the fused forward for it)."""
    if case == "causal":
        return None, True, (64, 256)
    if case == "window":
        return masks.window_fn(100, 20), False, (64, 256)
    if case == "block layout":
        return block_sparse(strided_layout(n // 64, 2, 3), 64), False, (64, 64)
    ids = torch.arange(n) * 3 // n  # three documents: an undeclared mask function

    def documents(b, h, i, j):
        return ids[i] == ids[j]

    return documents, True, (64, 256)


@pytest.mark.parametrize("case", ["causal", "window", "block layout", "documents"])
def test_one_plan_serves_tiled_fused_and_the_cost_model(case: str, monkeypatch) -> None:
    """The cost model, the fused kernel and the tiled backend ask for the same plan and get one
    object, made once; its kept tiles are exactly the tiles with a visible pair under exact
    structure ("full" exactly where every pair is visible), and every tile, partly visible,
    for an undeclared function (which the fused kernel evaluates whole, planning its tiles by
    the causal band alone: a second plan)."""
    from attnkit import _structure, scaled_dot_product_attention
    from attnkit.backends import cost
    from attnkit.backends.fused import jit
    from attnkit.backends.tiled import tiled_attention
    from attnkit.functional import make_call

    try:
        jit.build()
    except jit.NotBuilt as reason:
        pytest.skip(f"the fused kernel cannot be built here: {reason}")
    n = 640
    fn, causal, (bq, bk) = _plan_case(case, n)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g, dtype=torch.float64) for _ in range(3))
    monkeypatch.setattr(_structure, "_PLANS", type(_structure._PLANS)())
    monkeypatch.setattr(_structure, "_PLAN_STATS", {"hits": 0, "misses": 0})
    kw = {"mask": fn, "is_causal": causal}
    cost.terms("fused", make_call(q, k, v, **kw))
    fused = scaled_dot_product_attention(q, k, v, backend="fused", **kw)
    tiled = tiled_attention(q, k, v, mask_fn=fn, is_causal=causal, block_q=bq, block_k=bk)
    info = masks.plan_cache_info()
    made, shared = (2, 1) if case == "documents" else (1, 2)
    assert (info["misses"], info["hits"], info["size"]) == (made, shared, made)
    # the plan the cost model and tiled share (documents: the one with the undeclared part)
    ((plan, _),) = [v for key, v in _structure._PLANS.items() if ("opaque",) in key[0] or made == 1]
    assert (plan.block_q, plan.block_k) == (bq, bk)
    ref = scaled_dot_product_attention(q, k, v, backend="math", **kw)
    assert (fused - ref).abs().max() < 1e-12 and (tiled - ref).abs().max() < 1e-12
    dense = masks.materialize(fn, (1, 1, n, n))[0, 0] if fn is not None else torch.ones(n, n)
    if causal:
        dense = dense.bool() & masks.causal_mask(n, n)
    for r, row in enumerate(plan.rows):
        kept = {j0: full for j0, _, full in row}
        for j0 in range(0, n, bk):
            tile = dense[r * bq : (r + 1) * bq, j0 : j0 + bk]
            if case == "documents":  # the causal band's tiles, all to be evaluated
                band = masks.causal_mask(n, n)[r * bq : (r + 1) * bq, j0 : j0 + bk]
                assert kept.get(j0) is (False if bool(band.any()) else None), (r, j0)
            else:
                assert (j0 in kept) == bool(tile.any()), (r, j0)
                assert kept.get(j0, False) == bool(tile.all()), (r, j0)
    offsets, tiles = plan.tensors()
    assert offsets.tolist()[-1] == plan.tiles == tiles.shape[0]
    by_key_offsets, by_key = plan.by_key()
    assert by_key.shape[0] == plan.tiles and by_key_offsets.tolist()[-1] == plan.tiles
    assert "kept" in plan.to_string().splitlines()[0]
