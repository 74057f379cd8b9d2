"""The fused backend's entry points: ``fused_attention``, the autograd function, the operand
layouts the kernel reads, and the registry entry."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit._numerics import all_finite, blocked, compute_dtype
from attnkit._structure import tile_plan
from attnkit.backends.engine_inputs import engine_inputs
from attnkit.backends.fused import jit
from attnkit.backends.fused.plan import MATERIALIZE_BYTES, Plan, materialized_bytes, plan
from attnkit.backends.tiled.skipping import negligible_bits
from attnkit.backends.tiled.softmax import LOG2E
from attnkit.masks import BiasFn, MaskFn, bias_requires_grad, pad_to_rank
from attnkit.registry import AttentionCall, register_backend

__all__ = ["BLOCK_K", "BLOCK_Q", "fused_attention", "prepare", "run", "why_not"]

# Tile sizes (measured choices: docs/benchmarks.md, "The fused CPU kernel"): queries x keys of
# the forward, and of the backward (whose inner loop runs over query blocks).
BLOCK_Q = 64
BLOCK_K = 256
BACKWARD_BLOCK_Q = 256
BACKWARD_BLOCK_K = 256
# In float32 a key's gradients sum one query tile per matmul in a single chain: at 256 queries
# their largest error reached 2.3x that of torch's kernel, at 64 at most 1.8x, at the same speed.
FLOAT32_BACKWARD_BLOCK_Q = 64

# The parts of a ScoreModification the kernel reads: bias tensors and functions (evaluated per
# tile in C++ where their structure allows, else as one tensor).
SERVES = ("bias", "bias_fn")

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Setup:
    """How one call runs: the kernel's input dtype, whether bfloat16 operands are packed in
    pairs (``pairs_of_rows``), and the tile sizes of the forward and of the backward."""

    dtype: torch.dtype
    packed: bool
    block_q: int
    block_k: int
    backward_q: int
    backward_k: int


def _divisor(n: int, cap: int) -> int:
    """The largest divisor of ``n`` up to ``cap``, an even one when there is one."""
    found = [x for x in range(min(n, cap), 0, -1) if n % x == 0]
    even = [x for x in found if x % 2 == 0]
    return (even or found)[0]


def setup(q: Tensor, p: Plan, kernel) -> Setup:
    tiles = [BLOCK_Q, BLOCK_K, BACKWARD_BLOCK_Q, BACKWARD_BLOCK_K]
    if p.layout is not None:  # every tile inside one layout cell
        tiles = [_divisor(p.layout_block, t) for t in tiles]
    if q.dtype == torch.float64:
        return Setup(torch.float64, False, *tiles)
    packed = q.dtype == torch.bfloat16 and all(t % 2 == 0 for t in tiles)
    if packed and kernel.bfloat16_packed_ok():
        return Setup(torch.bfloat16, True, *tiles)
    tiles[2] = _divisor(tiles[2], FLOAT32_BACKWARD_BLOCK_Q)
    return Setup(torch.float32, False, *tiles)  # float16 (and unpacked bfloat16) in float32


# The operands' layouts. A bfloat16 B operand is packed in pairs of rows (fused.h ``matmul``).


def _pad_even(x: Tensor) -> Tensor:
    """``(..., n, d)`` padded with zeros to even ``n`` and ``d`` (``x`` itself when even)."""
    if x.shape[-1] % 2 == 0 and x.shape[-2] % 2 == 0:
        return x
    return F.pad(x, (0, x.shape[-1] % 2, 0, x.shape[-2] % 2))


def pairs_of_rows(x: Tensor) -> Tensor:
    """``(..., n, d)`` (n even) -> ``(..., n / 2, 2 d)``: rows ``2r`` and ``2r + 1`` interleaved."""
    return x.unflatten(-2, (-1, 2)).transpose(-1, -2).contiguous().flatten(-2)


def pairs_of_columns(x: Tensor) -> Tensor:
    """``(..., n, d)`` (d even) -> ``(..., d / 2, 2 n)``: ``pairs_of_rows`` of ``x^T``, which is
    a transpose of ``x`` read as 32-bit pairs."""
    pairs = x.contiguous().view(torch.int32)  # (..., n, d / 2)
    return pairs.transpose(-1, -2).contiguous().view(x.dtype)  # (..., d / 2, 2 n)


def _transposed(x: Tensor) -> Tensor:
    return x.transpose(-1, -2).contiguous()  # (..., n, d) -> (..., d, n), contiguous


def _sizes(q: Tensor, k: Tensor, v: Tensor, p: Plan, tiles: tuple[int, int]) -> dict[str, int]:
    """The kernel's named sizes (fused.h ``make_spec``)."""
    nb, h, ni, d = q.shape
    return {
        "b": nb, "h": h, "hk": k.shape[1], "i": ni, "j": k.shape[2], "d": d, "dv": v.shape[-1],
        "block_q": tiles[0], "block_k": tiles[1], "band_lo": p.band_lo, "band_hi": p.band_hi,
    }  # fmt: skip


