"""torch's calling convention for ``score_mod`` and ``mask_mod``: one element at a time.

torch's FlexAttention defines a mod on scalars: ``score_mod(score, b, h, q_idx, kv_idx)`` and
``mask_mod(b, h, q_idx, kv_idx)`` see one score and four 0-d index tensors, and torch runs them
over a grid through four nested ``torch.vmap`` (``_vmap_for_bhqkv`` in
``torch/nn/attention/flex_attention.py``: key positions innermost, then queries, heads,
batches), with ``tensor[index_tensor]`` read as ``aten.index`` (``_IndexAsTorchDoes``). So a
mod may reduce (``(qf[q_idx] * kf[kv_idx]).sum()``, ``torch.dot`` of gathered rows,
``.any()``) or index a gathered row (``interval[0]``), and it means the same per element.
``per_element`` gives the tiled engine that meaning: a function on a tile's broadcast index
tensors that runs the mod exactly as torch does::

    score (b, h, bi, bj)    b (b, 1, 1, 1)    h (1, h, 1, 1)    i (1, 1, bi, 1)    j (1, 1, 1, bj)

vmap computes each operation once per distinct index it depends on (``q_idx - kv_idx`` is a
``(bi, bj)`` tensor, ``h`` a ``(h,)`` one), so an elementwise mod costs what the broadcast
call cost, plus vmap's dispatch per operation and tile (``docs/benchmarks.md``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

__all__ = ["per_element"]

try:  # what torch.vmap does for each level, called directly (private names): the C calls,
    # not torch's Python wrappers (a context manager and an export-mode lookup per level)
    from torch._C._functorch import (
        _add_batch_dim,
        _remove_batch_dim,
        _vmap_decrement_nesting,
        _vmap_increment_nesting,
    )
except ImportError:  # pragma: no cover - torch.vmap itself, slower
    _add_batch_dim = _remove_batch_dim = None  # type: ignore[assignment]


class _IndexAsTorchDoes(TorchFunctionMode):
    """``tensor[index]`` with tensor or int indices read as ``aten.index(tensor, indices)``, as
    torch reads it inside a mod: under vmap a 0-d index tensor cannot become a Python int.

    torch's ``TransformGetItemToIndex`` routes the same call through ``ModIndex``, an autograd
    function computing ``aten.index`` forward and its scatter backward (the gradient
    ``aten.index`` has itself); written here so that vmap uses ``aten.index``'s batching rule
    directly: ``ModIndex`` under four vmaps costs milliseconds a call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is Tensor.__getitem__:
            target, index = args
            leaves = tree_leaves(index)
            if all(isinstance(x, (Tensor, int)) for x in leaves):
                indices = [
                    x if isinstance(x, Tensor) else torch.tensor(x, device=target.device)
                    for x in leaves
                ]
                return torch.ops.aten.index(target, indices)
        return func(*args, **(kwargs or {}))


def _vmap(fn: Callable[..., Tensor], in_dims: tuple[int | None, ...]) -> Callable[..., Tensor]:
    """``torch.vmap(fn, in_dims, out_dims=0)`` for positional tensor arguments, without its
    argument flattening and checks: the same batching calls, about a tenth of the Python cost
    (the engine calls a mod once per tile and vmap level)."""
    if _remove_batch_dim is None:  # pragma: no cover - a torch without these internals
        return torch.vmap(fn, in_dims=in_dims, out_dims=0)
    axis = next(k for k, d in enumerate(in_dims) if d is not None)

    def mapped(*args: Tensor) -> Tensor:
        n = args[axis].shape[in_dims[axis]]  # type: ignore[index]
        level = _vmap_increment_nesting(n, "error")
        try:
            batched = [
                a if d is None else _add_batch_dim(a, d, level)
                for a, d in zip(args, in_dims, strict=True)
            ]
            out = fn(*batched)
            if not isinstance(out, Tensor):  # as torch.vmap says it
                raise ValueError(f"vmap: the mod must only return Tensors, got type {type(out)}")
            return _remove_batch_dim(out, level, n, 0)  # an unbatched result is expanded
        finally:
            _vmap_decrement_nesting()

    return mapped


def _broadcast_shape(shapes: list[torch.Size]) -> tuple[int, ...]:
    """``torch.broadcast_shapes`` of shapes of one rank, in plain Python (torch's reference
    implementation is slow for a call made once per tile)."""
    out = []
    for sizes in zip(*shapes, strict=True):
        big = {n for n in sizes if n != 1}
        if len(big) > 1:
            raise RuntimeError(f"the index tensors {[tuple(s) for s in shapes]} do not broadcast")
        out.append(big.pop() if big else 1)
    return tuple(out)


def per_element(fn: Callable[..., Tensor], *, score: bool) -> Callable[..., Tensor]:
    """``fn`` (a score_mod when ``score``, else a mask_mod) as a function of a tile's broadcast
    index tensors, computing what torch computes: ``fn`` vmapped over every element.

    The index tensors may come in any layout the engine keeps its scores in (the tiled engine's
    grouped rows ``(b, h_kv, rows, bj)``, where ``h`` varies along two axes): one vmap level
    per axis of the broadcast shape, outermost first, each mapping the arguments that vary
    along it. Each element's value is the same in any order of levels, so the result is torch's,
    in the scores' own layout (a view where ``fn`` does not depend on an index). A mask_mod's
    result keeps size 1 along the axes it does not depend on (vmap would expand it there): the
    engine reads masks as broadcastable, and a tile mask expanded over heads costs ``h`` times
    more in every pass that reads it (``any``, ``~``, ``masked_fill_``)."""
    name = getattr(fn, "__name__", type(fn).__name__)
    kind = "score_mod" if score else "mask_mod"

    nested: dict[tuple, Callable[..., Tensor]] = {}  # the vmapped fn of each level pattern

    def tile(*args: Tensor) -> Tensor:
        rank = max(a.dim() for a in args)
        args = tuple(a.reshape((1,) * (rank - a.dim()) + tuple(a.shape)) for a in args)
        shape = _broadcast_shape([a.shape for a in args])
        if any(n == 0 for n in shape):  # vmap over an empty axis: nothing to call
            dtype = args[0].dtype if score else torch.bool
            return args[0].new_empty(shape, dtype=dtype)
        axes = [x for x in range(rank) if shape[x] != 1]  # one vmap level each
        squeezed = [a.reshape([a.shape[x] for x in axes if a.shape[x] != 1]) for a in args]
        levels = tuple(tuple(0 if a.shape[x] != 1 else None for a in args) for x in axes)
        mapped = nested.get(levels)
        if mapped is None:  # the same levels for every tile of a call: built once
            mapped = fn
            for in_dims in reversed(levels):  # innermost first; outer levels peel their axis
                mapped = _vmap(mapped, in_dims)
            nested[levels] = mapped
        with _IndexAsTorchDoes():
            out = mapped(*squeezed)
        if out.dim() != len(axes):  # (..., extra): not one value per element
            raise ValueError(
                f"{kind} {name!r} must return one value per element (a 0-d tensor, as torch "
                f"calls it), got shape {tuple(out.shape[len(axes) :])} for each (b, h, q_idx, "
                "kv_idx)"
            )
        out = out.reshape(shape)
        if not score:  # a mask broadcasts: size 1 where it does not depend on an index
            keep = [slice(0, 1) if out.stride(x) == 0 else slice(None) for x in range(rank)]
            out = out[tuple(keep)]
        return out

    tile.__name__ = name
    return tile
