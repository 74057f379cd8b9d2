"""RMSNorm against its formula in float64, torch's own nn.RMSNorm, and Llama's dtype rules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnkit.norms import RMSNorm

D64 = torch.float64


def test_matches_the_formula_in_float64() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(7, eps=1e-5).to(D64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 7, dtype=D64)
    rms = (x.pow(2).sum(-1, keepdim=True) / 7 + 1e-5).sqrt()  # Zhang & Sennrich, eq. 4
    torch.testing.assert_close(norm(x), x / rms * norm.weight, rtol=0, atol=1e-14)


def test_agrees_with_torch_rmsnorm() -> None:
    torch.manual_seed(1)
    ours, theirs = RMSNorm(16, eps=1e-6), nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        ours.weight.normal_()
        theirs.weight.copy_(ours.weight)
    x = torch.randn(4, 9, 16) * 30
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-5)


def test_statistic_in_float32_for_half_inputs() -> None:
    # 300^2 * 16 overflows float16 (max 65504): the mean square must be taken in float32.
    norm = RMSNorm(16)
    x = torch.full((2, 16), 300.0, dtype=torch.float16)
    y = norm(x)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), torch.ones(2, 16), rtol=1e-3, atol=1e-3)
    # Llama's order: normalise, cast back to the input dtype, then multiply by the weight.
    assert norm.to(torch.bfloat16)(x.bfloat16()).dtype == torch.bfloat16


def test_gradients_flow_and_scale_invariance() -> None:
    norm = RMSNorm(8).to(D64)
    x = torch.randn(3, 8, dtype=D64, requires_grad=True)
    torch.testing.assert_close(norm(x), norm(x * 1000), rtol=1e-6, atol=1e-9)  # eps is tiny
    norm(x).sum().backward()
    assert x.grad is not None and norm.weight.grad is not None


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_dim_must_be_a_positive_int(bad) -> None:
    with pytest.raises(ValueError, match="dim"):
        RMSNorm(bad)


def test_eps_and_shape_are_checked() -> None:
    with pytest.raises(ValueError, match="eps"):
        RMSNorm(4, eps=0.0)
    with pytest.raises(ValueError, match="RMSNorm\\(4\\)"):
        RMSNorm(4)(torch.randn(2, 5))
    assert "eps=1e-06" in repr(RMSNorm(4))
