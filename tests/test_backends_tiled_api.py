"""The tiled backend's entry points: ``tiled_attention`` and the registry entries equal the
float64 reference math (gradients included, odd lengths, GQA, other ranks); the block steps
(forward_blocks / merge / backward_blocks) reproduce whole attention over key shards; calls it
cannot serve are refused in a sentence."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from attnkit import masks, scaled_dot_product_attention
from attnkit.backends import BackendUnavailable, memory_budget, select_backend
from attnkit.backends.tiled import backward_blocks, forward_blocks, merge, tiled_attention, why_not
from attnkit.functional import make_call
from attnkit.masks import relative
from oracles import qkv as _qkv

F64 = torch.float64


def _alibi(b, h, i, j):  # ALiBi (Press et al. 2022): a per-head linear distance penalty
    return -(2.0 ** (-(h + 1.0))) * (i - j).abs()


def _relative_alibi(b, h, i, j):  # the same values, declared relative: evaluated once per call
    return _alibi(b, h, i, j)


_relative_alibi = relative(_relative_alibi)


def _buckets(b, h, i, j):  # T5-style: exact distances below 4, then log-spaced, per direction
    d = j - i
    a = d.abs()
    far = 4 + (torch.log(a.clamp(min=1).double() / 4) / 0.7).long().clamp(max=3)
    return torch.sin(1.0 + h + 3.0 * torch.where(a < 4, a, far) + 0.5 * (d > 0).double())


_relative_buckets = relative(lambda b, h, i, j: _buckets(b, h, i, j))


def _cases(i: int, j: int) -> dict[str, dict]:
    g = torch.Generator().manual_seed(7)
    dense = torch.rand(2, 1, i, j, generator=g) > 0.6
    dense[:, :, 0] = False  # a fully masked row
    return {
        "plain": {},
        "causal bottom-right": {"is_causal": True},
        "causal top-left": {"mask": masks.causal_fn(0)},
        "window fn": {"mask": masks.window_fn(5, 2, j - i)},
        "alibi fn": {"bias": _alibi, "is_causal": True},
        "relative alibi fn": {"bias": _relative_alibi, "is_causal": True},
        "relative buckets, top-left": {"bias": _relative_buckets, "mask": masks.causal_fn(0)},
        "relative fn and dense mask": {"bias": _relative_buckets, "mask": dense},
        "relative fn and unstructured fn": {
            "bias": _relative_buckets,
            "mask": lambda b, h, i, j: (i * 7 + j * 3 + b) % 5 != 0,
        },
        "dense mask and bias": {
            "mask": dense,
            "bias": torch.randn(1, 4, i, j, dtype=F64, generator=g),
        },
        "padding mask": {"mask": masks.padding_mask(torch.tensor([j, max(j - 3, 0)]), j)},
        "unstructured fn": {"mask": lambda b, h, i, j: (i * 7 + j * 3 + b) % 5 != 0},
    }


@pytest.mark.parametrize(("i", "j"), [(1, 1), (7, 7), (97, 97), (257, 257), (7, 97), (97, 7)])
def test_tiled_equals_reference_forward_and_backward(i: int, j: int) -> None:
    for name, kw in _cases(i, j).items():
        q, k, v = (t.requires_grad_() for t in _qkv(i, j))
        results = []
        for backend in ("math", "tiled"):
            out = scaled_dot_product_attention(q, k, v, backend=backend, **kw)
            weight = torch.linspace(-1, 1, out.numel(), dtype=F64).view_as(out)
            grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
            results.append((out, *grads))
        for a, b_, what in zip(*results, ("out", "dq", "dk", "dv"), strict=True):
            assert torch.isfinite(b_).all(), f"{name}: {what} not finite"
            torch.testing.assert_close(b_, a, atol=1e-12, rtol=1e-10, msg=f"{name}: {what}")


def test_small_tiles_and_gradcheck() -> None:
    """Tiles much smaller than the inputs exercise the online softmax across many tiles."""
    q, k, v = (t.requires_grad_() for t in _qkv(7, 6, h=2, h_kv=1, d=3, dv=2, b=1))
    bias = torch.randn(1, 2, 7, 6, dtype=F64, requires_grad=True)
    mask = torch.rand(1, 1, 7, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[..., 2, :] = False

    def with_bias(q, k, v, bias):
        return tiled_attention(q, k, v, mask=mask, bias=bias, block_q=3, block_k=4)

    assert torch.autograd.gradcheck(with_bias, (q, k, v, bias))
    for kw in (
        {"is_causal": True},
        {"mask_fn": masks.window_fn(3, 1, 2), "bias_fn": lambda b, h, i, j: 0.3 * (j - i)},
        {"mask_fn": masks.window_fn(3, 1, 2), "bias_fn": _relative_buckets},
        {"bias_fn": _relative_alibi, "is_causal": True},
    ):
        assert torch.autograd.gradcheck(
            lambda q, k, v, kw=kw: tiled_attention(q, k, v, block_q=3, block_k=4, **kw), (q, k, v)
        )


def test_low_precision_and_other_ranks() -> None:
    q, k, v = (t.float() for t in _qkv(50, 61, h=2, h_kv=2))
    ref = scaled_dot_product_attention(q, k, v, is_causal=True, backend="math")
    out = scaled_dot_product_attention(q, k, v, is_causal=True, backend="tiled")
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    qh, kh, vh = q.bfloat16(), k.bfloat16(), v.bfloat16()
    ref = scaled_dot_product_attention(qh, kh, vh, backend="math")
    torch.testing.assert_close(
        scaled_dot_product_attention(qh, kh, vh, backend="tiled"), ref, atol=2e-2, rtol=2e-2
    )
    for shape in ((13, 8), (3, 13, 8), (2, 3, 2, 13, 8)):  # (i, d), (h, i, d), (a, b, h, i, d)
        x = torch.randn(shape, dtype=F64)
        m = torch.rand((*shape[:-1], 13)) > 0.2
        ref = scaled_dot_product_attention(x, x, x, m, backend="math")
        out = scaled_dot_product_attention(x, x, x, m, backend="tiled")
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)


def test_unsupported_options_name_themselves() -> None:
    q, k, v = _qkv(4, 4)
    with pytest.raises(BackendUnavailable, match="dropout_p"):
        scaled_dot_product_attention(q, k, v, dropout_p=0.1, backend="tiled")
    with pytest.raises(BackendUnavailable, match="return_weights"):
        scaled_dot_product_attention(q, k, v, return_weights=True, backend="tiled")
    slope = torch.tensor(0.5, requires_grad=True)
    with pytest.raises(BackendUnavailable, match="bias function"):
        scaled_dot_product_attention(
            q, k, v, bias=lambda b, h, i, j: slope * (j - i), backend="tiled"
        )


@pytest.mark.parametrize(("n_shards", "bias_fn"), [(2, _alibi), (3, _alibi), (3, _relative_alibi)])
def test_block_step_over_key_shards_equals_whole_attention(n_shards: int, bias_fn) -> None:
    """What ring attention does: forward_blocks per K/V shard with global offsets, merge,
    then backward_blocks per shard with the global out and lse."""
    q, k, v = _qkv(37, 37)
    q_off = 0
    causal = masks.causal_fn(0)
    bounds = torch.linspace(0, 37, n_shards + 1).long().tolist()
    out = lse = None
    for a, b in itertools.pairwise(bounds):
        o, l = forward_blocks(
            q, k[:, :, a:b], v[:, :, a:b], scale=0.3, mask_fn=causal, bias_fn=bias_fn,
            q_offset=q_off, k_offset=a, block_q=8, block_k=8,
        )  # fmt: skip
        out, lse = (o, l) if out is None else merge(out, lse, o, l)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = scaled_dot_product_attention(
        qr, kr, vr, bias=bias_fn, mask=causal, scale=0.3, backend="math"
    )
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), grad)
    dq = torch.zeros_like(q)
    dks, dvs = [], []
    for a, b in itertools.pairwise(bounds):
        gq, gk, gv = backward_blocks(
            q, k[:, :, a:b], v[:, :, a:b], out, lse, grad, scale=0.3, mask_fn=causal,
            bias_fn=bias_fn, k_offset=a, block_q=8, block_k=8,
        )  # fmt: skip
        dq += gq
        dks.append(gk)
        dvs.append(gv)
    for mine, theirs in zip((dq, torch.cat(dks, 2), torch.cat(dvs, 2)), ref_grads, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-12, rtol=1e-10)


def test_auto_routes_functions_to_tiled_within_the_budget_and_plain_calls_to_torch() -> None:
    q, k, v = (t.float() for t in _qkv(600, 600, b=1))
    assert select_backend("auto", make_call(q, k, v)).name == "torch"
    assert select_backend("auto", make_call(q, k, v, is_causal=True)).name == "torch"
    seen = []

    def recording(b, h, i, j):
        seen.append(i.shape[-2] * j.shape[-1])
        return (i - j).abs() < 300

    call = make_call(q, k, v, recording)
    with memory_budget(600 * 600 - 1):  # too small for the mask as a tensor
        assert select_backend("auto", call).name == "tiled"
        out = scaled_dot_product_attention(q, k, v, recording)
    assert max(seen) < 600 * 600  # evaluated per tile: no n x n tensor was built
    ref = scaled_dot_product_attention(q, k, v, masks.materialize(recording, (1, 1, 600, 600)))
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    # A bias function with learnable parameters cannot be differentiated by tiled: auto falls
    # back to torch, which materialises it, and the gradient reaches the parameter.
    slope = torch.tensor(0.1, requires_grad=True)
    call = make_call(q, k, v, bias=lambda b, h, i, j: -slope * (i - j).abs())
    assert select_backend("auto", call).name == "torch"


def test_why_not_says_why_in_a_sentence() -> None:
    q, k, v = _qkv(4, 4)
    assert why_not(make_call(q, k, v)) is None
    assert why_not(make_call(q, k, v, masks.causal_fn(0), bias=_alibi)) is None
    gen = torch.Generator().manual_seed(0)
    assert why_not(make_call(q, k, v, dropout_p=0.1, generator=gen)) == (
        "dropout_p=0.1: the tiled backend cannot replay a dropout mask tile by tile in its "
        "backward; use backend='math' or 'torch' for dropout"
    )
    assert why_not(make_call(q, k, v, return_weights=True)) == (
        "return_weights=True: the tiled backend never builds the attention weights"
    )
    with torch.no_grad():  # without autograd a learnable bias function is only a function
        slope = torch.tensor(0.5, requires_grad=True)
        assert why_not(make_call(q, k, v, bias=lambda b, h, i, j: slope * (j - i))) is None
    ref = scaled_dot_product_attention(q, k, v, masks.causal_fn(0), backend="math")
    out = scaled_dot_product_attention(q, k, v, masks.causal_fn(0), backend="tiled")
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)


def test_leading_dims_with_a_broadcast_mask_and_bias() -> None:
    """Inputs with two leading dims (a, b, h, i, d) and a mask/bias broadcast over them."""
    g = torch.Generator().manual_seed(12)
    q = torch.randn(3, 2, 4, 37, 8, dtype=F64, generator=g)
    k = torch.randn(3, 2, 2, 45, 8, dtype=F64, generator=g)
    v = torch.randn(3, 2, 2, 45, 6, dtype=F64, generator=g)
    mask = torch.rand(1, 2, 1, 37, 45, generator=g) > 0.3
    bias = torch.randn(3, 1, 4, 1, 45, dtype=F64, generator=g)
    for kw in ({"mask": mask}, {"mask": mask, "bias": bias, "is_causal": True}):
        ref = scaled_dot_product_attention(q, k, v, backend="math", **kw)
        out = scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("h_kv", [4, 2])
def test_softcap_and_sinks_equal_the_reference_with_gradients(h_kv: int) -> None:
    """Soft-capped logits and attention sinks through the tiled forward and its recomputing
    backward (the sinks' gradient included), with masks, causal, ALiBi and a bias tensor."""
    from attnkit import alibi_fn

    q, k, v = _qkv(37, 45, h_kv=h_kv)
    sinks = torch.linspace(-1.0, 2.0, 4, dtype=F64)
    cases = [
        {},
        {"is_causal": True},
        {"bias": alibi_fn(4)},
        {"mask": masks.window_fn(5)},
        {"bias": torch.randn(1, 4, 37, 45, dtype=F64)},
    ]
    for case in cases:
        for extra in ({"softcap": 3.0}, {"sinks": sinks}, {"softcap": 2.0, "sinks": sinks}):
            results = []
            for backend in ("math", "tiled", "auto"):
                leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
                kwargs = {**case, **extra}
                if "sinks" in kwargs:
                    kwargs["sinks"] = leaves[3]
                out = scaled_dot_product_attention(*leaves[:3], backend=backend, **kwargs)
                weight = torch.linspace(-1, 1, out.numel(), dtype=F64).view_as(out)
                used = leaves if "sinks" in kwargs else leaves[:3]
                results.append((out, *torch.autograd.grad((out * weight).sum(), used)))
            for got in results[1:]:
                for a, b_ in zip(results[0], got, strict=True):
                    torch.testing.assert_close(b_, a, atol=1e-12, rtol=1e-10)


def test_score_mod_and_its_captured_tensors_get_exact_gradients() -> None:
    """A FlexAttention-style score_mod rewrites each tile's scores; the backward goes through it
    (non-additive mods too) and into the tensors it captures: a learned relative table and
    per-head slopes, against dense float64 autograd of the same formula (GQA, causal)."""
    q0, k0, v0 = _qkv(37, 45)
    n, m = 37, 45
    table = torch.randn(4, 2 * 64 + 1, dtype=F64, generator=torch.Generator().manual_seed(5))
    slopes = torch.linspace(0.1, 0.8, 4, dtype=F64)

    def mods(table, slopes):
        def relative_table(s, b, h, i, j):
            return s + table[h, (j - i).clamp(-64, 64) + 64]

        def alibi_capped(s, b, h, i, j):  # non-additive: a cap after a learned ALiBi
            return 5.0 * torch.tanh((s - slopes[h] * (i - j).abs()) / 5.0)

        return relative_table, alibi_capped

    def dense(mod, q, k, v, causal):
        kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        s = q @ kk.transpose(-2, -1) / math.sqrt(q.shape[-1])
        i, j = torch.arange(n).view(1, 1, -1, 1), torch.arange(m).view(1, 1, 1, -1)
        s = mod(s, torch.arange(2).view(-1, 1, 1, 1), torch.arange(4).view(1, -1, 1, 1), i, j)
        if causal:
            s = s.masked_fill(j > i + (m - n), float("-inf"))
        return torch.softmax(s, dim=-1) @ vv

    weight = torch.randn(2, 4, n, 6, dtype=F64, generator=torch.Generator().manual_seed(6))
    for which in range(2):
        for causal in (False, True):
            results = []
            for route in ("dense", "tiled"):
                q, k, v, tab, slo = (
                    t.clone().requires_grad_() for t in (q0, k0, v0, table, slopes)
                )
                mod = mods(tab, slo)[which]
                if route == "dense":
                    out = dense(mod, q, k, v, causal)
                else:
                    out = tiled_attention(
                        q, k, v, score_mod=mod, is_causal=causal, block_q=16, block_k=16
                    )
                used = (q, k, v, tab) if which == 0 else (q, k, v, slo)
                results.append((out, *torch.autograd.grad((out * weight).sum(), used)))
            for a, b_ in zip(*results, strict=True):
                torch.testing.assert_close(b_, a, atol=1e-12, rtol=1e-10)


def test_score_mod_that_changes_the_shape_is_named_and_lse_is_returned() -> None:
    q, k, v = _qkv(9, 11)
    with pytest.raises(ValueError, match=r"score_mod must return a tensor of the score's shape"):
        tiled_attention(q, k, v, score_mod=lambda s, b, h, i, j: s.sum(dim=-1))
    out, lse = tiled_attention(q, k, v, return_lse=True)
    g = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(g, dim=1).transpose(-2, -1) / math.sqrt(q.shape[-1])
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ v.repeat_interleave(g, dim=1))


