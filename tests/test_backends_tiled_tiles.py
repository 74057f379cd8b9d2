"""Tile iteration: each query block visits every key some query of it may see and no tile its
mask's structure rules out; each tile's mask, bias and logits are slices of the dense ones."""

from __future__ import annotations

import itertools

import pytest
import torch

from attnkit import masks, scaled_dot_product_attention
from attnkit._numerics import blocked
from attnkit.backends.sparse import block_sparse, strided_layout
from attnkit.backends.tiled import tiled_attention
from attnkit.backends.tiled.layout import flat, rows
from attnkit.backends.tiled.softmax import LOG2E
from attnkit.backends.tiled.tiles import (
    BLOCK_K,
    BLOCK_K_BIAS,
    BLOCK_Q,
    BLOCK_Q_BIAS,
    KeyTiles,
    Spec,
    Tiles,
    tile_sizes,
)
from attnkit.masks import all_of, declare, structure_of
from oracles import qkv as _qkv

F64 = torch.float64
NI, NJ = 37, 45  # odd lengths, i != j


def _dense(fn, qo: int, ko: int, shape=(2, 4, NI, NJ)) -> torch.Tensor:
    """``fn`` on the call's grid, at absolute positions (queries from ``qo``, keys from ``ko``)."""
    return masks.materialize(lambda b, h, i, j: fn(b, h, i + qo, j + ko), shape)


MASK_FNS = {
    "causal": masks.causal_fn(NJ - NI),
    "top-left causal": masks.causal_fn(0),
    "window": masks.window_fn(6, 2, 3),
    "block layout": block_sparse(strided_layout(12, 2, 3), 8),
    "window and causal": all_of(masks.window_fn(9, 0), masks.causal_fn(-2)),
    "unstructured": lambda b, h, i, j: (i * 7 + j * 3 + b) % 5 != 0,
}
EXACT = {"causal", "top-left causal", "window", "window and causal"}  # bands: exact states


def _sel_keys(sel) -> list[int]:
    return list(range(sel.start, sel.stop)) if isinstance(sel, slice) else sel.tolist()


