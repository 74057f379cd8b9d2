"""The cost model behind ``backend="auto"``: what each backend would spend on a call.

Every estimate is a sum of a few terms, each a count times a constant measured on this
machine (``rates.Rates``, by ``calibration``; ``explain`` says where the numbers came from)::

    seconds = call                            # Python and dispatch, once per call
            + tile * tiles                    # per key tile the tiled loop visits (Python)
            + flops / gflops                  # the two matmuls over the pairs computed
            + pair * pairs                    # elementwise work per (b, h, i, j) pair computed
            + eval_s * function element-ops   # evaluating mask and bias functions

The counts come from the call: the sizes ``(b, h, i, j, d)``, the dtype, whether gradients
are needed (then the forward+backward constants apply), and the kind of mask and bias:

* a tensor is read as it is; a *function* is probed once on a 2 x 2 x 2 x 2 grid of indices
  (``_probe``) to count the element-ops it does and the shapes it builds at full size;
* declared structure (``masks.Structure``: causal, windows, block layouts) says which key
  tiles ``tiled`` and ``sparse`` visit, exactly as they do (``Structure.visible_keys`` and
  ``classify``); torch's fused kernel skips tiles only for its own causal flag;
* an undeclared mask function is sampled (8 x 8 points per tile) to guess the tiles that come
  out all blocked, which ``tiled`` skips after evaluating them;
* a ``relative`` bias function costs ``tiled`` one evaluation on the ``i + j - 1`` offsets.

Routes that build ``(b, h, i, j)``-sized masks or biases (torch's kernel and the reference
given a function, a causal band written out, a mask and a bias combined) report those bytes
in ``Estimate.materialised``; auto leaves them out above the memory budget.

Where this machine, thread count and dtype have no measurements (and for CUDA and MPS calls)
the estimates are places in ``PRIORITY`` instead of seconds (``Estimate.basis``).

A new backend joins auto by passing ``cost=`` to ``register_backend`` (or calling
``register_cost``); ``tiled_like(name)`` is the tiled model with that backend's own rates,
for kernels that visit tiles as ``tiled`` does.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from attnkit._structure import structure_of
from attnkit.backends import chunked as chunked_backend
from attnkit.backends.fused import api as fused_api
from attnkit.backends.fused.plan import evaluated_whole
from attnkit.backends.rates import Rates, Table, table_for
from attnkit.backends.sparse import WINDOW_BLOCK
from attnkit.backends.tiled import tiles as tiled_tiles
from attnkit.backends.visits import negligible_pairs, tiles_visited, windowed
from attnkit.registry import AttentionCall, Estimate, register_cost

__all__ = [
    "PRIORITY",
    "Terms",
    "estimate",
    "fused_terms",
    "price",
    "source",
    "terms",
    "tiled_like",
]


# dtypes without their own rows: float16 runs like bfloat16; float64 like float32, at half speed.
_ROW = {torch.float16: ("bfloat16", 1.0), torch.float64: ("float32", 2.0)}

PRIORITY = ("torch", "sparse", "tiled", "fused", "chunked", "math")
"""The order auto follows where this machine has not been measured (``rates.table_for`` gives
no table: before the first calibration, and on CUDA or MPS): torch's kernel wherever it serves
the call without building a (b, h, i, j) mask or bias, else the tile loops that evaluate
functions per tile (sparse, tiled), then the others; a route that builds tensors for torch's
kernel comes after them."""


def _priority(name: str, work: _Work) -> float:
    """A backend's place in ``PRIORITY`` (1 = first), as the "seconds" auto ranks by."""
    if name == "torch" and (callable(work.call.mask) or callable(work.call.bias)):
        return len(PRIORITY) - 1.5  # it would build them whole: after the tile loops
    return float(PRIORITY.index(name) + 1) if name in PRIORITY else float(len(PRIORITY) + 1)


def _rates(backend: str, work: _Work) -> Rates | None:
    table = work.table
    return None if table is None else table.rows.get((backend, "fwdbwd" if work.grad else "fwd"))


# The call, measured once per call object (the registry asks every candidate in a row).


@dataclass(frozen=True)
class _Fn:
    """What a probe of a mask or bias function found, scaled to a shape (``_Probe.at``)."""

    ops: float  # element-ops (sum of every op's output elements)
    out_bytes: int  # bytes of its result
    temp_bytes: int  # bytes of its largest intermediate


