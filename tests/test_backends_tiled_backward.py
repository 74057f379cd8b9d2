"""The tiled backward: gradients recomputed tile by tile from the saved log-sum-exp equal autograd
through the float64 reference, including the bias gradient summed to a broadcast bias's shape;
rows that see no key get zero, finite gradients."""

from __future__ import annotations

import pytest
import torch

from attnkit import masks, scaled_dot_product_attention
from attnkit.backends.sparse import block_sparse, strided_layout
from attnkit.backends.tiled.backward import backward
from attnkit.backends.tiled.forward import forward
from attnkit.backends.tiled.tiles import Spec
from oracles import qkv as _qkv

F64 = torch.float64


def _reference_grads(q, k, v, grad_out, scale, mask=None, bias=None):
    """Autograd through the float64 reference math: (dq, dk, dv, dbias or None)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if bias is not None:
        leaves.append(bias.detach().clone().requires_grad_())
    out = scaled_dot_product_attention(
        *leaves[:3], mask, bias=leaves[3] if bias is not None else None, scale=scale, backend="math"
    )
    grads = torch.autograd.grad(out, leaves, grad_out)
    return (*grads[:3], grads[3] if bias is not None else None)


def _tiled_grads(q, k, v, grad_out, spec, want_dbias=False):
    out, lse, _ = forward(q, k, v, spec)
    return backward(q, k, v, out, lse, grad_out, spec, want_dbias)[:4]


def _cases(i: int, j: int):
    g = torch.Generator().manual_seed(8)
    dense = torch.rand(2, 1, i, j, generator=g) > 0.5
    dense[:, :, 0] = False  # a fully masked row
    causal = masks.causal_fn(j - i)
    alibi = lambda b, h, i, j: -(2.0 ** (-(h + 1.0))) * (i - j).abs()  # noqa: E731
    return {  # name: (spec keywords, dense mask, dense bias)
        "plain": ({}, None, None),
        "dense mask": ({"mask": dense}, dense, None),
        "causal fn": ({"mask_fn": causal}, masks.materialize(causal, (1, 1, i, j)), None),
        "bias fn": ({"bias_fn": alibi}, None, masks.materialize(alibi, (1, 4, i, j)).to(F64)),
        "relative bias fn and mask": (
            {"bias_fn": masks.relative(alibi), "mask": dense},
            dense,
            masks.materialize(alibi, (1, 4, i, j)).to(F64),
        ),
    }


@pytest.mark.parametrize(("i", "j"), [(1, 1), (37, 45), (97, 7)])
def test_gradients_equal_autograd_through_the_reference(i: int, j: int) -> None:
    q, k, v = _qkv(i, j)
    grad_out = torch.randn(2, 4, i, 6, dtype=F64, generator=torch.Generator().manual_seed(1))
    for name, (kw, mask, bias) in _cases(i, j).items():
        got = _tiled_grads(q, k, v, grad_out, Spec(0.3, block_q=8, block_k=16, **kw))
        want = _reference_grads(q, k, v, grad_out, 0.3, mask, bias)
        assert got[3] is None
        for a, b, what in zip(want[:3], got[:3], ("dq", "dk", "dv"), strict=True):
            assert b.dtype == F64 and torch.isfinite(b).all(), f"{name}: {what}"
            torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-10, msg=f"{name}: {what}")


@pytest.mark.parametrize(
    "shape", [(2, 4, 37, 45), (1, 4, 37, 45), (2, 1, 1, 45), (1, 1, 37, 1), (2, 4, 1, 1)]
)
def test_dbias_is_summed_to_the_bias_tensors_shape(shape: tuple[int, ...]) -> None:
    q, k, v = _qkv(37, 45)
    gen = torch.Generator().manual_seed(2)
    grad_out = torch.randn(2, 4, 37, 6, dtype=F64, generator=gen)
    bias = torch.randn(shape, dtype=F64, generator=gen)
    spec = Spec(0.3, bias=bias, mask_fn=masks.causal_fn(8), block_q=8, block_k=16)
    mask = masks.causal_mask(37, 45)
    dq, dk, dv, dbias = _tiled_grads(q, k, v, grad_out, spec, want_dbias=True)
    want = _reference_grads(q, k, v, grad_out, 0.3, mask, bias)
    assert dbias.shape == shape
    for a, b, what in zip(want, (dq, dk, dv, dbias), ("dq", "dk", "dv", "dbias"), strict=True):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-10, msg=what)


def test_dbias_over_gathered_key_groups() -> None:
    """The sparse layout's gathered (non-contiguous) key groups add dbias by index."""
    q, k, v = _qkv(48, 48)
    gen = torch.Generator().manual_seed(3)
    grad_out = torch.randn(2, 4, 48, 6, dtype=F64, generator=gen)
    bias = torch.randn(1, 4, 48, 48, dtype=F64, generator=gen)
    layout = block_sparse(strided_layout(6, 1, 3), 8)
    spec = Spec(0.3, mask_fn=layout, bias=bias, block_q=8, block_k=8, gather=True)
    got = _tiled_grads(q, k, v, grad_out, spec, want_dbias=True)
    want = _reference_grads(q, k, v, grad_out, 0.3, masks.materialize(layout, (1, 1, 48, 48)), bias)
    for a, b, what in zip(want, got, ("dq", "dk", "dv", "dbias"), strict=True):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-10, msg=what)


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


