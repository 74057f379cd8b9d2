"""Look inside attention: per layer and head, what the weights look like on a given input.

``inspect_attention(model, *inputs, **kwargs)`` runs ``model(*inputs, **kwargs)`` once with every
``attnkit.MultiHeadAttention`` inside it asked for its weights (through forward hooks, so any
model built from attnkit modules works unchanged), and returns an ``AttentionReport``:

* per attention call: the module's name, the query/key shapes, the weights' shape ``(b, h, i, j)``;
* per head: the row sums (1 for every query that sees a key, 0 for a fully masked one), the mean
  entropy of the rows in nats next to its maximum ``log(visible keys)`` (near the maximum: the
  head spreads its attention evenly; near 0: it looks at one key), and the key positions that get
  the most weight on average.

``print(report)`` shows it as a table; the fields are plain data for programs and tests.
Inspection runs in ``torch.no_grad()`` and inside ``attnkit.backends.use("math")``: every
attention call of that one run takes the reference math, which returns weights, even in modules
pinned to a backend that cannot (such as ``"torch"``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from attnkit.attention import MultiHeadAttention
from attnkit.registry import use

__all__ = ["AttentionReport", "HeadStats", "LayerReport", "inspect_attention"]


@dataclass(frozen=True)
class HeadStats:
    """Statistics of one head's weights ``(b, i, j)`` over the batch and its query rows."""

    head: int
    row_sum_min: float
    row_sum_max: float
    empty_rows: int  # query rows that could see no key (their weights are all zero)
    entropy: float  # mean row entropy, nats, over rows that see at least one key
    max_entropy: float  # mean log(number of visible keys) over the same rows
    top_positions: tuple[int, ...]  # key positions with the highest mean weight
    top_weights: tuple[float, ...]  # their mean weights


@dataclass(frozen=True)
class LayerReport:
    """One call of one attention module."""

    name: str
    call: int  # 0 for the first call of this module in the run, 1 for the second, ...
    query_shape: tuple[int, ...]
    key_shape: tuple[int, ...]
    weights_shape: tuple[int, ...]
    heads: tuple[HeadStats, ...]
    weights: Tensor  # (b, h, i, j), detached


@dataclass(frozen=True)
class AttentionReport:
    """Everything ``inspect_attention`` saw, in call order, and the model's own output."""

    layers: tuple[LayerReport, ...]
    output: Any

    def __str__(self) -> str:
        header = (
            "layer",
            "call",
            "query -> weights",
            "head",
            "row sum",
            "empty",
            "entropy/max",
            "top keys (mean weight)",
        )
        rows = []
        for layer in self.layers:
            shapes = f"{_fmt(layer.query_shape)} -> {_fmt(layer.weights_shape)}"
            for s in layer.heads:
                tops = " ".join(
                    f"{p}:{w:.2f}" for p, w in zip(s.top_positions, s.top_weights, strict=True)
                )
                rows.append(
                    (
                        layer.name,
                        str(layer.call),
                        shapes,
                        str(s.head),
                        f"{s.row_sum_min:.3f}-{s.row_sum_max:.3f}",
                        str(s.empty_rows),
                        f"{s.entropy:.2f}/{s.max_entropy:.2f}",
                        tops,
                    )
                )
        widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
        lines = [
            "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
            for r in [header, *rows]
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def layer(self, name: str, call: int = 0) -> LayerReport:
        """The report of module ``name`` (as in ``model.named_modules()``), call ``call``."""
        for layer in self.layers:
            if layer.name == name and layer.call == call:
                return layer
        known = sorted({layer.name for layer in self.layers})
        raise KeyError(f"no attention call {name!r} #{call}; modules seen: {known}")


def _fmt(shape: tuple[int, ...]) -> str:
    return "(" + ",".join(str(s) for s in shape) + ")"


def head_stats(weights: Tensor, top_k: int = 3) -> tuple[HeadStats, ...]:
    """Per-head statistics of weights ``(b, h, i, j)``."""
    w = weights.detach().to(torch.float64)
    sums = w.sum(-1)  # (b, h, i)
    seen = sums > 0.5  # rows with at least one visible key
    plogp = torch.where(w > 0, w * w.clamp_min(1e-300).log(), torch.zeros_like(w))
    entropy = -plogp.sum(-1)  # (b, h, i)
    visible = (w > 0).sum(-1).clamp_min(1).to(torch.float64)  # (b, h, i)
    stats = []
    for h in range(w.shape[1]):
        rows = seen[:, h]  # (b, i)
        n_rows = int(rows.sum())
        mean_key = (w[:, h] * rows[..., None]).sum((0, 1)) / max(n_rows, 1)  # (j,)
        k = min(top_k, w.shape[-1])
        top = torch.topk(mean_key, k)
        stats.append(
            HeadStats(
                head=h,
                row_sum_min=float(sums[:, h].min()),
                row_sum_max=float(sums[:, h].max()),
                empty_rows=int((~rows).sum()),
                entropy=float(entropy[:, h][rows].mean()) if n_rows else math.nan,
                max_entropy=float(visible[:, h][rows].log().mean()) if n_rows else math.nan,
                top_positions=tuple(int(p) for p in top.indices),
                top_weights=tuple(float(v) for v in top.values),
            )
        )
    return tuple(stats)


def inspect_attention(
    model: nn.Module, *inputs: Any, top_k: int = 3, **kwargs: Any
) -> AttentionReport:
    """Run ``model(*inputs, **kwargs)`` and report every attention call's weights (see module doc).

    Raises ``ValueError`` if ``model`` contains no ``attnkit.MultiHeadAttention``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    modules = [
        (n or type(m).__name__, m)
        for n, m in model.named_modules()
        if isinstance(m, MultiHeadAttention)
    ]
    if not modules:
        raise ValueError(
            f"{type(model).__name__} contains no attnkit.MultiHeadAttention to inspect"
        )
    layers: list[LayerReport] = []
    calls: dict[str, int] = {}
    pending: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    handles = []

    def make_hooks(name: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
        def pre(mod: nn.Module, args: tuple, kw: dict) -> tuple[tuple, dict]:
            query = args[0] if args else kw["query"]
            key = args[1] if len(args) > 1 and args[1] is not None else kw.get("key")
            key = query if key is None else key
            pending[id(mod)] = (tuple(query.shape), tuple(key.shape))
            kw = dict(kw, need_weights=True)
            return args, kw

        def post(mod: nn.Module, args: tuple, kw: dict, output: Any) -> None:
            q_shape, k_shape = pending.pop(id(mod))
            weights = output[1]
            call = calls.get(name, 0)
            calls[name] = call + 1
            layers.append(
                LayerReport(
                    name,
                    call,
                    q_shape,
                    k_shape,
                    tuple(weights.shape),
                    head_stats(weights, top_k),
                    weights.detach(),
                )
            )

        return pre, post

    try:
        for name, module in modules:
            pre, post = make_hooks(name)
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post, with_kwargs=True))
        with torch.no_grad(), use("math"):
            output = model(*inputs, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return AttentionReport(tuple(layers), output)
