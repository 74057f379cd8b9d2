"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Liu, Zaharia and Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
Context". Each of the ``W`` ranks holds one shard of the queries, keys and values. Key/value
blocks travel around the ring (rank ``r`` sends to ``r + 1`` and receives from ``r - 1``) while
every rank attends its own queries to the block it currently holds and folds the result into a
running ``(output, log-sum-exp)`` with the online-softmax rule (Milakov and Gimelshein 2018;
Dao et al. 2022, FlashAttention, section 3.1)::

    step 0: rank r attends to its own block r      | meanwhile it sends block r to r+1
    step s: rank r attends to block (r - s) mod W  | and forwards that block to r+1
    after W steps every rank has seen every block; besides its own, a rank holds only the
    block it computes on and the one arriving.

Memory per rank is therefore ``O(n / W)``, whatever the full length ``n``.

The backward pass runs the same ring again: the key/value block travels as before, and next to
it travels a gradient accumulator ``(dK, dV)`` for that block; each rank adds its contribution
and passes it on, and after ``W`` hops the accumulator arrives back at the rank that owns the
block. The query gradient stays local. The per-block math is the tiled backend's block step
(forward: partial output and log-sum-exp; backward: gradients given the *global* output and
log-sum-exp), exactly as a single process runs it over its own tiles.

Shape vocabulary: ``b`` batch, ``h`` query heads, ``h_kv`` key/value heads, ``i`` local query
positions, ``j`` key positions of one block, ``d`` query/key width, ``dv`` value width. Masks
follow ``attnkit.masks`` (``True`` = may attend), evaluated on **global** positions.

Causal alignment is the single-process rule on global positions: query ``q`` sees keys
``k <= q + (n_k - n_q)`` (bottom-right; equal to top-left when queries and keys are the same
sequence). A block pair is skipped when causality masks it entirely, which is why the zigzag
layout (see ``attnkit.distributed.layout``) balances the work: every rank has one early and one
late chunk.

Communication uses ``torch.distributed`` point-to-point ops (``batch_isend_irecv``): gloo on
CPU, NCCL on GPU. The next block's transfer is started before the current block is computed,
so communication overlaps computation (the gradient accumulator is the exception: a rank waits
for it before adding its part, which keeps one accumulator per rank alive instead of three).
Tested on gloo (CPU) only: the NCCL path uses the same calls on device tensors but has
not been run.

Every rank must call ``ring_attention`` with matching arguments. The shapes, ``is_causal`` and
``layout`` are checked across ranks first (one small ``all_gather``), so a mismatch raises on
every rank instead of hanging. Not supported (a clear error): dense mask or bias tensors (pass
functions of global positions), ``dropout_p > 0``, and shard lengths that are not the
``torch.tensor_split`` sizes of the chosen layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

import torch
import torch.distributed as dist
from torch import Tensor

from attnkit._numerics import blocked, compute_dtype
from attnkit.backends.tiled import backward_blocks, forward_blocks, merge
from attnkit.distributed.layout import LAYOUTS, Layout, Segments, shard_lengths, shard_segments
from attnkit.masks import BiasFn, MaskFn, causal_fn, causal_offset

__all__ = ["ring_attention"]

_TAG_KV, _TAG_DKV = 10, 20  # message streams (+0 keys, +1 values): gloo matches by tag


