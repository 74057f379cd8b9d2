"""The fused backend (C++ kernel of the tiled algorithm): everything the tiled backend's tests
check, against the same oracles (the float64 reference math, gradients included, odd lengths,
GQA, other ranks); NaN where the reference puts it; its error against float64 at most twice
that of torch's own kernel in the same precision; masks and biases read as exact structure;
calls it cannot serve refused in a sentence.

The kernel is built once per source version (``fused.build``, cached in the user's cache
folder): the first run of this file compiles it (about a minute), later runs load it."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnkit import alibi_fn, masks, scaled_dot_product_attention
from attnkit.backends import BackendUnavailable
from attnkit.backends.fused import api, fused_attention, jit, plan
from attnkit.backends.sparse import block_sparse, strided_layout
from attnkit.functional import make_call
from oracles import qkv as _qkv
from test_backends_tiled_api import _cases
from test_numerics import _agree, hostile_calls

F64 = torch.float64


@pytest.fixture(scope="module", autouse=True)
def kernel():
    """Build (or load) the kernel once; without a compiler these tests cannot run here."""
    try:
        return jit.build()
    except jit.NotBuilt as reason:
        pytest.skip(f"the fused kernel is unavailable here: {reason}")


def _with_grads(backend: str, q, k, v, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = scaled_dot_product_attention(*leaves, backend=backend, **kw)
    weight = torch.linspace(-1, 1, out.numel(), dtype=F64).view_as(out)
    return (out, *torch.autograd.grad((out.double() * weight).sum(), leaves))


@pytest.mark.parametrize(("i", "j"), [(1, 1), (7, 7), (97, 97), (257, 257), (7, 97), (97, 7)])
def test_fused_equals_reference_on_every_tiled_case(i: int, j: int) -> None:
    """The tiled API tests' cases (causal both alignments, windows, ALiBi and T5-style buckets
    declared relative or not, dense masks and biases, padding, unstructured functions)."""
    q, k, v = _qkv(i, j)
    for name, kw in _cases(i, j).items():
        want = _with_grads("math", q, k, v, **kw)
        got = _with_grads("fused", q, k, v, **kw)
        for a, b, what in zip(want, got, ("out", "dq", "dk", "dv"), strict=True):
            assert torch.isfinite(b).all(), f"{name}: {what} not finite"
            torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-10, msg=f"{name}: {what}")


def test_many_small_tiles_and_skipped_tiles(monkeypatch) -> None:
    """Tiles much smaller than the inputs (online softmax over many tiles, the band's partial
    tiles) and steep ALiBi heads whose distant tiles are skipped as negligible."""
    monkeypatch.setattr(api, "BLOCK_Q", 4)
    monkeypatch.setattr(api, "BLOCK_K", 6)
    q, k, v = _qkv(37, 45)
    steep = masks.relative(lambda b, h, i, j: -8.0 * (h + 1.0) * (i - j).abs())
    for kw in (
        {"is_causal": True},
        {"mask": masks.window_fn(3, 1, 2), "bias": _cases(37, 45)["relative alibi fn"]["bias"]},
        {"bias": steep},
        {"bias": steep, "mask": masks.causal_fn(0)},
    ):
        pairs = zip(
            _with_grads("math", q, k, v, **kw), _with_grads("fused", q, k, v, **kw), strict=True
        )
        for a, b in pairs:
            torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("block", [8, 7])
def test_block_layouts_skip_empty_tiles_exactly(block: int) -> None:
    """A block-sparse layout is read as a layout (tiles inside its cells), also for a block
    that no even tile divides (bfloat16 then computes in float32)."""
    n = 6 * block
    layout = strided_layout(6, 1, 3)
    fn = block_sparse(layout, block)
    q, k, v = _qkv(n, n)
    for kw in ({"mask": fn}, {"mask": fn, "is_causal": True}):
        pairs = zip(
            _with_grads("math", q, k, v, **kw), _with_grads("fused", q, k, v, **kw), strict=True
        )
        for a, b in pairs:
            torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-10)
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    want = scaled_dot_product_attention(qb.double(), kb.double(), vb.double(), fn, backend="math")
    got = scaled_dot_product_attention(qb, kb, vb, fn, backend="fused")
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)


def test_bias_tensor_gradient_is_summed_to_its_shape() -> None:
    q, k, v = _qkv(33, 40)
    for shape in ((1, 4, 33, 40), (2, 1, 1, 40), (4, 1, 40), (2, 4, 1, 1)):
        bias = torch.randn(shape, dtype=F64, requires_grad=True)
        grads = []
        for backend in ("math", "fused"):
            out = scaled_dot_product_attention(q, k, v, bias=bias, is_causal=True, backend=backend)
            grads.append(torch.autograd.grad(out.square().sum(), bias)[0])
        assert grads[1].shape == bias.shape
        torch.testing.assert_close(grads[1], grads[0], atol=1e-12, rtol=1e-10)


def test_other_ranks_and_broadcast_leading_dims() -> None:
    for shape in ((13, 8), (3, 13, 8), (2, 3, 2, 13, 8)):  # (i, d), (h, i, d), (a, b, h, i, d)
        x = torch.randn(shape, dtype=F64)
        m = torch.rand((*shape[:-1], 13)) > 0.2
        want = scaled_dot_product_attention(x, x, x, m, backend="math")
        torch.testing.assert_close(
            scaled_dot_product_attention(x, x, x, m, backend="fused"), want, atol=1e-12, rtol=1e-10
        )
    g = torch.Generator().manual_seed(12)
    q = torch.randn(3, 2, 4, 37, 8, dtype=F64, generator=g)
    k = torch.randn(3, 2, 2, 45, 8, dtype=F64, generator=g)
    v = torch.randn(3, 2, 2, 45, 6, dtype=F64, generator=g)
    mask = torch.rand(1, 2, 1, 37, 45, generator=g) > 0.3
    bias = torch.randn(3, 1, 4, 1, 45, dtype=F64, generator=g)
    kw = {"mask": mask, "bias": bias, "is_causal": True}
    want = scaled_dot_product_attention(q, k, v, backend="math", **kw)
    got = scaled_dot_product_attention(q, k, v, backend="fused", **kw)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_fully_masked_rows_give_zero_output_zero_gradient_and_blocked_lse() -> None:
    q, k, v = (t.requires_grad_() for t in _qkv(6, 5))
    out, lse = fused_attention(q, k, v, is_causal=True, return_lse=True)  # i > j: row 0 sees none
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    assert bool((lse[:, :, 0] == torch.finfo(F64).min).all())
    (gq,) = torch.autograd.grad(out.sum(), q)
    assert torch.isfinite(gq).all() and torch.equal(gq[:, :, 0], torch.zeros_like(gq[:, :, 0]))


def test_nan_values_laid_out_as_a_fused_projection_stay_in_their_rows() -> None:
    """q, k, v as views of one (b, n, 3, h, d) projection (strided, not contiguous), NaN from
    token 7 on in batch 1, causal with ALiBi (a transformer's second layer after a NaN token):
    rows 0..6 stay finite, as in the reference. Reading the NaN positions of v with v's strides
    as if contiguous put NaN into rows 0 and 1."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 40, 3, 4, 8, generator=g)
    qkv[1, 7:] = float("nan")
    q, k, v = (qkv[:, :, x].transpose(1, 2) for x in range(3))  # (b, h, n, d), strided
    assert not v.is_contiguous()
    kw = {"bias": alibi_fn(4), "is_causal": True}
    want = scaled_dot_product_attention(q, k, v, backend="math", **kw)
    got = scaled_dot_product_attention(q, k, v, backend="fused", **kw)
    assert not bool(torch.isnan(got[1, :, :7]).any())
    _agree(got, want, 1e-5, "strided q, k, v with NaN rows")


@pytest.mark.parametrize("where", ["last key", "first key", "one query"])
def test_a_nan_far_away_reaches_every_row_it_should_with_skipping(where: str) -> None:
    """ALiBi with steep heads lets the kernel skip distant key tiles as negligible; a NaN in a
    key (or a query) must still reach every row the reference puts it in: bounds over a NaN
    say nothing, so the kernel does not skip where q or k hold one (a NaN in the last key
    used to be lost in the rows that skipped its tile)."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 2048, 16, generator=g) for _ in range(3))
    if where == "last key":
        k[0, 1, -1, 3] = float("nan")
    elif where == "first key":
        k[0, 0, 0, 0] = float("nan")
    else:
        q[0, 1, 1000, 5] = float("nan")
    slopes = torch.tensor([1.0, 0.5])
    bias = masks.relative(lambda b, h, i, j: -slopes[h] * (i - j).abs())
    want = scaled_dot_product_attention(q, k, v, bias=bias, backend="math")
    got = scaled_dot_product_attention(q, k, v, bias=bias, backend="fused")
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert int(torch.isnan(want).any(-1).sum()) == (2048 if "key" in where else 1)
    _agree(got, want, 1e-5, where)


@pytest.mark.parametrize("scale", [-0.3, -1.0])
def test_a_negative_scale_with_a_relative_bias(scale: float) -> None:
    """Skipping bounds |scale q.k| by |scale| |q| |k|: with a negative scale the outputs and
    gradients equal the float64 reference (the bound's sign was wrong: outputs 4.8 off)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, 300, 32, generator=g, dtype=F64) * 3 for _ in range(3))
    kw = {"bias": alibi_fn(4), "scale": scale, "is_causal": True}
    want = _with_grads("math", q, k, v, **kw)
    got = _with_grads("fused", q, k, v, **kw)
    for what, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert (a - b).abs().max() < 1e-10, what


@pytest.mark.parametrize("layout", ["transposed heads", "sliced", "expanded heads"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_input_layout_on_every_dtype(layout: str, dtype) -> None:
    """q, k, v as a module hands them over (a (b, n, h, d) projection with heads transposed,
    a slice of a wider tensor, heads expanded with stride 0), even sizes, causal and ALiBi:
    the same result as contiguous copies, forward and backward (the packed bfloat16 path
    refused a non-contiguous query)."""
    g = torch.Generator().manual_seed(2)
    b, n, h, d = 2, 200, 4, 64

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    if layout == "transposed heads":
        q, k, v = (randn(b, n, h, d).transpose(1, 2) for _ in range(3))
    elif layout == "sliced":
        q, k, v = (randn(b, h, n, 2 * d)[..., ::2] for _ in range(3))
    else:
        q = randn(b, h, n, d).transpose(-1, -2).contiguous().transpose(-1, -2)
        k, v = (randn(b, 1, n, d).expand(b, h, n, d) for _ in range(2))
    assert not q.is_contiguous() and not k.is_contiguous()
    for kw in ({"is_causal": True}, {"bias": alibi_fn(h)}):
        got = _with_grads("fused", q, k, v, **kw)
        want = _with_grads("fused", *(t.contiguous() for t in (q, k, v)), **kw)
        for a, c in zip(got, want, strict=True):
            assert torch.equal(a, c), (layout, dtype, sorted(kw))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=hostile_calls(), cast=st.sampled_from([None, torch.bfloat16, torch.float16]))
def test_nan_goes_where_the_reference_puts_it(call, cast) -> None:
    """test_numerics' hostile inputs (NaN, +-inf in q, k, v and biases, masked rows, empty
    dims), on the fused backend, under autocast too."""
    q, k, v, kwargs = call
    context = torch.autocast("cpu", dtype=cast) if cast else torch.autocast("cpu", enabled=False)
    with context:
        want = scaled_dot_product_attention(q, k, v, backend="math", **kwargs)
        got = scaled_dot_product_attention(q, k, v, backend="fused", **kwargs)
    _agree(got, want, 1e-5 if cast is None else 2e-2, f"fused, autocast {cast}, {sorted(kwargs)}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [97, 257])
@pytest.mark.parametrize("case", ["plain", "causal", "alibi", "mask and bias"])
def test_error_is_at_most_twice_torchs_own_kernel(dtype, n: int, case: str) -> None:
    """Against the float64 reference on the same rounded inputs, the output's and every
    gradient's largest error is at most twice that of torch's kernel in the same dtype."""
    g = torch.Generator().manual_seed(n)
    h = 4
    q0, k0, v0 = (torch.randn(2, h, n, 64, generator=g).to(dtype) for _ in range(3))
    weight = torch.randn(2, h, n, 64, generator=g, dtype=F64)
    mask = torch.rand(2, 1, n, n, generator=g) > 0.3
    alibi = masks.materialize(alibi_fn(h), (1, h, n, n)).float()
    kwargs, dense = {
        "plain": ({}, {}),
        "causal": ({"is_causal": True}, {"is_causal": True}),
        "alibi": ({"bias": alibi_fn(h)}, {"attn_mask": alibi.to(dtype)}),
        "mask and bias": (
            {"mask": mask, "bias": alibi},
            {"attn_mask": alibi.masked_fill(~mask, float("-inf")).to(dtype)},
        ),
    }[case]

    def grads(fn, cast):
        leaves = [t.to(cast).requires_grad_() for t in (q0, k0, v0)]
        out = fn(*leaves)
        return (out, *torch.autograd.grad((out.double() * weight).sum(), leaves))

    want = grads(
        lambda q, k, v: scaled_dot_product_attention(q, k, v, backend="math", **kwargs), F64
    )
    theirs = grads(
        lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, **dense), dtype
    )
    ours = grads(
        lambda q, k, v: scaled_dot_product_attention(q, k, v, backend="fused", **kwargs), dtype
    )
    for what, a, b, w in zip(("out", "dq", "dk", "dv"), ours, theirs, want, strict=True):
        assert a.dtype == dtype
        err, limit = ((t.double() - w).abs().max().item() for t in (a, b))
        assert err <= 2 * limit + 1e-7, f"{what}: error {err:.2e} > 2x torch's ({limit:.2e})"


def test_masks_are_read_as_exact_structure() -> None:
    """attnkit's own mask functions are callable data whose numbers are read as bands and
    layouts; a function that only declares a band is not taken for one, nor is an exact mask
    re-declared with other numbers; and each exact mask equals its structure everywhere."""
    nl = plan.NO_LIMIT
    assert plan.exact_parts(masks.causal_fn(3)) == [("band", (-nl, 3))]
    assert plan.exact_parts(masks.window_fn(5, 2, 1)) == [("band", (-4, 3))]
    both = masks.all_of(masks.causal_fn(0), masks.window_fn(4))
    assert plan.exact_parts(both) == [("band", (-nl, 0)), ("band", (-4, 0))]
    layout = strided_layout(4, 1, 2)
    ((kind, (got, block)),) = plan.exact_parts(block_sparse(layout, 16))
    assert kind == "layout" and block == 16 and torch.equal(got, layout)
    promise = masks.declare(lambda b, h, i, j: (i + j) % 3 != 0, band=masks.Band(2, 0))
    assert plan.exact_parts(promise) is None
    assert plan.exact_parts(masks.all_of(masks.causal_fn(0), promise)) is None
    assert plan.exact_parts(lambda b, h, i, j: i >= j) is None
    assert plan.exact_parts(masks.declare(masks.causal_fn(0), band=masks.Band(3, 0))) is None
    n = 40
    grid = masks.materialize(lambda b, h, i, j: (j - i) + 0 * b * h, (1, 1, n, n))
    for fn in (masks.causal_fn(3), masks.window_fn(5, 2, 1), both):
        lo = max(p[1][0] for p in plan.exact_parts(fn))
        hi = min(p[1][1] for p in plan.exact_parts(fn))
        assert torch.equal(masks.materialize(fn, (1, 1, n, n)), (grid >= lo) & (grid <= hi))


def test_why_not_says_why_in_a_sentence(monkeypatch) -> None:
    q, k, v = _qkv(4, 4)
    assert api.why_not(make_call(q, k, v, masks.causal_fn(0), bias=alibi_fn(4))) is None
    gen = torch.Generator().manual_seed(0)
    cases = {
        "dropout_p=0.1": make_call(q, k, v, dropout_p=0.1, generator=gen),
        "return_weights=True": make_call(q, k, v, return_weights=True),
        "softcap": make_call(q, k, v, softcap=2.0),
        "sinks": make_call(q, k, v, sinks=torch.zeros(4, dtype=F64)),
    }
    for words, call in cases.items():
        assert words in api.why_not(call), words
    slope = torch.tensor(0.5, requires_grad=True)
    with pytest.raises(BackendUnavailable, match="bias function's output requires grad"):
        scaled_dot_product_attention(
            q, k, v, bias=lambda b, h, i, j: slope * (j - i), backend="fused"
        )
    monkeypatch.setattr(plan, "MATERIALIZE_BYTES", 100)
    monkeypatch.setattr(api, "MATERIALIZE_BYTES", 100)
    unstructured = make_call(q, k, v, lambda b, h, i, j: i >= j)
    assert "evaluates it per tile" in api.why_not(unstructured)
    assert api.why_not(make_call(q, k, v, masks.causal_fn(0))) is None  # exact: nothing built


def test_a_machine_without_a_compiler_is_told_so(monkeypatch) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler")
    reason = jit.prerequisites()
    assert reason == (
        "no C++ compiler ('no-such-compiler') is installed: the fused kernel cannot be built"
    )
    monkeypatch.setenv("ATTNKIT_FUSED", "0")
    assert jit.prerequisites() == "the fused kernel is turned off (ATTNKIT_FUSED=0)"


def test_the_build_is_cached_by_source_flags_and_torch(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    assert jit.cache_dir() == tmp_path
    monkeypatch.delenv("ATTNKIT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert jit.cache_dir() == tmp_path / "attnkit" / "torch_extensions"
    key = jit.build_key()
    monkeypatch.setattr(jit, "flags", lambda: ["-O0"])
    assert jit.build_key() != key and len(key) == 16
    # another install of the same sources (its build files name other paths): its own folder
    flagged = jit.build_key()
    monkeypatch.setattr(jit, "HERE", tmp_path)
    for name in jit.SOURCES:
        (tmp_path / name).write_bytes((Path(jit.__file__).parent / name).read_bytes())
    assert jit.build_key() != flagged


@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"), reason="x86's FTZ/DAZ float mode"
)
@pytest.mark.parametrize("threads", [1, 2])
def test_subnormal_weights_are_zero_inside_the_kernel_and_the_thread_keeps_its_mode(
    threads: int,
) -> None:
    """A weight exp2(s - m) below 2^-126 is zero in the kernel (forward and backward), where
    torch's math keeps it as a subnormal; the calling thread's own float mode is untouched."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # Key 1 scores 130 below key 0 in base 2: its weight is 2^-130, its value 2^100.
        q = torch.zeros(1, 1, 1, 4)
        q[..., 0] = 1.0
        k = torch.zeros(1, 1, 2, 4)
        k[0, 0, 1, 0] = -130.0 * torch.log(torch.tensor(2.0))
        v = torch.zeros(1, 1, 2, 4)
        v[0, 0, 1] = 2.0**100
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = scaled_dot_product_attention(*leaves, scale=1.0, backend="fused")
        want = scaled_dot_product_attention(q, k, v, scale=1.0, backend="math")
        assert float(want[0, 0, 0, 0]) == pytest.approx(2.0**-30, rel=1e-3)  # IEEE: subnormal
        assert float(out.detach()[0, 0, 0, 0]) == 0.0  # the kernel: zero
        out.sum().backward()
        assert leaves[2].grad[0, 0, 1].eq(0).all()  # dv of key 1 = its weight: zero too
        assert torch.isfinite(leaves[1].grad).all()
        tiny = torch.tensor([2.0**-130])
        assert float(tiny * 1.0) == 2.0**-130  # this thread still computes subnormals
    finally:
        torch.set_num_threads(before)
