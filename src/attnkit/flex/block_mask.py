"""Block masks: which tiles of a mask are full, partial or empty (torch's ``BlockMask``).

``create_block_mask`` evaluates a ``mask_mod(b, h, q_idx, kv_idx)`` one strip of
``BLOCK_SIZE`` queries at a time and records, per ``BLOCK_SIZE x BLOCK_SIZE`` block, whether
every position is visible (*full*), some are (*partial*) or none is (*empty*). ``BlockMask``
stores that in torch's format and prints itself as torch does; ``BlockMask.mask_fn`` hands it to
the tiled engine as a mask function with a declared structure (``masks.Structure``), so full
tiles are never evaluated and empty tiles never visited.

    b batch    h heads    q_idx / i query positions    kv_idx / j key positions
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit._structure import block_ranges
from attnkit.flex.elementwise import per_element
from attnkit.masks import StructuredFn, declare

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "BlockMask",
    "MaskMod",
    "and_masks",
    "create_block_mask",
    "noop_mask",
    "or_masks",
]

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""``mask_mod(b, h, q_idx, kv_idx) -> bool``: True = may attend."""

EMPTY, PARTIAL, FULL = 0, 1, 2  # a tile's class in ``BlockMask.block_states``
MIXED = 3  # the class differs between batches or heads (``_BlockMaskFn``)
_EVAL_BUDGET = 1 << 22  # positions per mask_mod call in create_block_mask (4 MiB of bool)
_PARTIAL_BUDGET = 1 << 24  # positions of a call's partial blocks kept at once (16 MiB of bool)


def noop_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Every query sees every key."""
    return b.new_ones((), dtype=torch.bool)


def or_masks(*mask_mods: MaskMod) -> MaskMod:
    """The union of ``mask_mods`` (a position is visible when any of them allows it)."""
    _check_callables(mask_mods)

    def or_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        result = b.new_zeros((), dtype=torch.bool)
        for mod in mask_mods:
            result = result | _checked_mask(mod, mod(b, h, q_idx, kv_idx))
        return result

    return or_mask


def and_masks(*mask_mods: MaskMod) -> MaskMod:
    """The intersection of ``mask_mods`` (a position is visible when all of them allow it)."""
    _check_callables(mask_mods)

    def and_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        result = b.new_ones((), dtype=torch.bool)
        for mod in mask_mods:
            result = result & _checked_mask(mod, mod(b, h, q_idx, kv_idx))
        return result

    return and_mask


def _check_callables(mods: tuple[object, ...]) -> None:
    bad = [m for m in mods if not callable(m)]
    if bad:
        raise TypeError(f"and_masks/or_masks take mask_mod functions, got {bad!r}")


def _name(fn: object) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _checked_mask(mask_mod: object, values: object) -> Tensor:
    """A mask_mod's output, checked: a bool tensor."""
    if not isinstance(values, Tensor) or values.dtype != torch.bool:
        got = values.dtype if isinstance(values, Tensor) else type(values).__name__
        raise TypeError(
            f"mask_mod {_name(mask_mod)!r} must return a bool tensor (True = may attend), got "
            f"{got}; a function that changes scores is a score_mod"
        )
    return values


