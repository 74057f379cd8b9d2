"""Attention rollout (Abnar and Zuidema 2020, "Quantifying Attention Flow in Transformers", §3).

A single head's map says where one layer looked, not how information from the input tokens has
mixed by the time it reaches a deep layer. Rollout follows the mixing through the layers:

    A_l      = W_l + I                    # the residual connection carries each token forward (§3)
    A_l      = A_l / A_l.sum(-1)          # renormalise rows, so each row is a distribution again
    R_1      = A_1
    R_l      = A_l @ R_{l-1}              # (i, i): how much of input token j reaches position i

``W_l`` is layer ``l``'s attention with its heads fused (mean by default, as in the paper). Every
``R_l`` is a product of row-stochastic matrices, so its rows sum to 1.

Rollout is still a heuristic view of information flow, not an explanation of the model's output
(Jain and Wallace 2019, "Attention is not Explanation"; Wiegreffe and Pinter 2019).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["attention_rollout", "plot_rollout"]

_FUSIONS = ("mean", "max", "min")


def attention_rollout(
    attentions: Tensor | Sequence[Tensor],
    *,
    head_fusion: str = "mean",
    residual: bool = True,
    all_layers: bool = False,
) -> Tensor:
    """Rolled-out attention from the input tokens to every position.

    Args:
        attentions: ``(l, ..., h, i, i)``: layers first, heads at dim -3 (for example attnkit's
            BERT gives ``(l, b, h, i, i)``), or a sequence of ``l`` tensors ``(..., h, i, i)`` (as
            Hugging Face returns them). Self-attention only: rollout needs ``i == j``.
        head_fusion: how heads become one map per layer: ``"mean"`` (the paper), ``"max"``,
            ``"min"``.
        residual: add the identity for the residual connection before renormalising (the paper's
            choice); ``False`` multiplies the raw maps.
        all_layers: return the rollout after every layer, ``(l, ..., i, i)``, instead of after the
            last one only, ``(..., i, i)``.

    Returns:
        Row-stochastic maps in float64 for float64 input, float32 otherwise. Row ``q`` tells how
        much each input token contributes to position ``q``.
    """
    if isinstance(attentions, (list, tuple)):
        if not attentions:
            raise ValueError("attentions is an empty sequence; need at least one layer")
        attentions = torch.stack([torch.as_tensor(a) for a in attentions])
    if not isinstance(attentions, Tensor):
        raise TypeError(f"attentions must be a tensor or a list of tensors, got {type(attentions)}")
    if attentions.dim() < 4:
        raise ValueError(
            "attentions must have shape (layers, ..., heads, i, i) with at least 4 dims; "
            f"got {tuple(attentions.shape)}"
        )
    i, j = attentions.shape[-2:]
    if i != j:
        raise ValueError(
            f"rollout needs self-attention with i == j, got i={i}, j={j} in shape "
            f"{tuple(attentions.shape)} (cross-attention has no path back to its own inputs)"
        )
    if head_fusion not in _FUSIONS:
        raise ValueError(f"head_fusion must be one of {_FUSIONS}, got {head_fusion!r}")
    dtype = torch.float64 if attentions.dtype == torch.float64 else torch.float32
    att = attentions.detach().to(dtype)
    if not torch.isfinite(att).all():
        raise ValueError("attentions contains NaN or infinite values")

    if head_fusion == "mean":
        fused = att.mean(dim=-3)  # (l, ..., i, i)
    elif head_fusion == "max":
        fused = att.amax(dim=-3)
    else:
        fused = att.amin(dim=-3)
    if residual:
        fused = fused + torch.eye(i, dtype=dtype, device=fused.device)
    # A row of zeros (a fully masked query without residual) stays zeros instead of becoming NaN.
    sums = fused.sum(dim=-1, keepdim=True)
    fused = fused / torch.where(sums == 0, torch.ones_like(sums), sums)

    rolled = [fused[0]]
    for layer in range(1, fused.shape[0]):
        rolled.append(fused[layer] @ rolled[-1])  # R_l = A_l @ R_{l-1}
    return torch.stack(rolled) if all_layers else rolled[-1]


def plot_rollout(
    attentions: Tensor | Sequence[Tensor],
    tokens: Sequence[str],
    *,
    layer: int | None = None,
    head_fusion: str = "mean",
    title: str | None = None,
    **kwargs: Any,
) -> Any:
    """Heat map of the rollout through ``layer`` (default: the last); returns the Figure.

    ``attentions`` is ``(l, h, i, i)`` for one input. Extra keyword arguments go to
    :func:`attnkit.viz.plot_attention` (``annotate``, ``figsize``, ``cmap``, ...).
    """
    from attnkit.viz._common import check_index
    from attnkit.viz.heatmap import plot_attention

    rolled = attention_rollout(attentions, head_fusion=head_fusion, all_layers=True)
    if rolled.dim() != 3:
        raise ValueError(
            f"plot_rollout takes one input, (layers, heads, i, i); got {tuple(rolled.shape)} "
            "after fusing heads: pick one batch item first"
        )
    n_layers = rolled.shape[0]
    layer = check_index(layer, n_layers, "layer")
    layer = n_layers - 1 if layer is None else layer
    if title is None:
        title = f"Attention rollout through layer {layer} (heads: {head_fusion})"
    return plot_attention(rolled[layer], tokens, title=title, **kwargs)
