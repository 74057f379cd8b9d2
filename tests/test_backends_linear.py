"""Linear attention equals its explicit quadratic form; rows are normalised by phi(q).sum phi(k)."""

from __future__ import annotations

import pytest
import torch

from attnkit.backends.linear import feature_map, linear_attention, linear_attention_quadratic

F64 = torch.float64


@pytest.mark.parametrize(("i", "j"), [(1, 1), (7, 7), (97, 97), (257, 257), (5, 97)])
@pytest.mark.parametrize("causal", [False, True])
def test_linear_equals_quadratic_form(i: int, j: int, causal: bool) -> None:
    g = torch.Generator().manual_seed(i * 31 + j)
    q = torch.randn(2, 4, i, 8, dtype=F64, generator=g, requires_grad=True)
    k = torch.randn(2, 2, j, 8, dtype=F64, generator=g, requires_grad=True)
    v = torch.randn(2, 2, j, 5, dtype=F64, generator=g, requires_grad=True)
    out = linear_attention(q, k, v, is_causal=causal, chunk_size=16)
    ref = linear_attention_quadratic(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    g_out = torch.autograd.grad(out.square().sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(g_out, g_ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_quadratic_form_by_hand_and_normaliser() -> None:
    """Hand-computed: weights phi(q).phi(k_j) / sum_j phi(q).phi(k_j); a constant value passes
    through unchanged (rows sum to one); causal row 0 sees only key 0."""
    q = torch.tensor([[[[0.5, -1.0]]]], dtype=F64)
    k = torch.tensor([[[[1.0, 0.0], [-2.0, 3.0]]]], dtype=F64)
    v = torch.tensor([[[[1.0], [4.0]]]], dtype=F64)
    pq, pk = feature_map(q)[0, 0, 0], feature_map(k)[0, 0]
    assert torch.allclose(pq, torch.tensor([1.5, torch.exp(torch.tensor(-1.0)).item()], dtype=F64))
    w = pk @ pq
    expected = (w[0] * 1.0 + w[1] * 4.0) / w.sum()
    torch.testing.assert_close(linear_attention(q, k, v, eps=0.0)[0, 0, 0, 0], expected)
    x = torch.randn(1, 2, 9, 4, dtype=F64)
    const = torch.full((1, 2, 9, 3), 2.5, dtype=F64)
    for causal in (False, True):
        torch.testing.assert_close(linear_attention(x, x, const, is_causal=causal, eps=0.0), const)
    out = linear_attention(x, x, x, is_causal=True)
    torch.testing.assert_close(out[:, :, 0], x[:, :, 0], atol=1e-5, rtol=1e-5)


def test_linear_rejects_bad_inputs() -> None:
    x = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match="4-D"):
        linear_attention(x[0], x[0], x[0])
    with pytest.raises(ValueError, match="is_causal"):
        linear_attention(x, x[:, :, :3], x[:, :, :3], is_causal=True)
    with pytest.raises(ValueError, match="divide"):
        linear_attention(torch.randn(1, 3, 5, 4), x, x)


def test_linear_attention_validates_like_the_reference() -> None:
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(
        TypeError, match=r"query must be a floating-point tensor, got dtype torch\.int64"
    ):
        linear_attention(q.long(), q, q)
    with pytest.raises(TypeError, match="must share a dtype"):
        linear_attention(q, q.double(), q)
    for eps in (-1e-6, float("nan")):
        with pytest.raises(ValueError, match="eps must be a non-negative number"):
            linear_attention(q, q, q, eps=eps)
    with pytest.raises(ValueError, match="eps must be a non-negative number"):
        linear_attention_quadratic(q, q, q, eps=-1.0)


def test_linear_attention_refuses_mixed_devices_and_empty_heads() -> None:
    x = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match="one device"):
        linear_attention(x.to("meta"), x, x)
    with pytest.raises(ValueError, match=r"key heads \(0\) must divide"):
        linear_attention(x, x[:, :0], x[:, :0])
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        linear_attention(x, x, x, is_causal=True, chunk_size=0)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        linear_attention(x, x, x, is_causal=1)