class BlockMask:
    """Which ``BLOCK_SIZE`` tiles of a ``(B, H, Q_LEN, KV_LEN)`` mask are full, partial or empty.

    The fields are torch's: ``kv_num_blocks (B, H, q blocks)`` and ``kv_indices (B, H, q blocks,
    kv blocks)`` list the partial key blocks of each query block (the first ``kv_num_blocks``
    entries of a row count), ``full_kv_num_blocks`` / ``full_kv_indices`` the full ones (None:
    no block is declared full, every kept block evaluates ``mask_mod``); a block in neither list
    is empty. ``B`` or ``H`` of 1 broadcast over batches or heads. Build one with
    ``create_block_mask`` or, from your own layout, ``from_kv_blocks``.
    """

    def __init__(
        self,
        seq_lengths: tuple[int, int],
        kv_num_blocks: Tensor,
        kv_indices: Tensor,
        full_kv_num_blocks: Tensor | None,
        full_kv_indices: Tensor | None,
        BLOCK_SIZE: tuple[int, int],
        mask_mod: MaskMod,
    ) -> None:
        if kv_indices.dim() != 4 or kv_num_blocks.shape != kv_indices.shape[:3]:
            raise ValueError(
                "kv_indices must be (B, H, q blocks, kv blocks) and kv_num_blocks (B, H, q "
                f"blocks), got {tuple(kv_indices.shape)} and {tuple(kv_num_blocks.shape)}"
            )
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise ValueError("full_kv_num_blocks and full_kv_indices go together")
        self.seq_lengths = seq_lengths
        self.kv_num_blocks = kv_num_blocks
        self.kv_indices = kv_indices
        self.full_kv_num_blocks = full_kv_num_blocks
        self.full_kv_indices = full_kv_indices
        self.BLOCK_SIZE = BLOCK_SIZE
        self.mask_mod = mask_mod

    @classmethod
    def from_kv_blocks(
        cls,
        kv_num_blocks: Tensor,
        kv_indices: Tensor,
        full_kv_num_blocks: Tensor | None = None,
        full_kv_indices: Tensor | None = None,
        BLOCK_SIZE: int | tuple[int, int] = 128,
        mask_mod: MaskMod | None = None,
        seq_lengths: tuple[int, int] | None = None,
    ) -> BlockMask:
        """A block mask from torch's ordered block lists (``seq_lengths`` defaults to whole
        blocks: ``kv_indices``' last two sizes times ``BLOCK_SIZE``)."""
        q_bs, kv_bs = _block_sizes(BLOCK_SIZE)
        kv_num_blocks, kv_indices = _at_least_4d(kv_num_blocks, kv_indices)
        if full_kv_num_blocks is not None and full_kv_indices is not None:
            full_kv_num_blocks, full_kv_indices = _at_least_4d(full_kv_num_blocks, full_kv_indices)
        if seq_lengths is None:
            seq_lengths = (kv_indices.shape[-2] * q_bs, kv_indices.shape[-1] * kv_bs)
        mask_mod = noop_mask if mask_mod is None else mask_mod
        return cls(
            seq_lengths,
            kv_num_blocks,
            kv_indices,
            full_kv_num_blocks,
            full_kv_indices,
            (q_bs, kv_bs),
            mask_mod,
        )

    @classmethod
    def from_states(
        cls,
        states: Tensor,
        seq_lengths: tuple[int, int],
        BLOCK_SIZE: int | tuple[int, int],
        mask_mod: MaskMod,
    ) -> BlockMask:
        """A block mask from a ``(B, H, q blocks, kv blocks)`` tensor of ``EMPTY`` / ``PARTIAL``
        / ``FULL`` (what ``block_states`` returns)."""
        partial = _dense_to_ordered(states == PARTIAL)
        full = _dense_to_ordered(states == FULL)
        return cls(seq_lengths, *partial, *full, _block_sizes(BLOCK_SIZE), mask_mod)

    @classmethod
    def from_torch(cls, block_mask: Any) -> BlockMask:
        """attnkit's copy of a ``torch.nn.attention.flex_attention.BlockMask``."""
        return cls(
            tuple(block_mask.seq_lengths),
            block_mask.kv_num_blocks,
            block_mask.kv_indices,
            block_mask.full_kv_num_blocks,
            block_mask.full_kv_indices,
            _block_sizes(block_mask.BLOCK_SIZE),
            block_mask.mask_mod,
        )

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, H, Q_LEN, KV_LEN)``; B or H is 1 when the mask broadcasts over it."""
        nb, nh = self.kv_indices.shape[:2]
        return (nb, nh, *self.seq_lengths)

    def block_states(self) -> Tensor:
        """``(B, H, q blocks, kv blocks)`` int8: ``EMPTY`` 0, ``PARTIAL`` 1, ``FULL`` 2."""
        n_cols = self.kv_indices.shape[-1]
        states = _ordered_to_dense(self.kv_num_blocks, self.kv_indices, n_cols).to(torch.int8)
        if self.full_kv_num_blocks is not None and self.full_kv_indices is not None:
            full = _ordered_to_dense(self.full_kv_num_blocks, self.full_kv_indices, n_cols)
            states = states.masked_fill(full.bool(), FULL)
        return states

    def to_dense(self) -> Tensor:
        """``(B, H, q blocks, kv blocks)`` int32: 1 where a block is computed (full or partial),
        as torch's ``to_dense``."""
        return (self.block_states() != EMPTY).to(torch.int32)

    def sparsity(self) -> float:
        """The percentage of blocks skipped (empty). torch divides by the positions instead, so
        its value differs (even goes negative) when the lengths are not multiples of the block
        size; for multiples the two agree."""
        states = self.block_states()
        return 100.0 * float((states == EMPTY).sum()) / max(1, states.numel())

    def to_string(self, grid_size: int | tuple[int, int] = (20, 20), limit: int = 4) -> str:
        """Each ``(b, h)``'s blocks, two characters each, as torch prints them: ``█`` computed,
        `` `` skipped, ``░`` a mix (when a character stands for several blocks, beyond
        ``grid_size``); at most ``limit`` pictures. ``grid_size=-1`` draws every block."""
        dense = self.to_dense()
        n_rows, n_cols = dense.shape[-2:]
        if grid_size == -1:
            max_rows, max_cols = n_rows, n_cols
        elif isinstance(grid_size, int):
            max_rows = max_cols = grid_size
        else:
            max_rows, max_cols = grid_size
        row_step = max(1, -(-n_rows // max_rows))
        col_step = max(1, -(-n_cols // max_cols))
        pictures = []
        for count, (b, h) in enumerate(itertools.product(*map(range, dense.shape[:2]))):
            if count == limit:
                pictures.append("...")
                pictures.append("To print out more, set BlockMask.to_string(limit=N)")
                break
            lines = [f"{(b, h)}"]
            for r in range(0, n_rows, row_step):
                cells = [
                    dense[b, h, r : r + row_step, c : c + col_step]
                    for c in range(0, n_cols, col_step)
                ]
                lines.append("".join(2 * _shade(cell) for cell in cells))
            pictures.append("\n".join(lines) + "\n")
        return "\n".join(pictures)

    def __str__(self) -> str:
        return (
            f"BlockMask(shape={self.shape}, sparsity={self.sparsity():.2f}%, \n"
            f"{self.to_string().strip()}\n)"
        )

    def __repr__(self) -> str:
        return (
            f"BlockMask(shape={self.shape}, BLOCK_SIZE={self.BLOCK_SIZE}, "
            f"sparsity={self.sparsity():.2f}%, mask_mod={_name(self.mask_mod)})"
        )

    def mask_fn(self, n_batch: int, n_heads: int) -> StructuredFn:
        """The mask function the tiled engine evaluates for ``(n_batch, n_heads)`` queries,
        declaring this block layout (``masks.Structure``: full tiles are never evaluated, empty
        ones never visited)."""
        return _BlockMaskFn(self, n_batch, n_heads).declared()


def _shade(cell: Tensor) -> str:
    fraction = cell.float().mean().item()
    return "█" if fraction == 1 else (" " if fraction == 0 else "░")


class _BlockMaskFn:
    """A ``BlockMask`` as the engine's declared mask function.

    The tile classifier answers for every batch and head at once: a tile is full (or empty) only
    when it is for all of them (otherwise ``MIXED``). Evaluated tiles compute, per ``(b, h)``,
    ``full | (partial & mask_mod)``: torch's reading of the block mask, exact whatever the
    layout and the tile boundaries.
    """

    def __init__(self, block_mask: BlockMask, n_batch: int, n_heads: int) -> None:
        self.mask_mod = per_element(block_mask.mask_mod, score=False)
        self.__name__ = _name(block_mask.mask_mod)  # what StructuredFn prints
        self.q_bs, self.kv_bs = block_mask.BLOCK_SIZE
        self.states = block_mask.block_states()  # (B or 1, H or 1, nq, nk)
        nb, nh = self.states.shape[:2]
        self.batch_index = nb == n_batch and nb > 1  # else broadcast: read (b, h) = (0, ...)
        self.head_index = nh == n_heads and nh > 1
        first = self.states[:1, :1]
        uniform = (self.states == first).all(dim=1).all(dim=0)  # (nq, nk)
        self.classes: list[list[int]] = torch.where(uniform, first[0, 0], MIXED).tolist()
        kept = (self.states != EMPTY).any(dim=1).any(dim=0)  # (nq, nk)
        self.kept_cols: list[list[int]] = [row.nonzero().flatten().tolist() for row in kept]
        self.lengths = tuple(block_mask.seq_lengths)  # (Q_LEN, KV_LEN)
        # The partial blocks' masks, evaluated once for the call (``_partial``): the forward
        # and the backward read the same tiles, and one vmapped call costs what one tile does.
        self.partial: tuple[Tensor, Tensor, dict[tuple[int, int], int], Tensor] | None = None
        self.partial_tried = False

    def declared(self) -> StructuredFn:
        return declare(self, tile=self.classify, ranges=self.visible_keys, block=self.q_bs)

    def _blocks(self, lo: int, hi: int, size: int, count: int) -> range:
        return range(max(lo, 0) // size, min(max(hi - 1, lo) // size, count - 1) + 1)

    def classify(self, i0: int, i1: int, j0: int, j1: int) -> bool | None:
        rows = self._blocks(i0, i1, self.q_bs, len(self.classes))
        cols = self._blocks(j0, j1, self.kv_bs, len(self.classes[0]) if self.classes else 0)
        found = {self.classes[r][c] for r in rows for c in cols}
        if found == {FULL}:
            return True
        return False if found <= {EMPTY} else None

    def visible_keys(self, i0: int, i1: int, j0: int, j1: int) -> list[tuple[int, int]]:
        cols = sorted(
            {
                c
                for r in self._blocks(i0, i1, self.q_bs, len(self.kept_cols))
                for c in self.kept_cols[r]
            }
        )
        return block_ranges(cols, self.kv_bs, j0, j1)

    def __call__(self, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        qb0, qb1 = int(i.min()) // self.q_bs, int(i.max()) // self.q_bs
        kb0, kb1 = int(j.min()) // self.kv_bs, int(j.max()) // self.kv_bs
        if qb0 == qb1 and kb0 == kb1 and self.classes[qb0][kb0] == PARTIAL:
            kept = self._partial(b, h, i, j, qb0, kb0)
            if kept is not None:
                return kept
            return _checked_mask(self.mask_mod, self.mask_mod(b, h, i, j))
        # Several blocks in this tile, or classes that differ by batch or head: by position.
        bb = b if self.batch_index else torch.zeros_like(b)
        hh = h if self.head_index else torch.zeros_like(h)
        states = self.states[bb, hh, i // self.q_bs, j // self.kv_bs]  # (b, h, bi, bj)
        partial = states == PARTIAL
        allowed = states == FULL
        if bool(partial.any()):
            allowed = allowed | (partial & _checked_mask(self.mask_mod, self.mask_mod(b, h, i, j)))
        return allowed

    def _partial(
        self, b: Tensor, h: Tensor, i: Tensor, j: Tensor, qb: int, kb: int
    ) -> Tensor | None:
        """The mask of partial block ``(qb, kb)`` when the tile ``(i, j)`` is that whole block in
        order, read from one evaluation of every whole-sized partial block of the call (made on
        first use, within ``_PARTIAL_BUDGET``): ``(b or 1, h or 1, q_bs, kv_bs)``, a view. None
        where the tile is not such a block, or the call's ``b``, ``h`` differ from the first."""
        if not self.partial_tried:
            self.partial_tried = True
            self.partial = self._evaluate_partial(b, h)
        if self.partial is None:
            return None
        b0, h0, where, masks = self.partial
        p = where.get((qb, kb))
        if p is None or i.numel() != self.q_bs or j.numel() != self.kv_bs:
            return None
        rows = torch.arange(qb * self.q_bs, (qb + 1) * self.q_bs, device=i.device)
        cols = torch.arange(kb * self.kv_bs, (kb + 1) * self.kv_bs, device=j.device)
        same = b.shape == b0.shape and h.shape == h0.shape and torch.equal(b, b0)
        same = same and torch.equal(h, h0) and torch.equal(i.flatten(), rows)
        if not (same and torch.equal(j.flatten(), cols)):
            return None
        return masks[p]

    def _evaluate_partial(
        self, b: Tensor, h: Tensor
    ) -> tuple[Tensor, Tensor, dict[tuple[int, int], int], Tensor] | None:
        """Every partial block of whole size, evaluated in one ``mask_mod`` call (per element,
        as torch evaluates it): the block's rows and keys along a leading axis of 5-D index
        tensors. None when they would not fit ``_PARTIAL_BUDGET`` or ``b``, ``h`` are not 4-D."""
        if b.dim() != 4 or h.dim() != 4:
            return None
        n_q, n_kv = self.lengths
        blocks = [
            (r, c)
            for r, row in enumerate(self.classes)
            for c, cls in enumerate(row)
            if cls == PARTIAL and (r + 1) * self.q_bs <= n_q and (c + 1) * self.kv_bs <= n_kv
        ]
        size = len(blocks) * self.q_bs * self.kv_bs * b.numel() * h.numel()
        if not blocks or size > _PARTIAL_BUDGET:
            return None
        device = b.device
        starts = torch.tensor(blocks, device=device)  # (P, 2) block coordinates
        i = starts[:, :1] * self.q_bs + torch.arange(self.q_bs, device=device)  # (P, q_bs)
        j = starts[:, 1:] * self.kv_bs + torch.arange(self.kv_bs, device=device)  # (P, kv_bs)
        masks = self.mask_mod(b.unsqueeze(0), h.unsqueeze(0), i.view(-1, 1, 1, self.q_bs, 1),
                              j.view(-1, 1, 1, 1, self.kv_bs))  # fmt: skip
        masks = _checked_mask(self.mask_mod, masks)  # (P, b or 1, h or 1, q_bs, kv_bs)
        where = {block: p for p, block in enumerate(blocks)}
        return b, h, where, masks.expand(len(blocks), *masks.shape[1:])


def _block_sizes(BLOCK_SIZE: int | tuple[int, int]) -> tuple[int, int]:
    sizes = (BLOCK_SIZE, BLOCK_SIZE) if _is_int(BLOCK_SIZE) else BLOCK_SIZE
    if not (isinstance(sizes, (tuple, list)) and len(sizes) == 2 and all(map(_is_int, sizes))):
        raise ValueError(f"BLOCK_SIZE must be an int or two ints (q, kv), got {BLOCK_SIZE!r}")
    q_bs, kv_bs = (int(x) for x in sizes)
    if q_bs < 1 or kv_bs < 1:
        raise ValueError(f"BLOCK_SIZE must be positive, got {BLOCK_SIZE!r}")
    return q_bs, kv_bs


def _is_int(x: object) -> bool:
    return hasattr(type(x), "__index__") and not isinstance(x, (bool, Tensor))


def _check_sizes(B: object, H: object, Q_LEN: object, KV_LEN: object) -> None:
    """``create_block_mask``'s sizes: B and H None or positive, the lengths non-negative."""
    for name, value, least, optional in (
        ("B", B, 1, True), ("H", H, 1, True), ("Q_LEN", Q_LEN, 0, False),
        ("KV_LEN", KV_LEN, 0, False),
    ):  # fmt: skip
        if value is None and optional:
            continue
        if not _is_int(value) or int(value) < least:
            what = "None or a positive int" if optional else "an int >= 0"
            raise ValueError(f"{name} must be {what}, got {value!r}")


def _at_least_4d(num: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
    while indices.dim() < 4:
        num, indices = num.unsqueeze(0), indices.unsqueeze(0)
    return num, indices


def _dense_to_ordered(dense: Tensor) -> tuple[Tensor, Tensor]:
    """Bool ``(B, H, rows, cols)`` -> torch's ``(num_blocks_in_row, col_indices)``: the kept
    columns of each row first, in order (a stable sort)."""
    dense = dense.to(torch.int32)
    num = dense.sum(dim=-1).to(torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return num, indices


def _ordered_to_dense(num: Tensor, indices: Tensor, n_cols: int) -> Tensor:
    """The inverse of ``_dense_to_ordered``: int32 ``(B, H, rows, cols)``, 1 on listed blocks."""
    listed = torch.arange(indices.shape[-1], device=indices.device) < num.unsqueeze(-1)
    cols = torch.where(listed, indices.long(), n_cols)  # unlisted entries land in a spare column
    dense = torch.zeros((*indices.shape[:-1], n_cols + 1), dtype=torch.int32, device=indices.device)
    dense.scatter_(-1, cols, 1)
    return dense[..., :n_cols]


def _n_positional(fn: Callable[..., object]) -> int | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in kinds and p.default is inspect.Parameter.empty for p in params)


def create_block_mask(
    mask_mod: MaskMod,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: torch.device | str = "cpu",
    BLOCK_SIZE: int | tuple[int, int] = 128,
) -> BlockMask:
    """The ``BlockMask`` of ``mask_mod`` over ``(B, H, Q_LEN, KV_LEN)``, built tile by tile.

    ``B`` / ``H`` None: the mask is the same for every batch / head (evaluated at 0, stored with
    size 1). ``mask_mod`` is called per element as torch calls it (``attnkit.flex.elementwise``),
    vmapped over one strip of ``BLOCK_SIZE`` queries by a bounded number of keys at a time,
    never over the whole ``Q_LEN x KV_LEN``; a block is full when all its
    ``BLOCK_SIZE x BLOCK_SIZE`` positions are visible (positions past the lengths count as not
    visible, as in torch, so edge blocks of uneven lengths are at most partial).
    """
    if not callable(mask_mod):
        raise TypeError(f"create_block_mask takes a mask_mod function, got {mask_mod!r}")
    if _n_positional(mask_mod) == 5:
        raise TypeError(
            f"create_block_mask takes a mask_mod(b, h, q_idx, kv_idx); {_name(mask_mod)!r} takes "
            "five arguments, like a score_mod(score, b, h, q_idx, kv_idx)"
        )
    _check_sizes(B, H, Q_LEN, KV_LEN)
    q_bs, kv_bs = _block_sizes(BLOCK_SIZE)
    tile_mod = per_element(mask_mod, score=False)
    nb, nh = 1 if B is None else int(B), 1 if H is None else int(H)
    Q_LEN, KV_LEN = int(Q_LEN), int(KV_LEN)
    n_rows, n_cols = -(-Q_LEN // q_bs), -(-KV_LEN // kv_bs)
    states = torch.zeros((nb, nh, n_rows, n_cols), dtype=torch.int8, device=device)
    b = torch.arange(nb, device=device).view(-1, 1, 1, 1)
    h = torch.arange(nh, device=device).view(1, -1, 1, 1)
    # Keys per call: whole blocks, at most _EVAL_BUDGET positions in all.
    chunk = max(1, _EVAL_BUDGET // (nb * nh * q_bs * kv_bs)) * kv_bs
    for r in range(n_rows):
        i0, i1 = r * q_bs, min(Q_LEN, (r + 1) * q_bs)
        i = torch.arange(i0, i1, device=device).view(1, 1, -1, 1)
        for j0 in range(0, KV_LEN, chunk):
            j1 = min(KV_LEN, j0 + chunk)
            j = torch.arange(j0, j1, device=device).view(1, 1, 1, -1)
            m = _checked_mask(mask_mod, tile_mod(b, h, i, j))
            m = m.expand(nb, nh, i1 - i0, j1 - j0)  # (b, h, bi, bj)
            width = -(-(j1 - j0) // kv_bs) * kv_bs  # pad with "not visible" to whole blocks
            m = F.pad(m, (0, width - (j1 - j0), 0, q_bs - (i1 - i0)))
            count = m.view(nb, nh, q_bs, -1, kv_bs).sum(dim=(2, 4))  # (b, h, blocks)
            cell = torch.where(count == q_bs * kv_bs, FULL, (count > 0).to(torch.int8))
            states[:, :, r, j0 // kv_bs : j0 // kv_bs + cell.shape[-1]] = cell.to(torch.int8)
    return BlockMask.from_states(states, (Q_LEN, KV_LEN), (q_bs, kv_bs), mask_mod)