def _tile_plan(q: Tensor, k: Tensor, p: Plan, tiles: tuple[int, int]):
    """The call's ``TilePlan`` at these tile sizes (shared with the cost model and ``tiled``)."""
    return tile_plan(p.structure, q.shape[2], k.shape[2], *tiles)


def _norms(q: Tensor, k: Tensor, p: Plan, acc: torch.dtype) -> tuple[Tensor | None, Tensor | None]:
    """``|q_i| * |scale| * log2(e)`` and ``|k_j|`` for skipping negligible tiles (relative bias),
    or None (no skipping): without a relative table, and wherever q, k or the table hold a
    non-finite value, whose NaN must reach every row that sees it (a bound over a NaN or an
    infinity says nothing)."""
    if p.relative is None or not (all_finite(q) and all_finite(k) and all_finite(p.relative)):
        return None, None
    # Cauchy-Schwarz bounds |scale q.k| by |scale| |q| |k|, whatever the scale's sign.
    q_norm = q.to(acc).norm(dim=-1).mul_(abs(p.scale) * LOG2E)  # (b, h, i)
    return q_norm.contiguous(), k.to(acc).norm(dim=-1).contiguous()  # (b, h_kv, j)


def _forward(q, k, v, bias, p: Plan, s: Setup):
    """``(out, lse, shift, poisoned, bad)``: output ``(b, h, i, dv)`` and natural log-sum-exp
    in the compute dtype; the log-sum-exp in base 2 as two parts, the row's maximum and log2 of
    its sum ``(2, b, h, i)``, for the backward; where the output must read NaN (non-finite values
    of v), and those values."""
    acc = compute_dtype(q.dtype)
    nb, h, ni, _ = q.shape
    nj, dv = k.shape[2], v.shape[-1]
    if q.numel() == 0 or nj == 0:  # nothing to attend: zeros, as the reference gives
        out = q.new_zeros(nb, h, ni, dv, dtype=acc)
        shift = q.new_zeros(2, nb, h, ni, dtype=acc)
        return out, q.new_full((nb, h, ni), blocked(acc), dtype=acc), shift, None, None
    kernel = jit.load()
    q_, k_, v_ = (t.to(s.dtype) for t in (q, k, v))
    # (b, h_kv, j, dv), contiguous: the kernel reads it as laid out, whatever v's strides
    bad = None if all_finite(v_) else (~torch.isfinite(v_)).contiguous()
    if bad is not None:
        v_ = v_.masked_fill(bad, 0.0)
    if s.packed:
        q_op, k_op, v_op = (_pad_even(t) for t in (q_, k_, v_))
        # any layout the caller gives (strided, transposed, expanded) is read contiguous
        q_op = q_op.contiguous()
        kt_op, v_op = pairs_of_columns(k_op), pairs_of_rows(v_op)
    else:
        q_op, kt_op, v_op = q_.contiguous(), _transposed(k_), v_.contiguous()
    out = q.new_empty(nb, h, ni, dv, dtype=acc)
    lse = q.new_empty(nb, h, ni, dtype=acc)
    shift = q.new_empty(2, nb, h, ni, dtype=acc)
    poisoned = None if bad is None else torch.zeros(nb, h, ni, dv, dtype=torch.bool)
    bias_ = None if bias is None else bias.to(acc).expand(nb, h, ni, nj)  # (b, h, i, j)
    q_norm, k_norm = _norms(q_, k_, p, acc)
    tiles = (s.block_q, s.block_k)
    offsets, kept = _tile_plan(q, k, p, tiles).tensors()  # key tiles of each query tile
    kernel.forward(
        q_op, kt_op, v_op, out, lse, shift, poisoned, bad, p.mask, bias_, p.relative, offsets,
        kept, q_norm, k_norm, _sizes(q, k, v, p, tiles),
        {"scale": p.scale, "negligible": negligible_bits(acc)},
    )  # fmt: skip
    return out, lse, shift, poisoned, bad


def _sum_to(t: Tensor, shape: torch.Size) -> Tensor:
    """Sum a ``(b, h, i, j)`` tensor over the axes where ``shape`` is 1 (broadcast axes)."""
    dims = [d for d in range(4) if shape[d] == 1 and t.shape[d] != 1]
    return t.sum(dim=dims, keepdim=True) if dims else t


