"""The shared numeric facts: the compute dtype of each float dtype, the blocked minimum (finite,
the dtype's own minimum, so a fully blocked row gives zeros, not NaN), autocast's policy, and
where NaN and infinities go on every backend."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnkit import alibi_fn, masks, scaled_dot_product_attention
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


# Every backend against the reference on hostile inputs: NaN, +-inf, fully masked rows, empty
# dimensions, autocast. The reference (backend="math") defines where NaN goes; every backend must
# put it exactly there and agree on every finite value.

BACKENDS = ["torch", "tiled", "chunked", "auto"]
SPECIAL = [float("nan"), float("inf"), float("-inf")]


@st.composite
def hostile_calls(draw):
    b = draw(st.sampled_from([0, 1, 2]))
    h_kv = draw(st.sampled_from([1, 2]))
    h = h_kv * draw(st.sampled_from([1, 2]))
    i = draw(st.sampled_from([0, 1, 5, 37]))
    j = draw(st.sampled_from([0, 1, 7, 40]))
    d, dv = draw(st.sampled_from([1, 8])), draw(st.sampled_from([1, 6]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, i, d, generator=g)
    k = torch.randn(b, h_kv, j, d, generator=g)
    v = torch.randn(b, h_kv, j, dv, generator=g)
    tensors = {"q": q, "k": k, "v": v}
    kwargs: dict = {}
    kind = draw(st.sampled_from(["none", "mask", "causal", "bias", "bias_fn", "window_fn"]))
    if kind == "mask":
        mask = torch.rand(b, 1, i, j, generator=g) > 0.4
        if i > 0:
            mask[:, :, draw(st.integers(0, i - 1))] = False  # a fully masked row
        kwargs["mask"] = mask
    elif kind == "causal":
        kwargs["is_causal"] = True
    elif kind == "bias":
        kwargs["bias"] = torch.randn(1, h, i, j, generator=g)
        tensors["bias"] = kwargs["bias"]
    elif kind == "bias_fn":
        kwargs["bias"] = alibi_fn(h)
    else:
        kwargs["mask"] = masks.window_fn(draw(st.sampled_from([0, 3, 50])))
    for _ in range(draw(st.integers(0, 3))):  # special values at random places
        name = draw(st.sampled_from(sorted(tensors)))
        t = tensors[name]
        if t.numel():
            t.view(-1)[draw(st.integers(0, t.numel() - 1))] = draw(st.sampled_from(SPECIAL))
    return q, k, v, kwargs


def _agree(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: NaN in other places"
    torch.testing.assert_close(got, want, atol=tol, rtol=tol, equal_nan=True, msg=what)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=hostile_calls(), cast=st.sampled_from([None, torch.bfloat16, torch.float16]))
def test_every_backend_puts_nan_where_the_reference_does(call, cast) -> None:
    q, k, v, kwargs = call
    backends = [*BACKENDS, "sparse"] if callable(kwargs.get("mask")) else BACKENDS
    context = torch.autocast("cpu", dtype=cast) if cast else contextlib.nullcontext()
    tol = 1e-5 if cast is None else 2e-2
    with context:
        want = scaled_dot_product_attention(q, k, v, backend="math", **kwargs)
        for backend in backends:
            got = scaled_dot_product_attention(q, k, v, backend=backend, **kwargs)
            _agree(got, want, tol, f"{backend}, autocast {cast}, {sorted(kwargs)}")
    assert want.dtype == (cast or q.dtype)  # autocast's policy for attention


@pytest.mark.parametrize("backend", ["math", "torch", "tiled", "chunked", "auto"])
@pytest.mark.parametrize("special", SPECIAL)
@pytest.mark.parametrize("mask_shape", [(5, 1), (2, 1, 5, 1)])
def test_a_mask_broadcast_over_keys_keeps_non_finite_values_in_their_rows(
    backend: str, special: float, mask_shape: tuple[int, ...]
) -> None:
    """A mask of shape (..., i, 1) says per query whether it sees every key or none. A NaN or
    infinity in v reaches exactly the output column of every row that sees keys; a row that
    sees nothing is zeros. The expectation is written out by hand in float64: softmax of the
    scores times v with the bad entry read as 0, then NaN in its column for the seeing rows."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64)  # 4 query heads ...
    k = torch.randn(2, 2, 7, 8, generator=g, dtype=torch.float64)  # ... share 2 kv heads
    v = torch.randn(2, 2, 7, 6, generator=g, dtype=torch.float64)
    v[1, 0, 4, 2] = special
    sees = torch.tensor([True, False, True, True, False])  # query 1 and 4 see no key
    mask = sees.reshape(5, 1).expand(*mask_shape[:-2], 5, 1).clone()
    out = scaled_dot_product_attention(q, k, v, mask, backend=backend)

    kv = torch.repeat_interleave(torch.arange(2), 2)  # query head -> its kv head
    weights = torch.softmax(q @ k[:, kv].transpose(-2, -1) / math.sqrt(8), dim=-1)
    want = weights @ v[:, kv].nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # (2, 4, 5, 6)
    want[1, 0:2, :, 2] = float("nan")  # query heads 0 and 1 read kv head 0
    want[:, :, ~sees] = 0.0
    assert torch.equal(torch.isnan(out), torch.isnan(want))
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12, equal_nan=True)


