"""FlexAttention's API on attnkit's backends: torch's flex code runs, and trains, on CPU.

``flex_attention``, ``create_block_mask``, ``BlockMask``, ``and_masks``, ``or_masks`` and
``noop_mask`` have the names and meaning of ``torch.nn.attention.flex_attention`` (Dong et al.
2024, "Flex Attention", arXiv:2412.05496). A ``score_mod(score, b, h, q_idx, kv_idx)`` and a
``mask_mod(b, h, q_idx, kv_idx)`` written for torch run unchanged, with torch's meaning: each
is called on one element (a score and four 0-d index tensors), vmapped over the grid as torch
vmaps it, so reductions (``torch.dot(qf[q_idx], kf[kv_idx])``, ``.any()``), indexing captured
tensors (``doc_ids[q_idx]``, ``table[h, q_idx - kv_idx]``) and elementwise ops mean what they
mean in torch (``attnkit.flex.elementwise``). ``flex_attention`` is a thin adapter: it makes
one ``attnkit.scaled_dot_product_attention`` call (mask function, score_mod, scale, grouped
heads, log-sum-exp, the block mask's tile sizes). With a block mask that is the tiled engine
(the mask_mod runs on partial blocks only); without one the registry chooses the backend as
for any call (auto). With a score_mod that is a tile engine
(``tiled`` or ``sparse``): no ``i x j`` tensor is built, and the backward recomputes each tile
and differentiates through ``score_mod``, so gradients reach q, k, v and the tensors a score_mod
captures (a learned bias table), which torch's CPU flex refuses.

It computes what torch's reference (its eager path) computes, written once here::

    s = scale * q @ k^T                                  # (b, h, i, j), scale = 1/sqrt(d)
    s = score_mod(s, b, h, i, j)
    s = where(mask_mod(b, h, i, j), s, -inf)             # the block mask's mask_mod
    out = softmax(s, dim=-1) @ v                         # a row with no visible key gives 0
    lse = logsumexp(s, dim=-1)                           # -inf for such a row

A ``BlockMask`` says, per tile of ``BLOCK_SIZE`` queries x keys, whether every position is
visible (*full*: ``mask_mod`` is not called), some are (*partial*: it is called) or none is
(*empty*: the tile is skipped), as torch's kernels read it.
"""

from attnkit.flex.attention import ScoreMod, flex_attention
from attnkit.flex.block_mask import (
    BlockMask,
    MaskMod,
    and_masks,
    create_block_mask,
    noop_mask,
    or_masks,
)

__all__ = [
    "BlockMask",
    "MaskMod",
    "ScoreMod",
    "and_masks",
    "create_block_mask",
    "flex_attention",
    "noop_mask",
    "or_masks",
]
