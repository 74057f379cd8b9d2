"""A paged KV cache: a pool of fixed-size blocks, and attention that reads keys through it.

Shape vocabulary: ``b`` sequences, ``t`` new tokens of all sequences packed one after the other,
``i`` new tokens of one sequence, ``j`` key positions of one sequence, ``h`` query heads,
``h_kv`` key/value heads, ``r = h // h_kv`` query heads per key/value head, ``d`` head width,
``N`` blocks in the pool, ``s`` positions per block (``block_size``), ``L`` layers.

Why pages (Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention", section 4): a server does not know how long each answer will be. Reserving the
whole context per request wastes most of the memory; growing one tensor per sequence copies it
every step. Instead every layer's keys and values live in one pool of ``N`` blocks of ``s``
positions, and a sequence owns a *block table*, the list of its blocks in order::

    sequence A, 11 tokens, s = 4:   table [7, 2, 9]     positions 0-3 -> block 7,
    sequence B,  5 tokens:          table [3, 5]        4-7 -> block 2, 8-10 -> block 9 (3 of 4)

A sequence grows by taking one more block from the free list when its last block is full: no
key is ever copied. A block may appear in several tables (a shared prompt prefix,
``attnkit.serve.prefix``): ``BlockPool`` counts its references and frees it only at zero.

``paged_attention`` is the reference math (readable torch, float64-capable); a fused kernel will
plug in behind the same signature (``attnkit.serve.forward.ATTENTION``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
from torch import Tensor

from attnkit._numerics import blocked, compute_dtype

__all__ = ["BlockPool", "PoolExhausted", "paged_attention", "write_kv"]


class PoolExhausted(RuntimeError):
    """No free block is left (the scheduler then waits, or preempts a sequence)."""


class BlockPool:
    """``N`` blocks of ``s`` positions for every layer's keys and values, with a free list and
    reference counts.

    Storage: ``keys[l]`` and ``values[l]`` are ``(N, s, h_kv, d)``; position ``p`` of a sequence
    with table ``T`` lives at ``keys[l][T[p // s], p % s]``. The pool only counts: which blocks
    are free, and how many tables hold each used block. Who holds what (block tables, the prefix
    cache) is the callers' business.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        for name, value in (
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)  # (N, s, h_kv, d)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.refs = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    def __repr__(self) -> str:
        return (
            f"BlockPool({self.num_blocks} blocks of {self.block_size}, {self.num_free} free, "
            f"{len(self.keys)} layers)"
        )

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A free block, now held once. Raises ``PoolExhausted`` when none is free."""
        if not self._free:
            raise PoolExhausted(f"all {self.num_blocks} KV blocks are in use")
        block = self._free.popleft()
        assert self.refs[block] == 0
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more holder of a used block (a second table, or the prefix cache)."""
        if self.refs[block] <= 0:
            raise ValueError(f"block {block} is free: it cannot be shared")
        self.refs[block] += 1

    def release(self, block: int) -> bool:
        """Drop one holder; at zero the block is free again. Returns whether it became free."""
        if self.refs[block] <= 0:
            raise ValueError(f"block {block} is already free (released twice)")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self._free.append(block)
            return True
        return False

    def check_whole(self) -> None:
        """Raise unless every block is free exactly once and held by nobody (after a run)."""
        free = list(self._free)
        if sorted(free) != list(range(self.num_blocks)) or any(self.refs):
            held = [b for b, n in enumerate(self.refs) if n]
            raise AssertionError(
                f"the pool is not whole: {len(free)} of {self.num_blocks} free "
                f"({len(set(free))} distinct), still held: {held[:10]}"
            )


def slots_of(block_table: Sequence[int], start: int, stop: int, block_size: int) -> list[int]:
    """Flat slot ``block * s + offset`` of each position ``start .. stop - 1`` of a sequence."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, stop)]


def write_kv(
    key_pool: Tensor, value_pool: Tensor, slots: Tensor, key: Tensor, value: Tensor
) -> None:
    """Store new keys/values ``(t, h_kv, d)`` at flat ``slots (t,)`` of pools ``(N, s, h_kv, d)``
    (in place: the pool is a view of ``(N * s, h_kv, d)`` positions)."""
    n, s, h_kv, d = key_pool.shape
    key_pool.view(n * s, h_kv, d).index_copy_(0, slots, key.to(key_pool.dtype))  # (N s, h_kv, d)
    value_pool.view(n * s, h_kv, d).index_copy_(0, slots, value.to(value_pool.dtype))


def paged_attention(
    q: Tensor,
    key_pool: Tensor,
    value_pool: Tensor,
    block_tables: Tensor,
    lengths: Tensor,
    query_lengths: Sequence[int],
    *,
    scale: float | None = None,
) -> Tensor:
    """Causal attention of every sequence's new tokens over its cached keys, read by block table.

    Args:
        q: ``(t, h, d)`` the new queries of all sequences packed in order: sequence ``n`` owns
            ``query_lengths[n]`` consecutive rows.
        key_pool, value_pool: ``(N, s, h_kv, d)``, one layer's pool, already holding the new
            tokens' keys and values (``write_kv``); ``h_kv`` must divide ``h`` (GQA).
        block_tables: ``(b, m)`` int, each row a sequence's blocks in order, padded with any
            valid block id (padding is masked out by ``lengths``).
        lengths: ``(b,)`` keys of each sequence, cached and new.
        query_lengths: ``b`` ints, new tokens of each sequence (``<= lengths``).
        scale: score scale, ``1 / sqrt(d)`` when ``None``.

    Returns:
        ``(t, h, d)`` in ``q``'s dtype; scores and softmax are computed in float32 (float64 for
        float64 inputs).

    The new queries are the last ``i`` positions of their sequence, so causality is aligned
    bottom-right: query ``k`` (position ``j - i + k``) sees keys ``0 .. j - i + k``::

        j = 5 keys, i = 2 new:   1 1 1 1 0
                                 1 1 1 1 1

    Sequences with the same number of new tokens (all decoding sequences have one) are computed
    together with one gather of their blocks: a decode step is one batched matmul, not one per
    sequence.
    """
    t, h, d = q.shape
    _, _, h_kv, d_kv = key_pool.shape  # (N, s, h_kv, d)
    b = len(query_lengths)
    if d_kv != d or h % h_kv or value_pool.shape != key_pool.shape:
        raise ValueError(
            f"q (t, h, d) = {tuple(q.shape)} needs pools (N, s, h_kv, d) with h_kv dividing h and "
            f"the same d, got keys {tuple(key_pool.shape)}, values {tuple(value_pool.shape)}"
        )
    if tuple(block_tables.shape[:1]) != (b,) or tuple(lengths.shape) != (b,):
        raise ValueError(
            f"block_tables (b, m) and lengths (b,) must have b = {b} rows (query_lengths), got "
            f"{tuple(block_tables.shape)} and {tuple(lengths.shape)}"
        )
    if sum(query_lengths) != t:
        raise ValueError(f"query_lengths sum to {sum(query_lengths)}, but q has t = {t} rows")
    scale = d**-0.5 if scale is None else scale
    starts = [0]
    for n in query_lengths:
        starts.append(starts[-1] + n)
    out = torch.empty_like(q)
    for i in sorted(set(query_lengths)):
        rows = [n for n in range(b) if query_lengths[n] == i]
        token_index = torch.tensor([starts[n] + k for n in rows for k in range(i)], device=q.device)
        group = torch.tensor(rows, device=q.device)
        qg = q.index_select(0, token_index).view(len(rows), i, h, d)  # (g, i, h, d)
        og = _attend_group(
            qg, key_pool, value_pool, block_tables[group], lengths[group], scale
        )  # (g, i, h, d)
        out.index_copy_(0, token_index, og.reshape(len(rows) * i, h, d))  # (g i, h, d)
    return out


def _attend_group(
    q: Tensor, key_pool: Tensor, value_pool: Tensor, tables: Tensor, lengths: Tensor, scale: float
) -> Tensor:
    """``q (g, i, h, d)`` of ``g`` sequences with ``i`` new tokens each -> ``(g, i, h, d)``."""
    g, i, h, d = q.shape
    _, s, h_kv, _ = key_pool.shape
    r = h // h_kv
    m = -(-int(lengths.max()) // s)  # blocks of the longest sequence
    dtype = compute_dtype(q.dtype)
    tables = tables[:, :m].long()
    k = key_pool[tables].reshape(g, m * s, h_kv, d).to(dtype)  # (g, j, h_kv, d)
    v = value_pool[tables].reshape(g, m * s, h_kv, d).to(dtype)  # (g, j, h_kv, d)
    qf = q.to(dtype).view(g, i, h_kv, r, d)  # (g, i, h_kv, r, d): GQA groups, no copy of k
    scores = torch.einsum("gikrd,gjkd->gkrij", qf, k) * scale  # (g, h_kv, r, i, j)
    key_pos = torch.arange(m * s, device=q.device)  # (j,)
    query_pos = lengths[:, None] - i + torch.arange(i, device=q.device)  # (g, i)
    visible = key_pos[None, None, :] <= query_pos[:, :, None]  # (g, i, j): causal, in length
    scores = scores.masked_fill(~visible[:, None, None], blocked(dtype))
    weights = scores.softmax(dim=-1)  # (g, h_kv, r, i, j)
    out = torch.einsum("gkrij,gjkd->gikrd", weights, v)  # (g, i, h_kv, r, d)
    return out.reshape(g, i, h, d).to(q.dtype)  # (g, i, h, d)