class _Probe:
    """The ops a function ran on a 2 x 2 x 2 x 2 index grid: for each, which of (b, h, i, j)
    its output spans and its element size; ``at(shape)`` scales them to a full grid."""

    def __init__(self, spans: list[tuple[tuple[bool, ...], int]], out: tuple[bool, ...], size: int):
        self.spans, self.out, self.size = spans, out, size

    def at(self, shape: tuple[int, ...]) -> _Fn:
        def elems(span: tuple[bool, ...]) -> int:
            return math.prod(n for n, s in zip(shape, span, strict=True) if s)

        sizes = [elems(span) * item for span, item in self.spans]
        ops = float(sum(elems(span) for span, _ in self.spans))
        return _Fn(ops, elems(self.out) * self.size, max(sizes, default=0))


class _Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, Tensor) and out.ndim == 4:
            self.outputs.append(out)
        return out


_PROBES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_FULL = (True, True, True, True)


def _probe(fn, shape: tuple[int, ...], device: torch.device) -> _Probe:
    """Run ``fn`` on index grids of two positions per dim (one where the dim is 1), noting
    the shape of every op's output; a function that fails here counts as a full-grid one."""
    sizes = tuple(min(2, n) for n in shape)
    key = (sizes, device.type)
    try:
        cached = _PROBES.get(fn, {}).get(key)
    except TypeError:  # not weakly referable: probed each time
        cached = None
    if cached is not None:
        return cached
    grids = [
        torch.arange(s, device=device).view([s if a == d else 1 for a in range(4)])
        for d, s in enumerate(sizes)
    ]
    recorder = _Recorder()
    try:
        with torch.no_grad(), recorder:
            out = fn(*grids)
    except Exception:  # the backend will raise it with its own message; cost it pessimistically
        return _Probe([(_FULL, 8)] * 8, _FULL, 4)

    def span(t: Tensor) -> tuple[bool, ...]:
        return tuple(n > 1 or s == 1 for n, s in zip(t.shape, sizes, strict=True))

    spans = [(span(t), t.element_size()) for t in recorder.outputs]
    out_span = span(out) if isinstance(out, Tensor) and out.ndim == 4 else _FULL
    size = out.element_size() if isinstance(out, Tensor) else 4
    probe = _Probe(spans or [(out_span, size)], out_span, size)
    with contextlib.suppress(TypeError):  # not weakly referable: probed each time
        _PROBES.setdefault(fn, {})[key] = probe
    return probe


@dataclass
class _Work:
    """The counts every backend's estimate reads, computed once per call."""

    call: AttentionCall
    row: str
    slow: float  # time multiplier for dtypes without a row of their own
    grad: bool
    b: int  # leading dims, multiplied
    h: int
    i: int
    j: int
    d: int
    dv: int
    itemsize: int
    table: Table | None  # this machine's rates for the call's device, dtype and threads

    @property
    def flops_per_pair(self) -> int:
        return 2 * (self.d + self.dv)  # q.k and w.v, forward

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.b, self.h, self.i, self.j)


_LAST: list = [(None, None)]  # (call, _Work) of the latest call weighed, swapped whole


def _work(call: AttentionCall) -> _Work:
    last_call, last_work = _LAST[0]
    if last_call is call:
        return last_work
    q, v = call.query, call.value
    row, slow = _ROW.get(q.dtype, (str(q.dtype).removeprefix("torch."), 1.0))
    if row not in ("float32", "bfloat16"):
        row, slow = "float32", 1.0
    lead = q.shape[:-3] if q.ndim >= 4 else q.shape[:-2]
    h = q.shape[-3] if q.ndim >= 4 else 1
    work = _Work(
        call,
        row,
        slow,
        call.needs_grad,
        math.prod(lead),
        h,
        q.shape[-2],
        call.key.shape[-2],
        q.shape[-1],
        v.shape[-1],
        q.element_size(),
        table_for(q.device, row),
    )
    _LAST[0] = (call, work)
    return work


def _fn(work: _Work, fn, shape: tuple[int, ...] | None = None) -> _Fn:
    return _probe(fn, work.shape, work.call.query.device).at(shape or work.shape)


