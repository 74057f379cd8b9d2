"""Sparse attention equals dense attention under the equivalent mask; its cost follows the
layout; top-k attention equals dense attention under the mask of the top-k indices."""

from __future__ import annotations

import pytest
import torch

from attnkit import masks, scaled_dot_product_attention
from attnkit.backends import BackendUnavailable
from attnkit.backends.sparse import (
    block_sparse,
    dilated_layout,
    strided_layout,
    topk_attention,
)

F64 = torch.float64


def _qkv(n: int, h: int = 4, h_kv: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(2, h, n, 8, dtype=F64, generator=g),
        torch.randn(2, h_kv, n, 8, dtype=F64, generator=g),
        torch.randn(2, h_kv, n, 6, dtype=F64, generator=g),
    )


LAYOUTS = {
    "window": lambda n: masks.window_fn(20, 3),
    "strided": lambda n: block_sparse(strided_layout(-(-n // 16), 2, 3), 16),
    "dilated": lambda n: block_sparse(dilated_layout(-(-n // 16), 3, 2), 16),
    "random blocks": lambda n: block_sparse(
        torch.rand(-(-n // 16), -(-n // 16), generator=torch.Generator().manual_seed(3)) > 0.6, 16
    ),
}


@pytest.mark.parametrize("n", [1, 7, 97, 257])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_sparse_equals_dense_under_the_equivalent_mask(n: int, name: str) -> None:
    layout = LAYOUTS[name](n)
    dense = masks.materialize(layout, (1, 1, n, n))  # the equivalent dense mask
    for causal in (False, True):
        q, k, v = (t.requires_grad_() for t in _qkv(n))
        out = scaled_dot_product_attention(q, k, v, layout, is_causal=causal, backend="sparse")
        ref = scaled_dot_product_attention(q, k, v, dense, is_causal=causal, backend="math")
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
        g_out = torch.autograd.grad(out.square().sum(), (q, k, v))
        g_ref = torch.autograd.grad(ref.square().sum(), (q, k, v))
        for a, b in zip(g_out, g_ref, strict=True):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_sparse_visits_only_kept_blocks() -> None:
    """The layout's kept key ranges are all the sparse backend looks at: keys outside them may
    hold NaN without affecting the result."""
    n = 128
    q, k, v = _qkv(n)
    layout = torch.zeros(8, 8, dtype=torch.bool)
    layout[:, 0] = True  # every query block sees key block 0 only
    k[:, :, 16:] = float("nan")
    v[:, :, 16:] = float("nan")
    out = scaled_dot_product_attention(q, k, v, block_sparse(layout, 16), backend="sparse")
    ref = scaled_dot_product_attention(q, k[:, :, :16], v[:, :, :16], backend="math")
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)


def test_sparse_refuses_unstructured_masks_and_dropout() -> None:
    q, k, v = _qkv(9)
    with pytest.raises(BackendUnavailable, match="layout"):
        scaled_dot_product_attention(q, k, v, torch.ones(9, 9, dtype=bool), backend="sparse")
    with pytest.raises(BackendUnavailable, match="dropout_p"):
        scaled_dot_product_attention(q, k, v, masks.window_fn(3), dropout_p=0.1, backend="sparse")
    with pytest.raises(ValueError, match="layout must be a 2-D bool"):
        block_sparse(torch.ones(3, 3), 4)


@pytest.mark.parametrize("n", [7, 97])
def test_topk_equals_dense_attention_under_its_topk_mask(n: int) -> None:
    q, k, v = _qkv(n, h=4, h_kv=4)
    top_k = 5
    for causal in (False, True):
        out = topk_attention(q, k, v, top_k, is_causal=causal, chunk_size=16)
        scores = q @ k.transpose(-2, -1)
        if causal:
            scores = scores.masked_fill(~masks.causal_mask(n), float("-inf"))
        idx = scores.topk(min(top_k, n), dim=-1).indices
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)
        if causal:
            keep &= masks.causal_mask(n)
        ref = scaled_dot_product_attention(q, k, v, keep, backend="math")
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    # With top_k >= n it is exact softmax attention.
    full = topk_attention(q, k, v, n)
    torch.testing.assert_close(full, scaled_dot_product_attention(q, k, v), atol=1e-12, rtol=0)


def test_topk_gradients_flow() -> None:
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 6, 3, dtype=F64, generator=g, requires_grad=True)
    k = torch.randn(1, 1, 7, 3, dtype=F64, generator=g, requires_grad=True)
    v = torch.randn(1, 1, 7, 2, dtype=F64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: topk_attention(q, k, v, 3), (q, k, v))


def test_gathered_backward_with_a_relative_bias_equals_the_reference() -> None:
    """A relative bias (ALiBi) reverses each query tile's rows; the backward's gathered groups
    of query tiles (key block J kept by query blocks J, J + 1, J + 2) keep that order, so the
    output and gradients equal the float64 reference."""
    from attnkit import alibi_fn

    n = 97
    layout = block_sparse(dilated_layout(-(-n // 16), 3, 1), 16)
    dense = masks.materialize(layout, (1, 1, n, n))
    q, k, v = (t.requires_grad_() for t in _qkv(n))
    kw = {"bias": alibi_fn(4), "is_causal": True}
    out = scaled_dot_product_attention(q, k, v, layout, backend="sparse", **kw)
    ref = scaled_dot_product_attention(q, k, v, dense, backend="math", **kw)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    g_out = torch.autograd.grad(out.square().sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(g_out, g_ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_topk_keeps_a_hidden_nan_out_and_handles_empty_sides() -> None:
    q, k, v = _qkv(5)
    v[0, 0, 4] = float("nan")  # key 4: hidden from rows 0-3 under is_causal
    out = topk_attention(q, k, v, 5, is_causal=True)
    ref = scaled_dot_product_attention(q, k, v, is_causal=True, backend="math")
    assert torch.equal(out.isnan(), ref.isnan())
    torch.testing.assert_close(out.nan_to_num(7.0), ref.nan_to_num(7.0), atol=1e-12, rtol=0)
    none = topk_attention(q, k[:, :, :0], v[:, :, :0], 2)  # no key: zeros, as every backend
    assert none.shape == (2, 4, 5, 6) and none.abs().max() == 0
    assert topk_attention(q[:, :, :0], k, v, 2).shape == (2, 4, 0, 6)


def test_topk_checks_its_arguments_like_the_reference() -> None:
    q, k, v = _qkv(5)
    cases = [
        ((q, k, v, 2), {"is_causal": "no"}, TypeError, "is_causal must be a bool"),
        ((q.long(), k, v, 2), {}, TypeError, "query must be a floating-point tensor"),
        ((q, k[:, :1].expand(2, 3, 5, 8), v[:, :1].expand(2, 3, 5, 6), 2), {}, ValueError,
         "must equal or divide query heads"),
        ((q, k, v, 2), {"chunk_size": 0}, ValueError, "chunk_size must be a positive int"),
        ((q, k, v, 0), {}, ValueError, "top_k must be a positive int"),
        ((q, k, v, 2), {"mask": torch.ones(3, 3, dtype=torch.bool)}, ValueError, "mask"),
    ]  # fmt: skip
    for args, kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            topk_attention(*args, **kwargs)
