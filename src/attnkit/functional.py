"""Scaled dot-product attention: the reference math, written once, and dispatch to a backend.

Shape vocabulary (used in every comment below):

    b  batch    h  query heads    h_kv  key/value heads    g = h // h_kv  queries per kv head
    i  query positions    j  key positions    d  query/key width    dv  value width

The reference (``attention_math``) is the specification every fast backend is tested against
(Vaswani et al. 2017, "Attention Is All You Need", section 3.2.1)::

    scores  = (Q @ K^T) * scale               # (..., h, i, j), scale defaults to 1/sqrt(d)
    scores  = softcap(scores) + bias          # softcap: optional, caps Q.K only (see below)
    scores  = scores where mask else -big     # mask: True = may attend; so is a -inf score
    weights = softmax(scores) * mask          # a fully masked row becomes all zeros
    weights = dropout(weights)                # training only; the caller passes dropout_p=0 at eval
    output  = weights @ V                     # (..., h, i, dv)

Why this order: the scale keeps softmax from saturating
as ``d`` grows; the mask must come before softmax so blocked keys take no probability mass; dropout
comes after softmax so it perturbs a distribution rather than the logits.

Numerics: scores and softmax are computed in float32 (float64 stays float64), so float16 and
bfloat16 inputs with large logits do not overflow. Blocked positions get the dtype's finite
minimum, not ``-inf`` (which would turn a fully masked row into NaN), and the weights are then
multiplied by the mask, so a fully masked row yields zero weights, zero output and finite gradients
instead of the uniform attention a ``-1e9`` fill gives. NaN and infinities follow the rules in
``attnkit._numerics``: a NaN reaches exactly the rows that can see it, never through a blocked
position.
"""

from __future__ import annotations

import math
from numbers import Real

import torch
from torch import Tensor

from attnkit._numerics import attention_op, blocked, compute_dtype, poison
from attnkit.masks import BiasFn, MaskFn, pad_to_rank
from attnkit.registry import (
    AttentionCall,
    ScoreMod,
    forced_backend,
    get_backend,
    register_backend,
    select_backend,
    use,
)

__all__ = ["attention_math", "make_call", "nested_why_not", "scaled_dot_product_attention"]