@dataclass(frozen=True)
class Terms:
    """The counts one backend's estimate multiplies by its ``Rates`` (``price``)."""

    tiles: float = 0.0  # key tiles (or query groups) the tiled loop visits
    pairs: float = 0.0  # (b, h, i, j) pairs whose matmuls run
    extra: float = 0.0  # pairs with elementwise work beyond the plain call
    ops: float = 0.0  # element-ops of mask and bias functions
    materialised: int = 0  # bytes of (b, h, i, j)-sized masks and biases built
    how: str = ""


def price(rates: Rates, terms: Terms, work: _Work) -> float:
    """``call + tile * tiles + flops / gflops + pair * extra + eval_s * ops``, in seconds."""
    flops = terms.pairs * work.flops_per_pair
    seconds = rates.call + rates.tile * terms.tiles + flops / (rates.gflops * 1e9)
    eval_s = work.table.eval_s if work.table is not None else 0.0
    return work.slow * (seconds + rates.pair * terms.extra + eval_s * terms.ops)


def _priced(name: str, terms_fn, float64: float = 1.0):
    """A cost function from a terms function and the rates of backend ``name``; ``float64``:
    how much slower than ``_ROW``'s price the backend runs float64."""

    def cost(call: AttentionCall) -> Estimate:
        work = _work(call)
        terms = terms_fn(work)
        rates = _rates(name, work)
        if rates is None:
            return Estimate(_priority(name, work), terms.materialised, terms.how, "priority")
        seconds = price(rates, terms, work)
        if float64 != 1.0 and call.query.dtype == torch.float64:
            seconds *= float64
        return Estimate(seconds, terms.materialised, terms.how)

    return cost


def _relative_ops(work: _Work, fn) -> float:
    """Element-ops of a relative bias function evaluated once on the ``i + j - 1`` offsets,
    as the tiled backend's table (and the fused kernel's) does."""
    offsets = work.i + work.j - 1 if work.i and work.j else 0
    return _fn(work, fn, (1, work.h, 1, offsets)).ops


# Torch's fused kernel and the reference: dense masks and biases, built when given functions.


def _dense_parts(work: _Work, per_rows: float = 1.0) -> tuple[float, int, list[str]]:
    """What building the call's mask and bias as tensors costs: (element-ops, bytes, words);
    ``per_rows`` scales to a share of the query rows (chunked)."""
    call = work.call
    ops, built, words, temp = 0.0, 0, [], 0
    for name, fn in (("mask", call.mask), ("bias", call.bias)):
        if callable(fn):
            f = _fn(work, fn)
            ops += f.ops
            built += f.out_bytes
            temp = max(temp, f.temp_bytes)
            words.append(f"the {name} function")
    return ops * per_rows, int((built + temp) * per_rows), words


def _mask_shape(work: _Work, causal_dense: bool) -> tuple[int, ...]:
    """The shape of the one mask tensor the kernel reads: mask, bias and causal band
    broadcast together (``()`` when there is none)."""
    call = work.call
    shapes = []
    for t in (call.mask, call.bias):
        if isinstance(t, Tensor):
            shapes.append(tuple(t.shape))
        elif callable(t):
            f = _probe(t, work.shape, call.query.device)
            shapes.append(tuple(n if s else 1 for n, s in zip(work.shape, f.out, strict=True)))
    if causal_dense:
        shapes.append((work.i, work.j))
    return tuple(torch.broadcast_shapes(*shapes)) if shapes else ()


# torch's CPU kernel skips key blocks of 512 above the diagonal (its key split; measured:
# causal / plain time 0.9-1.2 at n = 512, 0.63 at 2048, 0.57 at 4096, as this model gives).
_TORCH_KEY_BLOCK, _TORCH_QUERY_BLOCK = 512, 32


def _torch_causal_fraction(n: int) -> float:
    """The share of pairs torch's causal kernel computes for ``n`` queries and keys."""
    if n == 0:
        return 0.0
    starts = torch.arange(0, n, _TORCH_QUERY_BLOCK, dtype=torch.float64)
    last = (starts + _TORCH_QUERY_BLOCK).clamp(max=n)  # keys up to the block's last query
    keys = (torch.ceil(last / _TORCH_KEY_BLOCK) * _TORCH_KEY_BLOCK).clamp(max=n)
    rows = last - starts
    return float((rows * keys).sum()) / (n * n)


