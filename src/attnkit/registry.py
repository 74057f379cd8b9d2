"""The backend registry: every attention algorithm is one function with one signature.

A backend is registered under a name with two functions:

* ``run(call) -> (output, weights | None)`` computes attention for a validated ``AttentionCall``;
* ``why_not(call) -> str | None`` says, in a sentence, why the backend cannot serve that call
  (``None`` when it can).

``scaled_dot_product_attention(..., backend="name")`` looks the name up here; ``backend="auto"``
walks ``AUTO_ORDER`` and takes the first backend whose ``why_not`` is ``None``. The registry
alone decides routing, for example that a call asking for the attention weights goes to the
reference math (the fast backends say why they cannot return them); modules only pass names.
The registry checks ``why_not`` once, before ``run``: a backend's ``run`` may assume it can
serve the call.

``use(name)`` runs every attention call inside a ``with`` block on one backend, whatever the
call or the module names (``with use("math"): model(x)`` to read weights off any model).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit.masks import BiasFn, MaskFn, causal_mask, checked_bias, checked_mask, materialize

__all__ = [
    "AUTO_ORDER",
    "AttentionCall",
    "Backend",
    "BackendUnavailable",
    "available_backends",
    "get_backend",
    "register_backend",
    "select_backend",
    "use",
]


class BackendUnavailable(ValueError):
    """A backend was asked for a call it cannot serve; the message says why."""


@dataclass(frozen=True)
class AttentionCall:
    """The validated arguments of one attention call (see ``scaled_dot_product_attention``).

    Shapes: ``query (..., h, i, d)``, ``key (..., h_kv, j, d)``, ``value (..., h_kv, j, dv)``
    with ``h_kv`` dividing ``h`` (grouped-query attention when they differ, for inputs of 4 or
    more dims; inputs with fewer dims have no head axis). ``mask`` is a bool tensor broadcastable
    to ``(..., h, i, j)`` or a mask function; ``bias`` a float tensor or a bias function.
    ``is_causal`` is aligned bottom-right. ``softcap`` caps the scores,
    ``softcap * tanh(scores / softcap)``, before masking; ``sinks`` ``(h,)`` are one logit per
    query head that joins each row's softmax denominator without a value.
    """

    query: Tensor
    key: Tensor
    value: Tensor
    mask: Tensor | MaskFn | None
    bias: Tensor | BiasFn | None
    is_causal: bool
    scale: float
    dropout_p: float
    generator: torch.Generator | None
    return_weights: bool
    softcap: float | None = None
    sinks: Tensor | None = None

    @property
    def n_queries(self) -> int:
        return self.query.shape[-2]

    @property
    def n_keys(self) -> int:
        return self.key.shape[-2]

    @property
    def groups(self) -> int:
        """Query heads per key/value head: 1 for ordinary attention, ``h`` for multi-query."""
        if self.query.ndim < 4:  # no (b, h, ...) head axis
            return 1
        return self.query.shape[-3] // self.key.shape[-3]

    @property
    def score_shape(self) -> tuple[int, ...]:
        """Shape of the full score tensor ``(..., h, i, j)``."""
        return (*self.query.shape[:-1], self.n_keys)

    def dense_mask(self) -> Tensor | None:
        """The mask as one bool tensor: the given mask (evaluated if a function) and causality."""
        mask = self.mask
        if callable(mask):
            mask = checked_mask(materialize(mask, self.score_shape, device=self.query.device))
        if self.is_causal:
            causal = causal_mask(self.n_queries, self.n_keys, device=self.query.device)
            mask = causal if mask is None else mask & causal
        return mask

    def dense_bias(self, dtype: torch.dtype) -> Tensor | None:
        """The bias as one float tensor of ``dtype`` (evaluated if a function)."""
        bias = self.bias
        if bias is None:
            return None
        if callable(bias):
            bias = checked_bias(materialize(bias, self.score_shape, device=self.query.device))
        return bias.to(dtype)


@dataclass(frozen=True)
class Backend:
    name: str
    run: Callable[[AttentionCall], tuple[Tensor, Tensor | None]]
    why_not: Callable[[AttentionCall], str | None]
    description: str = ""


_REGISTRY: dict[str, Backend] = {}

# Why this order: a call with a mask or bias *function* goes to the tiled backend first
# ("tiled-functions" is the tiled backend restricted to such calls), so auto never builds an
# n x n tensor from a function; plain, causal and dense-mask calls go to torch's fused kernel,
# the fastest on them; "tiled" then serves what torch refuses but it can (inputs without a head
# axis); the math backend serves every call (dropout with a generator, return_weights).
AUTO_ORDER: list[str] = ["tiled-functions", "torch", "tiled", "math"]
"""Backends ``backend="auto"`` tries, in order. The math backend serves every call."""


def _always(call: AttentionCall) -> str | None:
    return None


def register_backend(
    name: str,
    run: Callable[[AttentionCall], tuple[Tensor, Tensor | None]],
    why_not: Callable[[AttentionCall], str | None] | None = None,
    *,
    description: str = "",
) -> Backend:
    """Register (or replace) a backend under ``name``."""
    if not name or name == "auto":
        raise ValueError(f"backend name must be a non-empty string other than 'auto', got {name!r}")
    backend = Backend(name, run, why_not or _always, description)
    _REGISTRY[name] = backend
    return backend


def available_backends() -> list[str]:
    """Names of the registered backends."""
    return sorted(_REGISTRY)


def get_backend(name: str) -> Backend:
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(["auto", *available_backends()])
        raise ValueError(f"backend must be one of {known}; got {name!r}") from None


_FORCED: ContextVar[str | None] = ContextVar("attnkit_backend", default=None)


@contextlib.contextmanager
def use(name: str) -> Iterator[None]:
    """Run every attention call in the ``with`` block on backend ``name`` (or ``"auto"``).

    Overrides the backend a call or a module names, for this thread or task only; blocks
    nest, the innermost wins. An unknown name fails here, before the block runs.
    """
    if not isinstance(name, str):
        raise TypeError(f"backend name must be a string, got {type(name).__name__}")
    if name != "auto":
        get_backend(name)
    token = _FORCED.set(name)
    try:
        yield
    finally:
        _FORCED.reset(token)


def select_backend(name: str, call: AttentionCall) -> Backend:
    """The backend that will serve ``call``: the named one, or the first that can for ``"auto"``.

    Inside ``use(other)`` the name is ``other``. Raises ``BackendUnavailable`` with the
    reasons when no backend can serve the call.
    """
    name = _FORCED.get() or name
    if name == "auto":
        reasons = []
        for candidate in AUTO_ORDER:
            backend = _REGISTRY.get(candidate)
            if backend is None:
                continue
            reason = backend.why_not(call)
            if reason is None:
                return backend
            reasons.append(f"{candidate}: {reason}")
        raise BackendUnavailable("no backend can serve this call (" + "; ".join(reasons) + ")")
    backend = get_backend(name)
    reason = backend.why_not(call)
    if reason is not None:
        raise BackendUnavailable(f"backend {name!r} cannot serve this call: {reason}")
    return backend
