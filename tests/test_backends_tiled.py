"""The tiled backend equals the reference math (float64), gradients included; its block step
(forward_blocks / merge / backward_blocks) reproduces whole attention over key shards."""

from __future__ import annotations

import itertools

import pytest
import torch

from attnkit import masks, scaled_dot_product_attention
from attnkit.backends import BackendUnavailable
from attnkit.masks import all_of, declare, relative, structure_of
from attnkit.backends.tiled import backward_blocks, forward_blocks, merge, tiled_attention

F64 = torch.float64


def _qkv(i: int, j: int, h: int = 4, h_kv: int = 2, d: int = 8, dv: int = 6, b: int = 2):
    g = torch.Generator().manual_seed(i * 1000 + j)
    q = torch.randn(b, h, i, d, dtype=F64, generator=g)
    k = torch.randn(b, h_kv, j, d, dtype=F64, generator=g)
    v = torch.randn(b, h_kv, j, dv, dtype=F64, generator=g)
    return q, k, v


def _alibi(b, h, i, j):  # ALiBi (Press et al. 2022): a per-head linear distance penalty
    return -(2.0 ** (-(h + 1.0))) * (i - j).abs()


def _relative_alibi(b, h, i, j):  # the same values, declared relative: evaluated once per call
    return _alibi(b, h, i, j)


_relative_alibi = relative(_relative_alibi)


def _buckets(b, h, i, j):  # T5-style: exact distances below 4, then log-spaced, per direction
    d = j - i
    a = d.abs()
    far = 4 + (torch.log(a.clamp(min=1).double() / 4) / 0.7).long().clamp(max=3)
    return torch.sin(1.0 + h + 3.0 * torch.where(a < 4, a, far) + 0.5 * (d > 0).double())


_relative_buckets = relative(lambda b, h, i, j: _buckets(b, h, i, j))


def _cases(i: int, j: int) -> dict[str, dict]:
    g = torch.Generator().manual_seed(7)
    dense = torch.rand(2, 1, i, j, generator=g) > 0.6
    dense[:, :, 0] = False  # a fully masked row
    return {
        "plain": {},
        "causal bottom-right": {"is_causal": True},
        "causal top-left": {"mask": masks.causal_fn(0)},
        "window fn": {"mask": masks.window_fn(5, 2, j - i)},
        "alibi fn": {"bias": _alibi, "is_causal": True},
        "relative alibi fn": {"bias": _relative_alibi, "is_causal": True},
        "relative buckets, top-left": {"bias": _relative_buckets, "mask": masks.causal_fn(0)},
        "relative fn and dense mask": {"bias": _relative_buckets, "mask": dense},
        "relative fn and unstructured fn": {
            "bias": _relative_buckets,
            "mask": lambda b, h, i, j: (i * 7 + j * 3 + b) % 5 != 0,
        },
        "dense mask and bias": {
            "mask": dense,
            "bias": torch.randn(1, 4, i, j, dtype=F64, generator=g),
        },
        "padding mask": {"mask": masks.padding_mask(torch.tensor([j, max(j - 3, 0)]), j)},
        "unstructured fn": {"mask": lambda b, h, i, j: (i * 7 + j * 3 + b) % 5 != 0},
    }


@pytest.mark.parametrize(("i", "j"), [(1, 1), (7, 7), (97, 97), (257, 257), (7, 97), (97, 7)])
def test_tiled_equals_reference_forward_and_backward(i: int, j: int) -> None:
    for name, kw in _cases(i, j).items():
        q, k, v = (t.requires_grad_() for t in _qkv(i, j))
        results = []
        for backend in ("math", "tiled"):
            out = scaled_dot_product_attention(q, k, v, backend=backend, **kw)
            weight = torch.linspace(-1, 1, out.numel(), dtype=F64).view_as(out)
            grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
            results.append((out, *grads))
        for a, b_, what in zip(*results, ("out", "dq", "dk", "dv"), strict=True):
            assert torch.isfinite(b_).all(), f"{name}: {what} not finite"
            torch.testing.assert_close(b_, a, atol=1e-12, rtol=1e-10, msg=f"{name}: {what}")


