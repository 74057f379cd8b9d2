"""Structure: what a mask or bias function declares about itself (re-exported by ``masks``).

A mask function is a black box: to know where it is True a backend would have to evaluate it on
every ``(i, j)``. Block backends (``tiled``, ``sparse``) evaluate it one tile at a time and skip
tiles that come out all False; a function that *declares its structure* lets them do better:
skip whole tiles without evaluating anything, and not even visit key ranges that no query of a
block can see. The declaration is data attached to the function (``StructuredFn``), as
FlexAttention's ``BlockMask`` is, and prints itself (``Structure.to_string``). Everything here
is plain Python on integers: it costs nothing next to a tile's matmul.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

__all__ = [
    "Band",
    "Structure",
    "StructuredFn",
    "TilePlan",
    "all_of",
    "block_ranges",
    "declare",
    "exact_structure",
    "exactly",
    "plan_cache_info",
    "relative",
    "structure_of",
    "tile_plan",
]

IndexFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""``fn(b, h, i, j)``: a mask function (bool out) or a bias function (float out)."""

TileFn = Callable[[int, int, int, int], "bool | None"]
"""``tile(i0, i1, j0, j1)``: True = every query of ``[i0, i1)`` sees every key of ``[j0, j1)``,
False = none does, None = mixed or unknown."""
RangesFn = Callable[[int, int, int, int], list[tuple[int, int]]]
"""``ranges(i0, i1, j0, j1)``: the sorted, disjoint sub-ranges of keys ``[j0, j1)`` that some
query of ``[i0, i1)`` may see."""


@dataclass(frozen=True)
class Band:
    """Key ``k`` is visible from query ``q`` only when ``-right <= (q + offset) - k <= left``.

    ``left``: most keys behind the query, ``right``: most keys ahead (``None``: unbounded).
    Causal is ``Band(None, 0, offset)``; a causal window of ``w`` keys ``Band(w - 1, 0)``.
    """

    left: int | None
    right: int | None
    offset: int = 0

    def __str__(self) -> str:
        if self.left is None and self.right == 0:
            return f"causal (k <= q + {self.offset})"
        left = "inf" if self.left is None else self.left
        right = "inf" if self.right is None else self.right
        return f"band (left {left}, right {right}, offset {self.offset})"


