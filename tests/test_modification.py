"""``ScoreModification``: softcap, bias and score_mod as one description, applied in the
reference's order by one ``apply`` in any units and layout; backends name the parts they lack."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit import scaled_dot_product_attention
from attnkit._modification import ScoreModification
from attnkit.functional import make_call
from attnkit.registry import get_backend

F64 = torch.float64


def _index(shape):
    return tuple(
        torch.arange(n).view([n if a == d else 1 for a in range(4)]) for d, n in enumerate(shape)
    )


def _mod(score, b, h, i, j):
    return score * 0.5 + 0.1 * h - 0.01 * (i - j).abs() + b


@pytest.mark.parametrize("unit", [1.0, math.log2(math.e)])
@pytest.mark.parametrize("inplace", [False, True])
def test_apply_is_softcap_then_bias_then_score_mod(unit: float, inplace: bool) -> None:
    """Hand-written order on natural scores equals ``apply`` in natural and base-2 units, in
    place or not, with the cap's slope ``1 - tanh^2``."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 3, 5, 7, dtype=F64, generator=g) * 20
    bias = torch.randn(1, 3, 5, 7, dtype=F64, generator=g)
    want = _mod(30.0 * torch.tanh(s / 30.0) + bias, *_index(s.shape))
    modification = ScoreModification(softcap=30.0, bias=bias, score_mod=_mod)
    got, slope = modification.apply(
        s.clone() * unit, bias, _index(s.shape), unit=unit, slope=True, inplace=inplace
    )
    assert torch.allclose(got / unit, want, atol=1e-12, rtol=0)
    assert torch.allclose(slope, 1 - torch.tanh(s / 30.0) ** 2, atol=1e-12, rtol=0)
    assert modification.parts == ("softcap", "bias", "score_mod")


def test_apply_adds_a_bias_with_rows_split_into_queries_and_groups() -> None:
    """A bias with one more axis than the scores reads their rows as (queries, g): the tiled
    engine's relative view ``(1, h_kv, queries, g, bj)`` on ``(b, h_kv, queries * g, bj)``."""
    s = torch.zeros(1, 2, 6, 4, dtype=F64)
    bias = torch.arange(2 * 3 * 2 * 4, dtype=F64).view(1, 2, 3, 2, 4)
    got, _ = ScoreModification(bias=bias).apply(s, bias)
    assert torch.equal(got, bias.view(1, 2, 6, 4))


def test_call_carries_its_modification_and_softcap_bias_match_the_reference() -> None:
    """``AttentionCall.modification`` splits the bias into tensor and function; softcap and a
    bias through ``tiled`` (which applies the modification) equal the float64 reference."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 33, 8, dtype=F64, generator=g) for _ in range(3))
    bias = torch.randn(1, 2, 33, 33, dtype=F64, generator=g)
    call = make_call(q, k, v, bias=bias, softcap=5.0)
    assert call.modification == ScoreModification(softcap=5.0, bias=bias)
    fn_call = make_call(q, k, v, bias=_alibi)
    assert fn_call.modification.bias_fn is _alibi and fn_call.modification.bias is None
    for kw in ({"bias": bias, "softcap": 5.0}, {"bias": _alibi, "softcap": 2.0}):
        ref = scaled_dot_product_attention(q, k, v, backend="math", **kw)
        got = scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
        assert (got - ref).abs().max() < 1e-12


def _alibi(b, h, i, j):
    return -0.5 * (h + 1) * (i - j).abs()


@pytest.mark.parametrize(
    ("backend", "kw", "words"),
    [
        ("torch", {"softcap": 5.0}, "torch's fused kernel has no logit soft-capping (softcap)"),
        ("torch", {"score_mod": _mod}, "has no score modification (score_mod)"),
        ("fused", {"softcap": 5.0, "score_mod": _mod}, "no logit soft-capping (softcap) and no"),
        ("chunked", {"score_mod": _mod}, "chunked attention has no score modification"),
    ],
)
def test_backends_name_the_parts_they_do_not_serve(backend: str, kw: dict, words: str) -> None:
    q = torch.randn(1, 2, 9, 8)
    reason = get_backend(backend).why_not(make_call(q, q, q, **kw))
    assert reason is not None and words in reason and "'tiled' has" in reason
    assert get_backend("tiled").why_not(make_call(q, q, q, **kw)) is None
