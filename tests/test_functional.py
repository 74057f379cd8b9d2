"""The reference attention against torch's kernel, float64 references and hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnkit import masks, scaled_dot_product_attention
from attnkit.backends import BackendUnavailable, select_backend, use
from attnkit.functional import make_call

sdpa = scaled_dot_product_attention
F64 = torch.float64


def rand(*shape: int, dtype: torch.dtype = F64, seed: int | None = None) -> torch.Tensor:
    g = None if seed is None else torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=dtype, generator=g)


def torch_oracle(q, k, v, mask=None, bias=None, is_causal=False, scale=None):
    """torch's own kernel with our conventions spelled out: bottom-right causal, bias + mask."""
    i, j = q.shape[-2], k.shape[-2]
    allowed = mask
    if is_causal:
        causal = masks.causal_mask(i, j)
        allowed = causal if allowed is None else allowed & causal
    attn_mask = allowed
    if bias is not None:
        attn_mask = bias if allowed is None else bias.masked_fill(~allowed, -math.inf)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    if allowed is not None:  # rows with no key: zeros by our definition
        out = out.masked_fill(~allowed.any(-1, keepdim=True), 0.0)
    return out


def test_worked_example_computed_by_hand() -> None:
    q = torch.tensor([[1.0, 2.0]])
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    v = torch.tensor([[0.5, 0.3], [0.8, 0.2], [0.1, 0.9]])
    out, w = sdpa(q, k, v, return_weights=True)
    assert torch.allclose(w, torch.tensor([[0.140, 0.284, 0.576]]), atol=5e-4)
    assert torch.allclose(out, torch.tensor([[0.355, 0.617]]), atol=5e-4)
    # by hand: scores [1, 2, 3] / sqrt(2), softmax, weighted sum
    s = torch.tensor([1.0, 2.0, 3.0], dtype=F64) / math.sqrt(2)
    w_hand = torch.exp(s) / torch.exp(s).sum()
    assert torch.allclose(w[0].double(), w_hand, atol=1e-6)


LENGTHS = st.sampled_from([1, 2, 7, 16, 97, 257])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    i=LENGTHS,
    j=LENGTHS,
    d=st.sampled_from([1, 3, 8, 16]),
    dv=st.sampled_from([1, 5, 8]),
    mask_kind=st.sampled_from(["none", "random", "padding", "per_head"]),
    is_causal=st.booleans(),
    use_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_math_and_auto_agree_with_torch_in_float64(
    b, h, i, j, d, dv, mask_kind, is_causal, use_bias, seed
) -> None:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, i, d, dtype=F64, generator=g)
    k = torch.randn(b, h, j, d, dtype=F64, generator=g)
    v = torch.randn(b, h, j, dv, dtype=F64, generator=g)
    mask = None
    if mask_kind == "random":
        mask = torch.rand(b, 1, i, j, generator=g) > 0.3
    elif mask_kind == "padding":
        lengths = torch.randint(0, j + 1, (b,), generator=g)
        mask = masks.padding_mask(lengths, max_len=j)
    elif mask_kind == "per_head":
        mask = torch.rand(b, h, i, j, generator=g) > 0.5
    bias = torch.randn(1, h, i, j, dtype=F64, generator=g) if use_bias else None
    expected = torch_oracle(q, k, v, mask, bias, is_causal)
    for backend in ("math", "auto", "torch"):
        got = sdpa(q, k, v, mask, bias=bias, is_causal=is_causal, backend=backend)
        assert got.shape == (b, h, i, dv)
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)


def test_weights_rows_sum_to_one_and_match_softmax() -> None:
    q, k, v = rand(2, 3, 7, 8, seed=1), rand(2, 3, 9, 8, seed=2), rand(2, 3, 9, 4, seed=3)
    out, w = sdpa(q, k, v, return_weights=True)
    assert w.shape == (2, 3, 7, 9)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, 7, dtype=F64))
    torch.testing.assert_close(w, torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8), -1))
    torch.testing.assert_close(out, w @ v)


@pytest.mark.parametrize("shape_q", [(5, 4), (3, 5, 4), (2, 3, 2, 5, 4)])
def test_any_number_of_leading_dims(shape_q) -> None:
    q = rand(*shape_q, seed=0)
    k = rand(*shape_q[:-2], 6, 4, seed=1)
    v = rand(*shape_q[:-2], 6, 3, seed=2)
    got = sdpa(q, k, v)
    flat = torch_oracle(q.reshape(-1, 5, 4), k.reshape(-1, 6, 4), v.reshape(-1, 6, 3))
    torch.testing.assert_close(got.reshape(-1, 5, 3), flat, atol=1e-12, rtol=0)