@dataclass(frozen=True)
class Structure:
    """What a mask or bias function promises about itself; positions are absolute.

    Every field is optional, and an empty ``Structure()`` promises nothing (the function is
    evaluated on every tile). Promises must hold for every batch and head.

    * ``band``: the function is False outside this band (``causal_fn``, ``window_fn``).
    * ``layout`` and ``block``: the function is False outside the blocks where the bool
      ``layout`` ``(query blocks, key blocks)`` is True, blocks of ``block`` positions
      (``backends.sparse.block_sparse``). ``block`` alone is a preferred tile size.
    * ``tile`` / ``ranges``: custom classifiers (see ``TileFn`` and ``RangesFn``) for layouts
      neither a band nor a block layout can say.
    * ``parts``: the function is the AND of functions with these structures (``all_of``).
    * ``relative``: a *bias* function that depends only on the head ``h`` and ``j - i`` (ALiBi,
      T5-style buckets). The tiled backend then evaluates it once per call on the
      ``n_i + n_j - 1`` offsets instead of once per tile. Declaring it for a function that
      also depends on ``b`` or on absolute positions gives wrong results.

    ``classify`` and ``visible_keys`` answer for a tile; ``to_string`` draws the tile layout.
    """

    band: Band | None = None
    layout: Tensor | None = field(default=None, compare=False)
    block: int | None = None
    tile: TileFn | None = field(default=None, compare=False)
    ranges: RangesFn | None = field(default=None, compare=False)
    parts: tuple[Structure, ...] = ()
    relative: bool = False

    @property
    def skips(self) -> bool:
        """Whether this structure can rule out keys without evaluating the function."""
        return (
            self.band is not None
            or self.layout is not None
            or self.tile is not None
            or self.ranges is not None
            or any(p.skips for p in self.parts)
        )

    def classify(self, i0: int, i1: int, j0: int, j1: int) -> bool | None:
        """The tile queries ``[i0, i1)`` x keys ``[j0, j1)``: all visible (True), none (False),
        or mixed / unknown (None)."""
        states = [p.classify(i0, i1, j0, j1) for p in self.parts]
        if self.tile is not None:
            states.append(self.tile(i0, i1, j0, j1))
        if self.band is not None:
            states.append(_band_state(self.band, i0, i1, j0, j1))
        if self.layout is not None:
            states.append(_layout_state(self, i0, i1, j0, j1))
        if any(s is False for s in states):
            return False
        return True if states and all(s is True for s in states) else None

    def visible_keys(self, i0: int, i1: int, j0: int, j1: int) -> list[tuple[int, int]]:
        """The sorted, disjoint parts of keys ``[j0, j1)`` that some query of ``[i0, i1)`` may
        see (all of them when nothing is declared)."""
        current = [(j0, j1)] if j1 > j0 else []
        steps: list[RangesFn] = [p.visible_keys for p in self.parts]
        if self.ranges is not None:
            steps.append(self.ranges)
        if self.band is not None:
            steps.append(functools.partial(_band_keys, self.band))
        if self.layout is not None:
            steps.append(functools.partial(_layout_keys, self))
        for step in steps:
            current = [r for lo, hi in current for r in step(i0, i1, lo, hi)]
        return current

    def to_string(self, n_queries: int, n_keys: int, block: int = 128) -> str:
        """The tiles of an ``n_queries x n_keys`` call, ``block`` positions a side, one
        character each: ``█`` every key visible, ``░`` partly or unknown, `` `` none (skipped):
        the call's ``TilePlan`` at that tile size, as the backends read it."""
        plan = tile_plan(self, n_queries, n_keys, block, block)
        header = f"{self}; {n_queries} x {n_keys}, tiles of {block}:"
        return "\n".join([header, *plan.picture()])

    def sparsity(self, n_queries: int, n_keys: int, block: int = 128) -> float:
        """The fraction of ``block x block`` tiles skipped unevaluated (0 when none is)."""
        plan = tile_plan(self, n_queries, n_keys, block, block)
        total = len(plan.rows) * -(-n_keys // block)
        return (total - plan.tiles) / max(1, total)

    def __str__(self) -> str:
        words = [str(p) for p in self.parts]
        if self.band is not None:
            words.append(str(self.band))
        if self.layout is not None:
            nq, nk = self.layout.shape
            words.append(f"block layout {nq} x {nk} of {self.block}")
        elif self.block is not None:
            words.append(f"tiles of {self.block}")
        if self.tile is not None or self.ranges is not None:
            words.append("custom tiles")
        if self.relative:
            words.append("relative (depends on h and j - i only)")
        if not words:
            return "no structure"
        return words[0] if len(words) == 1 else "all of (" + ", ".join(words) + ")"

    @functools.cached_property
    def _layout_rows(self) -> list[list[int]]:
        """The kept key blocks of each query block, as ints (a layout's ``visible_keys``)."""
        assert self.layout is not None
        return [row.nonzero().flatten().tolist() for row in self.layout]


def _band_state(band: Band, i0: int, i1: int, j0: int, j1: int) -> bool | None:
    left, right, offset = band.left, band.right, band.offset
    near = (i0 + offset) - (j1 - 1)  # smallest distance (query ahead of key) in the tile
    far = (i1 - 1 + offset) - j0  # largest distance
    if (right is not None and far < -right) or (left is not None and near > left):
        return False
    if (right is None or near >= -right) and (left is None or far <= left):
        return True
    return None


def _band_keys(band: Band, i0: int, i1: int, j0: int, j1: int) -> list[tuple[int, int]]:
    lo = j0 if band.left is None else max(j0, i0 + band.offset - band.left)
    hi = j1 if band.right is None else min(j1, i1 - 1 + band.offset + band.right + 1)
    return [(lo, hi)] if hi > lo else []


def _layout_state(s: Structure, i0: int, i1: int, j0: int, j1: int) -> bool | None:
    assert s.layout is not None and s.block is not None
    nqb, nkb = s.layout.shape
    if i0 < 0 or j0 < 0 or i1 > nqb * s.block or j1 > nkb * s.block:
        return None
    block = s.block
    cells = s.layout[i0 // block : (i1 - 1) // block + 1, j0 // block : (j1 - 1) // block + 1]
    if not bool(cells.any()):
        return False
    return True if bool(cells.all()) else None


def _layout_keys(s: Structure, i0: int, i1: int, j0: int, j1: int) -> list[tuple[int, int]]:
    assert s.layout is not None and s.block is not None
    block, rows = s.block, s._layout_rows
    kept: set[int] = set()
    for row in range(max(i0, 0) // block, min(i1 - 1, len(rows) * block - 1) // block + 1):
        kept.update(rows[row])
    return block_ranges(kept, block, j0, j1)


def block_ranges(columns: Iterable[int], block: int, j0: int, j1: int) -> list[tuple[int, int]]:
    """The keys of block columns ``columns`` (blocks of ``block`` keys) within ``[j0, j1)``, as
    sorted, disjoint ranges with neighbouring blocks merged."""
    ranges: list[tuple[int, int]] = []
    for col in sorted(columns):
        lo, hi = max(j0, col * block), min(j1, (col + 1) * block)
        if hi <= lo:
            continue
        if ranges and ranges[-1][1] == lo:
            ranges[-1] = (ranges[-1][0], hi)
        else:
            ranges.append((lo, hi))
    return ranges


@dataclass(frozen=True, eq=False)
class StructuredFn:
    """A mask or bias function with its declared ``Structure``; called like the function.

    ``exact``: the function *is* its structure, True exactly where the declared band and
    block layout allow (``causal_fn``, ``window_fn``, ``block_sparse`` and their ``all_of``),
    so a kernel may read the numbers of the structure instead of evaluating the function. A
    declaration made with ``declare`` is only a promise about where the function is False
    (``exact=False``) and is evaluated where the structure leaves tiles partly visible.
    """

    fn: IndexFn
    structure: Structure
    exact: bool = False

    def __call__(self, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return self.fn(b, h, i, j)

    @property
    def __name__(self) -> str:  # reads like the function it wraps
        return getattr(self.fn, "__name__", type(self.fn).__name__)

    def __str__(self) -> str:
        return f"{self.__name__}: {self.structure}"


def declare(
    fn: IndexFn,
    structure: Structure | None = None,
    **fields: object,
) -> StructuredFn:
    """``fn`` with a declared structure: ``declare(fn, band=Band(3, 0))``, or a ``Structure``.

    Fields given as keywords replace those of ``structure`` (and of ``fn``'s own, when ``fn``
    already declares one).
    """
    base = structure_of(fn) if structure is None else structure
    inner = fn.fn if isinstance(fn, StructuredFn) else fn
    return StructuredFn(inner, replace(base, **fields))  # type: ignore[arg-type]


def exactly(fn: IndexFn, structure: Structure) -> StructuredFn:
    """``fn`` declared as exactly ``structure`` (see ``StructuredFn.exact``): for attnkit's
    own band and layout masks, whose results equal their structure everywhere."""
    if structure.tile is not None or structure.ranges is not None or structure.relative:
        raise ValueError("only bands, block layouts and their AND can be exact structure")
    return StructuredFn(fn, structure, exact=True)


def exact_structure(fn: object) -> Structure | None:
    """The structure ``fn`` is exactly (``StructuredFn.exact``), or None."""
    return fn.structure if isinstance(fn, StructuredFn) and fn.exact else None


def relative(fn: IndexFn) -> StructuredFn:
    """Declare that the bias function ``fn(b, h, i, j)`` depends only on ``h`` and ``j - i``."""
    return declare(fn, relative=True)


def structure_of(fn: object) -> Structure:
    """What ``fn`` declares (``StructuredFn``), or an empty ``Structure`` for anything else."""
    return fn.structure if isinstance(fn, StructuredFn) else Structure()


def all_of(*fns: IndexFn | None) -> IndexFn | None:
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

    structure = Structure(parts=tuple(structure_of(f) for f in parts))
    if all(exact_structure(f) is not None for f in parts):
        return exactly(mask, structure)
    return declare(mask, structure)


# The tile plan of a call: the kept key tiles of each query tile, computed once.


@dataclass(frozen=True, eq=False)
class TilePlan:
    """Which key tiles each query tile of a call visits, and whether each is all visible.

    Query tile ``r`` holds queries ``[r * block_q, min(n_queries, (r + 1) * block_q))``; its
    ``rows[r]`` lists kept key tiles ``(j0, j1, full)``, ``j0`` a multiple of ``block_k``,
    ``full`` True when every pair is visible (else the mask is evaluated on the tile). Tiles the
    structure rules out are not listed. Local positions; the structure was read at absolute
    positions ``q_offset + i``, ``k_offset + j``. One plan serves every reader of a call:
    ``tiled`` and ``sparse`` (``Tiles.groups``), ``fused`` (``tensors`` and ``by_key``, read by
    its C++ loops), the cost model (``backends.visits``) and ``to_string``.
    """

    n_queries: int
    n_keys: int
    block_q: int
    block_k: int
    rows: tuple[tuple[tuple[int, int, bool], ...], ...]

    @property
    def tiles(self) -> int:
        """The number of kept tiles."""
        return sum(len(row) for row in self.rows)

    def pairs(self, full: bool | None = None) -> int:
        """The (i, j) pairs of the kept tiles (only full ones, or only partial, if asked)."""
        total = 0
        for r, row in enumerate(self.rows):
            height = min(self.n_queries, (r + 1) * self.block_q) - r * self.block_q
            total += sum(height * (j1 - j0) for j0, j1, f in row if full is None or f == full)
        return total

    def tensors(self) -> tuple[Tensor, Tensor]:
        """``(offsets, tiles)``: int64 ``(n_query_tiles + 1,)`` row offsets into ``(T, 3)``
        rows of ``(j0, j1, full)``, row ``r``'s tiles at ``offsets[r]:offsets[r + 1]``."""
        flat = [(j0, j1, int(full)) for row in self.rows for j0, j1, full in row]
        offsets = [0]
        for row in self.rows:
            offsets.append(offsets[-1] + len(row))
        tiles = torch.tensor(flat, dtype=torch.int64).view(-1, 3)
        return torch.tensor(offsets, dtype=torch.int64), tiles

    def by_key(self) -> tuple[Tensor, Tensor]:
        """The same plan key tile by key tile: ``(offsets, tiles)`` with rows ``(i0, i1,
        full)`` of the query tiles that keep key tile ``c`` at ``offsets[c]:offsets[c + 1]``."""
        n_cols = -(-self.n_keys // self.block_k)
        columns: list[list[tuple[int, int, int]]] = [[] for _ in range(n_cols)]
        for r, row in enumerate(self.rows):
            i0, i1 = r * self.block_q, min(self.n_queries, (r + 1) * self.block_q)
            for j0, _, full in row:
                columns[j0 // self.block_k].append((i0, i1, int(full)))
        offsets = [0]
        for col in columns:
            offsets.append(offsets[-1] + len(col))
        flat = [t for col in columns for t in col]
        return torch.tensor(offsets, dtype=torch.int64), torch.tensor(flat, dtype=torch.int64).view(
            -1, 3
        )

    def picture(self) -> list[str]:
        """One line a query tile, one character a key tile: ``█`` all visible, ``░`` partly
        (evaluated), `` `` skipped."""
        n_cols = -(-self.n_keys // self.block_k)
        lines = []
        for row in self.rows:
            chars = [" "] * n_cols
            for j0, _, full in row:
                chars[j0 // self.block_k] = "█" if full else "░"
            lines.append("|" + "".join(chars) + "|")
        return lines

    def to_string(self) -> str:
        """A header and ``picture``."""
        n_cols = -(-self.n_keys // self.block_k)
        header = (
            f"{self.n_queries} x {self.n_keys}, tiles of {self.block_q} x {self.block_k}: "
            f"{self.tiles} of {len(self.rows) * n_cols} kept"
        )
        return "\n".join([header, *self.picture()])


def _key(s: Structure) -> tuple:
    """A hashable description of a structure: its leaves (bands by value; layouts and custom
    classifiers by identity; a part that promises nothing as "opaque", since it makes every
    tile partly visible), sorted, since an AND does not depend on order."""
    leaves: list[tuple] = []
    for part in s.parts:
        leaves.extend(_key(part))
    if not s.skips:
        leaves.append(("opaque",))  # promises nothing: its tiles stay partly visible
    if s.band is not None:
        leaves.append(("band", s.band.left, s.band.right, s.band.offset))
    if s.layout is not None:
        leaves.append(("layout", id(s.layout), s.block))
    if s.tile is not None or s.ranges is not None:
        leaves.append(("custom", id(s.tile), id(s.ranges)))
    return tuple(sorted(leaves, key=repr))


_PLANS: OrderedDict[tuple, tuple[TilePlan, Structure]] = OrderedDict()
_PLANS_MAX = 64
_PLAN_STATS = {"hits": 0, "misses": 0}


def tile_plan(
    structure: Structure | None,
    n_queries: int,
    n_keys: int,
    block_q: int,
    block_k: int,
    q_offset: int = 0,
    k_offset: int = 0,
) -> TilePlan:
    """The ``TilePlan`` of a call whose mask function has ``structure`` (``None``: no mask
    function, every tile all visible), kept for the latest calls, so the forward, the backward
    and the cost model of one call share one plan object."""
    if structure is None:
        rows = tuple(
            tuple((j0, min(n_keys, j0 + block_k), True) for j0 in range(0, n_keys, block_k))
            for _ in range(0, n_queries, block_q)
        )
        return TilePlan(n_queries, n_keys, block_q, block_k, rows)
    key = (_key(structure), n_queries, n_keys, block_q, block_k, q_offset, k_offset)
    found = _PLANS.get(key)
    if found is not None:
        _PLANS.move_to_end(key)
        _PLAN_STATS["hits"] += 1
        return found[0]
    _PLAN_STATS["misses"] += 1
    rows = []
    for i0 in range(0, n_queries, block_q):
        i1 = min(n_queries, i0 + block_q)
        row: list[tuple[int, int, bool]] = []
        for lo, hi in structure.visible_keys(
            i0 + q_offset, i1 + q_offset, k_offset, k_offset + n_keys
        ):
            first = (lo - k_offset) // block_k * block_k
            for j0 in range(first, hi - k_offset, block_k):
                if row and row[-1][0] == j0:
                    continue  # two visible ranges in one aligned tile
                j1 = min(n_keys, j0 + block_k)
                state = structure.classify(
                    i0 + q_offset, i1 + q_offset, j0 + k_offset, j1 + k_offset
                )
                if state is not False:
                    row.append((j0, j1, state is True))
        rows.append(tuple(row))
    plan = TilePlan(n_queries, n_keys, block_q, block_k, tuple(rows))
    _PLANS[key] = (plan, structure)  # the structure keeps the ids in the key alive
    if len(_PLANS) > _PLANS_MAX:
        _PLANS.popitem(last=False)
    return plan


def plan_cache_info() -> dict[str, int]:
    """How often ``tile_plan`` found a plan already made (``hits``) or made one (``misses``)."""
    return dict(_PLAN_STATS, size=len(_PLANS))
