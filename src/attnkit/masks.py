"""Attention masks, in one convention.

A mask is a **bool** tensor where ``True`` means *may attend* and ``False`` means *blocked*.
It broadcasts against the score shape ``(b, h, i, j)``:

    b  batch          h  heads          i  query positions          j  key positions

Every builder here returns a tensor already shaped to broadcast (for example a padding mask is
``(b, 1, 1, j)``), so masks combine with ``&`` and never need to be copied per head.

Besides tensors, attnkit accepts *mask functions* (``MaskFn``): a callable
``fn(b, h, i, j) -> bool tensor`` over broadcastable integer index tensors. Block-wise backends
evaluate them one tile at a time, so no ``i x j`` tensor is ever built. ``materialize`` turns a
function into the equivalent dense tensor (what the reference math does).

Conversion to the additive float form happens only at a backend boundary (``to_additive``), with a
finite minimum rather than ``-inf``: ``-inf`` turns a fully blocked row into NaN.

Causal alignment
----------------
With ``i`` queries and ``j`` keys, ``align="bottom-right"`` (the default, what a KV cache needs)
lines the *last* query up with the *last* key; ``align="top-left"`` lines up the first ones
(torch's ``is_causal``). For ``i = 2``, ``j = 5`` (1 = keep, 0 = masked out)::

    bottom-right          top-left
    1 1 1 1 0             1 0 0 0 0
    1 1 1 1 1             1 1 0 0 0

With ``i > j`` bottom-right alignment leaves the first ``i - j`` rows fully masked; those rows
produce zeros, not NaN.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor

from attnkit._numerics import blocked
from attnkit._structure import (
    Band,
    Structure,
    StructuredFn,
    TilePlan,
    all_of,
    declare,
    exact_structure,
    exactly,
    plan_cache_info,
    relative,
    structure_of,
    tile_plan,
)

MaskFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""``fn(b, h, i, j) -> bool``: index tensors in, ``True`` = may attend out."""

BiasFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""``fn(b, h, i, j) -> float``: index tensors in, additive score bias out."""

Align = Literal["bottom-right", "top-left"]

__all__ = [
    "Align",
    "Band",
    "BiasFn",
    "MaskFn",
    "Structure",
    "StructuredFn",
    "TilePlan",
    "all_of",
    "block_diagonal_mask",
    "causal_fn",
    "causal_mask",
    "causal_offset",
    "checked_bias",
    "checked_mask",
    "combine_masks",
    "declare",
    "exact_structure",
    "from_torch",
    "materialize",
    "pad_to_rank",
    "padding_mask",
    "padding_mask_from_ids",
    "plan_cache_info",
    "relative",
    "sliding_window_mask",
    "structure_of",
    "tile_plan",
    "to_additive",
    "window_fn",
]


def causal_offset(n_queries: int, n_keys: int, align: Align = "bottom-right") -> int:
    """Key index that query 0 may reach: query ``q`` sees keys ``k <= q + offset``."""
    if align == "bottom-right":
        return n_keys - n_queries
    if align == "top-left":
        return 0
    raise ValueError(f"align must be 'bottom-right' or 'top-left', got {align!r}")


def _positions(
    n_queries: int, n_keys: int, device: torch.device | str | None
) -> tuple[Tensor, Tensor]:
    i = torch.arange(n_queries, device=device).unsqueeze(-1)  # (i, 1)
    j = torch.arange(n_keys, device=device).unsqueeze(0)  # (1, j)
    return i, j


# Positions, offsets and window sizes are int64 in the index arithmetic (``i + offset - j``);
# bounded by 2**62, a sum of two of them cannot wrap around (a wrapped offset turned a causal
# mask into "nothing visible" on one backend and "everything" on another).
INDEX_BOUND = 2**62


def _check_length(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= INDEX_BOUND:
        raise ValueError(f"{name} must be an int from 0 to 2**62, got {value!r}")


def _check_offset(value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or abs(value) > INDEX_BOUND:
        raise ValueError(f"offset must be an int from -2**62 to 2**62, got {value!r}")


def causal_mask(
    n_queries: int,
    n_keys: int | None = None,
    *,
    align: Align = "bottom-right",
    device: torch.device | str | None = None,
) -> Tensor:
    """Causal mask ``(i, j)``: query ``q`` may attend key ``k`` when ``k <= q + offset``.

    ``n_keys`` defaults to ``n_queries``. See the module docstring for the two alignments.
    """
    n_keys = n_queries if n_keys is None else n_keys
    _check_length("n_queries", n_queries)
    _check_length("n_keys", n_keys)
    offset = causal_offset(n_queries, n_keys, align)
    i, j = _positions(n_queries, n_keys, device)
    return j <= i + offset


def sliding_window_mask(
    n_queries: int,
    n_keys: int | None = None,
    *,
    left: int,
    right: int = 0,
    align: Align = "bottom-right",
    device: torch.device | str | None = None,
) -> Tensor:
    """Local attention ``(i, j)``: query ``q`` sees keys from ``left`` before to ``right`` after it.

    Positions are aligned as in ``causal_mask``; with ``right=0`` the window is causal. A causal
    window of ``w`` keys (the query itself included) is ``left=w - 1, right=0``.
    """
    n_keys = n_queries if n_keys is None else n_keys
    _check_length("n_queries", n_queries)
    _check_length("n_keys", n_keys)
    _check_length("left", left)
    _check_length("right", right)
    offset = causal_offset(n_queries, n_keys, align)
    i, j = _positions(n_queries, n_keys, device)
    distance = (i + offset) - j  # how far the key lies behind the query
    return (distance <= left) & (distance >= -right)


def padding_mask(lengths: Tensor | Sequence[int], max_len: int | None = None) -> Tensor:
    """Key padding mask ``(b, 1, 1, j)`` from sequence lengths: ``True`` on real tokens."""
    lengths = torch.as_tensor(lengths)
    if lengths.ndim != 1 or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise ValueError(
            f"lengths must be a 1-D integer tensor of shape (b,), got dtype {lengths.dtype} "
            f"and shape {tuple(lengths.shape)}"
        )
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"lengths must be non-negative, got {lengths.tolist()}")
    longest = int(lengths.max()) if lengths.numel() else 0
    if max_len is not None and (isinstance(max_len, bool) or not hasattr(max_len, "__index__")):
        raise ValueError(f"max_len must be an int or None, got {max_len!r}")
    max_len = longest if max_len is None else operator.index(max_len)
    if max_len < longest:
        raise ValueError(f"max_len={max_len} is shorter than the longest length {longest}")
    j = torch.arange(max_len, device=lengths.device)
    return (j < lengths.unsqueeze(-1))[:, None, None, :]  # (b, 1, 1, j)


def _tensors(fn: str, **named: object) -> None:
    """A clear TypeError for an argument that should be a tensor (or None) and is not."""
    for name, value in named.items():
        if value is not None and not isinstance(value, Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(value).__name__}")


def padding_mask_from_ids(ids: Tensor, pad_id: int) -> Tensor:
    """Key padding mask ``(b, 1, 1, j)`` from token ids ``(b, j)``; ``True`` on real tokens."""
    _tensors("padding_mask_from_ids", ids=ids)
    if ids.ndim != 2:
        raise ValueError(f"ids must have shape (b, j), got {tuple(ids.shape)}")
    return (ids != pad_id)[:, None, None, :]  # (b, 1, 1, j)


def block_diagonal_mask(segment_ids: Tensor, key_segment_ids: Tensor | None = None) -> Tensor:
    """Mask ``(b, 1, i, j)`` for packed sequences: attend only within the same segment.

    ``segment_ids`` is ``(b, i)`` (or ``(i,)``), one id per position; ``key_segment_ids``
    defaults to it. Negative ids mark padding, which attends to nothing and is never attended.
    """
    _tensors("block_diagonal_mask", segment_ids=segment_ids, key_segment_ids=key_segment_ids)
    q_ids = segment_ids
    k_ids = segment_ids if key_segment_ids is None else key_segment_ids
    if q_ids.ndim == 1:
        q_ids = q_ids.unsqueeze(0)
    if k_ids.ndim == 1:
        k_ids = k_ids.unsqueeze(0)
    if q_ids.ndim != 2 or k_ids.ndim != 2:
        raise ValueError(
            f"segment ids must have shape (b, n) or (n,), got {tuple(segment_ids.shape)}"
        )
    same = q_ids[:, :, None] == k_ids[:, None, :]  # (b, i, j)
    real = (q_ids[:, :, None] >= 0) & (k_ids[:, None, :] >= 0)
    return (same & real).unsqueeze(1)  # (b, 1, i, j)


def combine_masks(*masks: Tensor | None) -> Tensor | None:
    """Logical AND of any number of bool masks (``None`` entries are skipped); broadcasts."""
    result: Tensor | None = None
    for m in masks:
        if m is None:
            continue
        _tensors("combine_masks", mask=m)
        if m.dtype != torch.bool:
            raise TypeError(f"combine_masks takes bool masks, got dtype {m.dtype}")
        result = m if result is None else result & m
    return result


def from_torch(
    attn_mask: Tensor | None = None, key_padding_mask: Tensor | None = None
) -> Tensor | None:
    """Translate ``nn.MultiheadAttention``'s masks into attnkit's convention.

    torch's bool masks mean ``True`` = *ignore*; its float ``attn_mask`` is added to the scores
    (``-inf`` blocks). ``key_padding_mask`` is ``(b, j)``; ``attn_mask`` is ``(i, j)`` or
    ``(b * h, i, j)`` (the latter is returned as ``(b * h, i, j)``: reshape it to ``(b, h, i, j)``).
    Returns a bool mask, ``True`` = may attend, shaped to broadcast to ``(b, h, i, j)``.
    A float ``attn_mask`` must hold only ``0`` and ``-inf``; anything else is a bias, not a mask.
    """
    _tensors("from_torch", attn_mask=attn_mask, key_padding_mask=key_padding_mask)
    parts: list[Tensor] = []
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            parts.append(~attn_mask)
        elif attn_mask.is_floating_point():
            blocked = torch.isneginf(attn_mask)
            if not bool(((attn_mask == 0) | blocked).all()):
                raise ValueError(
                    "attn_mask is a float tensor with values other than 0 and -inf; that is a "
                    "bias: pass it as `bias=` instead of converting it to a mask"
                )
            parts.append(~blocked)
        else:
            raise TypeError(f"attn_mask must be bool or float, got dtype {attn_mask.dtype}")
    if key_padding_mask is not None:
        if key_padding_mask.ndim != 2:
            raise ValueError(
                f"key_padding_mask must have shape (b, j), got {tuple(key_padding_mask.shape)}"
            )
        kpm = key_padding_mask
        if kpm.dtype == torch.bool:
            keep = ~kpm
        elif kpm.is_floating_point():
            if not bool(((kpm == 0) | torch.isneginf(kpm)).all()):
                raise ValueError(
                    "key_padding_mask is a float tensor with values other than 0 and -inf; "
                    "torch reads a float mask as added to the scores: pass it as `bias=`"
                )
            keep = ~torch.isneginf(kpm)
        else:
            raise TypeError(
                f"key_padding_mask must be bool (True = padding, torch's convention) or float "
                f"(0 / -inf), got dtype {kpm.dtype}; convert it with `.bool()` first"
            )
        parts.append(keep[:, None, None, :])  # (b, 1, 1, j)
    return combine_masks(*parts)


def pad_to_rank(t: Tensor, ndim: int) -> Tensor:
    """A mask or bias broadcastable to scores of rank ``ndim``, with leading singleton axes added
    up to that rank (a view): ``(j,)`` -> ``(1, 1, 1, j)`` for ``ndim=4``."""
    return t.reshape((1,) * (ndim - t.ndim) + tuple(t.shape))


def to_additive(mask: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Bool mask to additive float: ``0`` where allowed, the dtype's finite minimum where not.

    Use only at a backend boundary (a kernel that adds its mask to the scores).
    """
    _tensors("to_additive", mask=mask)
    if mask.dtype != torch.bool:
        raise TypeError(f"to_additive takes a bool mask, got dtype {mask.dtype}")
    if not dtype.is_floating_point:
        raise TypeError(f"to_additive needs a floating dtype, got {dtype}")
    zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return zeros.masked_fill_(~mask, blocked(dtype))