def test_causal_is_bottom_right_aligned() -> None:
    # i = 2, j = 5: the last query sees all keys, the first sees keys 0..3
    q, k, v = rand(1, 2, 4, seed=0), rand(1, 5, 4, seed=1), rand(1, 5, 3, seed=2)
    _, w = sdpa(q, k, v, is_causal=True, return_weights=True)
    expected = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(w[0] > 0, expected)
    # with more queries than keys the first rows see nothing: zeros, not NaN
    out, w = sdpa(rand(1, 4, 4, seed=3), k[:, :2], v[:, :2], is_causal=True, return_weights=True)
    assert torch.equal(out[0, :2], torch.zeros(2, 3, dtype=F64))
    assert torch.equal(w[0, :2], torch.zeros(2, 2, dtype=F64))


def test_mask_and_is_causal_both_apply() -> None:
    q, k, v = rand(1, 1, 6, 4, seed=0), rand(1, 1, 6, 4, seed=1), rand(1, 1, 6, 2, seed=2)
    keep_even = (torch.arange(6) % 2 == 0).view(1, 1, 1, 6)
    _, w = sdpa(q, k, v, keep_even, is_causal=True, return_weights=True)
    allowed = keep_even & masks.causal_mask(6)
    assert torch.equal(w > 0, allowed.expand_as(w))


@pytest.mark.parametrize("backend", ["math", "torch", "auto"])
def test_fully_masked_rows_give_zeros_and_finite_gradients(backend) -> None:
    q = rand(2, 2, 5, 8, seed=0).requires_grad_()
    k = rand(2, 2, 6, 8, seed=1).requires_grad_()
    v = rand(2, 2, 6, 3, seed=2).requires_grad_()
    mask = torch.rand(2, 2, 5, 6, generator=torch.Generator().manual_seed(0)) > 0.4
    mask[0, 1, 2] = False  # one fully masked row
    mask[1, :, 4] = False
    out = sdpa(q, k, v, mask, backend=backend)
    assert torch.equal(out[0, 1, 2], torch.zeros(3, dtype=F64))
    assert torch.equal(out[1, :, 4], torch.zeros(2, 3, dtype=F64))
    out.square().sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[0, 1, 2], torch.zeros(8, dtype=F64))  # nothing flows from nowhere
    if backend == "math":
        _, w = sdpa(q, k, v, mask, return_weights=True)
        assert torch.equal(w[0, 1, 2], torch.zeros(6, dtype=F64))
        torch.testing.assert_close(w[0, 1, 1].sum(), torch.tensor(1.0, dtype=F64))


def test_gradcheck_math_path_with_mask_bias_and_empty_row() -> None:
    q = rand(1, 2, 4, 3, seed=0).requires_grad_()
    k = rand(1, 2, 5, 3, seed=1).requires_grad_()
    v = rand(1, 2, 5, 2, seed=2).requires_grad_()
    bias = rand(1, 2, 4, 5, seed=3).requires_grad_()
    mask = torch.ones(1, 1, 4, 5, dtype=torch.bool)
    mask[..., 1, :] = False
    mask[..., 2, 3:] = False

    def fn(q, k, v, bias):
        return sdpa(q, k, v, mask, bias=bias, is_causal=True, backend="math")

    assert torch.autograd.gradcheck(fn, (q, k, v, bias))


def test_large_logits_are_stable() -> None:
    q = rand(2, 2, 7, 16, seed=0) * 1e2
    k = rand(2, 2, 9, 16, seed=1) * 1e2  # scores around 1e4
    v = rand(2, 2, 9, 4, seed=2)
    expected = torch_oracle(q, k, v)
    for backend in ("math", "torch"):
        got = sdpa(q.float(), k.float(), v.float(), backend=backend)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=0)
    _, w = sdpa(q.float(), k.float(), v.float(), return_weights=True)
    assert torch.isfinite(w).all()


