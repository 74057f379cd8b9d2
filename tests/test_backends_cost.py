"""The cost model behind auto: its counts against hand-computed and brute-force oracles, the
memory budget (a bias over it is never built), and auto equal to the reference in every branch."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from attnkit import masks, scaled_dot_product_attention
from attnkit.backends import chunked, cost, explain, memory_budget
from attnkit.backends.sparse import block_sparse
from attnkit.backends.tiled import BLOCK_Q
from attnkit.backends.tiled.tiles import Spec, Tiles
from attnkit.functional import make_call
from attnkit.registry import select_backend

F64 = torch.float64


def _qkv(n: int = 300, b: int = 1, h: int = 2, h_kv: int | None = None, d: int = 8, seed=0):
    g = torch.Generator().manual_seed(seed)
    h_kv = h_kv or h
    return (
        torch.randn(b, h, n, d, dtype=F64, generator=g),
        torch.randn(b, h_kv, n, d, dtype=F64, generator=g),
        torch.randn(b, h_kv, n, d, dtype=F64, generator=g),
    )


def _alibi(h: int):
    slopes = torch.tensor([2.0 ** (-(x + 1)) for x in range(h)], dtype=F64)

    def alibi(b, h, i, j):
        return -slopes[h] * (i - j).abs()

    return masks.relative(alibi)


def test_probe_counts_element_ops_by_hand() -> None:
    # -slopes[h] * (i - j).abs(): i - j and abs span (i, j); slopes[h] and its negation span
    # h; the product spans (h, i, j). At (b, h, i, j) = (3, 4, 10, 20):
    fn = _alibi(4)
    found = cost._probe(fn, (3, 4, 10, 20), torch.device("cpu")).at((3, 4, 10, 20))
    assert found.ops == 200 + 200 + 4 + 4 + 4 * 200
    assert found.out_bytes == 4 * 200 * 8  # float64, (1, 4, 10, 20)
    assert found.temp_bytes == 4 * 200 * 8
    # The same function is probed once (cached by identity) and scales to any shape.
    again = cost._probe(fn, (3, 4, 10, 20), torch.device("cpu"))
    assert again is cost._probe(fn, (3, 4, 10, 20), torch.device("cpu"))
    assert again.at((1, 4, 1, 7)).ops == 7 + 7 + 4 + 4 + 28


def test_a_function_that_fails_on_the_probe_counts_as_a_full_grid() -> None:
    def broken(b, h, i, j):
        raise RuntimeError("not on a probe")

    found = cost._probe(broken, (2, 3, 4, 5), torch.device("cpu")).at((2, 3, 4, 5))
    assert found.ops == 8 * 120 and found.out_bytes == 4 * 120


def _tiled_visits(q, k, mask_fn, is_causal: bool) -> tuple[int, int]:
    """The oracle: the key tiles the tiled backend's own loop visits (``Tiles.groups``)."""
    n_i, n_j = q.shape[2], k.shape[2]
    if is_causal:
        mask_fn = masks.all_of(mask_fn, masks.causal_fn(masks.causal_offset(n_i, n_j)))
    loop = Tiles(Spec(1.0, mask_fn=mask_fn), q, k)
    tiles = pairs = 0
    for i0 in range(0, n_i, BLOCK_Q):
        i1 = min(n_i, i0 + BLOCK_Q)
        for sel, _ in loop.groups(i0, i1):
            tiles += 1
            pairs += (i1 - i0) * (sel.stop - sel.start)
    return tiles, pairs


@pytest.mark.parametrize(
    ("n_i", "n_j", "kw"),
    [
        (1000, 1000, {"is_causal": True}),
        (300, 1000, {"is_causal": True}),  # bottom-right with a KV cache
        (1000, 1000, {"mask": masks.window_fn(99)}),
        (777, 777, {"mask": masks.window_fn(50, 30), "is_causal": True}),
    ],
)
def test_tiles_visited_match_a_brute_force_count(n_i, n_j, kw) -> None:
    q = torch.zeros(1, 1, n_i, 4)
    k = torch.zeros(1, 1, n_j, 4)
    call = make_call(q, k, k, **kw)
    want_tiles, want_pairs = _tiled_visits(q, k, kw.get("mask"), kw.get("is_causal", False))
    got = cost.terms("tiled", call)
    assert (got.tiles, got.pairs) == (want_tiles, want_pairs)
    if kw.get("is_causal") and len(kw) == 1 and n_i == n_j:  # torch's kernel skips above it
        # in key blocks of 512: queries 0..511 read the first block, the rest all 1000 keys
        assert cost.terms("torch", call).pairs == 512 * 512 + (n_i - 512) * n_i


