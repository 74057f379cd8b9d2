"""The backend registry: every attention algorithm is one function with one signature.

A backend is registered under a name with up to three functions:

* ``run(call) -> (output, extra | None)`` computes attention for a validated ``AttentionCall``;
  ``extra`` is the attention weights when ``call.return_weights``, the log-sum-exp of each row
  when ``call.return_lse``, else None;
* ``why_not(call) -> str | None`` says, in a sentence, why the backend cannot serve that call
  (``None`` when it can);
* ``cost(call) -> Estimate`` (optional) says what serving the call would cost: seconds on this
  machine and the bytes of the ``(b, h, i, j)``-sized masks and biases it would build. A backend
  with a cost takes part in ``auto``; ``register_cost`` adds or replaces one later.

``scaled_dot_product_attention(..., backend="name")`` looks the name up here; ``backend="auto"``
weighs every backend that has a cost and can serve the call, leaves out those whose built
masks and biases would exceed the memory budget (``memory_budget``), and takes the cheapest
(``weigh`` gives every candidate's verdict; ``attnkit.backends.explain`` prints them). The
registry alone decides routing; modules only pass names. It checks ``why_not`` before ``run``
and before ``cost``: both may assume the backend can serve the call.

``use(name)`` runs every attention call inside a ``with`` block on one backend, whatever the
call or the module names (``with use("math"): model(x)`` to read weights off any model).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit._modification import ScoreMod, ScoreModification
from attnkit.masks import BiasFn, MaskFn, causal_mask, checked_bias, checked_mask, materialize

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "AttentionCall",
    "Backend",
    "BackendUnavailable",
    "Estimate",
    "ScoreModification",
    "Verdict",
    "available_backends",
    "forced_backend",
    "forget_rankings",
    "get_backend",
    "get_memory_budget",
    "memory_budget",
    "register_backend",
    "register_cost",
    "select_backend",
    "set_memory_budget",
    "use",
    "weigh",
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
    ``is_causal`` is aligned bottom-right. ``softcap`` caps the scaled dot products,
    ``softcap * tanh(scale q.k / softcap)``, before the bias is added and masks apply;
    ``sinks`` ``(h,)`` are one logit per query head that joins each row's softmax denominator
    without a value. ``score_mod(score,
    b, h, i, j) -> score`` rewrites the scaled (soft-capped, then biased) scores before masking
    (FlexAttention's score modification), called on broadcast index tensors as mask and bias
    functions are. ``return_lse`` asks for the natural log-sum-exp of each row ``(..., h, i)``
    besides the output; ``block_sizes`` ``(block_q, block_k)`` are the tile sizes a tile engine
    (``tiled``, ``sparse``) plans the call with, when given (flex's block mask's).
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
    score_mod: ScoreMod | None = None
    return_lse: bool = False
    block_sizes: tuple[int, int] | None = None

    @property
    def modification(self) -> ScoreModification:
        """What happens to a scaled score before the softmax (softcap, bias, score_mod), as one
        ``ScoreModification``: the bias split into its tensor or its function."""
        bias = self.bias
        return ScoreModification(
            softcap=self.softcap,
            bias=None if bias is None or callable(bias) else bias,
            bias_fn=bias if callable(bias) else None,
            score_mod=self.score_mod,
        )

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

    @property
    def needs_grad(self) -> bool:
        """Whether autograd will ask for gradients: grad mode is on and a tensor needs them."""
        if not torch.is_grad_enabled():
            return False
        return any(
            isinstance(t, Tensor) and t.requires_grad
            for t in (self.query, self.key, self.value, self.bias, self.sinks)
        )

    def dense_mask(self) -> Tensor | None:
        """The mask as one bool tensor: the given mask (evaluated if a function) and causality."""
        mask = self.mask
        if callable(mask):
            grid = self.score_shape
            mask = checked_mask(materialize(mask, grid, device=self.query.device), grid)
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
            grid = self.score_shape
            bias = checked_bias(materialize(bias, grid, device=self.query.device), grid)
        return bias.to(dtype)


@dataclass(frozen=True)
class Estimate:
    """What serving one call would cost a backend, by its cost model.

    ``seconds``: the expected wall time on this machine (forward, or forward and backward when
    the call needs gradients). ``materialised``: bytes of the ``(b, h, i, j)``-sized masks and
    biases the backend would build to serve the call (a function evaluated on the full grid,
    a causal band written out, a mask and a bias combined); what ``memory_budget`` limits.
    ``how``: a short phrase for ``explain``, such as "materialises the bias function as a
    (1, 8, 4096, 4096) float32 tensor". ``basis``: "measured" (seconds from this machine's
    measurements), or "priority" where there are none (CUDA, MPS, or before the first
    calibration): ``seconds`` is then the backend's place in auto's priority list.
    """

    seconds: float
    materialised: int = 0
    how: str = ""
    basis: str = "measured"  # "priority": no measurements here; ``seconds`` is a rank


CostFn = Callable[[AttentionCall], Estimate]


@dataclass(frozen=True)
class Backend:
    name: str
    run: Callable[[AttentionCall], tuple[Tensor, Tensor | None]]
    why_not: Callable[[AttentionCall], str | None]
    description: str = ""
    prepare: Callable[[], None] | None = None  # run before an explicit selection (a build)


_REGISTRY: dict[str, Backend] = {}
_COSTS: dict[str, CostFn] = {}  # the backends auto weighs, in registration order


def _always(call: AttentionCall) -> str | None:
    return None


def register_backend(
    name: str,
    run: Callable[[AttentionCall], tuple[Tensor, Tensor | None]],
    why_not: Callable[[AttentionCall], str | None] | None = None,
    *,
    description: str = "",
    cost: CostFn | None = None,
    prepare: Callable[[], None] | None = None,
) -> Backend:
    """Register (or replace) a backend under ``name``; with a ``cost`` it takes part in auto.

    Replacing a backend without a ``cost`` keeps the cost it had (see ``register_cost``).
    ``prepare()`` runs when a call names the backend explicitly, before its ``why_not``: the
    place for work only an explicit request may do (the fused kernel compiles there); auto
    never calls it.
    """
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"backend name must be a non-empty string other than 'auto', got {name!r}")
    for arg, fn in (("run", run), ("why_not", why_not), ("cost", cost), ("prepare", prepare)):
        if fn is not None and not callable(fn):
            raise TypeError(f"register_backend's {arg} must be a function, got {fn!r}")
    backend = Backend(name, run, why_not or _always, description, prepare)
    _REGISTRY[name] = backend
    if cost is not None:
        register_cost(name, cost)
    _RANKED.clear()
    return backend


def register_cost(name: str, cost: CostFn | None) -> None:
    """Give backend ``name`` a cost model, so auto weighs it (``None``: auto leaves it out).

    ``cost(call)`` is called only for calls the backend can serve (its ``why_not`` is None).
    Auto remembers its ranking per call signature (dtypes, shapes, flags, the budget and which
    mask and bias functions), so a cost must depend on nothing else.
    """
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"backend name must be a non-empty string other than 'auto', got {name!r}")
    if cost is None:
        _COSTS.pop(name, None)
    elif not callable(cost):
        raise TypeError(f"cost must be a function of an AttentionCall, got {type(cost).__name__}")
    else:
        _COSTS[name] = cost
    _RANKED.clear()


def forget_rankings() -> None:
    """Drop auto's remembered rankings, so the next call of each signature is weighed again
    (a kernel became available, the machine's measurements changed)."""
    _RANKED.clear()


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


def forced_backend() -> str | None:
    """The backend an enclosing ``use(name)`` block forces, or ``None``."""
    return _FORCED.get()


# The memory budget: how many bytes of (b, h, i, j)-sized masks and biases auto may build.

DEFAULT_MEMORY_BUDGET = 1 << 30
"""1 GiB: auto's budget for building masks and biases unless ``set_memory_budget`` changes it."""

_DEFAULT_BUDGET = [DEFAULT_MEMORY_BUDGET]  # the process-wide default, set_memory_budget's
_BUDGET: ContextVar[int | None] = ContextVar("attnkit_memory_budget", default=None)


def _checked_budget(nbytes: object) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(
            f"memory budget must be a whole number of bytes (int), got {type(nbytes).__name__} "
            f"{nbytes!r}"
        )
    if nbytes < 0:
        raise ValueError(f"memory budget must be >= 0 bytes, got {nbytes}")
    return nbytes


def set_memory_budget(nbytes: int) -> int:
    """Set the process-wide memory budget (bytes); returns the previous one.

    Auto never takes a route that would build more than ``nbytes`` of ``(b, h, i, j)``-sized
    masks and biases (a mask or bias function evaluated on the full grid, for torch's fused
    kernel; a causal band written out; a mask and a bias combined). ``memory_budget`` sets it
    for a ``with`` block only. Default ``DEFAULT_MEMORY_BUDGET`` (1 GiB).
    """
    previous = _DEFAULT_BUDGET[0]
    _DEFAULT_BUDGET[0] = _checked_budget(nbytes)
    _RANKED.clear()
    return previous


@contextlib.contextmanager
def memory_budget(nbytes: int) -> Iterator[None]:
    """Use a memory budget of ``nbytes`` (see ``set_memory_budget``) inside a ``with`` block.

    For this thread or task only; blocks nest, the innermost wins. A bad value fails here,
    before the block runs.
    """
    token = _BUDGET.set(_checked_budget(nbytes))
    try:
        yield
    finally:
        _BUDGET.reset(token)


def get_memory_budget() -> int:
    """The memory budget in force here: the innermost ``memory_budget`` block's, else the
    process-wide one."""
    budget = _BUDGET.get()
    return _DEFAULT_BUDGET[0] if budget is None else budget


# Auto: weigh the candidates.


@dataclass(frozen=True)
class Verdict:
    """One candidate's answer for a call: why it cannot serve it, or what it would cost."""

    backend: str
    why_not: str | None
    estimate: Estimate | None
    chosen: bool = False

    def sentence(self, best: float | None = None) -> str:
        """One line for ``explain``; ``best`` is the chosen backend's estimated seconds."""
        if self.estimate is None:
            return f"{self.backend}: cannot serve this call: {self.why_not}"
        if self.estimate.basis == "priority":
            cost = f"priority {self.estimate.seconds:g}"
            best = None
        else:
            cost = f"about {_duration(self.estimate.seconds)}"
        if self.estimate.how:
            cost += f"; {self.estimate.how}"
        if self.why_not is not None:
            return f"{self.backend}: left out: {self.why_not} ({cost})"
        if self.chosen:
            if self.estimate.basis == "priority":
                return f"{self.backend}: chosen, first in the priority list that serves: {cost}"
            return f"{self.backend}: chosen, the cheapest estimate: {cost}"
        if best:
            cost = f"{self.estimate.seconds / best:.2f}x the chosen, " + cost
        return f"{self.backend}: not chosen: {cost}"


def _duration(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} µs"


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def weigh(call: AttentionCall) -> list[Verdict]:
    """Every backend with a cost, weighed for ``call``: the chosen one first (when any can
    serve), then the others that can by estimated seconds, then those over the memory budget,
    then those that cannot serve the call."""
    budget = get_memory_budget()
    fits: list[Verdict] = []
    over: list[Verdict] = []
    refused: list[Verdict] = []
    for name, cost in list(_COSTS.items()):
        backend = _REGISTRY.get(name)
        if backend is None:
            continue
        if call.query.is_nested and name != "torch":  # jagged lengths: one route takes them
            reason: str | None = "nested (jagged) inputs: auto gives them to torch's kernel"
        else:
            reason = backend.why_not(call)
        if reason is not None:
            refused.append(Verdict(name, reason, None))
            continue
        if call.query.is_nested:  # jagged lengths: nothing to count, one route
            fits.append(Verdict(name, None, Estimate(1.0, 0, "takes nested inputs", "priority")))
            continue
        estimate = cost(call)
        if estimate.materialised > budget:
            reason = (
                f"it would build {_bytes(estimate.materialised)} of masks and biases, over the "
                f"memory budget of {_bytes(budget)}"
            )
            over.append(Verdict(name, reason, estimate))
        else:
            fits.append(Verdict(name, None, estimate))
    fits.sort(key=lambda v: v.estimate.seconds)  # type: ignore[union-attr]
    if fits:
        fits[0] = Verdict(fits[0].backend, None, fits[0].estimate, chosen=True)
    return fits + over + refused


# Rankings by call signature: a decoding step calls attention once per layer per token with
# the same shapes, and weighing every candidate each time would cost more than torch's kernel
# does on such small inputs; a call with mask or bias functions costs milliseconds to weigh
# (probes, the tiles visited), so the same functions on the same shapes are weighed once.
_RANKED: dict[tuple, tuple[str, ...]] = {}
_RANKED_MAX = 1024


def _signature(call: AttentionCall) -> tuple | None:
    mask, bias = call.mask, call.bias
    fns: tuple = ()
    if callable(mask) or callable(bias) or call.score_mod is not None:
        # A function is known by a weak reference (equal while it lives, never to a later one
        # at the same address): the same mask or bias function weighs the same.
        try:
            fns = tuple(
                weakref.ref(f) if callable(f) else None for f in (mask, bias, call.score_mod)
            )
        except TypeError:
            return None  # not weakly referable: weighed afresh each call
        mask = mask if not callable(mask) else None
        bias = bias if not callable(bias) else None
    q, k, v = call.query, call.key, call.value
    # Written out (not call.needs_grad) and flags packed in one int: this runs on every call.
    grad = torch.is_grad_enabled() and (
        q.requires_grad
        or k.requires_grad
        or v.requires_grad
        or (bias is not None and bias.requires_grad)
        or (call.sinks is not None and call.sinks.requires_grad)
    )
    flags = (
        call.is_causal
        | grad << 1
        | call.return_weights << 2
        | (call.dropout_p > 0.0) << 3
        | (call.generator is None) << 4
        | (call.softcap is None) << 5
        | (call.sinks is None) << 6
        | q.is_cpu << 7
        | call.return_lse << 8
        | torch.get_num_threads() << 9
    )
    budget = _BUDGET.get()
    return (
        q.dtype,
        q.shape,
        k.shape,
        v.shape,
        None if mask is None else mask.shape,
        None if bias is None else (bias.shape, bias.dtype),
        flags,
        _DEFAULT_BUDGET[0] if budget is None else budget,
        call.block_sizes,
        *fns,
    )


def _auto(call: AttentionCall) -> Backend:
    key = _signature(call)
    ranked = None if key is None else _RANKED.get(key)
    if ranked is not None:
        for name in ranked:
            backend = _REGISTRY.get(name)
            if backend is not None and backend.why_not(call) is None:
                return backend
    verdicts = weigh(call)
    if verdicts and verdicts[0].chosen:
        if key is not None:
            if len(_RANKED) >= _RANKED_MAX:
                _RANKED.clear()
            _RANKED[key] = tuple(v.backend for v in verdicts if v.estimate and v.why_not is None)
        return _REGISTRY[verdicts[0].backend]
    math = _REGISTRY.get("math")
    if not _COSTS and math is not None:  # no cost model loaded: the reference serves every call
        return math
    reasons = "; ".join(f"{v.backend}: {v.why_not}" for v in verdicts)
    hint = ""
    if any(v.estimate is not None for v in verdicts):
        hint = " (raise it with attnkit.backends.memory_budget(bytes), or name a backend)"
    raise BackendUnavailable(f"no backend can serve this call ({reasons}){hint}")


def select_backend(name: str, call: AttentionCall) -> Backend:
    """The backend that will serve ``call``: the named one, or auto's choice for ``"auto"``.

    Inside ``use(other)`` the name is ``other``. Raises ``BackendUnavailable`` with the
    reasons when no backend can serve the call (within the memory budget, for auto).
    """
    name = _FORCED.get() or name
    if name == "auto":
        return _auto(call)
    backend = get_backend(name)
    if backend.prepare is not None:
        backend.prepare()
    reason = backend.why_not(call)
    if reason is not None:
        raise BackendUnavailable(f"backend {name!r} cannot serve this call: {reason}")
    return backend
