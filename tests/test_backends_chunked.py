"""Chunked attention is the reference math over query chunks: equal to it, gradients included."""

from __future__ import annotations

import pytest
import torch

from attnkit import masks, scaled_dot_product_attention
from attnkit.backends import BackendUnavailable
from attnkit.backends.chunked import chunked_attention
from attnkit.functional import make_call

F64 = torch.float64


@pytest.mark.parametrize(("i", "j"), [(1, 1), (7, 7), (97, 97), (257, 100), (5, 97)])
def test_chunked_equals_reference(i: int, j: int) -> None:
    g = torch.Generator().manual_seed(i + j)
    q = torch.randn(2, 4, i, 8, dtype=F64, generator=g, requires_grad=True)
    k = torch.randn(2, 2, j, 8, dtype=F64, generator=g, requires_grad=True)
    v = torch.randn(2, 2, j, 6, dtype=F64, generator=g, requires_grad=True)
    dense = torch.rand(2, 1, i, j, generator=g) > 0.5
    cases = [
        {},
        {"is_causal": True},
        {"mask": masks.causal_fn(0), "bias": lambda b, h, i, j: 0.1 * (j - i)},
        {"mask": dense, "bias": torch.randn(4, i, j, dtype=F64, generator=g), "is_causal": True},
    ]
    for kw in cases:
        call = make_call(q, k, v, **kw)
        out = chunked_attention(call, chunk_size=16)
        ref = scaled_dot_product_attention(q, k, v, backend="math", **kw)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
        g_out = torch.autograd.grad(out.square().sum(), (q, k, v))
        g_ref = torch.autograd.grad(ref.square().sum(), (q, k, v))
        for a, b in zip(g_out, g_ref, strict=True):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    out = scaled_dot_product_attention(q, k, v, is_causal=True, backend="chunked")
    ref = scaled_dot_product_attention(q, k, v, is_causal=True, backend="math")
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)


def test_chunked_refuses_dropout_and_weights() -> None:
    x = torch.randn(1, 2, 5, 4)
    with pytest.raises(BackendUnavailable, match="dropout_p"):
        scaled_dot_product_attention(x, x, x, dropout_p=0.5, backend="chunked")
    with pytest.raises(BackendUnavailable, match="return_weights"):
        scaled_dot_product_attention(x, x, x, return_weights=True, backend="chunked")
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_attention(make_call(x, x, x), chunk_size=0)
