"""The online softmax: tile by tile, under either shift policy, it ends at the float64 softmax and
log-sum-exp; rows that see no key finish as 0 and the blocked minimum; ``merge`` of two disjoint
key sets equals attention over their union."""

from __future__ import annotations

import pytest
import torch

from attnkit import scaled_dot_product_attention
from attnkit._numerics import blocked
from attnkit.backends.tiled import forward_blocks, merge, tiled_attention
from attnkit.backends.tiled.softmax import (
    LAZY_SHIFT,
    LOG2E,
    State,
    exact_shift,
    exp2_shifted,
    finish,
    lazy_shift,
    update,
)
from oracles import qkv as _qkv

F64 = torch.float64
BLOCKED = blocked(F64)
TILES = [slice(0, 10), slice(10, 25), slice(25, 37)]  # 37 keys in uneven tiles


def _scores(n: int = 3, rows: int = 5, j: int = 37, dv: int = 4, spread: float = 3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, rows, j, dtype=F64, generator=g) * spread  # natural-log scores
    v = torch.randn(n, j, dv, dtype=F64, generator=g)
    return s, v


def _online(s: torch.Tensor, v: torch.Tensor, policy: str, dtype=F64, visible=None) -> State:
    """Run the update rule over ``TILES`` of natural scores ``s``, as the forward does (blocked
    logits where ``visible`` is False)."""
    state = State()
    floor = blocked(dtype)
    s2, v = (s * LOG2E).to(dtype), v.to(dtype)
    if visible is not None:
        s2 = s2.masked_fill(~visible, floor)
    for tile in TILES:
        t = s2[..., tile].clone()  # update works in place
        shift = exact_shift(state, t) if policy == "exact" else lazy_shift(state, t, False)
        state = update(state, t, v[:, tile], shift, None, floor)
    return state


@pytest.mark.parametrize("policy", ["exact", "lazy"])
def test_update_and_finish_give_softmax_and_logsumexp(policy: str) -> None:
    s, v = _scores()
    out, lse = finish(_online(s, v, policy), s, v.shape[-1], BLOCKED)
    torch.testing.assert_close(out, torch.softmax(s, dim=-1) @ v, atol=1e-13, rtol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(s, dim=-1), atol=1e-13, rtol=1e-12)


def test_the_state_after_each_tile_is_the_sum_under_its_shift() -> None:
    """Invariant of the rule: ``l = sum exp2(s - m)``, ``acc = sum exp2(s - m) v`` over the keys
    seen so far, with ``m`` the running maximum (exact shift)."""
    s, v = _scores()
    s2 = s * LOG2E
    state = State()
    for n, tile in enumerate(TILES):
        t = s2[..., tile].clone()
        state = update(state, t, v[:, tile], exact_shift(state, t), None, BLOCKED)
        seen = s2[..., : tile.stop]
        torch.testing.assert_close(state.m, seen.amax(dim=-1), atol=0, rtol=0, msg=str(n))
        p = torch.exp2(seen - state.m.unsqueeze(-1))
        torch.testing.assert_close(state.l, p.sum(-1), atol=1e-13, rtol=1e-13)
        torch.testing.assert_close(state.acc, p @ v[:, : tile.stop], atol=1e-13, rtol=1e-13)


def test_lazy_shift_regimes() -> None:
    near = torch.tensor([[[1.0, -3.0], [20.0, 39.0]]], dtype=F64)  # (1 batch, 2 rows, 2 keys)
    assert lazy_shift(State(), near.clone(), small=True) is None  # promised small: no maximum
    assert lazy_shift(State(), near.clone(), small=False) is None  # within 40 bits of 0
    far = torch.tensor([[[1.0, 2.0], [100.0, 3.0], [-90.0, -50.0]]], dtype=F64)
    shift = lazy_shift(State(), far, small=False)
    assert torch.equal(shift, torch.tensor([[0.0, 100.0, -50.0]], dtype=F64))  # far rows only
    started = State(shift, torch.ones(1, 3), torch.zeros(1, 3, 2))
    within = torch.tensor([[[30.0], [130.0], [-20.0]]], dtype=F64)
    assert lazy_shift(started, within, small=False) is shift  # no row grew past 40 bits
    grown = torch.tensor([[[41.0], [139.0], [-9.0]]], dtype=F64)
    moved = lazy_shift(started, grown, small=False)
    assert torch.equal(moved, torch.tensor([[41.0, 100.0, -9.0]], dtype=F64))
    zero_shift = State(None, torch.ones(1, 1), torch.zeros(1, 1, 2))
    top = torch.tensor([[[LAZY_SHIFT + 1.0]]], dtype=F64)
    assert torch.equal(lazy_shift(zero_shift, top, small=False), top[..., 0])


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_lazy_and_exact_shifts_agree_with_float64_for_far_logits(dtype) -> None:
    """Rows near 0, far above it (exp2 would overflow float32 unshifted), far below it, and
    growing tile after tile: every regime ends at the float64 softmax."""
    s, v = _scores(rows=4, spread=1.0)
    s[:, 1] += 500.0
    s[:, 2] -= 300.0
    s[:, 3] += torch.linspace(0, 400, 37, dtype=F64)  # later tiles dominate
    tol = {"atol": 1e-12, "rtol": 1e-11} if dtype == F64 else {"atol": 2e-5, "rtol": 2e-5}
    for policy in ("exact", "lazy"):
        state = _online(s, v, policy, dtype)
        out, lse = finish(state, s.to(dtype), v.shape[-1], blocked(dtype))
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        torch.testing.assert_close(out.double(), torch.softmax(s, -1) @ v, **tol)
        torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), **tol)