# The loop order: key tiles outside, the query tiles that keep each inside (backward.cpp's).


def _order_case(case: str, n: int):
    """(mask function, is_causal, tile size, gather) of a loop-order case."""
    if case == "causal":
        return None, True, 64, False
    if case == "window":
        return masks.window_fn(100, 20), False, 64, False
    if case == "block layout":  # the sparse backend's gathered groups
        return block_sparse(strided_layout(n // 32, 2, 3), 32), False, 32, True
    ids = torch.arange(n) * 3 // n  # three documents: an undeclared mask function

    def documents(b, h, i, j):
        return ids[i] == ids[j]

    return documents, True, 64, False


@pytest.mark.parametrize("case", ["causal", "window", "block layout", "documents"])
def test_backward_visits_key_tiles_outside_in_the_plans_by_key_order(case: str) -> None:
    """The (key tile, query tile) pairs the backward visits are ``TilePlan.by_key``'s, in its
    order (the order the fused backward's C++ loops read the same tensors in), with gathered
    query tiles listed one by one; the gradients stay those of the float64 reference."""
    from attnkit._structure import tile_plan
    from attnkit.backends.tiled import tiled_attention
    from attnkit.backends.tiled.backward import visits

    n = 321
    fn, causal, block, gather = _order_case(case, n)
    q, k, v = _qkv(n, n, h=4, h_kv=2, d=8, dv=6, b=1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with visits() as seen:
        out = tiled_attention(
            *leaves, mask_fn=fn, is_causal=causal, block_q=block, block_k=block, gather=gather
        )
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    mask_fn = masks.all_of(fn, masks.causal_fn(0)) if causal else fn
    plan = tile_plan(masks.structure_of(mask_fn), n, n, block, block)
    offsets, kept = plan.by_key()
    want = []
    for kb in range(len(offsets) - 1):
        j0 = kb * block
        for i0, i1, _ in kept[offsets[kb] : offsets[kb + 1]].tolist():
            want.append((j0, min(n, j0 + block), i0, i1))
    assert seen == want
    ref = _reference_grads(q, k, v, torch.ones_like(out), 8**-0.5, mask=_dense(mask_fn, n))
    for got, expected in zip(grads, ref[:3], strict=True):
        assert (got - expected).abs().max() < 1e-12


def _dense(mask_fn, n: int):
    return None if mask_fn is None else masks.materialize(mask_fn, (1, 1, n, n))