def _backward(q, k, v, bias, out, shift, grad_out, bad, p: Plan, s: Setup, want_dbias: bool):
    """``(dq, dk, dv, dbias)`` in the compute dtype (``dbias`` None unless ``want_dbias``)."""
    acc = compute_dtype(q.dtype)
    nb, h, ni, d = q.shape
    hk, nj, dv = k.shape[1], k.shape[2], v.shape[-1]
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        zeros = [torch.zeros(t.shape, dtype=acc) for t in (q, k, v)]
        dbias = torch.zeros(bias.shape, dtype=acc) if want_dbias else None
        return (*zeros, dbias)
    kernel = jit.load()
    q_, k_, v_, do = (t.to(s.dtype) for t in (q, k, v, grad_out))
    if bad is not None:
        v_ = v_.masked_fill(bad, 0.0)
    delta = q.new_empty(nb, h, ni, dtype=acc)  # D = rowsum(dO * O), a head at a time (memory)
    for head in range(h):
        delta[:, head] = (grad_out[:, head].to(acc) * out[:, head].to(acc)).sum(dim=-1)
    nan_rows = bool(torch.isnan(shift[0]).any())
    if s.packed:
        q_, k_, v_, do = (_pad_even(t) for t in (q_, k_, v_, do))
        q_t, do_t = pairs_of_columns(q_), pairs_of_columns(do)
        do_rows, q_rows = pairs_of_rows(do), pairs_of_rows(q_)
    else:
        q_t, do_t, do_rows, q_rows = _transposed(q_), _transposed(do), do.contiguous(), q_
    k_op, v_op, kt_op = k_.contiguous(), v_.contiguous(), _transposed(k_)
    d_p, dv_p, ni_p, nj_p = k_op.shape[-1], v_op.shape[-1], q_.shape[-2], k_op.shape[-2]
    dq_t = torch.zeros(nb, h, d_p, ni_p, dtype=acc)
    dk_h = torch.zeros(nb, h, nj_p, d_p, dtype=acc)  # per query head, summed below
    dv_h = torch.zeros(nb, h, nj_p, dv_p, dtype=acc)
    dbias_full = torch.zeros(nb, h, ni, nj, dtype=acc) if want_dbias else None
    bias_ = None if bias is None else bias.to(acc).expand(nb, h, ni, nj)  # (b, h, i, j)
    relative = None if p.relative is None else p.relative.flip(-1).contiguous()
    q_norm, k_norm = _norms(q_[..., :ni, :d], k_[..., :nj, :d], p, acc)
    tiles = (s.backward_q, s.backward_k)
    offsets, kept = _tile_plan(q, k, p, tiles).by_key()  # query tiles of each key tile
    kernel.backward(
        k_op, v_op, kt_op, q_t.contiguous(), do_t, do_rows, q_rows.contiguous(), shift, delta,
        dq_t, dk_h, dv_h, dbias_full, p.mask, bias_, relative, offsets, kept, q_norm, k_norm,
        _sizes(q, k, v, p, tiles),
        {"scale": p.scale, "negligible": negligible_bits(acc), "nan_rows": float(nan_rows)},
    )  # fmt: skip
    g = h // hk
    dq = dq_t.mul_(p.scale).transpose(-1, -2)[:, :, :ni, :d]  # (b, h, i, d)
    # per query head (b, h_kv, g, j, d) summed over each group: (b, h_kv, j, d)
    dk = (dk_h if g == 1 else dk_h.view(nb, hk, g, nj_p, d_p).sum(dim=2))[:, :, :nj, :d]
    dk = dk.mul_(p.scale)
    dv_ = (dv_h if g == 1 else dv_h.view(nb, hk, g, nj_p, dv_p).sum(dim=2))[:, :, :nj, :dv]
    if bad is not None:
        dv_ = dv_.masked_fill(bad, 0.0)
    dbias = None if dbias_full is None else _sum_to(dbias_full, bias.shape)
    return dq, dk, dv_, dbias