def test_small_tiles_and_gradcheck() -> None:
    """Tiles much smaller than the inputs exercise the online softmax across many tiles."""
    q, k, v = (t.requires_grad_() for t in _qkv(7, 6, h=2, h_kv=1, d=3, dv=2, b=1))
    bias = torch.randn(1, 2, 7, 6, dtype=F64, requires_grad=True)
    mask = torch.rand(1, 1, 7, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[..., 2, :] = False

    def with_bias(q, k, v, bias):
        return tiled_attention(q, k, v, mask=mask, bias=bias, block_q=3, block_k=4)

    assert torch.autograd.gradcheck(with_bias, (q, k, v, bias))
    for kw in (
        {"is_causal": True},
        {"mask_fn": masks.window_fn(3, 1, 2), "bias_fn": lambda b, h, i, j: 0.3 * (j - i)},
        {"mask_fn": masks.window_fn(3, 1, 2), "bias_fn": _relative_buckets},
        {"bias_fn": _relative_alibi, "is_causal": True},
    ):
        assert torch.autograd.gradcheck(
            lambda q, k, v, kw=kw: tiled_attention(q, k, v, block_q=3, block_k=4, **kw), (q, k, v)
        )


def test_bias_tensor_gradient_matches_reference() -> None:
    q, k, v = _qkv(33, 40)
    for shape in ((1, 4, 33, 40), (2, 1, 1, 40), (4, 1, 40)):
        bias = torch.randn(shape, dtype=F64, requires_grad=True)
        grads = []
        for backend in ("math", "tiled"):
            out = scaled_dot_product_attention(q, k, v, bias=bias, is_causal=True, backend=backend)
            grads.append(torch.autograd.grad(out.square().sum(), bias)[0])
        torch.testing.assert_close(grads[1], grads[0], atol=1e-12, rtol=1e-10)


def test_fully_masked_rows_give_zero_output_and_zero_gradient() -> None:
    q, k, v = (t.requires_grad_() for t in _qkv(6, 5))
    out = scaled_dot_product_attention(q, k, v, is_causal=True, backend="tiled")  # i > j
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))  # row 0 sees no key
    (gq,) = torch.autograd.grad(out.sum(), q)
    assert torch.isfinite(gq).all() and torch.equal(gq[:, :, 0], torch.zeros_like(gq[:, :, 0]))


def test_low_precision_and_other_ranks() -> None:
    q, k, v = (t.float() for t in _qkv(50, 61, h=2, h_kv=2))
    ref = scaled_dot_product_attention(q, k, v, is_causal=True, backend="math")
    out = scaled_dot_product_attention(q, k, v, is_causal=True, backend="tiled")
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    qh, kh, vh = q.bfloat16(), k.bfloat16(), v.bfloat16()
    ref = scaled_dot_product_attention(qh, kh, vh, backend="math")
    torch.testing.assert_close(
        scaled_dot_product_attention(qh, kh, vh, backend="tiled"), ref, atol=2e-2, rtol=2e-2
    )
    for shape in ((13, 8), (3, 13, 8), (2, 3, 2, 13, 8)):  # (i, d), (h, i, d), (a, b, h, i, d)
        x = torch.randn(shape, dtype=F64)
        m = torch.rand((*shape[:-1], 13)) > 0.2
        ref = scaled_dot_product_attention(x, x, x, m, backend="math")
        out = scaled_dot_product_attention(x, x, x, m, backend="tiled")
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)


def test_unsupported_options_name_themselves() -> None:
    q, k, v = _qkv(4, 4)
    with pytest.raises(BackendUnavailable, match="dropout_p"):
        scaled_dot_product_attention(q, k, v, dropout_p=0.1, backend="tiled")
    with pytest.raises(BackendUnavailable, match="return_weights"):
        scaled_dot_product_attention(q, k, v, return_weights=True, backend="tiled")
    slope = torch.tensor(0.5, requires_grad=True)
    with pytest.raises(BackendUnavailable, match="bias function"):
        scaled_dot_product_attention(
            q, k, v, bias=lambda b, h, i, j: slope * (j - i), backend="tiled"
        )


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