def naive_attention(q, k, v, mask=None):
    """The plain PyTorch path in the inputs' own precision: softmax(q k^T / sqrt(d)) v."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(q.dtype).min)
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale_logits", [1.0, 8.0])
def test_half_precision_error_at_most_twice_the_plain_path(dtype, scale_logits) -> None:
    q = rand(2, 4, 97, 32, seed=0) * scale_logits
    k = rand(2, 4, 97, 32, seed=1)
    v = rand(2, 4, 97, 32, seed=2)
    mask = masks.causal_mask(97)
    reference = torch_oracle(q, k, v, mask)
    lo = [t.to(dtype) for t in (q, k, v)]
    plain_err = (naive_attention(*lo, mask).double() - reference).abs().max()
    for backend in ("math", "torch"):
        got = sdpa(*lo, mask, backend=backend)
        assert got.dtype == dtype
        err = (got.double() - reference).abs().max()
        assert err <= 2 * plain_err, (backend, float(err), float(plain_err))


def test_gqa_equals_repeated_heads() -> None:
    q, k, v = rand(2, 6, 7, 8, seed=0), rand(2, 2, 9, 8, seed=1), rand(2, 2, 9, 5, seed=2)
    mask = torch.rand(2, 6, 7, 9, generator=torch.Generator().manual_seed(1)) > 0.3
    bias = rand(1, 6, 7, 9, seed=3)
    expected, w_exp = sdpa(
        q,
        k.repeat_interleave(3, 1),
        v.repeat_interleave(3, 1),
        mask,
        bias=bias,
        return_weights=True,
    )
    got, w = sdpa(q, k, v, mask, bias=bias, return_weights=True)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(w, w_exp, atol=1e-12, rtol=0)
    torch.testing.assert_close(sdpa(q, k, v, mask, backend="torch"), sdpa(q, k, v, mask))


def test_bias_function_equals_bias_tensor() -> None:
    q, k, v = rand(2, 3, 7, 8, seed=0), rand(2, 3, 9, 8, seed=1), rand(2, 3, 9, 4, seed=2)

    def distance_bias(b, h, i, j):
        return -0.1 * (h + 1) * (i - j).abs().to(F64)

    dense = masks.materialize(distance_bias, (2, 3, 7, 9))
    window = masks.window_fn(2, 1)
    dense_window = masks.materialize(window, (2, 3, 7, 9))
    expected = torch_oracle(q, k, v, dense_window, dense)
    for backend in ("math", "torch"):
        got = sdpa(q, k, v, window, bias=distance_bias, backend=backend)
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)


def test_dropout_is_reproducible_and_matches_its_definition() -> None:
    q, k, v = rand(2, 2, 6, 4, seed=0), rand(2, 2, 6, 4, seed=1), rand(2, 2, 6, 3, seed=2)
    p = 0.3
    a = sdpa(q, k, v, dropout_p=p, generator=torch.Generator().manual_seed(7))
    b = sdpa(q, k, v, dropout_p=p, generator=torch.Generator().manual_seed(7))
    c = sdpa(q, k, v, dropout_p=p, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    # the definition: drop weights with probability p, scale survivors by 1 / (1 - p)
    w = torch.softmax(q @ k.transpose(-2, -1) / 2.0, -1)
    keep = torch.rand(w.shape, generator=torch.Generator().manual_seed(7), dtype=F64) >= p
    torch.testing.assert_close(a, (w * keep / (1 - p)) @ v)
    # weights returned are the attention distribution, before dropout
    _, weights = sdpa(q, k, v, dropout_p=p, return_weights=True)
    torch.testing.assert_close(weights, w)
    assert torch.equal(sdpa(q, k, v, dropout_p=0.0), sdpa(q, k, v))


def test_auto_picks_the_fused_kernel_when_it_can() -> None:
    q = rand(1, 2, 4, 8)

    def chosen(**kw) -> str:
        return select_backend("auto", make_call(q, q, q, **kw)).name

    assert chosen() == "torch"
    assert chosen(mask=masks.causal_mask(4)) == "torch"
    assert chosen(return_weights=True) == "math"
    assert chosen(dropout_p=0.1, generator=torch.Generator()) == "math"


def test_a_backend_that_cannot_serve_says_why() -> None:
    q = rand(1, 2, 4, 8)
    with pytest.raises(BackendUnavailable, match="does not return the attention weights"):
        sdpa(q, q, q, return_weights=True, backend="torch")
    with pytest.raises(BackendUnavailable, match="generator"):
        sdpa(q, q, q, dropout_p=0.5, generator=torch.Generator(), backend="torch")


BAD_INPUTS = [
    # (description, kwargs overrides, exception, message pattern)
    ("d mismatch", dict(key=rand(2, 5, 7)), ValueError, r"same last dim d.*query \(2, 4, 8\)"),
    ("j mismatch", dict(value=rand(2, 6, 3)), ValueError, r"same length j.*key \(2, 5, 8\)"),
    (
        "mask shape",
        dict(mask=torch.ones(3, 4, 5, dtype=torch.bool)),
        ValueError,
        r"mask of shape \(3, 4, 5\) does not broadcast.*\(2, 4, 5\)",
    ),
    (
        "integer query",
        dict(query=torch.ones(2, 4, 8, dtype=torch.long)),
        TypeError,
        r"query must be a floating-point tensor, got dtype torch.int64",
    ),
    ("float mask", dict(mask=torch.ones(2, 4, 5)), TypeError, r"mask must be a bool tensor"),
    ("dropout 1", dict(dropout_p=1.0), ValueError, r"dropout_p must be a float in \[0, 1\)"),
    ("dropout neg", dict(dropout_p=-0.1), ValueError, r"dropout_p"),
    ("backend", dict(backend="flashy"), ValueError, r"backend must be one of auto, .*'flashy'"),
    ("dtype mix", dict(value=rand(2, 5, 3, dtype=torch.float32)), TypeError, r"share a dtype"),
    ("batch", dict(key=rand(3, 5, 8), value=rand(3, 5, 3)), ValueError, r"same batch dims"),
    (
        "heads",
        dict(key=rand(2, 3, 5, 8), value=rand(2, 3, 5, 3), query=rand(2, 4, 4, 8)),
        ValueError,
        r"must equal or divide query heads",
    ),
    ("not tensor", dict(query=[[1.0]]), TypeError, r"query must be a torch.Tensor"),
    ("bias dtype", dict(bias=torch.ones(4, 5, dtype=torch.long)), TypeError, r"bias must be"),
    ("scale", dict(scale=float("nan")), TypeError, r"scale must be a finite number"),
    ("fn on 3-D", dict(mask=masks.causal_fn()), ValueError, r"query must be 4-D"),
]


@pytest.mark.parametrize(
    "name, overrides, exc, pattern", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input_is_named(name, overrides, exc, pattern) -> None:
    args = dict(query=rand(2, 4, 8), key=rand(2, 5, 8), value=rand(2, 5, 3))
    args.update(overrides)
    with pytest.raises(exc, match=pattern):
        sdpa(**args)


@pytest.mark.parametrize(
    ("mask_shape", "bias_shape"), [((3, 1, 1, 9), (7, 9)), ((9,), (6, 1, 9)), ((7, 9), None)]
)
def test_gqa_with_lower_rank_mask_and_bias(mask_shape, bias_shape) -> None:
    # Regression: a padding mask (b, 1, 1, j) once lined its batch axis up with the kv heads.
    q, k, v = rand(3, 6, 7, 8, seed=0), rand(3, 2, 9, 8, seed=1), rand(3, 2, 9, 5, seed=2)
    mask = torch.rand(*mask_shape, generator=torch.Generator().manual_seed(4)) > 0.3
    bias = None if bias_shape is None else rand(*bias_shape, seed=5)
    kr, vr = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
    expected = sdpa(q, kr, vr, mask, bias=bias, backend="math")
    got = sdpa(q, k, v, mask, bias=bias, backend="math")
    assert got.shape == (3, 6, 7, 5)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", ["math", "torch"])
def test_low_rank_masks_and_bias_broadcast(backend) -> None:
    q, k, v = rand(2, 3, 4, 8, seed=0), rand(2, 3, 5, 8, seed=1), rand(2, 3, 5, 2, seed=2)
    keep = torch.tensor([True, False, True, True, False])
    bias = rand(5, seed=3)
    expected = torch_oracle(q, k, v, keep.expand(4, 5), bias.expand(4, 5))
    got = sdpa(q, k, v, keep, bias=bias, backend=backend)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def test_bad_shapes_devices_and_mask_functions_are_named_before_any_work() -> None:
    q = torch.randn(1, 2, 5, 4)
    empty = torch.randn(1, 2, 5, 0)
    with pytest.raises(ValueError, match="width d = 0, so the default scale 1/sqrt"):
        scaled_dot_product_attention(empty, empty, q)
    # With a scale, d = 0 is meaningful: every score is 0, so each row averages the values.
    out = scaled_dot_product_attention(empty, empty, q, scale=1.0)
    torch.testing.assert_close(out, q.mean(dim=2, keepdim=True).expand_as(q))
    meta_bias = torch.zeros(1, 1, 5, 5, device="meta")
    for name, kwargs in (("bias", {"bias": meta_bias}), ("mask", {"mask": meta_bias.bool()})):
        for backend in ("torch", "auto", "tiled"):
            with pytest.raises(ValueError, match=f"{name} is on device meta but"):
                scaled_dot_product_attention(q, q, q, backend=backend, **kwargs)
    float_mask = lambda b, h, i, j: (j <= i).float()  # noqa: E731  (additive? no: a mistake)
    for backend in ("torch", "auto", "math", "tiled", "chunked"):
        with pytest.raises(TypeError, match="a mask function must return a bool tensor"):
            scaled_dot_product_attention(q, q, q, float_mask, backend=backend)
    bool_bias = lambda b, h, i, j: j <= i  # noqa: E731
    for backend in ("torch", "tiled"):
        with pytest.raises(TypeError, match="a bias function must return a floating-point"):
            scaled_dot_product_attention(q, q, q, bias=bool_bias, backend=backend)


@pytest.mark.parametrize("backend", ["math", "torch", "tiled", "chunked", "auto"])
def test_overflowing_scores_and_minus_inf_rows_are_not_silent(backend: str) -> None:
    """scale=1e300 overflows the scores: the rows become NaN as in the reference, never zeros.
    An additive -inf over a whole row blocks it like a mask: zeros on every backend."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=g) for _ in range(3))
    out = scaled_dot_product_attention(q, k, v, scale=1e300, backend=backend)
    assert bool(torch.isnan(out).all())
    bias = torch.zeros(1, 2, 9, 9)
    bias[:, :, 3] = float("-inf")
    out = scaled_dot_product_attention(q, k, v, bias=bias, backend=backend)
    assert bool((out[:, :, 3] == 0).all()) and bool(torch.isfinite(out).all())
    ref = scaled_dot_product_attention(q, k, v, backend="math")
    torch.testing.assert_close(out[:, :, 4:], ref[:, :, 4:])