def _ref64(q, k, v, **kwargs):
    """The float64 reference on the same (already rounded) inputs."""
    return scaled_dot_product_attention(
        q.double(), k.double(), v.double(), backend="math", **kwargs
    )


@pytest.mark.parametrize("cast", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["plain", "causal", "mask", "bias", "alibi_fn", "window_fn"])
def test_autocast_error_is_at_most_twice_torchs_forward_and_backward(cast, case) -> None:
    """Under CPU autocast every backend runs (forward and backward), returns the autocast dtype,
    and its error against float64 is at most twice that of torch's own kernel under the same
    autocast, for the output and for every gradient."""
    g = torch.Generator().manual_seed(7)
    n, h = 97, 4
    q0, k0, v0 = (torch.randn(2, h, n, 32, generator=g) for _ in range(3))
    mask = torch.rand(2, 1, n, n, generator=g) > 0.3
    bias = torch.randn(1, h, n, n, generator=g)
    kwargs = {
        "plain": {},
        "causal": {"is_causal": True},
        "mask": {"mask": mask},
        "bias": {"bias": bias},
        "alibi_fn": {"bias": alibi_fn(h)},
        "window_fn": {"mask": masks.window_fn(20)},
    }[case]
    dense = {  # the same call as torch's kernel takes it
        "mask": kwargs.get("mask"),
        "bias": kwargs.get("bias"),
        "is_causal": kwargs.get("is_causal", False),
    }
    if callable(dense["mask"]):
        dense["mask"] = masks.materialize(dense["mask"], (1, 1, n, n))
    if callable(dense["bias"]):
        dense["bias"] = masks.materialize(dense["bias"], (1, h, n, n)).float()
    weight = torch.randn(2, h, n, 32, generator=g)

    def run(fn):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        with torch.autocast("cpu", dtype=cast):
            out = fn(q, k, v)
        (out.double() * weight).sum().backward()
        return out, q.grad, k.grad, v.grad

    def torch_kernel(q, k, v):
        attn_mask = dense["mask"]
        if dense["bias"] is not None:
            attn_mask = (
                dense["bias"]
                if attn_mask is None
                else dense["bias"].masked_fill(~attn_mask, float("-inf"))
            )
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=dense["is_causal"]
        )

    # The float64 reference on inputs rounded as autocast rounds them.
    q, k, v = (t.to(cast).double().requires_grad_() for t in (q0, k0, v0))
    out64 = _ref64(q, k, v, **kwargs)
    (out64 * weight.double()).sum().backward()
    want = (out64, q.grad, k.grad, v.grad)
    theirs = run(torch_kernel)
    bound = [
        2 * (t.double() - w).abs().max().item() + 1e-6 for t, w in zip(theirs, want, strict=True)
    ]
    backends = ["math", "torch", "tiled", "chunked", "auto"]
    if case == "window_fn":
        backends.append("sparse")
    for backend in backends:
        ours = run(
            lambda q, k, v, b=backend: scaled_dot_product_attention(q, k, v, backend=b, **kwargs)
        )
        assert ours[0].dtype == cast, backend
        for name, t, w, limit in zip(("out", "dq", "dk", "dv"), ours, want, bound, strict=True):
            err = (t.double() - w).abs().max().item()
            assert err <= limit, f"{backend} {name}: error {err:.2e} > 2x torch's ({limit:.2e})"