@pytest.mark.parametrize("name", list(MASK_FNS))
@pytest.mark.parametrize(("qo", "ko"), [(0, 0), (40, 13)])
def test_groups_visit_every_visible_key_and_no_tile_ruled_out(name: str, qo: int, ko: int) -> None:
    """The kept tiles of the call's plan: aligned key tiles of 7, every visible key among them;
    under exact structure no kept tile is all blocked and "all visible" means exactly that."""
    fn = MASK_FNS[name]
    q, k, _ = _qkv(NI, NJ)
    dense = _dense(fn, qo, ko)[0, 0]  # the same for every b, h here except "unstructured"
    dense_any_b = _dense(fn, qo, ko)[:, 0].any(0)
    spec = Spec(1.0, mask_fn=fn, q_offset=qo, k_offset=ko, block_q=8, block_k=7)
    tiles = Tiles(spec, q, k)
    for i0 in range(0, NI, 8):
        i1 = min(NI, i0 + 8)
        groups = tiles.groups(i0, i1)
        visited: list[int] = []
        for sel, state in groups:
            keys = _sel_keys(sel)
            assert 0 < len(keys) <= 7 and all(0 <= c < NJ for c in keys)
            assert keys == list(range(keys[0] // 7 * 7, min(NJ, keys[0] // 7 * 7 + 7)))  # aligned
            visited += keys
            tile = dense[i0:i1, keys]
            if state is True:
                assert bool(tile.all()), (name, i0, keys)
            if name in EXACT:  # a band's states are exact: no wasted tile, None means mixed
                assert bool(tile.any()), (name, i0, keys)
                assert (state is True) == bool(tile.all())
        assert len(visited) == len(set(visited)) and visited == sorted(visited)
        seen = dense_any_b[i0:i1].any(0).nonzero().flatten().tolist()
        assert set(seen) <= set(visited), (name, i0)
    if name == "unstructured":  # nothing declared: every block visits every tile of keys
        assert [_sel_keys(s) for s, _ in tiles.groups(0, 8)] == [
            list(range(j0, min(NJ, j0 + 7))) for j0 in range(0, NJ, 7)
        ]
        assert all(state is None for _, state in tiles.groups(0, 8))


@pytest.mark.parametrize("name", ["block layout", "window", "causal", "unstructured"])
def test_gathered_groups_hold_the_same_keys(name: str) -> None:
    fn = MASK_FNS[name]
    q, k, _ = _qkv(NI, NJ)
    plain = Tiles(Spec(1.0, mask_fn=fn, block_q=8, block_k=8), q, k)
    gathered = Tiles(Spec(1.0, mask_fn=fn, block_q=8, block_k=8, gather=True), q, k)
    for i0 in range(0, NI, 8):
        i1 = min(NI, i0 + 8)
        want = plain.groups(i0, i1)
        got = gathered.groups(i0, i1)
        assert len(got) <= 1
        keys = [c for sel, _ in want for c in _sel_keys(sel)]
        assert [c for sel, _ in got for c in _sel_keys(sel)] == keys
        if got:
            assert (got[0][1] is True) == all(state is True for _, state in want)


def test_order_visits_the_same_groups_nearest_first_with_a_bias() -> None:
    q, k, _ = _qkv(NI, NJ)
    for bias_fn, qo, ko in ((None, 0, 0), (lambda b, h, i, j: 0.0 * i, 0, 0), (_zero, 30, 2)):
        spec = Spec(1.0, bias_fn=bias_fn, q_offset=qo, k_offset=ko, block_q=8, block_k=5)
        tiles = Tiles(spec, q, k)
        for i0 in range(0, NI, 8):
            i1 = min(NI, i0 + 8)
            groups, order = tiles.groups(i0, i1), tiles.order(i0, i1)
            key = lambda g: (g[0].start, g[0].stop, g[1])  # noqa: E731
            assert sorted(map(key, order)) == sorted(map(key, groups))
            if bias_fn is None:
                assert order == groups
                continue
            centre = (i0 + i1) / 2 + qo - ko
            distance = [abs((s.start + s.stop) / 2 - centre) for s, _ in order]
            assert distance == sorted(distance)


def _zero(b, h, i, j):
    return 0.0 * (i - j)


def test_allowed_tiles_are_slices_of_the_dense_mask() -> None:
    q, k, _ = _qkv(NI, NJ)
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(2, 1, NI, NJ, generator=g) > 0.3  # (b, 1, i, j)
    fn = MASK_FNS["unstructured"]
    qo, ko = 5, 9
    dense = mask & _dense(fn, qo, ko)  # (b, h, i, j)
    for spec_mask, spec_fn, want in (
        (mask, None, mask.expand(2, 4, NI, NJ)),
        (None, fn, _dense(fn, qo, ko)),
        (mask, fn, dense),
    ):
        want = want.expand(2, 4, NI, NJ)
        tiles = Tiles(Spec(1.0, spec_mask, spec_fn, q_offset=qo, k_offset=ko), q, k)
        for (i0, i1), sel in itertools.product(((0, 8), (8, 37)), (slice(0, 7), slice(30, 45))):
            got = tiles.allowed(slice(i0, i1), sel, None)
            tile = rows(want[:, :, i0:i1, sel], 2)  # (b, h_kv, rows, bj)
            assert torch.equal(got.expand_as(tile), tile)
            idx = torch.tensor([1, 4, 40])
            got = tiles.allowed(slice(i0, i1), idx, None)
            assert torch.equal(got.expand(2, 2, (i1 - i0) * 2, 3), rows(want[:, :, i0:i1, idx], 2))
    declared = Tiles(Spec(1.0, mask_fn=fn), q, k)
    assert (
        declared.allowed(slice(0, 8), slice(0, 7), True) is None
    )  # declared visible: not evaluated
    assert Tiles(Spec(1.0), q, k).allowed(slice(0, 8), slice(0, 7), None) is None


def test_bias_tiles_are_slices_of_the_dense_bias() -> None:
    q, k, _ = _qkv(NI, NJ)
    g = torch.Generator().manual_seed(4)
    bias = torch.randn(1, 4, NI, NJ, dtype=F64, generator=g)
    row_bias = torch.randn(2, 1, NI, 1, dtype=F64, generator=g)  # broadcast over keys and heads

    def fn(b, h, i, j):
        return torch.sin(1.0 + h + 0.3 * i - 0.7 * j + b)

    qo, ko = 3, 11
    for spec_bias, spec_fn, want in (
        (bias, None, bias),
        (row_bias, None, row_bias.expand(2, 4, NI, NJ)),
        (None, fn, _dense(fn, qo, ko)),
        (bias, fn, bias + _dense(fn, qo, ko)),
    ):
        want = want.expand(2, 4, NI, NJ).to(F64)  # the tile is in the compute dtype
        tiles = Tiles(Spec(1.0, bias=spec_bias, bias_fn=spec_fn, q_offset=qo, k_offset=ko), q, k)
        assert tiles.relative is None and not tiles.reverse
        for (i0, i1), sel in itertools.product(((0, 9), (9, 37)), (slice(2, 11), slice(40, 45))):
            tile = rows(want[:, :, i0:i1, sel], 2)
            torch.testing.assert_close(
                tiles.bias(slice(i0, i1), sel).expand_as(tile), tile, atol=0, rtol=0
            )
    assert Tiles(Spec(1.0), q, k).bias(slice(0, 8), slice(0, 7)) is None


def test_tiles_of_a_relative_call_have_their_query_rows_reversed() -> None:
    q, k, _ = _qkv(NI, NJ)
    mask = torch.rand(2, 1, NI, NJ, generator=torch.Generator().manual_seed(5)) > 0.3
    tiles = Tiles(Spec(1.0, mask=mask, bias_fn=masks.relative(_zero)), q, k)
    assert tiles.reverse
    got = tiles.allowed(slice(8, 16), slice(0, 9), None)
    want = rows(mask[:, :, 8:16, 0:9].flip(2).expand(2, 4, 8, 9), 2)
    assert torch.equal(got.expand_as(want), want)
    block = torch.arange(2 * 8 * 2, dtype=F64).view(2, 8 * 2, 1)  # (n, rows, 1): query-major
    flipped = tiles.queries(block)
    assert torch.equal(flipped.view(2, 8, 2), block.view(2, 8, 2).flip(1))
    assert torch.equal(tiles.queries(flipped), block)


def test_logits_are_scaled_biased_and_masked_scores_in_base_2() -> None:
    q, k, _ = _qkv(NI, NJ)
    g = torch.Generator().manual_seed(6)
    mask = torch.rand(2, 1, NI, NJ, generator=g) > 0.4
    bias = torch.randn(1, 4, NI, NJ, dtype=F64, generator=g)
    tiles = Tiles(Spec(0.3, mask=mask, bias=bias), q, k)
    i0, i1, sel = 8, 20, slice(5, 17)
    q2 = flat(rows(q, 2))[:, i0 * 2 : i1 * 2] * (0.3 * LOG2E)  # (b * h_kv, rows, d)
    k_tt = flat(k)[:, sel].mT  # (b * h_kv, d, bj)
    got = tiles.logits(
        q2, k_tt, tiles.allowed(slice(i0, i1), sel, None), tiles.bias(slice(i0, i1), sel)
    )
    scores = torch.einsum("bhid,bhjd->bhij", q, k.repeat_interleave(2, 1))[:, :, i0:i1, sel]
    want = (scores * 0.3 + bias[:, :, i0:i1, sel]) * LOG2E
    want = want.masked_fill(~mask[:, :, i0:i1, sel], blocked(F64))
    torch.testing.assert_close(got, flat(rows(want, 2)), atol=1e-13, rtol=1e-13)
    plain = tiles.logits(q2, k_tt, None, None)
    torch.testing.assert_close(plain, flat(rows(scores * 0.3 * LOG2E, 2)), atol=1e-13, rtol=0)


def test_key_tiles_are_slices_and_cached() -> None:
    _, k, v = _qkv(NI, NJ)
    kf, vf = flat(k), flat(v)
    tiles = KeyTiles(kf, vf, bounds=True)
    torch.testing.assert_close(tiles.norm, kf.norm(dim=-1), atol=0, rtol=0)
    k_t, k_tt, v_t, v_tt, top = tiles.get(slice(10, 20))
    assert torch.equal(k_t, kf[:, 10:20]) and torch.equal(k_tt, kf[:, 10:20].mT)
    assert torch.equal(v_t, vf[:, 10:20]) and torch.equal(v_tt, vf[:, 10:20].mT)
    assert top == float(kf[:, 10:20].norm(dim=-1).max())
    cached = tiles.get(slice(10, 20))
    assert all(a is b for a, b in zip(cached, (k_t, k_tt, v_t, v_tt, top), strict=True))
    idx = torch.tensor([0, 3, 44])
    k_i, _, v_i, _, top_i = tiles.get(idx)
    assert torch.equal(k_i, kf[:, idx]) and torch.equal(v_i, vf[:, idx])
    assert top_i == float(kf[:, idx].norm(dim=-1).max())
    assert KeyTiles(kf, vf, bounds=False).get(slice(0, 5))[4] == float("inf")


def test_tile_sizes() -> None:
    assert tile_sizes(None, None, False) == (BLOCK_Q, BLOCK_K)
    assert tile_sizes(None, None, True) == (BLOCK_Q_BIAS, BLOCK_K_BIAS)
    assert tile_sizes(16, None, True) == (16, BLOCK_K_BIAS)
    assert tile_sizes(None, 24, False) == (BLOCK_Q, 24)


def test_structure_protocol_skips_tiles_without_evaluating() -> None:
    causal = masks.causal_fn(0)
    tile_state = structure_of(causal).classify
    assert tile_state(0, 4, 4, 8) is False
    assert tile_state(4, 8, 0, 4) is True
    assert tile_state(0, 4, 0, 4) is None
    window = masks.window_fn(2, 0, 0)
    assert structure_of(window).visible_keys(10, 14, 0, 100) == [(8, 14)]
    assert structure_of(all_of(window, causal)).visible_keys(10, 14, 0, 100) == [(8, 14)]
    calls = []

    def counted(b, h, i, j):
        calls.append(i.numel() * j.numel())
        return j <= i

    declared = declare(counted, tile=tile_state)
    q, k, v = _qkv(64, 64)
    out = tiled_attention(q, k, v, mask_fn=declared, block_q=16, block_k=16)
    ref = scaled_dot_product_attention(q, k, v, is_causal=True, backend="math")
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    assert len(calls) == 4  # only the 4 diagonal tiles of 16 were evaluated


@pytest.mark.parametrize("h_kv", [3, 1])
def test_score_mod_is_called_on_the_engines_own_scores(h_kv: int, monkeypatch) -> None:
    """No layout copy for a score_mod: the scores it receives, forward and backward, share the
    memory of a tile's matmul result (the engine's tensor, in its ``(b, h_kv, rows, bj)``
    layout), and the index tensors say which element each is: the function's value at every
    element equals the reference's, gradients included."""
    from attnkit.backends.tiled import tiles as tiles_module

    made: set[int] = set()
    real_bmm = tiles_module.bmm

    def recording_bmm(*args):
        out = real_bmm(*args)
        made.add(out.untyped_storage().data_ptr())
        return out

    monkeypatch.setattr(tiles_module, "bmm", recording_bmm)
    received: list[tuple[int, tuple[int, ...]]] = []

    def mod(score, b, h, i, j):
        received.append((score.untyped_storage().data_ptr(), tuple(score.shape)))
        return score + 0.01 * h * (i - j) + 0.1 * b

    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 3, 37, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, h_kv, 41, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, h_kv, 41, 5, dtype=torch.float64, generator=g, requires_grad=True)
    out = tiled_attention(q, k, v, score_mod=mod, block_q=16, block_k=16)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    received = received[1:]  # the first call: api._captured's one-element probe
    assert received and all(ptr in made for ptr, _ in received)
    assert {shape[1] for _, shape in received} == {h_kv}  # the grouped rows layout
    monkeypatch.undo()
    ref_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = scaled_dot_product_attention(*ref_leaves, score_mod=mod, backend="math")
    ref_grads = torch.autograd.grad(ref.square().sum(), ref_leaves)
    assert (out - ref).abs().max() < 1e-12
    for got, want in zip(grads, ref_grads, strict=True):
        assert (got - want).abs().max() < 1e-12


@pytest.mark.parametrize("g", [1, 3])
def test_index_tensors_are_made_once_per_call(g: int) -> None:
    """A score_mod's index tensors: every element of a tile in the engine's ``(b, h_kv, rows,
    bj)`` layout gets its own ``(b, h, i, j)`` (offsets included, gathered tiles too), and a
    contiguous tile's tensors are views of the call's (``Tiles.indices``), not new ones."""
    h_kv, ni, nj = 2, 37, 41
    q = torch.zeros(2, h_kv * g, ni, 8, dtype=torch.float64)
    k = torch.zeros(2, h_kv, nj, 8, dtype=torch.float64)
    spec = Spec(0.5, q_offset=5, k_offset=3, block_q=16, block_k=16, score_mod=lambda s, *_: s)
    tiles = Tiles(spec, q, k)
    made = {t.untyped_storage().data_ptr() for t in tiles.indices()}
    gathered = torch.tensor([0, 1, 2, 20, 21, 36])
    for qs, sel in [
        (slice(0, 16), slice(0, 16)),
        (slice(16, 32), slice(32, 41)),
        (slice(32, 37), slice(16, 32)),
        (gathered, slice(0, 16)),
    ]:
        b, h, i, j = tiles.index(qs, sel)
        queries = torch.arange(ni)[qs]
        keys = torch.arange(nj)[sel]
        shape = (2, h_kv, queries.numel() * g, keys.numel())  # the engine's tile layout
        rows = torch.arange(shape[2])
        want_h = torch.arange(h_kv).view(-1, 1) * g + rows % g  # (h_kv, rows)
        assert torch.equal(b.expand(shape), torch.arange(2).view(-1, 1, 1, 1).expand(shape))
        assert torch.equal(h.expand(shape), want_h.view(1, h_kv, -1, 1).expand(shape))
        assert torch.equal(
            i.expand(shape), (queries[rows // g] + 5).view(1, 1, -1, 1).expand(shape)
        )
        assert torch.equal(j.expand(shape), (keys + 3).view(1, 1, 1, -1).expand(shape))
        if g == 1:
            assert h.shape == (1, h_kv, 1, 1)  # broadcast over rows: one value per head
        if isinstance(qs, slice):  # views of the call's tensors, whatever the tile
            assert {t.untyped_storage().data_ptr() for t in (h, i, j)} <= made