@pytest.mark.parametrize("policy", ["exact", "lazy"])
def test_rows_without_a_visible_key(policy: str) -> None:
    s, v = _scores()
    visible = torch.ones_like(s, dtype=torch.bool)
    visible[0, 1] = False  # sees nothing
    visible[1, 2, : TILES[1].stop] = False  # sees nothing in the first two tiles
    visible[2, 0, 11:] = False  # sees only the first tile's keys
    state = _online(s, v, policy, visible=visible)
    out, lse = finish(state, s, v.shape[-1], BLOCKED)
    assert torch.equal(out[0, 1], torch.zeros(4, dtype=F64)) and float(lse[0, 1]) == BLOCKED
    weights = torch.softmax(s.masked_fill(~visible, -torch.inf), dim=-1).nan_to_num(0.0)
    ok = visible.any(-1)
    torch.testing.assert_close(out[ok], (weights @ v)[ok], atol=1e-13, rtol=1e-12)
    want_lse = torch.logsumexp(s.masked_fill(~visible, -torch.inf), dim=-1)
    torch.testing.assert_close(lse[ok], want_lse[ok], atol=1e-13, rtol=1e-12)
    # An empty state (no tile at all) finishes every row as 0 and blocked.
    out, lse = finish(State(), s, 4, BLOCKED)
    assert torch.equal(out, torch.zeros(3, 5, 4, dtype=F64))
    assert torch.equal(lse, torch.full((3, 5), BLOCKED, dtype=F64))


def test_filled_writes_out_the_empty_state() -> None:
    like = torch.zeros(3, 5, 8, dtype=F64)
    filled = State().filled(like, 4, BLOCKED)
    assert torch.equal(filled.m, torch.full((3, 5), BLOCKED, dtype=F64))
    assert torch.equal(filled.l, torch.zeros(3, 5, dtype=F64))
    assert torch.equal(filled.acc, torch.zeros(3, 5, 4, dtype=F64))
    # Updating the filled state is updating the empty one (garbage cleared by alpha = 0).
    s, v = _scores()
    t = (s[..., :10] * LOG2E).clone()
    a = update(State(), t.clone(), v[:, :10], exact_shift(State(), t), None, BLOCKED)
    filled = State().filled(t, 4, BLOCKED)
    b = update(filled, t.clone(), v[:, :10], exact_shift(filled, t), None, BLOCKED)
    for x, y in ((a.m, b.m), (a.l, b.l), (a.acc, b.acc)):
        torch.testing.assert_close(y, x, atol=1e-14, rtol=1e-14)
    assert filled.filled(like, 4, BLOCKED) is filled  # a started state is left as it is


def test_exp2_shifted_flushes_only_below_the_threshold() -> None:
    s, _ = _scores(spread=60.0)
    shift = s.amax(-1)
    want = torch.exp2(s - shift.unsqueeze(-1))
    torch.testing.assert_close(exp2_shifted(s.clone(), shift, None, BLOCKED), want, atol=0, rtol=0)
    flushed = exp2_shifted(s.clone(), shift, -50.0, BLOCKED)
    keep = (s - shift.unsqueeze(-1)) > -50.0
    assert torch.equal(flushed[keep], want[keep])
    assert torch.equal(flushed[~keep], torch.zeros_like(flushed[~keep])) and (~keep).any()
    torch.testing.assert_close(exp2_shifted(s.clone(), None, None, BLOCKED), torch.exp2(s))