@pytest.mark.parametrize(("n_shards", "bias_fn"), [(2, _alibi), (3, _alibi), (3, _relative_alibi)])
def test_block_step_over_key_shards_equals_whole_attention(n_shards: int, bias_fn) -> None:
    """What ring attention does: forward_blocks per K/V shard with global offsets, merge,
    then backward_blocks per shard with the global out and lse."""
    q, k, v = _qkv(37, 37)
    q_off = 0
    causal = masks.causal_fn(0)
    bounds = torch.linspace(0, 37, n_shards + 1).long().tolist()
    out = lse = None
    for a, b in itertools.pairwise(bounds):
        o, l = forward_blocks(
            q, k[:, :, a:b], v[:, :, a:b], scale=0.3, mask_fn=causal, bias_fn=bias_fn,
            q_offset=q_off, k_offset=a, block_q=8, block_k=8,
        )  # fmt: skip
        out, lse = (o, l) if out is None else merge(out, lse, o, l)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = scaled_dot_product_attention(
        qr, kr, vr, bias=bias_fn, mask=causal, scale=0.3, backend="math"
    )
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), grad)
    dq = torch.zeros_like(q)
    dks, dvs = [], []
    for a, b in itertools.pairwise(bounds):
        gq, gk, gv = backward_blocks(
            q, k[:, :, a:b], v[:, :, a:b], out, lse, grad, scale=0.3, mask_fn=causal,
            bias_fn=bias_fn, k_offset=a, block_q=8, block_k=8,
        )  # fmt: skip
        dq += gq
        dks.append(gk)
        dvs.append(gv)
    for mine, theirs in zip((dq, torch.cat(dks, 2), torch.cat(dvs, 2)), ref_grads, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-12, rtol=1e-10)


def test_merge_treats_a_shard_without_keys_as_no_contribution() -> None:
    q, k, v = _qkv(5, 6)
    out, lse = forward_blocks(q, k, v, scale=0.5)
    empty_out, empty_lse = forward_blocks(q, k, v, scale=0.5, mask=torch.zeros(5, 6, dtype=bool))
    assert torch.equal(empty_out, torch.zeros_like(empty_out))
    m_out, m_lse = merge(out, lse, empty_out, empty_lse)
    torch.testing.assert_close(m_out, out)
    torch.testing.assert_close(m_lse, lse)
    # The log-sum-exp is the natural one, of the scaled scores.
    scores = torch.einsum("bhid,bhjd->bhij", q, k.repeat_interleave(2, dim=1)) * 0.5
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1))