# Mask functions: the same patterns as callables, for backends that work tile by tile.


def causal_fn(offset: int = 0) -> StructuredFn:
    """Causal mask as a function: key ``k`` visible from query ``q`` when ``k <= q + offset``.

    ``offset = j - i`` gives bottom-right alignment, ``0`` top-left. It declares itself a band
    (``Structure``), so block backends skip the tiles above the diagonal unevaluated.
    """

    _check_offset(offset)

    def causal(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return j <= i + offset

    return exactly(causal, Structure(band=Band(None, 0, offset)))


def window_fn(left: int, right: int = 0, offset: int = 0) -> StructuredFn:
    """Sliding window as a function (see ``sliding_window_mask``); declares its band."""
    _check_length("left", left)
    _check_length("right", right)
    _check_offset(offset)

    def window(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        distance = (i + offset) - j
        return (distance <= left) & (distance >= -right)

    return exactly(window, Structure(band=Band(left, right, offset)))


def checked_mask(values: object, shape: Sequence[int] | None = None) -> Tensor:
    """A mask function's output, checked: a bool tensor (``True`` = may attend), and, given the
    ``shape`` of the grid it was evaluated on, one that broadcasts to it."""
    if not isinstance(values, Tensor) or values.dtype != torch.bool:
        got = values.dtype if isinstance(values, Tensor) else type(values).__name__
        raise TypeError(
            f"a mask function must return a bool tensor (True = may attend), got {got}; "
            "pass additive scores as a bias function (bias=) instead"
        )
    return _on_grid("mask", values, shape)


def checked_bias(values: object, shape: Sequence[int] | None = None) -> Tensor:
    """A bias function's output, checked: a floating-point tensor added to the scores, and,
    given the ``shape`` of the grid it was evaluated on, one that broadcasts to it."""
    if not isinstance(values, Tensor) or not values.is_floating_point():
        got = values.dtype if isinstance(values, Tensor) else type(values).__name__
        raise TypeError(
            f"a bias function must return a floating-point tensor, got {got}; "
            "pass a bool mask as a mask function (mask=) instead"
        )
    return _on_grid("bias", values, shape)


def bias_requires_grad(bias_fn: BiasFn, device: torch.device) -> bool:
    """Whether a bias function's output requires grad (it reads parameters), from one probe
    element: a backend that does not differentiate through bias functions says so."""
    probe = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    return checked_bias(bias_fn(probe, probe, probe, probe)).requires_grad


def _on_grid(kind: str, values: Tensor, shape: Sequence[int] | None) -> Tensor:
    if shape is None:
        return values
    grid = tuple(shape)
    try:
        fits = torch.broadcast_shapes(tuple(values.shape), grid) == grid
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"a {kind} function must return a tensor that broadcasts to the (b, h, i, j) grid "
            f"of the indices it was given, {grid}; got shape {tuple(values.shape)}"
        )
    return values


def materialize(
    fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor],
    shape: Sequence[int],
    device: torch.device | str | None = None,
) -> Tensor:
    """Evaluate a mask or bias function on the full ``(b, h, i, j)`` grid."""
    if len(shape) != 4:
        raise ValueError(f"mask and bias functions need a (b, h, i, j) shape, got {tuple(shape)}")
    nb, nh, ni, nj = shape
    b = torch.arange(nb, device=device).view(nb, 1, 1, 1)
    h = torch.arange(nh, device=device).view(1, nh, 1, 1)
    i = torch.arange(ni, device=device).view(1, 1, ni, 1)
    j = torch.arange(nj, device=device).view(1, 1, 1, nj)
    return fn(b, h, i, j)