def torch_terms(work: _Work) -> Terms:
    call = work.call
    flag = call.is_causal and work.i == work.j and call.mask is None and call.bias is None
    full = work.b * work.h * work.i * work.j
    pairs = full * (_torch_causal_fraction(work.i) if flag else 1.0)
    causal_dense = call.is_causal and not flag
    shape = _mask_shape(work, causal_dense)
    elems = math.prod(shape) if shape else 0
    ops, built, words = _dense_parts(work)
    if causal_dense:
        ops += 3 * work.i * work.j
        built += work.i * work.j
        words.append("the causal band")
    if call.mask is not None or causal_dense:  # a bool mask becomes one float mask
        built += elems * work.itemsize
    how = ""
    if words:
        how = f"builds {' and '.join(words)} as a {shape} tensor for torch's kernel"
    return Terms(0, pairs, full if elems else 0, ops, built, how)


def math_terms(work: _Work) -> Terms:
    call = work.call
    full = work.b * work.h * work.i * work.j
    ops, built, words = _dense_parts(work)
    if call.score_mod is not None:
        ops += full  # at least one element-op per score
    if call.is_causal:
        ops += 3 * work.i * work.j
        built += work.i * work.j
    how = "explicit scores"
    if words:
        how += f"; builds {' and '.join(words)} as tensors"
    return Terms(0, full, full, ops, built, how)