@attention_op  # under autocast: inputs in the autocast dtype, float32 statistics inside
def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | MaskFn | None = None,
    *,
    bias: Tensor | BiasFn | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    backend: str = "auto",
    generator: torch.Generator | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    score_mod: ScoreMod | None = None,
    return_lse: bool = False,
    block_sizes: tuple[int, int] | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of ``query`` over ``key``/``value``.

    Args:
        query: ``(..., h, i, d)``; any number of leading dims (a head axis is optional).
        key: ``(..., h_kv, j, d)``. ``h_kv`` may divide ``h`` (grouped-query attention, for
            4-D inputs); ``j`` may differ from ``i``.
        value: ``(..., h_kv, j, dv)``; ``dv`` may differ from ``d``.
        mask: bool, ``True`` = may attend, broadcastable to ``(..., h, i, j)``; or a mask function
            ``fn(b, h, i, j) -> bool`` (4-D inputs only). See ``attnkit.masks``.
        bias: float, added to the scaled scores (relative positions, ALiBi), broadcastable to
            ``(..., h, i, j)``; or a bias function ``fn(b, h, i, j) -> float``.
        is_causal: query ``q`` sees keys ``k <= q + (j - i)``: aligned bottom-right, so with a KV
            cache the last query sees every key. For ``i = 2, j = 5``::

                1 1 1 1 0
                1 1 1 1 1

            May be combined with ``mask`` (both apply).
        scale: multiplies ``Q @ K^T``; ``None`` means ``1 / sqrt(d)``.
        dropout_p: probability of zeroing an attention weight (survivors are scaled by
            ``1 / (1 - p)``). Pass ``0.0`` at inference; modules do this from ``self.training``.
        return_weights: also return the attention weights ``(..., h, i, j)`` (before dropout).
        backend: ``"auto"`` (the backend this machine's measurements say is fastest for the
            call, within a memory budget; before any measurement, and on CUDA or MPS, torch's
            kernel wherever it serves the call without building an ``n x n`` tensor, else a
            tile loop: ``attnkit.backends.explain`` says which and why), ``"math"`` (the
            reference below), ``"torch"``, ``"tiled"``, ``"fused"`` (compiled on this call
            when not built yet), ``"sparse"``, ``"chunked"``, or any registered backend.
        generator: random generator for dropout, for reproducible masks.
        softcap: caps the scaled dot products, ``softcap * tanh(scale * q.k / softcap)``
            (logit soft-capping, Gemma 2); ``bias`` is added after the cap, uncapped, and masks
            apply last. So a ``-inf`` bias still blocks its key (a row of ``-inf`` gives
            zeros), and a float attention mask or a relative bias shifts the capped scores, as
            in transformers' eager attention of every soft-capped model (Gemma 2 and 3,
            T5Gemma, VaultGemma: ``tanh`` on ``q.k``, then ``+ attention_mask``) and in
            FlashAttention's ``softcap``. To cap a bias too, add it inside a ``score_mod``.
        sinks: ``(h,)``, one learned logit per query head that joins each row's softmax
            denominator without contributing a value, so a row's weights may sum to less than
            one: ``w_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij))`` (the attention sinks of
            gpt-oss; Xiao et al. 2023, arXiv:2309.17453, for the phenomenon). Needs a head
            axis (inputs of 4 or more dims).
        score_mod: ``fn(score, b, h, i, j) -> score``, FlexAttention's score modification:
            rewrites the scaled (soft-capped, then biased) scores before masking; called on a
            score tensor and broadcast index tensors (as mask and bias functions are), so it
            must be elementwise; 4-D inputs only. Served by "math", "tiled" and "sparse".
        return_lse: also return the natural log-sum-exp of each row's modified scores over its
            visible keys (and sink), ``(..., h, i)`` in the compute dtype, ``-inf`` for a row
            that sees nothing; not differentiable. Served by "math", "tiled", "sparse" and
            "fused" (not with ``return_weights``).
        block_sizes: ``(block_q, block_k)``, the tile sizes the tile engines ("tiled",
            "sparse") plan the call with; None: their own. ``attnkit.flex`` passes its block
            mask's ``BLOCK_SIZE``.

    Returns:
        The output ``(..., h, i, dv)`` in the query's dtype, or ``(output, weights)``, or
        ``(output, lse)``. Under
        ``torch.autocast`` inputs are first cast to the autocast dtype (float64 stays), so the
        output has that dtype on every backend; softmax statistics stay in float32.
    """
    call = make_call(
        query,
        key,
        value,
        mask,
        bias=bias,
        is_causal=is_causal,
        scale=scale,
        dropout_p=dropout_p,
        return_weights=return_weights,
        generator=generator,
        softcap=softcap,
        sinks=sinks,
        score_mod=score_mod,
        return_lse=return_lse,
        block_sizes=block_sizes,
    )
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    if backend != "auto":
        get_backend(backend)  # unknown names fail here, before any work
    if (query.is_nested or query.device.type == "meta") and (forced_backend() or backend) == "auto":
        # Jagged batches: torch's kernel is the one backend that takes them, and auto's cost
        # model sizes a call with plain ints, so they go there before auto weighs anything.
        # Meta tensors (shapes without values) too: the other backends look at values.
        with use("torch"):
            chosen = select_backend("torch", call)
    else:
        chosen = select_backend(backend, call)
    output, extra = chosen.run(call)
    if return_weights:
        assert extra is not None, "a backend that serves return_weights must return weights"
        return output, extra
    if return_lse:
        assert extra is not None, "a backend that serves return_lse must return the lse"
        # an engine marks a row that sees nothing with the blocked minimum (the backward reads
        # it so): log 0 = -inf here
        return output, extra.masked_fill(extra <= blocked(extra.dtype) * 0.5, float("-inf"))
    return output


def make_call(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | MaskFn | None = None,
    *,
    bias: Tensor | BiasFn | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    generator: torch.Generator | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    score_mod: ScoreMod | None = None,
    return_lse: bool = False,
    block_sizes: tuple[int, int] | None = None,
) -> AttentionCall:
    """Validate the arguments of an attention call; every problem is reported before any work."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if t.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., n, d), got {tuple(t.shape)}")
    shapes = f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, "
            f"{value.dtype}"
        )
    if not (query.device == key.device == value.device):
        raise ValueError(f"query, key and value must be on one device ({shapes})")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key must have the same last dim d; got {shapes}")
    if query.shape[-1] == 0 and scale is None:
        raise ValueError(
            f"query and key have width d = 0, so the default scale 1/sqrt(d) is undefined; "
            f"pass scale= ({shapes})"
        )
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"key and value must have the same length j (dim -2); got {shapes}")
    if key.shape[:-2] != value.shape[:-2]:
        raise ValueError(f"key and value must have the same leading dims; got {shapes}")
    if query.ndim != key.ndim:
        raise ValueError(f"query and key must have the same number of dims; got {shapes}")
    if query.ndim < 4 and query.shape[:-2] != key.shape[:-2]:
        raise ValueError(f"query and key must have the same batch dims; got {shapes}")
    if query.ndim >= 4:
        # Grouped-query attention: dim -3 is the head axis; key/value heads may divide query heads.
        if query.shape[:-3] != key.shape[:-3]:
            raise ValueError(f"query and key must have the same batch dims; got {shapes}")
        h, h_kv = query.shape[-3], key.shape[-3]
        if h_kv == 0 or h % h_kv != 0:
            raise ValueError(
                f"key/value heads (dim -3, {h_kv}) must equal or divide query heads ({h}) "
                f"for grouped-query attention; got {shapes}"
            )
    score_shape = (*query.shape[:-1], key.shape[-2])

    if mask is not None and not callable(mask):
        check_mask(mask, score_shape, query)
    if bias is not None and not callable(bias):
        if not isinstance(bias, Tensor):
            raise TypeError(
                f"bias must be a float tensor or a bias function, got {type(bias).__name__}"
            )
        if not bias.is_floating_point():
            raise TypeError(f"bias must be a floating-point tensor, got dtype {bias.dtype}")
        _check_broadcast("bias", bias, score_shape)
        _check_device("bias", bias, query)
    if (callable(mask) or callable(bias)) and query.ndim != 4:
        raise ValueError(
            f"mask and bias functions take (b, h, i, j) indices, so query must be 4-D; got {shapes}"
        )
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    elif not isinstance(scale, Real) or isinstance(scale, bool) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite number or None, got {scale!r}")
    if not isinstance(dropout_p, Real) or isinstance(dropout_p, bool) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if not isinstance(return_weights, bool):
        raise TypeError(f"return_weights must be a bool, got {type(return_weights).__name__}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if softcap is not None and (
        not isinstance(softcap, Real)
        or isinstance(softcap, bool)
        or not (math.isfinite(softcap) and softcap > 0)
    ):
        raise ValueError(f"softcap must be a positive finite number or None, got {softcap!r}")
    if sinks is not None:
        _check_sinks(sinks, query)
    if score_mod is not None and not callable(score_mod):
        raise TypeError(
            f"score_mod must be a function (score, b, h, i, j) -> score, got "
            f"{type(score_mod).__name__}"
        )
    if score_mod is not None and query.ndim != 4:
        raise ValueError(
            f"score_mod takes (b, h, i, j) indices, so query must be 4-D; got {shapes}"
        )
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if return_lse and return_weights:
        raise ValueError("return_lse and return_weights: ask for one of them")
    if block_sizes is not None and not (
        isinstance(block_sizes, tuple)
        and len(block_sizes) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in block_sizes)
    ):
        raise ValueError(
            f"block_sizes must be None or two positive ints (block_q, block_k), got {block_sizes!r}"
        )
    return AttentionCall(
        query,
        key,
        value,
        mask,
        bias,
        is_causal,
        float(scale),
        float(dropout_p),
        generator,
        return_weights,
        None if softcap is None else float(softcap),
        sinks,
        score_mod,
        return_lse,
        block_sizes,
    )


