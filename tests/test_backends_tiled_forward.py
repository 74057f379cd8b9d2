"""The tiled forward: its output is softmax(scores) @ V and its log-sum-exp is torch.logsumexp of
the float64 scores, for both shift policies (no bias: lazy; bias: exact); rows that see no key
give output 0 and ``lse = finfo.min``."""

from __future__ import annotations

import pytest
import torch

from attnkit import masks
from attnkit.backends.tiled.forward import forward
from attnkit.backends.tiled.tiles import Spec
from oracles import qkv as _qkv

F64 = torch.float64


def _alibi(b, h, i, j):
    return -(2.0 ** (-(h + 1.0))) * (i - j).abs()


def _reference(q, k, v, scale, mask=None, bias=None):
    """float64 scores (b, h, i, j), then out = softmax @ V and lse = logsumexp; -inf where
    blocked, so a row without keys has lse = -inf and NaN weights (zeroed here)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~mask, -torch.inf)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v, lse


def _cases(i: int, j: int):
    g = torch.Generator().manual_seed(9)
    dense = torch.rand(2, 1, i, j, generator=g) > 0.5
    dense[:, :, 0] = False  # a fully masked row
    bias = torch.randn(1, 4, i, j, dtype=F64, generator=g)
    causal = masks.causal_fn(j - i)  # bottom-right
    alibi = masks.materialize(_alibi, (1, 4, i, j)).to(F64)
    return {  # name: (spec keywords, dense mask, dense bias)
        "plain (lazy shift)": ({}, None, None),
        "dense mask": ({"mask": dense}, dense, None),
        "causal fn": ({"mask_fn": causal}, masks.materialize(causal, (1, 1, i, j)), None),
        "bias tensor (exact shift)": ({"bias": bias}, None, bias),
        "bias and mask": ({"bias": bias, "mask": dense}, dense, bias),
        "relative bias fn": ({"bias_fn": masks.relative(_alibi)}, None, alibi),
    }


@pytest.mark.parametrize(("i", "j"), [(1, 1), (37, 45), (97, 97), (97, 7)])
@pytest.mark.parametrize("blocks", [(8, 16), (256, 256)])
def test_out_and_lse_equal_the_float64_reference(i: int, j: int, blocks) -> None:
    q, k, v = _qkv(i, j)
    for name, (kw, mask, bias) in _cases(i, j).items():
        spec = Spec(0.3, block_q=blocks[0], block_k=blocks[1], **kw)
        out, lse, _ = forward(q, k, v, spec)
        want_out, want_lse = _reference(q, k, v, 0.3, mask, bias)
        assert out.dtype == lse.dtype == F64 and lse.shape == (2, 4, i)
        seen = torch.isfinite(want_lse)
        torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-10, msg=name)
        torch.testing.assert_close(lse[seen], want_lse[seen], atol=1e-12, rtol=1e-12, msg=name)
        blocked = torch.finfo(F64).min
        assert torch.equal(lse[~seen], torch.full_like(lse[~seen], blocked)), name
        assert torch.equal(out[~seen], torch.zeros_like(out[~seen])), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs_are_computed_in_float32(dtype) -> None:
    q, k, v = _qkv(37, 45)
    mask = torch.ones(1, 1, 37, 45, dtype=torch.bool)  # a Spec holds 4-D tensors
    mask[..., 4, :] = False
    out, lse, _ = forward(*(t.to(dtype) for t in (q, k, v)), Spec(0.3, mask=mask, block_q=16))
    assert out.dtype == lse.dtype == torch.float32
    want_out, want_lse = _reference(*(t.to(dtype).double() for t in (q, k, v)), 0.3, mask)
    tol = 1e-5 if dtype == torch.float32 else 1e-4
    torch.testing.assert_close(out.double(), want_out, atol=tol, rtol=tol)
    keep = torch.arange(37) != 4
    torch.testing.assert_close(lse[:, :, keep].double(), want_lse[:, :, keep], atol=tol, rtol=tol)
    assert bool((lse[:, :, 4] == torch.finfo(torch.float32).min).all())
    assert torch.equal(out[:, :, 4], torch.zeros_like(out[:, :, 4]))


def test_offsets_place_queries_and_keys_at_absolute_positions() -> None:
    """A mask function sees absolute positions: queries from ``q_offset``, keys from
    ``k_offset``; shifting both by the same amount changes nothing for a causal mask."""
    q, k, v = _qkv(37, 45)
    causal = masks.causal_fn(0)
    base = forward(q, k, v, Spec(0.3, mask_fn=causal, q_offset=20, k_offset=12, block_q=8))
    moved = forward(q, k, v, Spec(0.3, mask_fn=causal, q_offset=120, k_offset=112, block_q=8))
    mask = torch.arange(45).view(1, 45) + 12 <= torch.arange(37).view(37, 1) + 20
    want_out, want_lse = _reference(q, k, v, 0.3, mask)
    for got in (base, moved):
        torch.testing.assert_close(got[0], want_out, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(got[1], want_lse, atol=1e-12, rtol=1e-12)