def _capped_sink_formula(q, k, v, *, softcap=None, sinks=None, mask=None):
    """The papers' formulas written directly, float64: Gemma 2's logit cap, then the gpt-oss
    sink in each row's denominator: w_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij))."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    e = torch.exp(s)
    if mask is not None:
        e = e * mask
    denominator = e.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denominator = denominator + torch.exp(sinks).view(1, -1, 1, 1)
    w = torch.where(denominator > 0, e / denominator, 0.0)  # a fully masked row: zeros
    return w @ v, w


@pytest.mark.parametrize("h_kv", [4, 2])
def test_softcap_and_sinks_equal_their_formulas(h_kv: int) -> None:
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, 9, 8, dtype=torch.float64, generator=g) * 3
    k = torch.randn(2, h_kv, 13, 8, dtype=torch.float64, generator=g)
    v = torch.randn(2, h_kv, 13, 5, dtype=torch.float64, generator=g)
    sinks = torch.randn(4, dtype=torch.float64, generator=g)
    mask = torch.rand(2, 1, 9, 13, generator=g) > 0.3
    mask[0, 0, 4] = False  # a fully masked row: the sink takes all its weight, output 0
    for kwargs in ({"softcap": 2.5}, {"sinks": sinks}, {"softcap": 1.5, "sinks": sinks}):
        want_out, want_w = _capped_sink_formula(q, k, v, mask=mask, **kwargs)
        out, w = scaled_dot_product_attention(
            q, k, v, mask, return_weights=True, backend="math", **kwargs
        )
        torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(w, want_w, atol=1e-12, rtol=1e-12)
        if "sinks" in kwargs:  # rows sum to less than one
            assert bool((w.sum(dim=-1) < 1).all())
            assert bool((out[0, :, 4] == 0).all())


@pytest.mark.parametrize(
    "backend, softcap",
    [(b, None) for b in ("math", "tiled", "chunked", "torch", "fused", "auto")]
    + [(b, 2.0) for b in ("math", "tiled", "chunked", "auto")],  # torch and fused decline it
)
def test_a_minus_inf_bias_masks_with_and_without_softcap(backend: str, softcap) -> None:
    """A -inf bias blocks its key on every backend, soft-capped or not; a row of -inf gives
    zeros; finite bias entries are added to the capped scores (the formula, float64)."""
    q, k, v = rand(2, 3, 6, 4, seed=3), rand(2, 3, 6, 4, seed=4), rand(2, 3, 6, 5, seed=5)
    bias = rand(2, 1, 6, 6, seed=6)
    bias[..., 1] = float("-inf")  # column 1 blocked everywhere
    bias[:, :, 4] = float("-inf")  # row 4 blocked entirely
    keep = torch.isfinite(bias)
    s = q @ k.transpose(-2, -1) / 2.0
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    e = torch.exp(s + bias.masked_fill(~keep, 0.0)) * keep
    want = e / e.sum(-1, keepdim=True).clamp_min(1e-300) @ v
    fn = lambda b, h, i, j: bias[b, 0, i, j]  # noqa: E731  (the same bias as a function)
    for form in (bias, fn):
        try:
            out = sdpa(q, k, v, bias=form, softcap=softcap, backend=backend)
        except BackendUnavailable as exc:  # the fused kernel needs a compiler
            if backend != "fused":
                raise
            pytest.skip(str(exc))
        torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)
        assert bool((out[:, :, 4] == 0).all())


# transformers models whose eager attention takes softcap= (each caps, then adds the mask)
SOFTCAPPED = ["gemma2", "gemma3", "gemma3n", "gemma4", "t5gemma", "t5gemma2", "vaultgemma"]


@pytest.mark.parametrize("model", SOFTCAPPED)
def test_softcap_with_a_float_mask_equals_transformers_eager(
    model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' eager attention of every soft-capped model caps ``q.k * scale`` and then
    adds the float attention mask: finite entries shift the capped scores, large negative ones
    block. attnkit's ``bias=`` is that mask, on every backend that caps, with gradients (the
    mask's too). Eager's softmax upcasts to float32 even in float64; only that rounding is
    removed here."""
    import types

    eager = pytest.importorskip(f"transformers.models.{model}.modeling_{model}")
    original = F.softmax

    def softmax(input, dim=None, _stacklevel=3, dtype=None):  # type: ignore[no-untyped-def]
        if input.dtype == F64 and dtype == torch.float32:
            dtype = None
        return original(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)

    monkeypatch.setattr(F, "softmax", softmax)
    module = types.SimpleNamespace(num_key_value_groups=2, training=False, head_dim=8)
    q0, k0, v0 = rand(2, 4, 7, 8, seed=7) * 3, rand(2, 2, 9, 8, seed=8), rand(2, 2, 9, 8, seed=9)
    mask0 = rand(2, 1, 7, 9, seed=10)  # finite shifts, some columns blocked as transformers does
    mask0[1, :, :, :3] = torch.finfo(F64).min
    mask0[0, :, 2, 5] = float("-inf")
    results = []
    for backend in ("eager", "math", "tiled", "chunked", "auto"):
        q, k, v, mask = (t.clone().requires_grad_() for t in (q0, k0, v0, mask0))
        if backend == "eager":
            out, _ = eager.eager_attention_forward(module, q, k, v, mask, softcap=1.5)
            out = out.transpose(1, 2)  # (b, i, h, d) -> (b, h, i, d)
        else:
            out = sdpa(q, k, v, bias=mask, softcap=1.5, scale=8**-0.5, backend=backend)
        weight = torch.linspace(-1, 1, out.numel(), dtype=F64).view_as(out)
        grads = torch.autograd.grad((out * weight).sum(), (q, k, v, mask))
        results.append((out, *(g.nan_to_num(posinf=0.0, neginf=0.0) for g in grads)))
    for got in results[1:]:
        for a, b in zip(results[0], got, strict=True):
            torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-10)


