"""Backend "torch" (torch's fused kernel) equals the float64 reference math, gradients included,
where torch's own conventions differ (bottom-right causal, fully masked rows), and says why when
it cannot serve a call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnkit import masks, scaled_dot_product_attention
from attnkit.backends import BackendUnavailable
from attnkit.backends.torch_sdpa import why_not
from attnkit.functional import make_call
from oracles import qkv as _qkv

F64 = torch.float64


def _cases(i: int, j: int) -> dict[str, dict]:
    g = torch.Generator().manual_seed(11)
    dense = torch.rand(2, 1, i, j, generator=g) > 0.5
    dense[:, :, 0] = False  # a fully masked row
    return {
        "plain": {},
        "causal": {"is_causal": True},
        "dense mask with a fully masked row": {"mask": dense},
        "key mask (j,)": {"mask": torch.arange(j) % 3 != 1},
        "bias": {"bias": torch.randn(1, 4, i, j, dtype=F64, generator=g)},
        "bias, mask and causal": {
            "bias": torch.randn(2, 1, 1, j, dtype=F64, generator=g),
            "mask": dense,
            "is_causal": True,
        },
        "mask and bias functions": {
            "mask": masks.window_fn(4, 1, j - i),
            "bias": lambda b, h, i, j: -0.25 * (h + 1) * (i - j).abs(),
        },
        "scale": {"scale": 0.37},
    }


def _run(backend: str, q, k, v, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = scaled_dot_product_attention(q, k, v, backend=backend, **kw)
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return (out, *torch.autograd.grad((out * weight).sum(), (q, k, v)))


@pytest.mark.parametrize(("i", "j"), [(1, 1), (37, 37), (97, 97), (257, 257), (7, 97), (97, 7)])
def test_torch_equals_reference_forward_and_backward(i: int, j: int) -> None:
    q, k, v = _qkv(i, j)
    for name, kw in _cases(i, j).items():
        ref = _run("math", q, k, v, **kw)
        got = _run("torch", q, k, v, **kw)
        for a, b, what in zip(ref, got, ("out", "dq", "dk", "dv"), strict=True):
            assert torch.isfinite(b).all(), f"{name}: {what} not finite"
            torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-10, msg=f"{name}: {what}")


@pytest.mark.parametrize(("i", "j"), [(5, 12), (12, 5)])
def test_causal_is_bottom_right_where_torch_is_top_left(i: int, j: int) -> None:
    q, k, v = _qkv(i, j, h=2, h_kv=2)
    out = scaled_dot_product_attention(q, k, v, is_causal=True, backend="torch")
    bottom_right = masks.causal_mask(i, j)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=bottom_right)
    if i > j:  # the first i - j queries see no key: zeros, where torch's kernel gives NaN
        want[:, :, : i - j] = 0.0
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)
    top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not torch.allclose(out, top_left)  # the two alignments really differ here


def test_fully_masked_rows_give_zeros_and_zero_finite_gradients() -> None:
    q, k, v = _qkv(9, 11)
    mask = torch.ones(2, 4, 9, 11, dtype=torch.bool)
    mask[0, 1, 3] = False
    mask[1, :, 8] = False
    out, dq, dk, dv = _run("torch", q, k, v, mask=mask)
    assert torch.equal(out[0, 1, 3], torch.zeros(6, dtype=F64))
    assert torch.equal(out[1, :, 8], torch.zeros(4, 6, dtype=F64))
    assert torch.equal(dq[0, 1, 3], torch.zeros(8, dtype=F64))
    for t in (dq, dk, dv):
        assert torch.isfinite(t).all()
    everything_masked = torch.zeros(9, 11, dtype=torch.bool)
    out, *grads = _run("torch", q, k, v, mask=everything_masked)
    assert torch.equal(out, torch.zeros_like(out))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@pytest.mark.parametrize("shape", [(13, 8), (3, 13, 8), (2, 3, 2, 13, 8)])
def test_other_ranks(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(5))
    mask = torch.rand((*shape[:-1], 13), generator=torch.Generator().manual_seed(6)) > 0.3
    call = make_call(x, x, x, mask)
    if len(shape) < 3:
        assert why_not(call) == "torch's fused kernel needs at least (b, i, d) inputs"
        with pytest.raises(BackendUnavailable, match=r"at least \(b, i, d\) inputs"):
            scaled_dot_product_attention(x, x, x, mask, backend="torch")
        return
    assert why_not(call) is None
    ref = _run("math", x, x, x, mask=mask, is_causal=True)
    got = _run("torch", x, x, x, mask=mask, is_causal=True)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-10)


def test_float32_error_is_at_most_twice_the_math_backends() -> None:
    q, k, v = _qkv(97, 97)
    ref = scaled_dot_product_attention(q, k, v, is_causal=True, backend="math")
    q32, k32, v32 = q.float(), k.float(), v.float()
    errors = {}
    for backend in ("math", "torch"):
        out = scaled_dot_product_attention(q32, k32, v32, is_causal=True, backend=backend)
        assert out.dtype == torch.float32
        errors[backend] = float((out.double() - ref).abs().max())
    assert errors["torch"] <= 2 * errors["math"] + 1e-7, errors


def test_why_not_says_why_in_a_sentence() -> None:
    q, k, v = _qkv(4, 4)
    assert why_not(make_call(q, k, v)) is None
    assert why_not(make_call(q, k, v, dropout_p=0.2)) is None  # global RNG dropout is fine
    reasons = {
        "return_weights": (
            {"return_weights": True},
            "torch's fused kernel does not return the attention weights",
        ),
        "generator": (
            {"dropout_p": 0.2, "generator": torch.Generator().manual_seed(0)},
            "torch's fused kernel draws dropout from the global RNG and cannot take a generator",
        ),
    }
    for name, (kw, sentence) in reasons.items():
        assert why_not(make_call(q, k, v, **kw)) == sentence, name
        with pytest.raises(BackendUnavailable, match=sentence.split(" and ")[0]):
            scaled_dot_product_attention(q, k, v, backend="torch", **kw)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_meta_tensors_give_the_shape_as_torch_does(backend) -> None:
    q = torch.empty(2, 4, 3, 8, device="meta")
    k, v = torch.empty(2, 2, 5, 8, device="meta"), torch.empty(2, 2, 5, 6, device="meta")
    mask = torch.empty(3, 5, dtype=torch.bool, device="meta")
    for kwargs in ({}, {"is_causal": True}, {"mask": mask}):
        out = scaled_dot_product_attention(q, k, v, backend=backend, **kwargs)
        assert out.device.type == "meta" and out.shape == (2, 4, 3, 6)


def test_causal_jagged_inputs_on_the_cpu_say_why() -> None:
    offsets = torch.tensor([0, 3, 5])

    def jagged(t):
        return torch.nested.nested_tensor_from_jagged(t, offsets).transpose(1, 2)

    q = jagged(torch.randn(5, 2, 4))
    with pytest.raises(BackendUnavailable, match="is_causal with nested"):
        scaled_dot_product_attention(q, q, q, is_causal=True)