def check_mask(mask: object, score_shape: tuple[int, ...], query: Tensor) -> None:
    """A mask tensor as attention takes it: bool (``True`` = may attend), broadcastable to
    ``score_shape`` (``(..., h, i, j)``) and on ``query``'s device; a clear error otherwise."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a bool tensor or a mask function, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(
            f"mask must be a bool tensor (True = may attend), got dtype {mask.dtype}; "
            "for an additive float mask pass it as bias=, for torch's True = ignore "
            "convention use attnkit.masks.from_torch"
        )
    _check_broadcast("mask", mask, score_shape)
    _check_device("mask", mask, query)


def _check_broadcast(name: str, t: Tensor, score_shape: tuple[int, ...]) -> None:
    # Broadcasting to score_shape (never growing it): each trailing dim is 1 or equal. Written
    # out because torch.broadcast_shapes costs ~30 us, as much as a whole decoding step's kernel.
    shape = tuple(t.shape)
    fits = len(shape) <= len(score_shape) and all(
        a == 1 or a == b for a, b in zip(reversed(shape), reversed(score_shape), strict=False)
    )
    if not fits:
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} does not broadcast to the scores' shape "
            f"{tuple(score_shape)} (..., h, i, j)"
        )


def _check_sinks(sinks: object, query: Tensor) -> None:
    if not isinstance(sinks, Tensor) or not sinks.is_floating_point():
        got = sinks.dtype if isinstance(sinks, Tensor) else type(sinks).__name__
        raise TypeError(f"sinks must be a floating-point tensor of shape (h,), got {got}")
    if query.ndim < 4:
        raise ValueError(
            f"sinks are one logit per head, so query needs a head axis (..., h, i, d); "
            f"got query {tuple(query.shape)}"
        )
    h = query.shape[-3]
    if tuple(sinks.shape) != (h,):
        raise ValueError(
            f"sinks must have shape (h,) = ({h},), one logit per query head; "
            f"got {tuple(sinks.shape)}"
        )
    _check_device("sinks", sinks, query)


def _check_device(name: str, t: Tensor, query: Tensor) -> None:
    if t.device != query.device:
        raise ValueError(
            f"{name} is on device {t.device} but query, key and value are on {query.device}; "
            f"move it with .to({str(query.device)!r})"
        )


def _grouped(t: Tensor, ndim: int, h_kv: int, g: int) -> Tensor:
    """View a tensor broadcastable to ``(..., h, i, j)`` as ``(..., h_kv, g, i, j)``, no copy."""
    t = pad_to_rank(t, ndim)
    if t.shape[-3] == 1:
        return t.unsqueeze(-3)  # (..., 1, 1, i, j)
    return t.unflatten(-3, (h_kv, g))  # (..., h_kv, g, i, j)


def _sink_column(sinks: Tensor, scores: Tensor, g: int) -> Tensor:
    """The sink logit of each row, ``(..., h, i, 1)`` (grouped: ``(..., h_kv, g, i, 1)``)."""
    # (h_kv, g, 1, 1) grouped, else (h, 1, 1)
    column = sinks.view(-1, g, 1, 1) if g > 1 else sinks.view(-1, 1, 1)
    return column.expand(*scores.shape[:-1], 1)  # (..., h, i, 1) or (..., h_kv, g, i, 1)


def _positions(scores: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Index tensors ``b, h, i, j`` broadcastable to scores ``(b, h, i, j)``."""
    return tuple(  # type: ignore[return-value]
        torch.arange(n, device=scores.device).view([n if a == d else 1 for a in range(4)])
        for d, n in enumerate(scores.shape)
    )


