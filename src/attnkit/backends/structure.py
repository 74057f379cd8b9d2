"""How a mask function tells a block backend which tiles it can skip, without being evaluated.

A mask function ``fn(b, h, i, j) -> bool`` (see ``attnkit.masks``) is a black box: to know where
it is ``True`` a backend would have to evaluate it on every ``(i, j)``. Block backends (``tiled``,
``sparse``) evaluate it one tile at a time and skip tiles that come out all ``False``; a function
that *declares its structure* lets them do better: skip whole tiles without evaluating anything,
and not even visit key ranges that no query in a block can see.

The protocol: a mask function may carry either or both of these attributes (positions are
absolute, the same integers the function receives as ``i`` and ``j``)::

    fn.tile(i0, i1, j0, j1) -> True | False | None
        True: every query in [i0, i1) may attend every key in [j0, j1) (no need to evaluate);
        False: none may (skip the tile); None: mixed or unknown (evaluate the tile).
    fn.key_ranges(i0, i1, j0, j1) -> list[tuple[int, int]]
        the sub-ranges of keys [j0, j1) that some query in [i0, i1) may see, sorted, disjoint.

Both must hold for every batch and head (structure never depends on ``b`` or ``h``). Use
``with_structure(fn, tile=..., key_ranges=...)`` to attach them. attnkit's own builders need
nothing: ``masks.causal_fn`` and ``masks.window_fn`` are recognised by the ``causal_offset`` and
``window`` attributes they carry, and ``all_of`` combines functions keeping their structure.
Everything here is plain Python on integers: it costs nothing next to a tile's matmul.

Bias functions have one structure to declare: ``relative(fn)`` (sets ``fn.relative = True``)
promises that ``fn(b, h, i, j)`` depends only on the head ``h`` and the offset ``j - i`` (ALiBi,
T5-style relative buckets; ``positional.alibi_fn`` declares it). The ``tiled`` backend then
evaluates it once per call on the ``n_i + n_j - 1`` offsets instead of once per tile, and reads
each tile as a strided view of that row (a Hankel view: query rows in reverse order). Declaring it
for a function that also depends on ``b`` or on absolute positions gives wrong results.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from attnkit.masks import BiasFn, MaskFn

__all__ = ["all_of", "is_relative", "key_ranges", "relative", "tile_state", "with_structure"]

TileFn = Callable[[int, int, int, int], "bool | None"]
RangesFn = Callable[[int, int, int, int], list[tuple[int, int]]]


def with_structure(
    fn: MaskFn, *, tile: TileFn | None = None, key_ranges: RangesFn | None = None
) -> MaskFn:
    """Attach the structure protocol (see the module docstring) to a mask function; returns it."""
    if tile is not None:
        fn.tile = tile  # type: ignore[attr-defined]
    if key_ranges is not None:
        fn.key_ranges = key_ranges  # type: ignore[attr-defined]
    return fn


def relative(fn: BiasFn) -> BiasFn:
    """Declare that the bias function ``fn(b, h, i, j)`` depends only on ``h`` and ``j - i``;
    returns it (see the module docstring)."""
    fn.relative = True  # type: ignore[attr-defined]
    return fn


def is_relative(fn: BiasFn | None) -> bool:
    """Whether ``fn`` declares (``relative``) that it depends only on the head and ``j - i``."""
    return fn is not None and getattr(fn, "relative", False) is True


def _band(fn: MaskFn) -> tuple[int | None, int | None, int] | None:
    """``(left, right, offset)`` when ``fn`` is a band: key ``k`` visible from query ``q`` iff
    ``-right <= (q + offset) - k <= left`` (``None`` = unbounded on that side)."""
    if hasattr(fn, "window"):
        left, right, offset = fn.window
        return left, right, offset
    if hasattr(fn, "causal_offset"):
        return None, 0, fn.causal_offset
    return None


def tile_state(fn: MaskFn, i0: int, i1: int, j0: int, j1: int) -> bool | None:
    """Classify the tile queries ``[i0, i1)`` x keys ``[j0, j1)``: all True, all False, or None."""
    if hasattr(fn, "tile"):
        return fn.tile(i0, i1, j0, j1)
    band = _band(fn)
    if band is None:
        return None
    left, right, offset = band
    near = (i0 + offset) - (j1 - 1)  # smallest distance (query ahead of key) in the tile
    far = (i1 - 1 + offset) - j0  # largest distance
    if far < -right or (left is not None and near > left):
        return False
    if near >= -right and (left is None or far <= left):
        return True
    return None


def key_ranges(fn: MaskFn, i0: int, i1: int, j0: int, j1: int) -> list[tuple[int, int]]:
    """The parts of keys ``[j0, j1)`` that some query of ``[i0, i1)`` may see."""
    if hasattr(fn, "key_ranges"):
        return fn.key_ranges(i0, i1, j0, j1)
    band = _band(fn)
    if band is None:
        return [(j0, j1)] if j1 > j0 else []
    left, right, offset = band
    lo = j0 if left is None else max(j0, i0 + offset - left)
    hi = min(j1, i1 - 1 + offset + right + 1)
    return [(lo, hi)] if hi > lo else []


def all_of(*fns: MaskFn | None) -> MaskFn | None:
    """The AND of mask functions (``None`` entries skipped), keeping their structure."""
    parts = [f for f in fns if f is not None]
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]

    def mask(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        result = parts[0](b, h, i, j)
        for f in parts[1:]:
            result = result & f(b, h, i, j)
        return result

    def tile(i0: int, i1: int, j0: int, j1: int) -> bool | None:
        states = [tile_state(f, i0, i1, j0, j1) for f in parts]
        if any(s is False for s in states):
            return False
        return True if all(s is True for s in states) else None

    def ranges(i0: int, i1: int, j0: int, j1: int) -> list[tuple[int, int]]:
        current = [(j0, j1)]
        for f in parts:
            current = [r for lo, hi in current for r in key_ranges(f, i0, i1, lo, hi)]
        return current

    return with_structure(mask, tile=tile, key_ranges=ranges)