def ring_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: MaskFn | None = None,
    *,
    bias: BiasFn | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    layout: Layout = "contiguous",
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Attention over a sequence sharded across ``group``; call it on every rank of the group.

    Args:
        query: this rank's shard ``(b, h, i, d)`` of the queries.
        key: this rank's shard ``(b, h_kv, j, d)`` of the keys, laid out like the queries;
            ``h_kv`` may divide ``h`` (grouped-query attention, served by the block step).
        value: this rank's shard ``(b, h_kv, j, dv)``.
        mask: a mask *function* ``fn(b, h, i, j) -> bool`` over **global** positions
            (``attnkit.masks.window_fn`` for a sliding window, ...). A dense mask tensor would
            need every rank to hold the full ``(i, j)`` grid, which is what ring attention
            avoids, so it is rejected.
        bias: a bias function ``fn(b, h, i, j) -> float`` over global positions (ALiBi, ...).
        is_causal: causal attention on global positions, aligned bottom-right as in
            ``attnkit.scaled_dot_product_attention``.
        scale: multiplies ``Q @ K^T``; ``None`` means ``1 / sqrt(d)``.
        dropout_p: must be ``0.0`` (dropout is not implemented for ring attention).
        layout: how the sequence is sharded: ``"contiguous"`` or ``"zigzag"`` (see
            ``attnkit.distributed.shard_sequence``). Shard lengths may be uneven as long as they
            follow that layout for the total length (``torch.tensor_split`` sizes).
        group: the process group forming the ring; ``None`` is the default (world) group.

    Returns:
        This rank's shard of the output ``(b, h, i, dv)``, in the query's dtype. Differentiable
        with respect to ``query``, ``key`` and ``value`` (the backward is a second ring).
    """
    plan = _make_plan(query, key, value, mask, bias, is_causal, scale, dropout_p, layout, group)
    return _RingAttention.apply(query, key, value, plan)


@dataclass(frozen=True)
class _Plan:
    """Everything both rings need: who talks to whom, and which global positions each holds."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    q_segments: Segments  # this rank's query positions
    k_segments: tuple[Segments, ...]  # every rank's key positions
    k_lengths: tuple[int, ...]
    causal_offset: int | None  # query q sees keys k <= q + offset; None when not causal
    scale: float
    mask: MaskFn | None
    bias: BiasFn | None

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.world_size

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.world_size


