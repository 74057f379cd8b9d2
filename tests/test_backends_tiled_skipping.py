"""Skipping negligible heads: the bound is sound (every weight of a skipped head is below
``2^-negligible`` of its row's floor), row maxima equal the tile's, and skipping changes no result
beyond the dtype's accuracy."""

from __future__ import annotations

import pytest
import torch

from attnkit import masks, scaled_dot_product_attention
from attnkit.backends.tiled import tiled_attention
from attnkit.backends.tiled.layout import flat, rows
from attnkit.backends.tiled.skipping import can_skip, needed, negligible_bits, row_max
from attnkit.backends.tiled.softmax import LOG2E
from attnkit.backends.tiled.tiles import Spec, Tiles
from attnkit.masks import relative
from oracles import qkv as _qkv

F64 = torch.float64


def _steep_pair(b, h, i, j):  # heads 0-1 (key head 0) steep enough to underflow, 2-3 not
    return -torch.where(h < 2, 16.0, 0.125) * (i - j).abs()


def test_negligible_bits_are_the_mantissa_plus_the_margin() -> None:
    # Mantissa bits, the implicit one included: 11, 8, 24 and 53; plus 40.
    want = {torch.float16: 51, torch.bfloat16: 48, torch.float32: 64, F64: 93}
    assert {dtype: negligible_bits(dtype) for dtype in want} == want


def test_can_skip_needs_a_bias_no_mask_a_contiguous_tile_and_no_softcap() -> None:
    bias, mask, idx = torch.zeros(1), torch.ones(1, dtype=torch.bool), torch.tensor([0, 2])
    q, k, _ = _qkv(9, 9)
    tiles = Tiles(Spec(1.0, bias=bias.view(1, 1, 1, 1)), q, k)
    capped = Tiles(Spec(1.0, bias=bias.view(1, 1, 1, 1), softcap=5.0), q, k)
    assert can_skip(tiles, None, bias, slice(0, 4))
    assert not can_skip(tiles, None, None, slice(0, 4))
    assert not can_skip(tiles, mask, bias, slice(0, 4))
    assert not can_skip(tiles, None, bias, idx)
    assert not can_skip(capped, None, bias, slice(0, 4))  # its bounds are of raw logits


@pytest.mark.parametrize("declared", [False, True])
def test_row_max_is_the_largest_bias_of_each_row(declared: bool) -> None:
    q, k, _ = _qkv(37, 45)
    fn = relative(_steep_pair) if declared else _steep_pair
    tiles = Tiles(Spec(1.0, bias_fn=fn, q_offset=3, k_offset=9), q, k)
    assert (tiles.relative is not None) == declared
    dense = masks.materialize(lambda b, h, i, j: fn(b, h, i + 3, j + 9), (1, 4, 37, 45))
    for i0, i1, j0, j1 in ((0, 8, 0, 5), (8, 37, 40, 45), (29, 37, 0, 45)):
        top = row_max(tiles, tiles.bias(slice(i0, i1), slice(j0, j1)), i0, i1, slice(j0, j1))
        want = dense[:, :, i0:i1, j0:j1].to(F64)
        if declared:
            want = want.flip(2)  # a relative call's rows are reversed
        want = rows(want.amax(-1, keepdim=True), 2).squeeze(-1)  # (1, h_kv, rows)
        assert torch.equal(top.expand_as(want), want), (i0, j0)


def test_needed_is_sound_and_skips_steep_heads() -> None:
    """For every head outside ``needed``'s range, every base-2 logit of the tile lies more than
    ``negligible_bits`` below its row's floor (here the row's true maximum)."""
    q, k, _ = _qkv(40, 40)
    bits = negligible_bits(F64)
    for fn in (_steep_pair, relative(_steep_pair)):
        tiles = Tiles(Spec(0.5, bias_fn=fn), q, k)
        q2 = tiles.queries(flat(rows(q, 2))[:, 8:16]) * (0.5 * LOG2E)  # queries 4-7
        k_f = flat(k)
        diagonal = tiles.logits(q2, k_f[:, 0:8].mT, None, tiles.bias(slice(4, 8), slice(0, 8)))
        floor = diagonal.amax(-1)  # (b * h_kv, rows): the running maximum after the diagonal
        q_norm = q2.norm(dim=-1)
        assert needed(tiles, q_norm, k_f.norm(dim=-1)[:, 0:8], floor, None) == (0, 2)
        skipped_somewhere = False
        for j0 in range(8, 40, 8):
            sel = slice(j0, j0 + 8)
            bias = tiles.bias(slice(4, 8), sel)
            top = row_max(tiles, bias, 4, 8, sel)
            lo, hi = needed(tiles, q_norm, k_f.norm(dim=-1)[:, sel], top, floor)
            logits = tiles.logits(q2, k_f[:, sel].mT, None, bias).view(2, 2, 8, 8)
            for head in set(range(2)) - set(range(lo, hi)):
                skipped_somewhere = True
                below = floor.view(2, 2, 8)[:, head] - bits
                assert bool((logits[:, head].amax(-1) < below).all()), (j0, head)
            assert 1 in range(lo, hi)  # the gentle heads always count
        assert skipped_somewhere
        # A floor far below every logit needs every head.
        low = torch.full_like(floor, -1e6)
        assert needed(tiles, q_norm, k_f.norm(dim=-1)[:, 32:40], top, low) == (0, 2)


