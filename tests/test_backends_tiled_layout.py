"""The tiled backend's head layout: the grouped-query row layout against index arithmetic, its
inverse, the flattened ``(b * h_kv)`` axis, head and key ranges, and the split ``bmm``."""

from __future__ import annotations

import itertools

import pytest
import torch

from attnkit.backends.tiled.layout import (
    add_heads,
    add_keys,
    bmm,
    flat,
    flip_queries,
    head_tile,
    heads,
    keys,
    rows,
    tile_rows,
    unflat,
    unrows,
)

F64 = torch.float64


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("g", [1, 2, 4])
def test_rows_follow_index_arithmetic_and_unrows_inverts_them(g: int) -> None:
    b, h, i, d = 2, 4, 37, 3
    x = _randn(b, h, i, d)
    r = rows(x, g)
    assert r.shape == (b, h // g, i * g, d)
    for kv, row in itertools.product(range(h // g), range(i * g)):
        # row r of key head kv = query r // g of head kv * g + r % g
        assert torch.equal(r[:, kv, row], x[:, kv * g + row % g, row // g])
    assert torch.equal(unrows(r, g), x)
    y = _randn(b, h // g, i * g, d, seed=1)
    assert torch.equal(rows(unrows(y, g), g), y)
    if g == 1:
        assert r is x  # no copy without grouping


@pytest.mark.parametrize("shape", [(2, 4, 5, 7), (2, 1, 5, 7), (1, 4, 5, 1), (1, 1, 1, 7)])
def test_tile_rows_equal_rows_of_the_expanded_tile(shape: tuple[int, ...]) -> None:
    g, bi, bj = 2, 5, 7
    t = _randn(*shape)
    full = t.expand(shape[0], 4, bi, bj)  # (b, h, bi, bj)
    got = tile_rows(t, g, bi, bj)
    assert torch.equal(got.expand(shape[0], 2, bi * g, bj), rows(full, g))
    assert tile_rows(t, 1, bi, bj) is t


def test_flip_queries_reverses_queries_and_keeps_each_querys_group() -> None:
    g, n_q = 3, 7
    x = _randn(2, n_q * g, 4)
    flipped = flip_queries(x, g)
    for r in range(n_q * g):
        assert torch.equal(flipped[:, r], x[:, (n_q - 1 - r // g) * g + r % g])
    assert torch.equal(flip_queries(flipped, g), x)


def test_flat_and_unflat_are_inverse_views() -> None:
    x = _randn(2, 3, 5, 4)
    f = flat(x)
    assert f.shape == (6, 5, 4) and f.data_ptr() == x.data_ptr()
    for b, h in itertools.product(range(2), range(3)):
        assert torch.equal(f[b * 3 + h], x[b, h])
    u = unflat(f, 2)
    assert torch.equal(u, x) and u.data_ptr() == x.data_ptr()


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_odd_batches_are_split_without_changing_the_product(n: int) -> None:
    g = torch.Generator().manual_seed(4)
    a = torch.randn(n, 6, 4, dtype=F64, generator=g)
    b = torch.randn(n, 5, 4, dtype=F64, generator=g).transpose(1, 2)
    torch.testing.assert_close(bmm(a, b), torch.bmm(a, b), atol=1e-14, rtol=0)
    exact = torch.einsum("nik,nkj->nij", a, b)
    torch.testing.assert_close(bmm(a, b), exact, atol=1e-13, rtol=0)


def test_keys_selects_by_slice_or_index() -> None:
    t = _randn(4, 11, 3)
    assert torch.equal(keys(t, slice(2, 7)), t[:, 2:7])
    assert keys(t, slice(2, 7)).data_ptr() == t[:, 2:].data_ptr()  # a view
    idx = torch.tensor([0, 3, 4, 10])
    assert torch.equal(keys(t, idx), torch.stack([t[:, c] for c in idx.tolist()], dim=1))


@pytest.mark.parametrize("nb", [1, 2])
def test_heads_and_add_heads_follow_index_arithmetic(nb: int) -> None:
    hk = 4
    t = _randn(nb * hk, 5, 3)
    assert heads(t, nb, 0, hk) is t
    for lo, hi in ((0, 4), (1, 3), (2, 4), (0, 1)):
        part = heads(t, nb, lo, hi)
        want = torch.stack([t[b * hk + h] for b in range(nb) for h in range(lo, hi)])
        assert torch.equal(part, want)
        dst = t.clone()
        value = _randn(*part.shape, seed=lo * 10 + hi)
        add_heads(dst, nb, lo, hi, value)
        expected = t.clone()
        for n, (b, h) in enumerate(itertools.product(range(nb), range(lo, hi))):
            expected[b * hk + h] += value[n]
        assert torch.equal(dst, expected)


def test_head_tile_selects_heads_of_a_broadcastable_tile() -> None:
    t = _randn(2, 4, 3, 5)
    assert torch.equal(head_tile(t, 1, 3), t[:, 1:3])
    shared = _randn(2, 1, 3, 5)
    assert head_tile(shared, 1, 3) is shared  # broadcast over heads: every head is the same
    assert head_tile(None, 0, 1) is None


@pytest.mark.parametrize("nb", [1, 2])
@pytest.mark.parametrize("sel", [slice(3, 8), torch.tensor([0, 2, 3, 9, 10])])
def test_add_keys_follows_index_arithmetic(nb: int, sel) -> None:
    hk, j, d = 3, 11, 4
    idx = list(range(j))[sel] if isinstance(sel, slice) else sel.tolist()
    for lo, hi in ((0, hk), (1, 3), (0, 1)):
        dst = _randn(nb * hk, j, d)
        value = _randn(nb * (hi - lo), len(idx), d, seed=1)
        expected = dst.clone()
        for n, (b, h) in enumerate(itertools.product(range(nb), range(lo, hi))):
            for c, key in enumerate(idx):
                expected[b * hk + h, key] += value[n, c]
        add_keys(dst, sel, nb, lo, hi, value)
        assert torch.equal(dst, expected), (lo, hi)