def test_softcap_and_sinks_are_validated_and_declined_by_torch() -> None:
    q = torch.randn(1, 2, 5, 4)
    for bad in (0.0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="softcap must be a positive finite number"):
            scaled_dot_product_attention(q, q, q, softcap=bad)
    with pytest.raises(ValueError, match=r"sinks must have shape \(h,\) = \(2,\)"):
        scaled_dot_product_attention(q, q, q, sinks=torch.zeros(3))
    with pytest.raises(TypeError, match="sinks must be a floating-point tensor"):
        scaled_dot_product_attention(q, q, q, sinks=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="query needs a head axis"):
        scaled_dot_product_attention(q[0], q[0], q[0], sinks=torch.zeros(5))
    for kwargs, word in (({"softcap": 3.0}, "softcap"), ({"sinks": torch.zeros(2)}, "sinks")):
        with pytest.raises(BackendUnavailable, match=f"no .*\\({word}\\)"):
            scaled_dot_product_attention(q, q, q, backend="torch", **kwargs)
        assert select_backend("auto", make_call(q, q, q, **kwargs)).name != "torch"


def test_score_mod_is_part_of_the_call() -> None:
    """A score modification (FlexAttention's score_mod) on the reference equals the formula
    written out; tiled and sparse equal the reference, gradients into a captured tensor too;
    backends without one say so by name, and auto takes one that has it."""
    from attnkit import masks
    from attnkit.backends import explain
    from attnkit.registry import BackendUnavailable

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, 37, 8, generator=g, dtype=torch.float64) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64, requires_grad=True)

    def alibi(score, b, h, i, j):
        return score - slopes[h] * (i - j).abs()

    out = scaled_dot_product_attention(q, k, v, score_mod=alibi, is_causal=True, backend="math")
    i = torch.arange(37)
    scores = q @ k.transpose(-1, -2) / 8**0.5 - slopes.view(3, 1, 1) * (i[:, None] - i).abs()
    scores = scores.masked_fill(i[None, :] > i[:, None], float("-inf"))
    want = torch.softmax(scores, -1) @ v
    assert (out - want).abs().max() < 1e-12
    (grad_math,) = torch.autograd.grad(out.sum(), slopes)
    for backend, kw in (("tiled", {"is_causal": True}), ("sparse", {"mask": masks.causal_fn()})):
        got = scaled_dot_product_attention(q, k, v, score_mod=alibi, backend=backend, **kw)
        assert (got - want).abs().max() < 1e-12, backend
        (grad,) = torch.autograd.grad(got.sum(), slopes)
        assert (grad - grad_math).abs().max() < 1e-10, backend
    for backend in ("torch", "fused", "chunked"):
        with pytest.raises(BackendUnavailable, match=r"score_mod|score modification"):
            scaled_dot_product_attention(q, k, v, score_mod=alibi, backend=backend)
    e = explain(q, k, v, score_mod=alibi, is_causal=True)
    assert e.backend in ("tiled", "math") and "score_mod" in str(e).splitlines()[0]
    auto = scaled_dot_product_attention(q, k, v, score_mod=alibi, is_causal=True)
    assert (auto - want).abs().max() < 1e-12
    with pytest.raises(TypeError, match="score_mod must be a function"):
        scaled_dot_product_attention(q, k, v, score_mod=3.0)
    with pytest.raises(ValueError, match="score_mod takes"):
        scaled_dot_product_attention(q[0], k[0], v[0], score_mod=alibi)
    with pytest.raises(ValueError, match=r"score_mod must return a tensor of the score.s shape"):
        scaled_dot_product_attention(
            q, k, v, score_mod=lambda s, b, h, i, j: s.sum(), backend="math"
        )