def test_underflowing_slices_are_skipped_without_changing_the_result(monkeypatch) -> None:
    """Steep ALiBi heads: distant tiles' weights all underflow, so ``needed`` drops those key
    heads; output and gradients still equal the float64 reference (GQA, b=2)."""
    from attnkit.backends.tiled import backward, forward, skipping

    calls: list[tuple[int, int]] = []  # (key heads needed, key heads)

    def spy(tiles, q_norm, k_norm, bias, floor):
        heads = skipping.needed(tiles, q_norm, k_norm, bias, floor)
        total = len(q_norm) // tiles.nb
        calls.append((heads[1] - heads[0], total))
        return heads

    monkeypatch.setattr(forward, "needed", spy)
    monkeypatch.setattr(backward, "needed", spy)

    def all_steep(b, h, i, j):
        return -16.0 * (i - j).abs()

    def declared(fn):  # the same function, declared relative (row maxima from the offsets)
        return relative(lambda b, h, i, j: fn(b, h, i, j))

    i, j = 300, 257
    for fn, partly, whole in (
        (_steep_pair, True, False),
        (all_steep, False, True),
        (declared(_steep_pair), True, False),
        (declared(all_steep), False, True),
    ):
        calls.clear()
        q, k, v = (t.requires_grad_() for t in _qkv(i, j))
        results = []
        for backend in ("math", "tiled"):
            if backend == "tiled":
                out = tiled_attention(q, k, v, bias_fn=fn, block_q=32, block_k=32)
            else:
                dense = masks.materialize(fn, (1, 4, i, j))
                out = scaled_dot_product_attention(q, k, v, bias=dense, backend="math")
            weight = torch.linspace(-1, 1, out.numel(), dtype=F64).view_as(out)
            results.append((out, *torch.autograd.grad((out * weight).sum(), (q, k, v))))
        for a, b_, what in zip(*results, ("out", "dq", "dk", "dv"), strict=True):
            torch.testing.assert_close(b_, a, atol=1e-12, rtol=1e-10, msg=f"{fn.__name__}: {what}")
        assert any(0 < need < total for need, total in calls) == partly, fn.__name__
        assert any(need == 0 for need, _ in calls) == whole, fn.__name__
        assert any(need == total for need, total in calls), fn.__name__  # the diagonal tiles


def test_skipping_negligible_heads_in_float32_stays_at_float32_accuracy(monkeypatch) -> None:
    """float32 drops slices whose weights are all below 2^-64 of their row's largest; the result
    still equals the float64 reference to float32 accuracy (gradients included)."""
    from attnkit.backends.tiled import backward, forward, skipping
    from attnkit.positional import alibi_fn

    kept: list[float] = []  # fraction of key heads computed, per tile

    def spy(tiles, *args):
        lo, hi = skipping.needed(tiles, *args)
        kept.append((hi - lo) / tiles.hk)
        return lo, hi

    monkeypatch.setattr(forward, "needed", spy)
    monkeypatch.setattr(backward, "needed", spy)
    i, j = 700, 650
    q64, k64, v64 = _qkv(i, j, h=8, h_kv=4, d=16, dv=16, b=1)
    fn = alibi_fn(8, j - i)
    results = []
    for dtype in (F64, torch.float32):
        q, k, v = (t.to(dtype).requires_grad_() for t in (q64, k64, v64))
        if dtype == F64:
            out = scaled_dot_product_attention(q, k, v, bias=fn, backend="math")
        else:
            out = tiled_attention(q, k, v, bias_fn=fn, block_q=64, block_k=64)
        weight = torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)
        grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
        results.append([t.double() for t in (out, *grads)])
    for a, b_, what in zip(*results, ("out", "dq", "dk", "dv"), strict=True):
        torch.testing.assert_close(b_, a, atol=2e-6, rtol=1e-4, msg=what)
    assert 0.0 < sum(kept) / len(kept) < 0.9  # steep heads really were skipped
