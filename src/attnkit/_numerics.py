"""Numeric facts every path shares, written once: the compute dtype, the blocked minimum, the
autocast policy, and how non-finite values travel.

Autocast: under ``torch.autocast``, attention follows the policy autocast gives torch's own
``scaled_dot_product_attention`` (a "lower precision" op): floating inputs other than float64
are cast to the autocast dtype, and the output has that dtype, on every backend. Inside, the
backends run with autocast off, so scores and softmax statistics stay in float32
(``compute_dtype``) instead of being rounded to bfloat16 by each matmul.

Non-finite values follow the reference math (``attnkit.functional.attention_math``):

* a NaN or ``+inf`` score makes its row NaN (softmax of it is undefined);
* a ``-inf`` score (an additive ``-inf`` bias) blocks its key like a mask does, so a row whose
  scores are all ``-inf`` gives zeros, like a fully masked row;
* a blocked position never contributes, whatever q, k, v or the bias hold there;
* a non-finite entry of ``v`` is read as 0 by the weighted sum and turns the output entries of
  every row that can see its key into NaN (``poison``): a NaN in a masked-out key does not
  poison the head.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch import Tensor

__all__ = [
    "all_finite",
    "attention_op",
    "autocast_dtype",
    "blocked",
    "compute_dtype",
    "no_autocast",
    "poison",
    "to_autocast",
]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores and softmax statistics are computed in: float32 for float16, bfloat16
    and float32 inputs, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def blocked(dtype: torch.dtype) -> float:
    """The score a blocked position gets: the dtype's finite minimum, never ``-inf`` (a row
    blocked everywhere would become NaN) nor ``-1e9`` (not large enough, and it overflows
    float16)."""
    return torch.finfo(dtype).min


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast casts attention inputs to on ``device``, or None when it is off."""
    kind = device.type
    try:
        if not torch.is_autocast_enabled(kind):
            return None
    except RuntimeError:  # a device type autocast does not know
        return None
    return torch.get_autocast_dtype(kind)


def to_autocast(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors as autocast would give them to a lower-precision op: floating tensors other
    than float64 cast to the autocast dtype of their device; unchanged when autocast is off."""
    out = []
    for t in tensors:
        dtype = autocast_dtype(t.device) if isinstance(t, Tensor) else None
        if dtype is not None and t.is_floating_point() and t.dtype != torch.float64:
            t = t.to(dtype)
        out.append(t)
    return tuple(out)


@contextlib.contextmanager
def no_autocast(device: torch.device) -> Iterator[None]:
    """Autocast off for ``device`` inside the block (a no-op where it is off already)."""
    if autocast_dtype(device) is None:
        yield
        return
    with torch.autocast(device.type, enabled=False):
        yield


F = TypeVar("F", bound=Callable)


def attention_op(fn: F) -> F:
    """Give an attention function ``fn(query, key, value, ...)`` autocast's policy for
    attention: ``query``, ``key`` and ``value`` cast by ``to_autocast``, and the body run with
    autocast off (it keeps its own float32 statistics)."""

    @functools.wraps(fn)
    def wrapper(query, key, value, *args, **kwargs):
        query, key, value = to_autocast(query, key, value)
        device = query.device if isinstance(query, Tensor) else torch.device("cpu")
        with no_autocast(device):
            return fn(query, key, value, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def all_finite(*tensors: Tensor | None) -> bool:
    """Whether every entry of the tensors is finite, by one sum per tensor (a NaN or an
    infinity makes the sum non-finite). A sum that overflows on finite entries also answers
    False: the caller then takes its careful path, which is right, only slower."""
    return all(
        math.isfinite(t.sum(dtype=_SUM_DTYPE.get(t.dtype, t.dtype)).item())
        for t in tensors
        if t is not None and t.numel()
    )


# Half-precision sums overflow early (float16 at 65,504): they add up in float32 instead.
_SUM_DTYPE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def poison(out: Tensor, visible: Tensor | None, bad: Tensor) -> Tensor:
    """``out`` ``(..., i, dv)`` with NaN where a row can see a key whose value is non-finite.

    ``visible`` is a bool ``(..., i, j)`` (None: every key) and ``bad`` the bool
    ``(..., j, dv)`` of non-finite value entries; both broadcast against ``out``'s batch dims.
    """
    if visible is None:
        reach = bad.any(dim=-2, keepdim=True)  # (..., 1, dv)
    else:
        # A mask broadcast over keys, (..., i, 1), is expanded to (..., i, j) for the product.
        visible = visible.expand(*visible.shape[:-1], bad.shape[-2])  # (..., i, j)
        reach = (visible.to(out.dtype) @ bad.to(out.dtype)) > 0  # (..., i, dv)
    return out.masked_fill(reach, float("nan"))