def _jagged(lengths, h: int = 4, d: int = 8):
    """q, k, v as nested (jagged) ``(b, h, j, d)`` tensors sharing their lengths, as torch's
    nested sdpa takes them, and each one's sequences ``(h, n, d)``."""
    g = torch.Generator().manual_seed(0)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    out = []
    for _ in range(3):
        values = torch.randn(int(offsets[-1]), h, d, generator=g)  # (sum n, h, d)
        nested = torch.nested.nested_tensor_from_jagged(values, offsets).transpose(1, 2)
        out.append((nested, [t.transpose(0, 1) for t in values.split(lengths)]))
    return out


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")  # torch's own
def test_nested_inputs_on_auto_go_to_torchs_kernel() -> None:
    """Jagged NestedTensor batches: auto sends them to torch's kernel before weighing anything
    (its cost model failed on the jagged lengths); each sequence equals the reference on it
    alone. Other backends say they take no nested inputs."""
    (q, qs), (k, ks), (v, vs) = _jagged([5, 9, 2])
    with use("auto"):  # a forced auto as well
        forced = sdpa(q, k, v, backend="math")
    for out in (sdpa(q, k, v), forced):
        assert out.is_nested
        for got, *one in zip(out.transpose(1, 2).unbind(), qs, ks, vs, strict=True):
            want = sdpa(*one, backend="math")  # (h, n, d)
            torch.testing.assert_close(got.transpose(0, 1), want, atol=1e-6, rtol=1e-5)
    for backend in ("math", "tiled", "chunked"):
        with pytest.raises(BackendUnavailable, match=r"nested \(jagged\) inputs: only torch's"):
            sdpa(q, k, v, backend=backend)


