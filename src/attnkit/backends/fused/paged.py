"""Attention over a paged KV cache: ``paged_attention``, the compiled kernel (``paged.cpp``)
behind the signature of ``attnkit.serve.paged.paged_attention`` (the reference math).

Shape vocabulary: ``b`` sequences, ``t`` new tokens of all sequences packed one after the other,
``h`` query heads, ``h_kv`` key/value heads (dividing ``h``), ``d`` head width, ``N`` blocks in
the pool, ``s`` positions per block, ``m`` blocks per block-table row.

A server's step holds several sequences, each with its own new tokens (one when decoding, a
chunk of its prompt when prefilling) and its own cached length; their keys and values live in
one pool of blocks, found through each sequence's block table. The kernel computes what the
reference does, equivalent to, for every sequence ``n`` with ``i`` new tokens and ``j`` keys::

    k = key_pool[table[n]].flatten(0, 1)[:j]           # (j, h_kv, d), through the table
    v = value_pool[table[n]].flatten(0, 1)[:j]
    scores = q_n @ k.repeat_interleave(h // h_kv, 1) * scale  # (h, i, j), per head
    scores[:, a, c] = blocked where c > j - i + a       # causal, aligned bottom-right
    out_n = softmax(scores, -1) @ v                     # (i, h, d)

but never gathers ``k`` or ``v``: the work is split across threads over (sequence, key head,
block of queries, chunk of keys), as the decode kernel's flash-decoding (``decode.cpp``), each
task reading its keys row by row through the table, and the chunks' softmax states are merged.

This module does not fall back: ``paged_attention`` raises ``NotBuilt`` when the kernel is not
loaded, and ``why_not`` says in a sentence why it cannot serve a call. The caller (the server's
``attnkit.serve.forward``) decides, asking ``why_not`` with ``loaded_only=True`` (reading no
file), and takes the reference otherwise. Nothing here compiles.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from attnkit.backends.fused import jit
from attnkit.backends.fused.decode import KV_DTYPES

__all__ = ["POOL_DTYPES", "paged_attention", "why_not"]

POOL_DTYPES = KV_DTYPES  # the pool dtypes the kernel reads: a dense cache's


def why_not(
    q: Tensor, key_pool: Tensor, value_pool: Tensor, *, loaded_only: bool = False
) -> str | None:
    """Why the kernel cannot serve this call, in a sentence, or None (never compiles).

    ``loaded_only``: count the kernel only if this process has loaded it already
    (``jit.loaded``, reading no file): the server asks once per step."""
    if not (q.is_cpu and key_pool.is_cpu and value_pool.is_cpu):
        return "the paged kernel runs on the CPU only"
    if q.dtype != torch.float32:
        return f"the paged kernel takes float32 queries, got {q.dtype}"
    if key_pool.dtype not in POOL_DTYPES or value_pool.dtype != key_pool.dtype:
        return (
            f"the paged kernel reads float32, bfloat16 or float16 pools, got "
            f"{key_pool.dtype}/{value_pool.dtype}"
        )
    if q.stride(-1) != 1 or key_pool.stride(-1) != 1 or value_pool.stride(-1) != 1:
        return "the paged kernel reads q and the pools contiguous in d"
    if key_pool.stride() != value_pool.stride():
        return "the paged kernel reads key and value pools of the same layout (strides)"
    if torch.is_grad_enabled() and (
        q.requires_grad or key_pool.requires_grad or value_pool.requires_grad
    ):
        return "the paged kernel has no backward (a tensor requires grad)"
    if jit.loaded() is not None:
        return None
    if loaded_only:
        return "the fused kernel is not loaded in this process (it loads once built)"
    return jit.unavailable()


def _check(
    q: Tensor,
    key_pool: Tensor,
    value_pool: Tensor,
    block_tables: Tensor,
    lengths: Tensor,
    query_lengths: Sequence[int],
) -> None:
    if not all(isinstance(x, Tensor) for x in (q, key_pool, value_pool, block_tables, lengths)):
        raise TypeError(
            "paged_attention: q, key_pool, value_pool, block_tables and lengths must be tensors"
        )
    if q.ndim != 3:
        raise ValueError(f"paged_attention: q must be (t, h, d), got {tuple(q.shape)}")
    t, h, d = q.shape
    if key_pool.ndim != 4 or key_pool.shape != value_pool.shape:
        raise ValueError(
            f"paged_attention: key_pool and value_pool must be (N, s, h_kv, d) of one shape, got "
            f"{tuple(key_pool.shape)} and {tuple(value_pool.shape)}"
        )
    _, s, h_kv, d_kv = key_pool.shape
    if d_kv != d or h % h_kv:
        raise ValueError(
            f"paged_attention: q (t, h, d) = {tuple(q.shape)} needs pools (N, s, h_kv, d) with "
            f"d = {d} and h_kv dividing h = {h}, got {tuple(key_pool.shape)}"
        )
    b = len(query_lengths)
    if block_tables.ndim != 2 or block_tables.shape[0] != b or tuple(lengths.shape) != (b,):
        raise ValueError(
            f"paged_attention: block_tables (b, m) and lengths (b,) must have b = {b} rows "
            f"(query_lengths), got {tuple(block_tables.shape)} and {tuple(lengths.shape)}"
        )
    if block_tables.is_floating_point() or lengths.is_floating_point():
        raise ValueError(
            f"paged_attention: block_tables and lengths must be integer tensors, got "
            f"{block_tables.dtype} and {lengths.dtype}"
        )
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in query_lengths):
        raise ValueError(
            f"paged_attention: query_lengths must be ints >= 0, got {list(query_lengths)}"
        )
    if sum(query_lengths) != t:
        raise ValueError(
            f"paged_attention: query_lengths sum to {sum(query_lengths)}, but q has t = {t} rows"
        )
    room = block_tables.shape[1] * s
    for n, (i, j) in enumerate(zip(query_lengths, lengths.tolist(), strict=True)):
        if not i <= j <= room:
            raise ValueError(
                f"paged_attention: sequence {n} has {i} new tokens and length {j}: needs "
                f"new <= length <= m * s = {block_tables.shape[1]} * {s} = {room}"
            )
    # Block ids are checked by the kernel (a RuntimeError naming the entry): a loop here would
    # cost more than a decode step.


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
    """Causal attention of every sequence's new tokens over its keys, read by block table, by
    the compiled kernel; the arguments and result of ``attnkit.serve.paged.paged_attention``.

    Args:
        q: ``(t, h, d)`` float32, sequence ``n`` owning ``query_lengths[n]`` consecutive rows.
        key_pool, value_pool: ``(N, s, h_kv, d)``, float32, bfloat16 or float16 (read as
            stored), already holding the new tokens' keys and values.
        block_tables: ``(b, m)`` int, each row a sequence's blocks in order (padding past a
            sequence's length is never read).
        lengths: ``(b,)`` keys of each sequence, cached and new.
        query_lengths: ``b`` ints, new tokens of each sequence (``<= lengths``).
        scale: score scale, ``1 / sqrt(d)`` when ``None``.

    Returns:
        ``(t, h, d)`` float32.

    Raises ``jit.NotBuilt`` when the kernel cannot serve the call (``why_not``'s sentence):
    there is no fallback here.
    """
    _check(q, key_pool, value_pool, block_tables, lengths, query_lengths)
    reason = why_not(q, key_pool, value_pool, loaded_only=True)
    if reason is not None:
        raise jit.NotBuilt(f"paged_attention: {reason}")
    kernel = jit.loaded()
    assert kernel is not None  # why_not said None
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    starts = [0]
    for i in query_lengths:
        starts.append(starts[-1] + i)
    out = torch.empty(q.shape, dtype=torch.float32)  # (t, h, d)
    tables = block_tables.to(torch.long)  # (b, m): no copy when already int64
    if tables.stride(-1) != 1:
        tables = tables.contiguous()
    kernel.paged(
        q,
        key_pool,
        value_pool,
        tables,
        lengths.to(torch.long).contiguous(),  # (b,)
        torch.tensor(starts, dtype=torch.long),  # (b + 1,)
        scale,
        out,
    )
    return out
