"""The tiled backend's entry points: the differentiable whole, the block steps for ring
attention, and the registry entries."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from attnkit._numerics import no_autocast
from attnkit.backends.engine_inputs import engine_inputs
from attnkit.backends.tiled.backward import backward
from attnkit.backends.tiled.forward import forward
from attnkit.backends.tiled.tiles import ScoreMod, Spec, tile_sizes
from attnkit.functional import make_call, nested_why_not
from attnkit.masks import (
    BiasFn,
    MaskFn,
    all_of,
    bias_requires_grad,
    causal_fn,
    causal_offset,
    pad_to_rank,
)
from attnkit.registry import AttentionCall, register_backend

__all__ = ["backward_blocks", "forward_blocks", "run_call", "tiled_attention", "why_not"]


class _TiledAttention(torch.autograd.Function):
    """Forward saves only q, k, v, the output and the log-sum-exp; backward recomputes tiles.

    Returns the output and the (non-differentiable) log-sum-exp. ``leaves`` are the tensors a
    score_mod captured (``_captured``): inputs here, so that autograd hands them their
    gradients like any other input's."""

    @staticmethod
    def forward(ctx, q, k, v, bias, sinks, spec: Spec, *leaves):  # type: ignore[override]
        spec = replace(spec, bias=bias)
        with no_autocast(q.device):
            out, lse, poisoned = forward(q, k, v, spec, sinks)
        out = out.to(q.dtype)
        ctx.spec = spec
        ctx.save_for_backward(q, k, v, bias, sinks, out, lse, poisoned, *leaves)
        ctx.mark_non_differentiable(lse)
        return (out if poisoned is None else out.masked_fill(poisoned, float("nan"))), lse

    @staticmethod
    def backward(ctx, grad_out: Tensor, grad_lse: Tensor | None):  # type: ignore[override]
        q, k, v, bias, sinks, out, lse, poisoned, *leaves = ctx.saved_tensors
        spec = replace(ctx.spec, bias=bias)
        want_dbias = bias is not None and ctx.needs_input_grad[3]
        if poisoned is not None:  # NaN entries from non-finite values carry no gradient
            grad_out = grad_out.masked_fill(poisoned, 0.0)
        with no_autocast(q.device):
            dq, dk, dv, dbias, dsinks, dleaves = backward(
                q, k, v, out, lse, grad_out, spec, want_dbias, sinks, tuple(leaves)
            )
        if dbias is not None:
            dbias = dbias.to(bias.dtype)
        if dsinks is not None:
            dsinks = dsinks.to(sinks.dtype)
        grads = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias, dsinks, None)
        return (*grads, *dleaves)


def _captured(score_mod: ScoreMod | None, q: Tensor) -> tuple[Tensor, ...]:
    """The leaf tensors that require grad and that ``score_mod`` reaches: found by calling it
    once on a one-element score and walking the autograd graph of its result."""
    if score_mod is None or not torch.is_grad_enabled():
        return ()
    index = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=q.device)
    score = torch.zeros(1, 1, 1, 1, dtype=q.dtype, device=q.device, requires_grad=True)
    with torch.enable_grad():
        out = score_mod(score, index, index, index, index)
    leaves: dict[int, Tensor] = {}
    stack = [getattr(out, "grad_fn", None)]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if isinstance(variable, Tensor) and variable is not score:
            leaves[id(variable)] = variable
        stack.extend(next_node for next_node, _ in node.next_functions)
    return tuple(leaves.values())


def _pad4(t: Tensor | None) -> Tensor | None:
    return None if t is None else pad_to_rank(t, 4)