def chunked_cost(call: AttentionCall) -> Estimate:
    """The reference over query chunks (``math``'s rates); under autograd each chunk's
    forward runs again in backward (checkpointing)."""
    work = _work(call)
    rows = max(1, chunked_backend.BUDGET // max(1, work.h * work.j))
    chunks = max(1, math.ceil(work.i / rows))
    share = min(1.0, rows / max(1, work.i))
    full = math_terms(work)
    word = "chunk" if chunks == 1 else "chunks"
    how = f"{chunks} query {word} of {min(rows, work.i)} rows"
    rates = _rates("math", work)
    forward = None if work.table is None else work.table.rows.get(("math", "fwd"))
    if rates is None or forward is None:
        return Estimate(_priority("chunked", work), int(full.materialised * share), how, "priority")
    seconds = price(rates, full, work) + chunks * rates.call
    if work.grad:
        seconds += price(forward, full, work)
    return Estimate(seconds, int(full.materialised * share), how)


# The tiled family: tiles visited (``visits``), as the tiled backend's ``Tiles.groups``
# chooses them.


def tiled_like(name: str, *, gather: bool = False, block: int | None = None):
    """The cost function of a backend that visits tiles as ``tiled`` does, with the
    rates of backend ``name`` (``gather``: one group per query block, ``sparse``)."""
    return _priced(name, lambda work: tiled_terms(work, gather=gather, block=block))


_MASK_PAIR = 2.0  # a masked pair costs about twice a biased one in tiled (calibration)


def tiled_terms(work: _Work, *, gather: bool = False, block: int | None = None) -> Terms:
    call = work.call
    has_bias = call.bias is not None or call.score_mod is not None  # elementwise per pair
    if block is not None or gather:
        size = block or structure_of(call.mask).block or WINDOW_BLOCK
        bq, bk = size, size
    else:
        bq, bk = tiled_tiles.tile_sizes(None, None, has_bias)
    visit = tiles_visited(work, bq, bk, gather)
    bh = work.b * work.h
    ops = 0.0
    if callable(call.mask) and visit.evaluated:
        ops += _fn(work, call.mask).ops * visit.evaluated / (work.i * work.j)
    if callable(call.bias):
        if structure_of(call.bias).relative:
            ops += _relative_ops(work, call.bias)
        else:
            ops += _fn(work, call.bias).ops * visit.pairs / max(1, work.i * work.j)
    if work.grad:
        ops *= 2  # the backward evaluates the functions again
    pairs = visit.pairs
    relative = callable(call.bias) and structure_of(call.bias).relative
    if relative and not gather and call.softcap is None and call.score_mod is None:
        pairs -= negligible_pairs(work, visit, bq, bk)
    share = pairs / max(1, work.i * work.j)
    unit = "query blocks" if gather else "tiles"
    how = f"{visit.tiles} {unit} of {bq} x {bk}, {share:.0%} of pairs"
    # Elementwise extra: a bias added to every pair computed; a mask function's result
    # applied (masked_fill over the (b, h) block) on the evaluated tiles it does not skip as
    # all blocked, each such pair counted _MASK_PAIR times.
    masked = visit.masked if callable(call.mask) else 0.0
    extra = (pairs if has_bias else 0.0) + _MASK_PAIR * masked
    return Terms(visit.tiles, bh * pairs, bh * extra, ops, 0, how)


def fused_terms(work: _Work) -> Terms:
    """The fused kernel visits tiles as ``tiled`` does, with its own tile sizes; it reads bands,
    block layouts and relative biases as structure and evaluates any other mask or bias
    function once on the whole grid (``plan.evaluated_whole``), then reads it per pair like a
    tensor. Its plan is kept for the backward, so nothing is evaluated twice."""
    call = work.call
    mask_fn = call.mask if callable(call.mask) else None
    bias_fn = call.bias if callable(call.bias) else None
    whole_mask, whole_bias = evaluated_whole(mask_fn, bias_fn)
    bq, bk = fused_api.BLOCK_Q, fused_api.BLOCK_K
    block = structure_of(mask_fn).block if mask_fn is not None else None
    if block:  # every tile inside one cell of a block layout
        bq, bk = min(bq, block), min(bk, block)
    visit = tiles_visited(work, bq, bk, False)
    bh = work.b * work.h
    ops, built, words = 0.0, 0, []
    for name, fn, whole in (("mask", mask_fn, whole_mask), ("bias", bias_fn, whole_bias)):
        if fn is not None and whole:
            f = _fn(work, fn)
            ops += f.ops
            built += f.out_bytes + f.temp_bytes
            words.append(f"the {name} function")
    if bias_fn is not None and not whole_bias:  # relative: one table of offsets
        ops += _relative_ops(work, bias_fn)
    pairs = visit.pairs
    if bias_fn is not None and not whole_bias and call.softcap is None:
        pairs -= negligible_pairs(work, visit, bq, bk)
    # Elementwise extra: every pair when a mask or bias tensor is read per pair (a relative
    # table is read in the same pass as the scale: no extra); and the pairs of tiles a
    # window cuts through, which calibration finds cost about as much again (a causal band
    # cuts one tile per query block: no extra found there).
    dense = whole_mask or whole_bias or isinstance(call.mask, Tensor)
    extra = pairs if dense or isinstance(call.bias, Tensor) else 0.0
    if windowed(mask_fn):
        extra += visit.evaluated
    share = pairs / max(1, work.i * work.j)
    how = f"{visit.tiles} tiles of {bq} x {bk}, {share:.0%} of pairs"
    if words:
        how += f"; evaluates {' and '.join(words)} once as a tensor"
    return Terms(visit.tiles, bh * pairs, bh * extra, ops, built, how)


# The fused kernel's float64 is a plain loop (for checking): about 8x its float32 time, where
# _ROW prices float64 at twice float32.
_FUSED_FLOAT64 = 4.0


TERMS = {
    "torch": torch_terms,
    "tiled": tiled_terms,
    "fused": fused_terms,
    "sparse": lambda work: tiled_terms(work, gather=True),
    "math": math_terms,
}
"""The terms of each backend whose rates are measured (``chunked`` uses ``math``'s)."""


def source(call: AttentionCall) -> str:
    """Where the numbers auto weighs ``call`` by come from, in a sentence."""
    work = _work(call)
    if work.table is not None:
        return f"numbers {work.table.source}"
    order = ", ".join(PRIORITY)
    device = call.query.device
    if device.type != "cpu":
        return f"no rates for {device.type} calls: auto follows its priority list ({order})"
    return (
        f"no measurements of this machine for {work.row} with {torch.get_num_threads()} "
        f"threads yet: auto follows its priority list ({order}); `attnkit kernels calibrate` "
        "measures them"
    )


def terms(name: str, call: AttentionCall) -> Terms:
    """Backend ``name``'s counts for ``call`` (which it must serve): what calibration fits."""
    return TERMS[name](_work(call))


def estimate(name: str, call: AttentionCall) -> Estimate:
    """The estimate of backend ``name``'s cost model for ``call`` (which it must serve)."""
    return _COST_FNS[name](call)


_COST_FNS = {
    "torch": _priced("torch", torch_terms),
    "tiled": tiled_like("tiled"),
    "fused": _priced("fused", fused_terms, float64=_FUSED_FLOAT64),
    "sparse": tiled_like("sparse", gather=True),
    "chunked": chunked_cost,
    "math": _priced("math", math_terms),
}
for _name, _cost in _COST_FNS.items():
    register_cost(_name, _cost)