def test_merge_of_disjoint_key_sets_equals_attention_over_their_union() -> None:
    s, v = _scores(spread=8.0)
    perm = torch.randperm(37, generator=torch.Generator().manual_seed(1))
    parts = [perm[:12], perm[12:30], perm[30:]]  # interleaved, uneven key sets

    def attend(keys: torch.Tensor):
        sk = s[..., keys]
        return torch.softmax(sk, -1) @ v[:, keys], torch.logsumexp(sk, -1)

    out, lse = attend(parts[0])
    for keys in parts[1:]:
        out, lse = merge(out, lse, *attend(keys))
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v, atol=1e-13, rtol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), atol=1e-13, rtol=1e-12)
    a, b = attend(parts[0]), attend(parts[1])
    for x, y in zip(merge(*a, *b), merge(*b, *a), strict=True):  # the order does not matter
        torch.testing.assert_close(x, y, atol=1e-14, rtol=1e-14)
    empty = (torch.zeros_like(out), torch.full_like(lse, BLOCKED))
    both_empty = merge(*empty, *empty)
    assert torch.equal(both_empty[0], empty[0]) and torch.isfinite(both_empty[1]).all()


def test_merge_treats_a_shard_without_keys_as_no_contribution() -> None:
    q, k, v = _qkv(5, 6)
    out, lse = forward_blocks(q, k, v, scale=0.5)
    empty_out, empty_lse = forward_blocks(q, k, v, scale=0.5, mask=torch.zeros(5, 6, dtype=bool))
    assert torch.equal(empty_out, torch.zeros_like(empty_out))
    m_out, m_lse = merge(out, lse, empty_out, empty_lse)
    torch.testing.assert_close(m_out, out)
    torch.testing.assert_close(m_lse, lse)
    # The log-sum-exp is the natural one, of the scaled scores.
    scores = torch.einsum("bhid,bhjd->bhij", q, k.repeat_interleave(2, dim=1)) * 0.5
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1))


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_lazy_shift_handles_logits_far_from_zero(dtype, monkeypatch) -> None:
    """Without a bias the forward keeps a per-row shift of 0 while a row's logits stay near
    0 (tiles whose Cauchy-Schwarz bound is below 40 bits skip the maximum) and moves it only
    when they leave +-40 bits. Huge logits, logits that grow block after block and logits far
    below zero all equal the float64 reference, masks and gradients included, and each of the
    shift's regimes really occurs."""
    from attnkit.backends.tiled import forward, softmax

    seen = set()

    def spy(state, s, small):
        new = softmax.lazy_shift(state, s, small)
        first = not state.started
        seen.add(("first" if first else "later", "zero" if new is None else "shifted"))
        seen.add(("bounded", small))
        m = state.m
        if not first and m is not None and new is not None and not torch.equal(m, new):
            seen.add(("later", "moved"))
        return new

    monkeypatch.setattr(forward, "lazy_shift", spy)
    i, j, d = 150, 230, 8
    q64, k64, v64 = _qkv(i, j, h=2, h_kv=2, d=d, dv=4, b=2)
    grow = torch.linspace(0.2, 30.0, j, dtype=F64).view(1, 1, j, 1)  # later keys dominate
    dense = torch.rand(2, 1, i, j, generator=torch.Generator().manual_seed(3)) > 0.3
    dense[:, :, 5] = False
    cases = {
        "plain": (q64, k64, {}),
        "huge": (q64 * 60, k64, {}),
        "growing": (q64 * 3, k64 * grow, {"mask": dense}),
        "far below": (torch.full_like(q64, 8.0), -k64.abs() - 8.0, {"is_causal": True}),
    }
    for name, (qc, kc, kw) in cases.items():
        results = []
        for impl in ("math", "tiled"):
            q, k, v = (t.to(dtype if impl == "tiled" else F64).detach().requires_grad_()
                       for t in (qc, kc, v64))  # fmt: skip
            if impl == "tiled":
                out = tiled_attention(q, k, v, block_q=32, block_k=64, **kw)
            else:
                out = scaled_dot_product_attention(q, k, v, backend="math", **kw)
            weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
            grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
            results.append([t.double() for t in (out, *grads)])
        tol = {"atol": 1e-9, "rtol": 1e-7} if dtype == F64 else {"atol": 1e-3, "rtol": 1e-3}
        for a, b_, what in zip(*results, ("out", "dq", "dk", "dv"), strict=True):
            torch.testing.assert_close(b_, a, **tol, msg=f"{name}: {what}")
    want = {("first", "zero"), ("first", "shifted"), ("later", "moved")}
    assert want | {("bounded", True), ("bounded", False)} <= seen