# return_lse and block_sizes: what attnkit.flex's adapter asks of one call.


@pytest.mark.parametrize("backend", ["math", "tiled", "sparse", "fused"])
def test_return_lse_is_the_log_sum_exp_of_the_visible_modified_scores(backend: str) -> None:
    """``return_lse=True``: the natural log-sum-exp of each row's scaled, capped, biased scores
    over its visible keys and its sink, ``-inf`` for a row that sees nothing, on every backend
    that serves it (grouped heads, a window that leaves row 0 nothing)."""
    if backend == "fused":
        from attnkit.backends.fused import jit

        try:
            jit.build()
        except jit.NotBuilt as reason:
            pytest.skip(f"the fused kernel cannot be built here: {reason}")
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 37, 8, dtype=F64, generator=g)
    k, v = (torch.randn(2, 2, 41, 8, dtype=F64, generator=g) for _ in range(2))
    window = masks.window_fn(7, 0, offset=-1)  # query i sees keys i - 8 .. i - 1
    kw: dict = {"mask": window}
    if backend != "fused":
        kw.update(softcap=3.0, sinks=torch.randn(4, dtype=F64, generator=g))
    if backend != "sparse":
        kw["bias"] = lambda b, h, i, j: -0.1 * (h + 1) * (i - j).abs()
    out, lse = scaled_dot_product_attention(q, k, v, backend=backend, return_lse=True, **kw)
    s = torch.einsum("bhid,bhjd->bhij", q, k.repeat_interleave(2, dim=1)) * 8**-0.5
    if "softcap" in kw:
        s = 3.0 * torch.tanh(s / 3.0)
    if "bias" in kw:
        s = s + masks.materialize(kw["bias"], s.shape)
    visible = masks.materialize(window, s.shape)
    want = torch.logsumexp(s.masked_fill(~visible, float("-inf")), dim=-1)  # (b, h, i)
    if "sinks" in kw:
        want = torch.logaddexp(want, kw["sinks"].view(1, 4, 1))
    assert lse.shape == (2, 4, 37) and not lse.requires_grad
    finite = torch.isfinite(want)
    assert not bool(finite[:, :, 0].any()) or "sinks" in kw  # row 0 sees no key
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want))
    assert (lse[finite] - want[finite]).abs().max() < 1e-10
    assert torch.allclose(out, scaled_dot_product_attention(q, k, v, backend="math", **kw))


