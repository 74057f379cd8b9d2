"""The shared numeric facts: the compute dtype of each float dtype, and the blocked minimum (finite,
the dtype's own minimum, so a fully blocked row gives zeros, not NaN)."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit import scaled_dot_product_attention
from attnkit._numerics import blocked, compute_dtype

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def test_compute_dtype_of_each_float_dtype() -> None:
    want = {
        torch.float16: torch.float32,
        torch.bfloat16: torch.float32,
        torch.float32: torch.float32,
        torch.float64: torch.float64,
    }
    assert {dtype: compute_dtype(dtype) for dtype in FLOATS} == want


@pytest.mark.parametrize("dtype", FLOATS)
def test_blocked_is_the_finite_minimum_of_the_dtype(dtype: torch.dtype) -> None:
    value = blocked(dtype)
    assert math.isfinite(value) and value < -1e4
    as_tensor = torch.tensor(value, dtype=dtype)
    assert torch.isfinite(as_tensor) and float(as_tensor) == value  # representable exactly
    # -(2 - 2^-mantissa) * 2^max_exponent, by hand: the most negative finite value.
    mantissa, exponent = {
        torch.float16: (10, 15),
        torch.bfloat16: (7, 127),
        torch.float32: (23, 127),
        torch.float64: (52, 1023),
    }[dtype]
    assert value == -(2 - 2.0**-mantissa) * 2.0**exponent == float(torch.finfo(dtype).min)
    # In a softmax it takes no mass next to any ordinary score, and alone it is not NaN.
    scores = torch.tensor([value, 0.0, -30.0], dtype=compute_dtype(dtype))
    assert float(torch.softmax(scores, dim=0)[0]) == 0.0
    assert torch.isfinite(torch.softmax(torch.full((3,), value, dtype=dtype), dim=0)).all()


@pytest.mark.parametrize("dtype", FLOATS)
def test_a_fully_blocked_row_gives_zeros_through_the_math_backend(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g).to(dtype).requires_grad_() for _ in range(3))
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    mask[0, :, 2] = False  # query 2 of batch 0 sees no key
    out = scaled_dot_product_attention(q, k, v, mask, backend="math")
    assert out.dtype == dtype
    assert torch.equal(out[0, :, 2], torch.zeros_like(out[0, :, 2]))
    assert torch.isfinite(out).all()
    dq, dk, dv = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))
    assert torch.equal(dq[0, :, 2], torch.zeros_like(dq[0, :, 2]))
    # The other rows are the reference computed in float64.
    ref = scaled_dot_product_attention(
        *(t.detach().double() for t in (q, k, v)), mask, backend="math"
    )
    tol = 1e-12 if dtype == torch.float64 else 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.detach().double(), ref, atol=tol, rtol=tol)