def test_an_undeclared_mask_is_sampled_for_the_tiles_it_blocks() -> None:
    # Four documents of 256 positions: with tiles of 256 the blocked tiles are exactly the
    # off-diagonal ones, and 8 x 8 samples per tile find every visible one.
    ids = torch.arange(1024) // 256

    def document(b, h, i, j):
        return ids[i] == ids[j]

    q = torch.zeros(1, 1, 1024, 4)
    got = cost.terms("tiled", make_call(q, q, q, document))
    assert (got.tiles, got.pairs) == (4, 4 * 256 * 256)
    assert cost.terms("torch", make_call(q, q, q, document)).pairs == 1024 * 1024  # no skipping


def test_terms_scale_with_the_call() -> None:
    q, k, v = (t.float() for t in _qkv(512, b=2, h=4))
    plain = cost.terms("torch", make_call(q, k, v))
    assert plain.pairs == 2 * 4 * 512 * 512 and plain.extra == 0 and plain.materialised == 0
    with_bias = cost.terms("torch", make_call(q, k, v, bias=_alibi(4)))
    assert with_bias.extra == plain.pairs
    assert with_bias.materialised >= 4 * 512 * 512 * 8  # the float64 bias (1, 4, i, j) at least
    tiled = cost.terms("tiled", make_call(q, k, v, bias=_alibi(4)))
    assert tiled.materialised == 0 and tiled.tiles == 2  # 512 x 512 in tiles of 256 x 512
    # A relative bias is evaluated once on the i + j - 1 offsets: far fewer ops than torch's.
    assert tiled.ops < with_bias.ops / 100
    grad = make_call(q.requires_grad_(), k, v, bias=_alibi(4))
    assert cost.estimate("torch", grad).seconds > cost.estimate("torch", make_call(q, k, v)).seconds


def test_float64_and_float16_use_the_nearest_measured_rows() -> None:
    q, k, v = _qkv(256)
    f64 = cost.estimate("torch", make_call(q, k, v)).seconds
    f32 = cost.estimate("torch", make_call(q.float(), k.float(), v.float())).seconds
    assert f64 == pytest.approx(2 * f32)
    half = make_call(q.half(), k.half(), v.half())
    bf16 = make_call(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert cost.estimate("tiled", half).seconds == cost.estimate("tiled", bf16).seconds


def _recorded(fn, shapes: list[tuple[int, ...]]):
    def recording(b, h, i, j):
        out = fn(b, h, i, j)
        shapes.append(tuple(out.shape))
        return out

    return masks.declare(recording, masks.structure_of(fn))


def test_a_tiny_budget_never_builds_the_bias_and_matches_the_reference() -> None:
    n = 700
    q, k, v = _qkv(n, h=2)
    shapes: list[tuple[int, ...]] = []
    bias = _recorded(_alibi(2), shapes)
    ref = scaled_dot_product_attention(q, k, v, bias=bias, backend="math")
    assert (1, 2, n, n) in shapes  # the reference builds it (the oracle for "built")
    shapes.clear()
    with memory_budget(1024):
        e = explain(q, k, v, bias=bias)
        assert e.backend == "tiled"
        over = {v.backend: v.why_not for v in e.verdicts if v.why_not and v.estimate}
        assert {"torch", "math"} <= set(over)
        assert all("over the memory budget of 1.0 KiB" in why for why in over.values())
        out = scaled_dot_product_attention(q, k, v, bias=bias)
    assert shapes and max(math.prod(s[-2:]) for s in shapes) < n * n  # never on the full grid
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    # With the default budget, a small call takes whatever is cheapest: the same result.
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, bias=bias), ref)


def _document(n: int):
    ids = torch.arange(n) * 3 // n

    def document(b, h, i, j):
        return ids[i] == ids[j]

    return document


def _branches(n: int, h: int, slope: torch.Tensor):
    """Calls that reach every backend auto can take (under some budget)."""
    layout = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=torch.bool)  # blocks of 64
    return {
        "plain": {},
        "causal": {"is_causal": True},
        "alibi function": {"bias": _alibi(h)},
        "window function": {"mask": masks.window_fn(40)},
        "block layout": {"mask": block_sparse(layout, 64)},
        "document function": {"mask": _document(n), "is_causal": True},
        "mask tensor": {"mask": torch.rand(n, n, generator=torch.Generator().manual_seed(1)) > 0.3},
        "bias tensor": {"bias": torch.randn(h, n, n, dtype=F64)},
        "learnable bias function": {"bias": lambda b, h, i, j: -slope * (i - j).abs()},
        "weights": {"return_weights": True, "bias": _alibi(h)},
    }


