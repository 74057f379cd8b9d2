"""An ``AttentionCall`` as the inputs of a 4-D engine (``tiled``, ``sparse``, ``fused``).

The engines work on ``q (b, h, i, d)``, ``k, v (b, h_kv, j, d)`` with masks and biases split
into tensors (broadcastable to ``(b, h, i, j)``) and functions ``fn(b, h, i, j)``. A call may
have any number of leading dims; they are flattened into ``b`` here, once, for every engine, so
that each backend's ``run`` differs from another only in the engine it calls.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import Tensor

from attnkit.masks import BiasFn, MaskFn, pad_to_rank
from attnkit.registry import AttentionCall, ScoreModification

__all__ = ["EngineInputs", "as4d", "engine_inputs"]


def as4d(t: Tensor, ndim: int, lead: tuple[int, ...]) -> Tensor:
    """A tensor broadcastable to (*lead, h, i, x), as 4-D (b, h, i, x) with b = prod(lead)."""
    t = pad_to_rank(t, ndim)
    if ndim <= 4:
        return pad_to_rank(t, 4)
    if all(s == 1 for s in t.shape[:-3]):
        return t.reshape(1, *t.shape[-3:])  # (1, h, i, x)
    t = t.expand(*lead, *t.shape[-3:])  # a broadcast leading axis is copied here, only here
    return t.reshape(-1, *t.shape[-3:])  # (prod(lead), h, i, x)


@dataclass(frozen=True)
class EngineInputs:
    """One call's operands in an engine's 4-D terms.

    ``q (b, h, i, d)``, ``k (b, h_kv, j, d)``, ``v (b, h_kv, j, dv)`` with ``b`` the product of
    the call's leading dims; ``mask`` bool and ``modification.bias`` float, 4-D and
    broadcastable to ``(b, h, i, j)``; ``mask_fn`` and the modification's ``bias_fn`` as
    given. ``output`` reshapes an engine's ``(b, h, i, dv)`` back to the call's shape.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    scale: float
    mask: Tensor | None
    mask_fn: MaskFn | None
    is_causal: bool
    modification: ScoreModification
    sinks: Tensor | None
    shape: tuple[int, ...]  # the call's output shape (..., h, i, dv)

    @property
    def bias(self) -> Tensor | None:
        return self.modification.bias

    @property
    def bias_fn(self) -> BiasFn | None:
        return self.modification.bias_fn

    def output(self, out: Tensor) -> Tensor:
        """An engine's ``(b, h, i, dv)`` output in the call's shape ``(..., h, i, dv)``."""
        return out.reshape(self.shape)  # (..., h, i, dv)

    def lse(self, lse: Tensor) -> Tensor:
        """An engine's log-sum-exp ``(b, h, i)`` in the call's shape ``(..., h, i)``."""
        return lse.reshape(self.shape[:-1])  # (..., h, i)


def engine_inputs(call: AttentionCall) -> EngineInputs:
    """``call`` unpacked for a 4-D engine (see ``EngineInputs``)."""
    q, k, v = call.query, call.key, call.value
    ndim, lead = q.ndim, tuple(q.shape[:-3])
    q4, k4, v4 = (as4d(t, ndim, lead) for t in (q, k, v))
    mask_fn = call.mask if callable(call.mask) else None
    mask = None if call.mask is None or mask_fn is not None else as4d(call.mask, ndim, lead)
    modification = call.modification
    if modification.bias is not None:
        modification = replace(modification, bias=as4d(modification.bias, ndim, lead))
    return EngineInputs(
        q4, k4, v4, call.scale, mask, mask_fn, call.is_causal, modification, call.sinks,
        (*q.shape[:-1], v.shape[-1]),
    )  # fmt: skip