def test_return_lse_is_refused_where_it_cannot_be_served() -> None:
    q = torch.randn(1, 2, 9, 8)
    call = make_call(q, q, q, return_lse=True)
    for name in ("torch", "chunked"):
        reason = select_backend_reason(name, call)
        assert reason is not None and "return_lse=True" in reason
    with pytest.raises(ValueError, match="return_lse and return_weights"):
        make_call(q, q, q, return_lse=True, return_weights=True)
    with pytest.raises(ValueError, match="block_sizes"):
        make_call(q, q, q, block_sizes=(0, 16))


def select_backend_reason(name: str, call) -> str | None:
    from attnkit.registry import get_backend

    return get_backend(name).why_not(call)


def test_block_sizes_are_the_tile_engines_tile_sizes() -> None:
    """``block_sizes=(16, 32)``: the tiled engine plans the call with 16-query x 32-key tiles
    (the backward's visits), and the result is the reference's."""
    from attnkit.backends.tiled.backward import visits

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 70, 8, dtype=F64, generator=g, requires_grad=True) for _ in "qkv")
    with visits() as seen:
        out = scaled_dot_product_attention(q, k, v, backend="tiled", block_sizes=(16, 32))
        out.sum().backward()
    assert {
        (j1 - j0 if j1 < 70 else 32, i1 - i0 if i1 < 70 else 16) for j0, j1, i0, i1 in seen
    } == {(32, 16)}
    ref = scaled_dot_product_attention(q, k, v, backend="math")
    assert (out - ref).abs().max() < 1e-12