def attention_math(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    """The reference: every step visible, every other backend is tested against it."""
    q, k, v = call.query, call.key, call.value
    compute = compute_dtype(q.dtype)
    g = call.groups
    mask = call.dense_mask()
    bias = call.dense_bias(compute)  # (..., h, i, j)-broadcastable: the tensor, or the function's
    if g > 1:
        # Grouped-query attention: each key/value head serves g query heads. Broadcasting a
        # singleton axis shares K and V between the group without copying them per head.
        h_kv = k.shape[-3]
        ndim = q.ndim  # the scores' rank before grouping
        q = q.unflatten(-3, (h_kv, g))  # (..., h_kv, g, i, d)
        k = k.unsqueeze(-3)  # (..., h_kv, 1, j, d)
        v = v.unsqueeze(-3)  # (..., h_kv, 1, j, dv)
        mask = None if mask is None else _grouped(mask, ndim, h_kv, g)

    scores = (q.to(compute) @ k.to(compute).transpose(-2, -1)) * call.scale  # (..., i, j)
    modification = call.modification
    if modification.parts:  # softcap, then bias, then score_mod (ScoreModification.apply)
        # Soft-capping: Gemma Team 2024, Gemma 2, section 2. The bias comes after the cap, so
        # an additive -inf still blocks (Gemma 2's eager attention).
        flat = scores.flatten(-4, -3) if g > 1 else scores  # (..., h, i, j), a view
        index = _positions(flat) if call.score_mod is not None else None
        flat, _ = modification.apply(
            flat, None if bias is None else pad_to_rank(bias, flat.ndim), index
        )
        scores = flat.unflatten(-3, scores.shape[-4:-2]) if g > 1 else flat  # grouped again
    visible = mask
    minus_inf = torch.isneginf(scores)  # an additive -inf blocks its key, as a mask does
    if bool(minus_inf.any()):
        visible = ~minus_inf if visible is None else visible & ~minus_inf
    if visible is not None:
        scores = scores.masked_fill(~visible, blocked(compute))
    lse = None
    if call.return_lse:  # log-sum-exp over the visible keys (and the sink): -inf for none
        hidden = scores if visible is None else scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(hidden, dim=-1)  # (..., i)
        if call.sinks is not None:
            lse = torch.logaddexp(lse, _sink_column(call.sinks.to(compute), scores, g)[..., 0])
        lse = lse.flatten(-3, -2) if g > 1 else lse  # (..., h, i)
    if call.sinks is None:
        weights = torch.softmax(scores, dim=-1)
    else:  # a sink: one more logit per head in the denominator, with no value (gpt-oss)
        sink = _sink_column(call.sinks.to(compute), scores, g)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    if visible is not None:
        # A fully masked row softmaxes to uniform; multiplying by the mask makes it zero.
        weights = weights * visible
    attended = weights
    if call.dropout_p > 0.0:
        keep = (
            torch.rand(
                weights.shape, generator=call.generator, device=weights.device, dtype=compute
            )
            >= call.dropout_p
        )
        attended = weights * keep / (1.0 - call.dropout_p)
    v = v.to(compute)
    bad = ~torch.isfinite(v)  # read as 0, and NaN for the rows that see them (_numerics)
    if bool(bad.any()):
        output = poison(attended @ v.masked_fill(bad, 0.0), visible, bad)
    else:
        output = attended @ v  # (..., i, dv)

    if g > 1:
        output = output.flatten(-4, -3)  # (..., h, i, dv)
        weights = weights.flatten(-4, -3)  # (..., h, i, j)
    out_weights = weights.to(call.query.dtype) if call.return_weights else None
    return output.to(call.query.dtype), (lse.detach() if lse is not None else out_weights)


def nested_why_not(call: AttentionCall) -> str | None:
    """Why a backend other than torch's cannot serve nested (jagged) inputs, or None."""
    if call.query.is_nested:
        return (
            "nested (jagged) inputs: only torch's kernel takes them; use backend='torch' "
            "(or 'auto', which sends them there)"
        )
    return None


register_backend(
    "math",
    attention_math,
    nested_why_not,
    description="the reference: explicit scores, float32 softmax, serves every dense call",
)