def tiled_attention(
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
    block_q: int | None = None,
    block_k: int | None = None,
    gather: bool = False,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    score_mod: ScoreMod | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Differentiable tiled attention on 4-D inputs ``(b, h, i, d)``, ``k, v (b, h_kv, j, d)``.

    ``mask``/``bias``: bool/float tensors broadcastable to ``(b, h, i, j)``; ``mask_fn`` and
    ``bias_fn``: functions ``fn(b, h, i, j)`` evaluated per tile. ``is_causal`` is aligned
    bottom-right (as ``scaled_dot_product_attention``). Gradients flow to ``q``, ``k``, ``v``
    and a ``bias`` tensor, not into a bias function's parameters. ``gather=True`` visits all
    the key ranges a query block may see as one group (gathered when they are not contiguous):
    fewer, larger matmuls for sparse layouts (the ``sparse`` backend). ``softcap`` and
    ``sinks`` ``(h,)`` as in ``scaled_dot_product_attention``; gradients reach ``sinks``.

    ``score_mod(score, b, h, i, j) -> score`` (FlexAttention's) rewrites each tile's scaled
    (soft-capped, then biased) scores before masking, called on the tile itself in the engine's
    layout ``(b, h_kv, bi * g, bj)`` with index tensors that say which element each score is
    (``Tiles.index``), so it must be elementwise; gradients flow through it, into the tensors it
    captures too. ``return_lse=True`` also returns the natural
    log-sum-exp of each row ``(b, h, i)`` (not differentiable).
    """
    # checked as scaled_dot_product_attention checks its own (make_call), before any work
    for name, fn in (("mask_fn", mask_fn), ("bias_fn", bias_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be a function (b, h, i, j), got {type(fn).__name__}")
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(f"{name} must be a positive int or None, got {size!r}")
    make_call(q, k, v, mask, bias=bias, is_causal=is_causal, scale=scale, softcap=softcap,
              sinks=sinks, score_mod=score_mod, return_lse=return_lse)  # fmt: skip
    if q.ndim != 4:
        raise ValueError(
            "tiled_attention needs 4-D inputs: query (b, h, i, d), key and value (b, h_kv, j, d); "
            f"got query {tuple(q.shape)}"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if is_causal:
        mask_fn = all_of(mask_fn, causal_fn(causal_offset(q.shape[2], k.shape[2])))
    modified = bias is not None or bias_fn is not None or score_mod is not None
    block_q, block_k = tile_sizes(block_q, block_k, modified)
    spec = Spec(
        scale,
        _pad4(mask),
        mask_fn,
        None,
        bias_fn,
        block_q=block_q,
        block_k=block_k,
        gather=gather,
        softcap=softcap,
        score_mod=score_mod,
    )
    leaves = _captured(score_mod, q)
    out, lse = _TiledAttention.apply(q, k, v, _pad4(bias), sinks, spec, *leaves)
    return (out, lse) if return_lse else out


def forward_blocks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    mask: Tensor | None = None,
    mask_fn: MaskFn | None = None,
    bias: Tensor | None = None,
    bias_fn: BiasFn | None = None,
    q_offset: int = 0,
    k_offset: int = 0,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of ``q`` over one shard of keys: the normalised output and the log-sum-exp.

    Args:
        q: ``(b, h, i, d)``; k: ``(b, h_kv, j, d)``; v: ``(b, h_kv, j, dv)``, ``h_kv`` dividing
            ``h``. No autograd (use ``tiled_attention`` for a differentiable call).
        scale: multiplies ``q @ k^T``.
        mask / bias: bool / float tensors broadcastable to this shard's ``(b, h, i, j)``.
        mask_fn / bias_fn: functions ``fn(b, h, i, j)`` of *absolute* positions: query ``r`` of
            ``q`` is position ``q_offset + r``, key ``c`` of ``k`` is ``k_offset + c``. Causal
            attention over shards is ``mask_fn=masks.causal_fn(offset)`` with global positions.
        block_q, block_k: tile sizes (``None``: ``BLOCK_Q x BLOCK_K``; ``BLOCK_Q_BIAS x
            BLOCK_K_BIAS`` with a bias).

    Returns:
        ``out (b, h, i, dv)`` in the compute dtype (float32, float64 for float64 inputs) and
        ``lse (b, h, i)``, the natural log-sum-exp of each row's scaled, biased scores over the
        visible keys of this shard. A row that sees no key here has ``out = 0`` and
        ``lse = finfo(dtype).min`` (finite), which ``merge`` treats as "no contribution".
    """
    spec = _block_spec(scale, mask, mask_fn, bias, bias_fn, q_offset, k_offset, block_q, block_k)
    with torch.no_grad(), no_autocast(q.device):  # never differentiated
        out, lse, poisoned = forward(q, k, v, spec)
    return out if poisoned is None else out.masked_fill(poisoned, float("nan")), lse


def backward_blocks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    *,
    scale: float,
    mask: Tensor | None = None,
    mask_fn: MaskFn | None = None,
    bias: Tensor | None = None,
    bias_fn: BiasFn | None = None,
    q_offset: int = 0,
    k_offset: int = 0,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients for one K/V shard, given the *global* ``out`` and ``lse`` of these queries.

    ``out``/``lse`` are the final results over all shards (after ``merge``), ``grad_out`` the
    gradient of the loss with respect to ``out``. Returns ``dq`` (this shard's contribution:
    sum it over shards), ``dk`` and ``dv`` (complete for this shard), in the compute dtype.
    Other arguments as in ``forward_blocks``.
    """
    spec = _block_spec(scale, mask, mask_fn, bias, bias_fn, q_offset, k_offset, block_q, block_k)
    with torch.no_grad(), no_autocast(q.device):
        dq, dk, dv, *_ = backward(q, k, v, out, lse, grad_out, spec, want_dbias=False)
    return dq, dk, dv


def _block_spec(
    scale: float,
    mask: Tensor | None,
    mask_fn: MaskFn | None,
    bias: Tensor | None,
    bias_fn: BiasFn | None,
    q_offset: int,
    k_offset: int,
    block_q: int | None,
    block_k: int | None,
) -> Spec:
    block_q, block_k = tile_sizes(block_q, block_k, bias is not None or bias_fn is not None)
    return Spec(
        scale, _pad4(mask), mask_fn, _pad4(bias), bias_fn, q_offset, k_offset, block_q, block_k
    )


# The registry entry: AttentionCall (any leading dims) -> 4-D tiled_attention.


def why_not(call: AttentionCall) -> str | None:
    if call.query.is_nested:
        return nested_why_not(call)
    if call.return_weights:
        return "return_weights=True: the tiled backend never builds the attention weights"
    if call.dropout_p > 0.0:
        return (
            f"dropout_p={call.dropout_p}: the tiled backend cannot replay a dropout mask tile by "
            "tile in its backward; use backend='math' or 'torch' for dropout"
        )
    grad = torch.is_grad_enabled()
    if callable(call.bias) and grad and bias_requires_grad(call.bias, call.query.device):
        return (
            "the bias function's output requires grad: the tiled backend does not "
            "differentiate through bias functions; pass the bias as a tensor"
        )
    return None


def run_call(
    call: AttentionCall,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    gather: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Serve an ``AttentionCall`` (any leading dims) with ``tiled_attention``: the output and,
    when ``call.return_lse``, the log-sum-exp. Tile sizes: as given (``sparse``, with
    ``gather``), else the call's ``block_sizes``, else the engine's."""
    if call.block_sizes is not None:
        block_q = call.block_sizes[0] if block_q is None else block_q
        block_k = call.block_sizes[1] if block_k is None else block_k
    x = engine_inputs(call)
    out, lse = tiled_attention(
        x.q, x.k, x.v, scale=x.scale, mask=x.mask, mask_fn=x.mask_fn, bias=x.bias,
        bias_fn=x.bias_fn, is_causal=x.is_causal, block_q=block_q, block_k=block_k,
        gather=gather, softcap=x.modification.softcap, sinks=x.sinks,
        score_mod=x.modification.score_mod, return_lse=True,
    )  # fmt: skip
    return x.output(out), (x.lse(lse) if call.return_lse else None)


def run(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    return run_call(call)


register_backend(
    "tiled",
    run,
    why_not,
    description="FlashAttention in PyTorch: online softmax over tiles, recomputing backward",
)