N = 160
BRANCHES = list(_branches(N, 2, torch.tensor(0.0)))


@pytest.mark.parametrize("budget", [None, 0, 100_000])
@pytest.mark.parametrize("branch", BRANCHES)
def test_auto_equals_the_reference_in_every_branch(branch: str, budget, monkeypatch) -> None:
    """Forward and gradients, float64, h = 4 over 2 key/value heads (GQA); budgets: the
    default, none at all and one that fits only chunks of the reference (its chunks shrunk)."""
    monkeypatch.setattr(chunked, "BUDGET", 4 * N * 40)  # 40 query rows per chunk
    n = N
    q, k, v = (t.requires_grad_() for t in _qkv(n, h=4, h_kv=2, seed=3))
    slope = torch.tensor(0.3, dtype=F64, requires_grad=True)
    kw = _branches(n, 4, slope)[branch]
    call = make_call(q, k, v, **kw)
    ref = scaled_dot_product_attention(q, k, v, backend="math", **kw)
    with memory_budget(budget) if budget is not None else contextlib.nullcontext():
        e = explain(q, k, v, **kw)
        if e.backend is None:  # nothing fits: auto says so and builds nothing
            assert budget is not None and any(v.estimate for v in e.verdicts)
            with pytest.raises(ValueError, match="memory budget"):
                scaled_dot_product_attention(q, k, v, **kw)
            return
        assert e.backend == select_backend("auto", call).name
        if budget == 0:
            assert e.verdicts[0].estimate.materialised == 0
        out = scaled_dot_product_attention(q, k, v, **kw)
    if kw.get("return_weights"):
        (out, weights), (ref, ref_weights) = out, ref
        torch.testing.assert_close(weights, ref_weights, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    leaves = [q, k, v, slope] if branch == "learnable bias function" else [q, k, v]
    got = torch.autograd.grad(out.sum(), leaves)
    want = torch.autograd.grad(ref.sum(), leaves)
    for g_got, g_want in zip(got, want, strict=True):
        torch.testing.assert_close(g_got, g_want, atol=1e-10, rtol=1e-8)


def test_the_branches_reach_every_backend() -> None:
    """The parametrised test above is only as good as the routes it takes."""
    n = N
    q, k, v = (t.requires_grad_() for t in _qkv(n, h=4, h_kv=2, seed=3))
    taken = set()
    old = chunked.BUDGET
    chunked.BUDGET = 4 * N * 40
    try:
        for budget in (None, 0, 100_000):
            for kw in _branches(n, 4, torch.tensor(0.3, requires_grad=True)).values():
                with memory_budget(budget) if budget is not None else contextlib.nullcontext():
                    taken.add(explain(q, k, v, **kw).backend)
    finally:
        chunked.BUDGET = old
    assert {"torch", "tiled", "math", "chunked"} <= taken


def test_a_long_narrow_window_with_gradients_takes_sparse_and_matches() -> None:
    q, k, v = (t.requires_grad_() for t in _qkv(1024, h=2, d=16, seed=5))
    window = masks.window_fn(63)
    assert explain(q, k, v, window).backend == "sparse"
    out = scaled_dot_product_attention(q, k, v, window)
    ref = scaled_dot_product_attention(q, k, v, window, backend="math")
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    got_grads = torch.autograd.grad(out.sum(), (q, k, v))
    for got, want in zip(got_grads, torch.autograd.grad(ref.sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-8)


def test_negligible_heads_of_a_relative_bias_are_left_out_of_the_pairs() -> None:
    # One head, bias -|i - j|, zero queries and keys (no Cauchy-Schwarz slack): a tile of
    # 256 x 512 is negligible in float32 when its nearest pair is more than (24 + 40 + 1) bits,
    # 45.05 nats, off the diagonal, the largest bias of every row being 0.
    n = 1024
    q = torch.zeros(1, 1, n, 8)
    bias = masks.relative(lambda b, h, i, j: -(i - j).abs().float())
    want = 0
    for i0 in range(0, n, 256):
        for j0 in range(0, n, 512):
            nearest = max(0, j0 - (i0 + 255), i0 - (j0 + 511))
            want += 256 * 512 * (nearest * math.log2(math.e) <= 65)
    got = cost.terms("tiled", make_call(q, q, q, bias=bias))
    assert got.pairs == want < n * n
    bounded = masks.relative(lambda b, h, i, j: -((i - j).abs() % 7).float())  # never far below
    assert cost.terms("tiled", make_call(q, q, q, bias=bounded)).pairs == n * n


def test_auto_weighs_a_call_without_queries_or_keys() -> None:
    """An empty call with a relative bias function: no offsets, no pairs, and auto's choice
    gives what the reference gives."""
    from attnkit.positional import alibi_fn

    for ni, nj in [(0, 0), (0, 3), (3, 0)]:
        q = torch.randn(1, 2, ni, 4)
        k = v = torch.randn(1, 2, nj, 4)
        ref = scaled_dot_product_attention(q, k, v, bias=alibi_fn(2), backend="math")
        out = scaled_dot_product_attention(q, k, v, bias=alibi_fn(2))
        torch.testing.assert_close(out, ref)


def test_torchs_causal_kernel_is_priced_by_its_key_blocks_of_512() -> None:
    """Hand-computed: up to 512 keys nothing is skipped; at n = 1024 the first 512 queries
    read one key block and the rest two, (512 * 512 + 512 * 1024) / 1024^2 = 0.75."""
    assert cost._torch_causal_fraction(512) == 1.0
    assert cost._torch_causal_fraction(1024) == pytest.approx(0.75)
    assert cost._torch_causal_fraction(0) == 0.0
    q, k, v = _qkv(1024, h=2, d=8)
    plain, causal = (cost.terms("torch", make_call(q, k, v, is_causal=c)) for c in (False, True))
    assert causal.pairs == pytest.approx(0.75 * plain.pairs)


def _fused_ready() -> bool:
    from attnkit.backends.fused import jit

    try:
        jit.build()
    except jit.NotBuilt:
        return False
    return True


needs_fused = pytest.mark.skipif(
    not _fused_ready(), reason="the fused kernel cannot be built here (no compiler or ninja)"
)


@needs_fused
def test_auto_takes_the_fused_kernel_where_it_is_cheapest_and_falls_back_without_it(
    monkeypatch,
) -> None:
    """bfloat16 with an ALiBi function and gradients: the fused kernel's estimate is the
    lowest and auto runs it; where it cannot be built, explain says why in its sentence and
    auto takes another backend; both results equal the float64 reference within bfloat16."""
    from attnkit import registry
    from attnkit.backends.fused import jit

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 4, 1024, 64, generator=g).bfloat16().requires_grad_() for _ in "qkv")
    bias = _alibi(4)
    ref = scaled_dot_product_attention(
        *(t.detach().double() for t in (q, k, v)), bias=bias, backend="math"
    )
    e = explain(q, k, v, bias=bias)
    assert e.backend == "fused"
    cheapest = min(x.estimate.seconds for x in e.verdicts if x.estimate)
    assert e.verdicts[0].estimate.seconds == cheapest
    registry._RANKED.clear()
    out = scaled_dot_product_attention(q, k, v, bias=bias)
    assert (out.double() - ref).abs().max() < 2e-2

    reason = "no C++ compiler ('c++') is installed: the fused kernel cannot be built"
    monkeypatch.setattr(jit, "unavailable", lambda: reason)
    registry._RANKED.clear()
    e = explain(q, k, v, bias=bias)
    assert e.backend not in (None, "fused")
    fused = next(x for x in e.verdicts if x.backend == "fused")
    assert fused.estimate is None and fused.why_not == reason
    assert f"fused: cannot serve this call: {reason}" in str(e)
    out = scaled_dot_product_attention(q, k, v, bias=bias)
    assert (out.double() - ref).abs().max() < 2e-2
    registry._RANKED.clear()


@needs_fused
def test_the_fused_kernel_counts_a_mask_function_it_evaluates_against_the_budget() -> None:
    """An undeclared mask function is evaluated once into a bool tensor (i x j here: it does
    not depend on b or h); a budget below that leaves the fused kernel out, one above keeps it."""
    n = 512
    q, k, v = (t.float() for t in _qkv(n, h=2, d=16))
    doc = _document(n)
    est = cost.estimate("fused", make_call(q, k, v, mask=doc))
    assert est.materialised >= n * n  # one byte per (i, j)
    assert "evaluates the mask function once as a tensor" in est.how
    with memory_budget(est.materialised - 1):
        over = {x.backend: x for x in explain(q, k, v, mask=doc).verdicts}
        assert over["fused"].why_not.startswith("it would build")
    declared = cost.estimate("fused", make_call(q, k, v, mask=masks.window_fn(40)))
    assert declared.materialised == 0  # a band is read as structure
