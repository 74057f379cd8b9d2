"""Relative bias functions: the one-table views equal the dense bias (query rows reversed), their
row maxima equal a brute-force maximum, the function is evaluated once per pass, and a function
of the wrong shape is named."""

from __future__ import annotations

import itertools

import pytest
import torch

from attnkit import masks
from attnkit.backends.tiled import tiled_attention
from attnkit.backends.tiled.relative import Relative, sliding_max
from attnkit.masks import relative, structure_of
from oracles import qkv as _qkv

F64 = torch.float64


def _alibi(b, h, i, j):  # ALiBi (Press et al. 2022): a per-head linear distance penalty
    return -(2.0 ** (-(h + 1.0))) * (i - j).abs()


def _buckets(b, h, i, j):  # T5-style: exact distances below 4, then log-spaced, per direction
    d = j - i
    a = d.abs()
    far = 4 + (torch.log(a.clamp(min=1).double() / 4) / 0.7).long().clamp(max=3)
    return torch.sin(1.0 + h + 3.0 * torch.where(a < 4, a, far) + 0.5 * (d > 0).double())


@pytest.mark.parametrize("w", [1, 2, 7, 10, 49, 50])
def test_sliding_max_equals_brute_force(w: int) -> None:
    t = torch.randn(3, 50, dtype=F64, generator=torch.Generator().manual_seed(3))
    want = torch.stack([t[:, y : y + w].amax(dim=-1) for y in range(50 - w + 1)], dim=-1)
    assert torch.equal(sliding_max(t, w), want)


@pytest.mark.parametrize("fn", [_alibi, _buckets])
@pytest.mark.parametrize(
    ("ni", "nj", "qo", "ko"), [(37, 45, 0, 0), (37, 45, 40, 13), (97, 7, 5, 60)]
)
def test_tiles_and_row_maxima_equal_the_dense_bias(fn, ni: int, nj: int, qo: int, ko: int) -> None:
    h, hk = 4, 2
    g = h // hk
    table = Relative(fn, (h, hk, ni, nj), qo, ko, F64, torch.device("cpu"))
    dense = masks.materialize(lambda b, h, i, j: fn(b, h, i + qo, j + ko), (1, h, ni, nj))
    dense = dense.to(F64).expand(1, h, ni, nj)
    starts_i = sorted({0, 8, ni - 9, ni - 1})
    starts_j = sorted({0, 3, nj - 5, nj - 1})
    for i0, j0 in itertools.product(starts_i, starts_j):
        for i1, j1 in ((min(ni, i0 + 8), min(nj, j0 + 5)), (ni, nj)):
            want = dense[:, :, i0:i1, j0:j1].flip(2)  # (1, h, bi, bj), rows reversed
            want = want.unflatten(1, (hk, g)).transpose(2, 3)  # (1, h_kv, bi, g, bj)
            tile = table.tile(i0, i1, j0, j1)
            assert torch.equal(tile, want), (i0, i1, j0, j1)
            top = table.row_max(i0, i1, j0, j1)
            assert torch.equal(top, want.amax(-1).reshape(1, hk, -1)), (i0, i1, j0, j1)


def test_relative_bias_function_of_the_wrong_shape_is_named() -> None:
    q, k, v = _qkv(9, 9)
    bad = relative(lambda b, h, i, j: torch.zeros(3, 2, dtype=F64))
    match = r"bias_fn is declared relative but returned shape \(3, 2\)"
    with pytest.raises(ValueError, match=match):
        tiled_attention(q, k, v, bias_fn=bad)
    with pytest.raises(ValueError, match=r"broadcastable to \(1, 4, 1, 17\)"):
        Relative(bad, (4, 2, 9, 9), 0, 0, F64, torch.device("cpu"))


def test_relative_bias_function_is_evaluated_once_per_pass() -> None:
    """Declared relative: one evaluation on the i + j - 1 offsets for the forward and one for
    the backward, whatever the number of tiles; undeclared: one per tile and pass. Same values."""
    seen: list[tuple[int, ...]] = []

    def counted(b, h, i, j):
        seen.append(tuple(torch.broadcast_shapes(b.shape, h.shape, i.shape, j.shape)))
        return _buckets(b, h, i, j)

    results = []
    for fn in (counted, relative(lambda b, h, i, j: counted(b, h, i, j))):
        seen.clear()
        q, k, v = (t.requires_grad_() for t in _qkv(70, 45))
        out = tiled_attention(q, k, v, bias_fn=fn, block_q=16, block_k=16)
        results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
        if structure_of(fn).relative:
            assert seen == [(1, 4, 1, 70 + 45 - 1)] * 2
        else:
            assert len(seen) == 2 * 5 * 3  # 5 query blocks x 3 key tiles, forward and backward
    for a, b_ in zip(*results, strict=True):
        torch.testing.assert_close(b_, a, atol=1e-12, rtol=1e-10)
    assert not structure_of(counted).relative and not structure_of(None).relative


@pytest.mark.parametrize(("ni", "nj"), [(0, 0), (0, 5), (5, 0)])
def test_a_call_without_queries_or_keys_has_no_offsets(ni: int, nj: int) -> None:
    fn = relative(_alibi)
    table = Relative(fn, (2, 2, ni, nj), 0, 0, torch.float64, torch.device("cpu"))
    assert table.length == 0
    q = torch.randn(1, 2, ni, 4, dtype=torch.float64)
    k = v = torch.randn(1, 2, nj, 4, dtype=torch.float64)
    out = tiled_attention(q, k, v, bias_fn=fn)
    assert out.shape == (1, 2, ni, 4) and not out.any()  # no key: zeros, as the reference gives
