"""The online softmax (Milakov & Gimelshein 2018; FlashAttention Algorithm 1), written once.

A block of query rows keeps three running statistics over the key tiles seen so far, in base 2
(``exp2``, with ``log2(e)`` folded into the scale, as FlashAttention does)::

    m    a per-row shift                 (the running maximum, or a lazy shift; see below)
    l    = sum_j exp2(s_j - m)           (the softmax denominator)
    acc  = sum_j exp2(s_j - m) v_j       (the unnormalised output)

One rule updates them with a tile of logits ``s`` and values ``v_t``; one rule rescales them
when the shift moves; one rule finishes them::

    m'  = shift(m, s)                    alpha = exp2(m - m')      (rescale, if m' != m)
    p   = exp2(s - m')                   l = l * alpha + rowsum(p)
    acc = acc * alpha + p v_t            output = acc / l,   lse = (m + log2 l) * ln 2

``merge`` combines two finished results over disjoint keys by the same rescaling rule, in
natural units (ring attention).

First-tile convention: a ``State`` starts empty (``l is None``), which stands for
``m = blocked, l = 0, acc = 0``; the first tile assigns ``l`` and ``acc`` instead of rescaling
zeros (``filled`` gives the explicit form when only some heads are updated).

Two shift policies:

* ``exact_shift``: the running maximum (with a bias: skipping compares against it);
* ``lazy_shift`` (no bias): any per-row shift gives the same ``acc / l`` as long as
  ``exp2(s - m)`` neither overflows nor loses the row's largest weight, so the shift stays 0
  while a row's tile maxima lie within ``LAZY_SHIFT`` bits of it and moves only past that. The
  usual tile then costs no subtraction and no rescaling.

A row that saw no visible key keeps ``m = blocked`` (the finite minimum) and finishes as output 0
and ``lse = blocked``: its garbage (blocked scores give ``p = 1`` under ``m = blocked``) is
cleared by ``alpha = exp2(blocked - m') = 0`` once a visible key arrives, or dropped at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit.backends.tiled.layout import bmm

__all__ = [
    "LAZY_SHIFT",
    "LN2",
    "LOG2E",
    "State",
    "exact_shift",
    "exp2_shifted",
    "finish",
    "lazy_shift",
    "merge",
    "update",
]

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e))
LN2 = 0.6931471805599453  # ln(2): log(x) = log2(x) * ln(2)
# Within 40 bits of the shift, weights stay in [2^-40, 2^40]: float32 keeps full precision.
LAZY_SHIFT = 40.0


@dataclass
class State:
    """The running statistics of a block of rows: ``m`` ``(n, rows)`` (``None``: a shift of 0),
    ``l`` ``(n, rows)`` and ``acc`` ``(n, rows, dv)``; empty before the first tile."""

    m: Tensor | None = None
    l: Tensor | None = None
    acc: Tensor | None = None

    @property
    def started(self) -> bool:
        return self.l is not None

    def filled(self, like: Tensor, dv: int, blocked: float) -> State:
        """This state with the empty one written out (``m = blocked, l = 0, acc = 0``, rows
        and dtype of ``like`` ``(n, rows, ...)``), so that parts of it can be updated."""
        if self.started:
            return self
        n, rows = like.shape[:2]
        m = torch.full((n, rows), blocked, dtype=like.dtype, device=like.device)
        return State(m, torch.zeros_like(m), like.new_zeros(n, rows, dv))


def exp2_shifted(s: Tensor, shift: Tensor | None, flush_below: float | None, blocked: float):
    """``exp2(s - shift)`` in place (``shift`` ``(n, rows)``; ``None``: 0).

    With ``flush_below``, logits that end up below it are set to ``blocked`` first: on CPU
    ``exp2`` is several times slower where its result is subnormal or zero (typical with ALiBi:
    distant keys) but fast on the finite minimum; those weights are below ``2^flush_below``
    (2^-126 in float32) of the row's largest and become exact zeros either way.
    """
    if shift is not None:
        s.sub_(shift.unsqueeze(-1))
    if flush_below is not None:
        torch.nn.functional.threshold_(s, flush_below, blocked)
    return s.exp2_()


def rescaled(l: Tensor, acc: Tensor, m: Tensor | float, m_new: Tensor, exp=torch.exp2):
    """The rescaling rule: ``(l, acc)`` summed under shift ``m``, expressed under ``m_new``."""
    alpha = exp(m - m_new)
    return l * alpha, acc * alpha.unsqueeze(-1)


def update(
    state: State,
    s: Tensor,
    v_t: Tensor,
    m_new: Tensor | None,
    flush_below: float | None,
    blocked: float,
) -> State:
    """The update rule: ``state`` after a tile of base-2 logits ``s`` ``(n, rows, bj)`` (used in
    place) with values ``v_t`` ``(n, bj, dv)``, under the new shift ``m_new``."""
    l, acc = state.l, state.acc
    if l is not None and acc is not None and m_new is not state.m:  # the shift moved
        assert m_new is not None  # a shift, once set, is never 0 again
        l, acc = rescaled(l, acc, 0.0 if state.m is None else state.m, m_new)
    p = exp2_shifted(s, m_new, flush_below, blocked)  # (n, rows, bj)
    if l is None or acc is None:
        return State(m_new, p.sum(dim=-1), bmm(p, v_t))
    return State(m_new, l + p.sum(dim=-1), torch.baddbmm(acc, p, v_t))


def exact_shift(state: State, s: Tensor) -> Tensor:
    """The running maximum of each row, after tile ``s``."""
    top = s.amax(dim=-1)  # (n, rows)
    return top if state.m is None else torch.maximum(state.m, top)


def lazy_shift(state: State, s: Tensor, small: bool) -> Tensor | None:
    """The lazy shift after tile ``s`` (see the module docstring); ``state.m`` itself when it
    does not move. ``small``: the caller knows that every logit of ``s`` is below
    ``LAZY_SHIFT``, so while the shift is 0 the tile's maximum is not needed at all."""
    if small and state.m is None:
        return None
    top = s.amax(dim=-1)  # (n, rows)
    if not state.started:  # first tile: shift 0 where the maximum is near 0
        near = (top > -LAZY_SHIFT) & (top < LAZY_SHIFT)
        return None if bool(near.all()) else torch.where(near, 0.0, top)
    ref = 0.0 if state.m is None else state.m
    grow = top > ref + LAZY_SHIFT
    if bool(grow.any()):  # a new maximum far above the shift: move it
        return torch.where(grow, top, ref)
    return state.m