class _FusedAttention(torch.autograd.Function):
    """Forward saves q, k, v, the bias, the output and the log-sum-exp (as its two parts,
    ``shift``); backward recomputes."""

    @staticmethod
    def forward(ctx, q, k, v, bias, p: Plan, s: Setup):  # type: ignore[override]
        out, lse, shift, poisoned, bad = _forward(q, k, v, bias, p, s)
        ctx.plan, ctx.setup, ctx.bad = p, s, bad
        out = out.to(q.dtype)  # kept as returned (before NaN), as torch keeps its output
        ctx.save_for_backward(q, k, v, bias, out, shift, poisoned)
        ctx.mark_non_differentiable(lse)
        result = out if poisoned is None else out.masked_fill(poisoned, float("nan"))
        return result, lse

    @staticmethod
    def backward(ctx, grad_out: Tensor, grad_lse: Tensor | None):  # type: ignore[override]
        q, k, v, bias, out, shift, poisoned = ctx.saved_tensors
        if poisoned is not None:  # NaN entries from non-finite values carry no gradient
            grad_out = grad_out.masked_fill(poisoned, 0.0)
        want_dbias = bias is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dbias = _backward(
            q, k, v, bias, out, shift, grad_out, ctx.bad, ctx.plan, ctx.setup, want_dbias
        )
        dbias = None if dbias is None else dbias.to(bias.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias, None, None


def fused_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    mask: Tensor | None = None,
    mask_fn: MaskFn | None = None,
    bias: Tensor | None = None,
    bias_fn: BiasFn | None = None,
    is_causal: bool = False,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Differentiable fused attention on 4-D CPU inputs ``q (b, h, i, d)``, ``k, v (b, h_kv, j,
    d)``; the arguments mean what they mean for ``tiled_attention`` (``is_causal`` bottom-right).
    Gradients flow to ``q``, ``k``, ``v`` and a ``bias`` tensor. ``return_lse=True`` also
    returns the natural log-sum-exp of each row ``(b, h, i)`` (not differentiable)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    pad4 = lambda t: None if t is None else pad_to_rank(t, 4)  # noqa: E731
    p, dense_bias = plan(
        q, k, scale=scale, mask=pad4(mask), mask_fn=mask_fn, bias=pad4(bias),
        bias_fn=bias_fn, is_causal=is_causal,
    )  # fmt: skip
    s = setup(q, p, jit.load())
    out, lse = _FusedAttention.apply(q, k, v, dense_bias, p, s)
    return (out, lse) if return_lse else out


# The registry entry: AttentionCall (any leading dims) -> 4-D fused_attention.


def why_not(call: AttentionCall) -> str | None:
    q = call.query
    if q.device.type != "cpu":
        return f"the fused kernel runs on CPU tensors; these are on {q.device}"
    if q.dtype not in _DTYPES:
        return f"the fused kernel takes float16, bfloat16, float32 and float64, not {q.dtype}"
    if call.return_weights:
        return "return_weights=True: the fused kernel never builds the attention weights"
    if call.dropout_p > 0.0:
        return f"dropout_p={call.dropout_p}: the fused kernel has no dropout"
    reason = call.modification.unserved(SERVES, "the fused kernel")
    if reason is not None:
        return reason
    if call.sinks is not None:
        return "sinks: the fused kernel has no attention sinks; backend 'tiled' has"
    if q.shape[-1] == 0 or call.value.shape[-1] == 0:
        return "zero-width heads: the fused kernel needs d >= 1 and dv >= 1"
    grad = torch.is_grad_enabled()
    if callable(call.bias) and grad and bias_requires_grad(call.bias, q.device):
        return (
            "the bias function's output requires grad: the fused kernel does not "
            "differentiate through bias functions; pass the bias as a tensor"
        )
    mask_fn = call.mask if callable(call.mask) else None
    bias_fn = call.bias if callable(call.bias) else None
    need = materialized_bytes(mask_fn, bias_fn, call.score_shape, q.dtype)
    if need > MATERIALIZE_BYTES:
        return (
            f"a mask or bias function without structure the fused kernel evaluates itself "
            f"would take {need / 2**20:.0f} MiB as a tensor (limit "
            f"{MATERIALIZE_BYTES / 2**20:.0f} MiB); backend 'tiled' evaluates it per tile"
        )
    return jit.unavailable()  # never builds: auto weighs the kernel once it is built


def prepare() -> None:
    """Build the kernel for an explicit ``backend="fused"`` (``why_not`` then says why not,
    where it cannot be built)."""
    with contextlib.suppress(jit.NotBuilt):
        jit.load()


def run(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    x = engine_inputs(call)
    out, lse = fused_attention(
        x.q, x.k, x.v, scale=x.scale, mask=x.mask, mask_fn=x.mask_fn, bias=x.bias,
        bias_fn=x.bias_fn, is_causal=x.is_causal, return_lse=True,
    )  # fmt: skip
    return x.output(out), (x.lse(lse) if call.return_lse else None)


register_backend(
    "fused",
    run,
    why_not,
    description="the tiled algorithm as one C++ kernel per direction (CPU, built when asked)",
    prepare=prepare,
)