def _make_plan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: object,
    bias: object,
    is_causal: object,
    scale: object,
    dropout_p: object,
    layout: object,
    group: dist.ProcessGroup | None,
) -> _Plan:
    """Validate locally, then agree on shapes with the other ranks (one small all_gather)."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if t.ndim != 4:
            raise ValueError(f"{name} must be 4-D (b, h, n_local, d), got {tuple(t.shape)}")
    shapes = f"query {tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)}"
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"query, key and value must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"query, key and value must be on one device ({shapes})")
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            "query, key and value must share the batch dim, and key and value their length; "
            f"got {shapes}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"query and key must have the same last dim d; got {shapes}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"key/value heads ({k.shape[1]}) must equal or divide query heads ({q.shape[1]}) "
            f"for grouped-query attention; got {shapes}"
        )
    if mask is not None and not callable(mask):
        raise ValueError(
            "mask: ring_attention takes a mask function fn(b, h, i, j) over global positions "
            f"(see attnkit.masks), not a dense {type(mask).__name__}: a dense mask would need the "
            "full (i, j) grid on every rank"
        )
    if bias is not None and not callable(bias):
        raise ValueError(
            "bias: ring_attention takes a bias function fn(b, h, i, j) over global positions, "
            f"not a dense {type(bias).__name__}"
        )
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif not isinstance(scale, Real) or isinstance(scale, bool) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite number or None, got {scale!r}")
    if not isinstance(dropout_p, Real) or dropout_p != 0.0:
        raise NotImplementedError(
            f"dropout_p: ring_attention does not implement attention dropout; got {dropout_p!r}"
        )
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "group: torch.distributed is not initialised; launch with torchrun and call "
            "torch.distributed.init_process_group first (a world of size 1 works too)"
        )

    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    # One all_gather so every rank knows every shard's length, and mismatches fail loudly here
    # instead of as a hang inside a point-to-point exchange.
    agreed = [q.shape[0], q.shape[1], k.shape[1], q.shape[3], v.shape[3]]
    agreed += [int(is_causal), LAYOUTS.index(layout)]
    meta = torch.tensor([*agreed, q.shape[2], k.shape[2]], dtype=torch.int64, device=q.device)
    everyone = [torch.empty_like(meta) for _ in range(world_size)]
    dist.all_gather(everyone, meta, group=group)
    table = torch.stack(everyone).cpu()  # (world, 9): the agreed fields, then the two lengths
    if not bool((table[:, :7] == table[rank, :7]).all()):
        raise ValueError(
            "ranks disagree on (b, h, h_kv, d, dv, is_causal, layout): "
            + "; ".join(f"rank {r}: {row[:7].tolist()}" for r, row in enumerate(table))
        )
    q_lengths, k_lengths = table[:, 7].tolist(), table[:, 8].tolist()
    n_q, n_k = sum(q_lengths), sum(k_lengths)
    for name, got, n in (("query", q_lengths, n_q), ("key", k_lengths, n_k)):
        expected = shard_lengths(n, world_size, layout)  # type: ignore[arg-type]
        if got != expected:
            raise ValueError(
                f"{name} shard lengths {got} across ranks are not a {layout} layout of "
                f"n={n} over {world_size} ranks (expected {expected}); shard the sequence with "
                "attnkit.distributed.shard_sequence"
            )
    return _Plan(
        group=group,
        rank=rank,
        world_size=world_size,
        q_segments=shard_segments(n_q, world_size, rank, layout),  # type: ignore[arg-type]
        k_segments=tuple(
            shard_segments(n_k, world_size, r, layout)  # type: ignore[arg-type]
            for r in range(world_size)
        ),
        k_lengths=tuple(k_lengths),
        causal_offset=causal_offset(n_q, n_k) if is_causal else None,
        scale=float(scale),
        mask=mask,  # type: ignore[arg-type]
        bias=bias,  # type: ignore[arg-type]
    )


def _block_pairs(plan: _Plan, src: int):
    """The (query slice, key slice, block step keywords) pairs that rank ``plan.rank`` computes
    against the block of rank ``src``; pairs that causality masks entirely are skipped."""
    q_local = 0
    for q_start, q_len in plan.q_segments:
        k_local = 0
        for k_start, k_len in plan.k_segments[src]:
            keywords = {
                "scale": plan.scale,
                "mask_fn": plan.mask,
                "bias_fn": plan.bias,
                "q_offset": q_start,
                "k_offset": k_start,
            }
            o = plan.causal_offset
            visible = q_len > 0 and k_len > 0
            if o is not None and visible:
                if k_start > q_start + q_len - 1 + o:  # the first key is past every query's reach
                    visible = False
                elif k_start + k_len - 1 > q_start + o:  # some keys are past some queries' reach
                    causal = causal_fn(o)  # on global positions: q_offset/k_offset are added
                    user = plan.mask
                    keywords["mask_fn"] = causal if user is None else _both(causal, user)
            if visible:
                yield slice(q_local, q_local + q_len), slice(k_local, k_local + k_len), keywords
            k_local += k_len
        q_local += q_len


def _both(first: MaskFn, second: MaskFn) -> MaskFn:
    def both(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return first(b, h, i, j) & second(b, h, i, j)

    return both


def _exchange(send: list[Tensor], recv: list[Tensor], plan: _Plan, tag: int) -> list[dist.Work]:
    """Send ``send`` to the next rank and receive ``recv`` from the previous one, asynchronously."""
    ops = [
        dist.P2POp(dist.isend, t, group=plan.group, group_peer=plan.next, tag=tag + n)
        for n, t in enumerate(send)
    ]
    ops += [
        dist.P2POp(dist.irecv, t, group=plan.group, group_peer=plan.prev, tag=tag + n)
        for n, t in enumerate(recv)
    ]
    return dist.batch_isend_irecv(ops)


def _empty_block(like: Tensor, plan: _Plan, owner: int, dtype: torch.dtype) -> Tensor:
    """An empty ``(b, h_kv, j_owner, width)`` tensor for the block of keys of rank ``owner``."""
    b, h_kv, _, width = like.shape
    return like.new_empty((b, h_kv, plan.k_lengths[owner], width), dtype=dtype)


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, plan: _Plan) -> tuple[Tensor, Tensor]:
    b, h, i, _ = q.shape
    acc = compute_dtype(q.dtype)  # accumulate in float32 (float64 stays)
    out = q.new_zeros((b, h, i, v.shape[-1]), dtype=acc)  # (b, h, i, dv)
    # "Saw no key yet": the block step's convention is the finite minimum, not -inf.
    lse = q.new_full((b, h, i), blocked(acc), dtype=acc)
    k, v = k.contiguous(), v.contiguous()  # sent as messages (a shard may be a strided view)
    for step in range(plan.world_size):
        src = (plan.rank - step) % plan.world_size  # whose block (k, v) we hold now
        works: list[dist.Work] = []
        if step + 1 < plan.world_size:  # start the next hop before computing on this block
            prev = (src - 1) % plan.world_size
            incoming = [_empty_block(t, plan, prev, t.dtype) for t in (k, v)]
            works = _exchange([k, v], incoming, plan, _TAG_KV)
        for qs, ks, keywords in _block_pairs(plan, src):
            part_out, part_lse = forward_blocks(q[:, :, qs], k[:, :, ks], v[:, :, ks], **keywords)
            out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], part_out, part_lse)
        _wait(works)
        if works:
            k, v = incoming
    return out, lse


def _ring_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor, plan: _Plan
) -> tuple[Tensor, Tensor, Tensor]:
    acc = compute_dtype(q.dtype)
    k_dtype, v_dtype = k.dtype, v.dtype
    grad_q = q.new_zeros(q.shape, dtype=acc)
    k, v = k.contiguous(), v.contiguous()
    carried: list[Tensor] = []  # (dK, dV) accumulated so far for the block we hold
    carried_works: list[dist.Work] = []
    for step in range(plan.world_size):
        src = (plan.rank - step) % plan.world_size
        prev = (src - 1) % plan.world_size
        kv_works: list[dist.Work] = []
        if step + 1 < plan.world_size:
            incoming = [_empty_block(t, plan, prev, t.dtype) for t in (k, v)]
            kv_works = _exchange([k, v], incoming, plan, _TAG_KV)
        if step == 0:
            grad_k = _empty_block(k, plan, src, acc).zero_()
            grad_v = _empty_block(v, plan, src, acc).zero_()
        else:
            # Add into the accumulator that arrived from the previous rank (the contributions
            # of the ranks that held block src before us). Waiting for it here, rather than
            # computing into a fresh buffer meanwhile, keeps one accumulator alive instead of
            # three (fresh, arriving, departing): memory over overlap for this message.
            _wait(carried_works)
            carried_works = []
            grad_k, grad_v = carried
        for qs, ks, keywords in _block_pairs(plan, src):
            dq, dk, dv = backward_blocks(
                q[:, :, qs],
                k[:, :, ks],
                v[:, :, ks],
                out[:, :, qs],
                lse[:, :, qs],
                grad_out[:, :, qs],
                **keywords,
            )
            grad_q[:, :, qs] += dq
            grad_k[:, :, ks] += dk
            grad_v[:, :, ks] += dv
        _wait(kv_works)
        if plan.world_size == 1:
            carried = [grad_k, grad_v]
            break
        # Pass the accumulator on: the next rank holds block src at its next step, and after
        # the last step the next rank is src itself, the owner.
        carried = [_empty_block(t, plan, prev, acc) for t in (k, v)]
        carried_works = _exchange([grad_k, grad_v], carried, plan, _TAG_DKV)
        del grad_k, grad_v  # in flight; freed once sent
        if kv_works:
            k, v = incoming
    _wait(carried_works)
    return grad_q.to(q.dtype), carried[0].to(k_dtype), carried[1].to(v_dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plan: _Plan) -> Tensor:  # type: ignore[override]
        out, lse = _ring_forward(q, k, v, plan)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v = _ring_backward(q, k, v, out, lse, grad_out.contiguous(), ctx.plan)
        return grad_q, grad_k, grad_v, None