def finish(
    state: State, like: Tensor, dv: int, blocked: float, sink: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``(output (n, rows, dv), lse (n, rows))`` of a finished state, ``lse`` in natural log.

    Rows without a visible key (and an empty state) give output 0 and ``lse = blocked``; so do
    rows whose scores were all ``-inf``. A NaN or ``+inf`` shift means a NaN or ``+inf`` score:
    the row is NaN, as in the reference (its per-element weights may have been flushed).

    ``sink`` ``(n, rows)``: a base-2 logit per row that joins the denominator with no value
    (attention sinks): one more key, added by the same rescaling rule."""
    state = state.filled(like, dv, blocked)
    assert state.l is not None and state.acc is not None
    l, acc = state.l, state.acc
    m = torch.zeros_like(l) if state.m is None else state.m
    if sink is not None:
        m_new = torch.maximum(m, sink)
        l, acc = rescaled(l, acc, m, m_new)
        l, m = l + torch.exp2(sink - m_new), m_new
    l = l.clamp_min(1e-30)
    seen = m > blocked  # rows with at least one visible key (False for NaN and -inf too)
    out = torch.where(seen.unsqueeze(-1), acc / l.unsqueeze(-1), 0)
    lse = torch.where(seen, (m + torch.log2(l)) * LN2, blocked)
    broken = torch.isnan(m) | torch.isposinf(m)
    if bool(broken.any()):
        out = out.masked_fill(broken.unsqueeze(-1), float("nan"))
        lse = lse.masked_fill(broken, float("nan"))
    return out, lse


def merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine attention over two disjoint key sets into attention over their union.

    ``out_x (..., i, dv)`` and ``lse_x (..., i)`` are normalised results (``l = 1`` under shift
    ``lse``), as ``forward_blocks`` returns them. Both are rescaled to the larger shift and
    summed (the rule above, natural units): ``lse = log(exp(lse_a) + exp(lse_b))``, output
    ``exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b``.
    """
    m = torch.maximum(lse_a, lse_b)
    wa, oa = rescaled(torch.ones_like(lse_a), out_a, lse_a, m, torch.exp)
    wb, ob = rescaled(torch.ones_like(lse_b), out_b, lse_b, m, torch.exp)
    total = wa + wb
    return (oa + ob) / total.unsqueeze(-1), m + torch.log(total)