def test_auto_routes_functions_to_tiled_and_plain_calls_to_torch() -> None:
    from attnkit.backends import select_backend
    from attnkit.functional import make_call

    q, k, v = (t.float() for t in _qkv(600, 600, b=1))
    assert select_backend("auto", make_call(q, k, v)).name == "torch"
    assert select_backend("auto", make_call(q, k, v, is_causal=True)).name == "torch"
    seen = []

    def recording(b, h, i, j):
        seen.append(i.shape[-2] * j.shape[-1])
        return (i - j).abs() < 300

    call = make_call(q, k, v, recording)
    assert select_backend("auto", call).name == "tiled-functions"
    out = scaled_dot_product_attention(q, k, v, recording)
    assert max(seen) < 600 * 600  # evaluated per tile: no n x n tensor was built
    ref = scaled_dot_product_attention(q, k, v, masks.materialize(recording, (1, 1, 600, 600)))
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    # A bias function with learnable parameters cannot be differentiated by tiled: auto falls
    # back to torch, which materialises it, and the gradient reaches the parameter.
    slope = torch.tensor(0.1, requires_grad=True)
    call = make_call(q, k, v, bias=lambda b, h, i, j: -slope * (i - j).abs())
    assert select_backend("auto", call).name == "torch"


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

    def steep_pair(b, h, i, j):  # heads 0-1 (key head 0) steep enough to underflow, 2-3 not
        return -torch.where(h < 2, 16.0, 0.125) * (i - j).abs()

    def all_steep(b, h, i, j):
        return -16.0 * (i - j).abs()

    def declared(fn):  # the same function, declared relative (row maxima from the offsets)
        return relative(lambda b, h, i, j: fn(b, h, i, j))

    i, j = 300, 257
    for fn, partly, whole in (
        (steep_pair, True, False),
        (all_steep, False, True),
        (declared(steep_pair), True, False),
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


def test_sliding_max_equals_brute_force() -> None:
    from attnkit.backends.tiled.relative import sliding_max as _sliding_max

    t = torch.randn(3, 50, dtype=F64, generator=torch.Generator().manual_seed(3))
    for w in (1, 2, 7, 10, 49, 50):
        want = torch.stack([t[:, y : y + w].amax(dim=-1) for y in range(50 - w + 1)], dim=-1)
        assert torch.equal(_sliding_max(t, w), want), w


def test_relative_bias_function_of_the_wrong_shape_is_named() -> None:
    q, k, v = _qkv(9, 9)
    bad = relative(lambda b, h, i, j: torch.zeros(3, 2, dtype=F64))
    match = r"bias_fn is declared relative but returned shape \(3, 2\)"
    with pytest.raises(ValueError, match=match):
        tiled_attention(q, k, v, bias_fn=bad)


def test_odd_batches_are_split_without_changing_the_product() -> None:
    from attnkit.backends.tiled.layout import bmm as _bmm

    g = torch.Generator().manual_seed(4)
    for n in (1, 2, 3, 5):
        a = torch.randn(n, 6, 4, dtype=F64, generator=g)
        b = torch.randn(n, 5, 4, dtype=F64, generator=g).transpose(1, 2)
        torch.testing.assert_close(_bmm(a, b), torch.bmm(a, b), atol=1e-14, rtol=0)


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


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_lazy_shift_handles_logits_far_from_zero(dtype, monkeypatch) -> None:
    """Without a bias the forward keeps a per-row shift of 0 while a row's logits stay near
    0 (tiles whose Cauchy-Schwarz bound is below 40 bits skip the maximum) and moves it only
    when they leave +-40 bits. Huge logits, logits that grow block after block and logits far
    below zero all equal the float64 reference, masks and gradients included, and each of the
    shift's regimes really occurs."""
    from attnkit.backends.tiled import forward, softmax

    seen = set()

    def spy(state, s, small):
        new = softmax.lazy_shift(state, s, small)
        first = not state.started
        seen.add(("first" if first else "later", "zero" if new is None else "shifted"))
        seen.add(("bounded", small))
        m = state.m
        if not first and m is not None and new is not None and not torch.equal(m, new):
            seen.add(("later", "moved"))
        return new

    monkeypatch.setattr(forward, "lazy_shift", spy)
    i, j, d = 150, 230, 8
    q64, k64, v64 = _qkv(i, j, h=2, h_kv=2, d=d, dv=4, b=2)
    grow = torch.linspace(0.2, 30.0, j, dtype=F64).view(1, 1, j, 1)  # later keys dominate
    dense = torch.rand(2, 1, i, j, generator=torch.Generator().manual_seed(3)) > 0.3
    dense[:, :, 5] = False
    cases = {
        "plain": (q64, k64, {}),
        "huge": (q64 * 60, k64, {}),
        "growing": (q64 * 3, k64 * grow, {"mask": dense}),
        "far below": (torch.full_like(q64, 8.0), -k64.abs() - 8.0, {"is_causal": True}),
    }
    for name, (qc, kc, kw) in cases.items():
        results = []
        for impl in ("math", "tiled"):
            q, k, v = (t.to(dtype if impl == "tiled" else F64).detach().requires_grad_()
                       for t in (qc, kc, v64))  # fmt: skip
            if impl == "tiled":
                out = tiled_attention(q, k, v, block_q=32, block_k=64, **kw)
            else:
                out = scaled_dot_product_attention(q, k, v, backend="math", **kw)
            weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
            grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
            results.append([t.double() for t in (out, *grads)])
        tol = {"atol": 1e-9, "rtol": 1e-7} if dtype == F64 else {"atol": 1e-3, "rtol": 1e-3}
        for a, b_, what in zip(*results, ("out", "dq", "dk", "dv"), strict=True):
            torch.testing.assert_close(b_, a, **tol, msg=f"{name}: {what}")
    want = {("first", "zero"), ("first", "shifted"), ("later", "moved")}
    assert want | {("bounded", True), ("bounded", False)} <= seen
