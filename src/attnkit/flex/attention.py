"""``flex_attention``: torch's signature as one ``attnkit.scaled_dot_product_attention`` call.

The adapter only translates: the block mask becomes a mask function that declares its layout
(and its ``BLOCK_SIZE`` the tile sizes, ``block_sizes``), the per-element ``score_mod`` a
function of broadcast index tensors (``elementwise.per_element``), ``enable_gqa`` grouped-query
attention, ``return_lse`` the call's log-sum-exp. A call with a block mask runs on the tiled
engine, which evaluates the per-element ``mask_mod`` on the partial blocks only: auto cannot
price a per-element function evaluated over all n x n pairs, and measured it took routes up to
4x slower (torch's kernel or the fused one, given the mask as a dense tensor). Without a block
mask the registry chooses as for any call (``attnkit.backends.explain``); a
``with attnkit.use(name)`` block names the backend in both cases.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

import attnkit.backends  # noqa: F401  (registers the backends auto chooses between)
from attnkit.flex.block_mask import BlockMask
from attnkit.flex.elementwise import per_element
from attnkit.functional import scaled_dot_product_attention

__all__ = ["ScoreMod", "flex_attention"]

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
"""``score_mod(score, b, h, q_idx, kv_idx) -> score``: the modified scaled score."""


def _as_block_mask(block_mask: object) -> BlockMask:
    if isinstance(block_mask, BlockMask):
        return block_mask
    fields = ("seq_lengths", "kv_num_blocks", "kv_indices", "BLOCK_SIZE", "mask_mod")
    if all(hasattr(block_mask, f) for f in fields):  # torch's BlockMask
        return BlockMask.from_torch(block_mask)
    raise TypeError(f"block_mask must be a BlockMask, got {type(block_mask).__name__}")


def flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    score_mod: ScoreMod | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict | None = None,
    *,
    dropout_p: float = 0.0,
) -> Tensor | tuple[Tensor, Tensor]:
    """torch's ``flex_attention`` (see ``attnkit.flex`` for the formula), differentiable: one
    ``attnkit.scaled_dot_product_attention`` call.

    Args:
        query: ``(b, h, i, d)``; key ``(b, h_kv, j, d)``; value ``(b, h_kv, j, dv)``, with
            ``h_kv == h``, or ``h_kv`` dividing ``h`` when ``enable_gqa`` (grouped-query
            attention: query head ``hq`` reads key head ``hq // (h / h_kv)``).
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` on one element, as torch
            calls it (``attnkit.flex.elementwise``); gradients flow through it into q, k and
            the tensors it captures.
        block_mask: from ``create_block_mask`` (attnkit's or torch's) for exactly ``(i, j)``;
            its ``mask_mod`` decides the partial blocks. None: every key is visible.
        scale: multiplies ``q @ k^T``; None: ``1 / sqrt(d)``.
        return_lse: also return the natural log-sum-exp of each row ``(b, h, i)`` (``-inf`` for
            a row that sees no key), not differentiable.
        kernel_options: torch's Triton tuning knobs; accepted and ignored.
        dropout_p: refused unless 0 (torch's flex has no dropout either).

    Returns:
        ``out (b, h, i, dv)`` in query's dtype, and ``lse`` when ``return_lse``.
    """
    if dropout_p:
        raise NotImplementedError(
            "flex_attention has no dropout (nor has torch's): the tiled backward would have to "
            "replay the dropout mask of every tile; use attnkit.scaled_dot_product_attention"
        )
    if score_mod is not None and not callable(score_mod):
        raise TypeError(
            f"score_mod must be a function (score, b, h, q_idx, kv_idx) -> score, got {score_mod!r}"
        )
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"flex_attention takes 4-D (b, h, n, d) tensors; {name} is {got}")
    if not query.is_floating_point() or not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"flex_attention takes query, key and value of one floating-point dtype; got "
            f"{query.dtype}, {key.dtype}, {value.dtype}"
        )
    nb, nh, _, d = query.shape  # (b, h, i, d)
    if key.shape[:3] != value.shape[:3] or key.shape[3] != d:
        raise ValueError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must share (b, h_kv, j), "
            f"and key must have query's head dim {d}"
        )
    h_kv = key.shape[1]
    if not enable_gqa and h_kv != nh:
        raise ValueError(
            f"query has {nh} heads and key/value {h_kv}; pass enable_gqa=True for grouped-query "
            "attention"
        )
    if h_kv == 0 or nh % h_kv:
        raise ValueError(f"key/value heads ({h_kv}) must divide query heads ({nh})")
    if key.shape[0] != nb:
        if key.shape[0] != 1:
            raise ValueError(f"query batch {nb} and key/value batch {key.shape[0]} differ")
        key, value = key.expand(nb, *key.shape[1:]), value.expand(nb, *value.shape[1:])
    mask_fn, block_sizes = None, None
    if block_mask is not None:
        block_mask = _as_block_mask(block_mask)
        _check_fits(block_mask, query, key)
        mask_fn = block_mask.mask_fn(nb, nh)
        block_sizes = tuple(block_mask.BLOCK_SIZE)
    return scaled_dot_product_attention(
        query,
        key,
        value,
        mask_fn,
        scale=scale,
        score_mod=None if score_mod is None else per_element(score_mod, score=True),
        return_lse=return_lse,
        block_sizes=block_sizes,
        backend="auto" if block_mask is None else "tiled",
    )


def _check_fits(block_mask: BlockMask, query: Tensor, key: Tensor) -> None:
    """A block mask serves only the sizes it was built for."""
    nb, nh, n_q, n_kv = block_mask.shape
    want = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    if (n_q, n_kv) != want[2:] or nb not in (1, want[0]) or nh not in (1, want[1]):
        raise ValueError(
            f"block_mask was built for (B, H, Q_LEN, KV_LEN) = {block_mask.shape}, but this "
            f"call is {want}; build it again for these sizes (B and H may be 1 or None)"
        )
    if block_mask.kv_indices.device != query.device:
        raise ValueError(
            f"block_mask is on {block_mask.kv_indices.device}, query on {query.device}"
        )