def test_tiled_attention_checks_its_arguments_before_any_work() -> None:
    q = torch.randn(1, 2, 9, 8)
    cases = [
        ({"block_q": -1}, ValueError, "block_q must be a positive int"),
        ({"block_k": 0}, ValueError, "block_k must be a positive int"),
        ({"mask_fn": 3}, TypeError, "mask_fn must be a function"),
        ({"scale": float("nan")}, TypeError, "scale must be a finite number"),
        ({"softcap": -1.0}, ValueError, "softcap must be a positive finite number"),
        ({"mask": torch.ones(9, 9)}, TypeError, "mask must be a bool tensor"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            tiled_attention(q, q, q, **kwargs)
    with pytest.raises(TypeError, match="query must be a floating-point tensor"):
        tiled_attention(q.int(), q.int(), q.int())
    with pytest.raises(ValueError, match="same last dim d"):
        tiled_attention(q, q[..., :4], q)
    with pytest.raises(ValueError, match="4-D inputs"):
        tiled_attention(q[0], q[0], q[0])


@pytest.mark.parametrize(("d", "dv"), [(0, 3), (5, 0)])
def test_zero_width_heads_equal_the_reference(d: int, dv: int) -> None:
    """d = 0: every score is 0, so each row averages its visible values; dv = 0: empty rows."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, d, dtype=F64, generator=g)
    k = torch.randn(2, 2, 7, d, dtype=F64, generator=g)
    v = torch.randn(2, 2, 7, dv, dtype=F64, generator=g, requires_grad=True)
    for causal in (False, True):
        out = scaled_dot_product_attention(q, k, v, is_causal=causal, scale=1.0, backend="tiled")
        ref = scaled_dot_product_attention(q, k, v, is_causal=causal, scale=1.0, backend="math")
        assert out.shape == ref.shape == (2, 4, 5, dv)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
