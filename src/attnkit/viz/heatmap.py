"""Static heat maps of attention with matplotlib: one head, all heads of a layer, an overview.

Shape vocabulary: ``l`` layers, ``h`` heads, ``i`` query positions (rows), ``j`` key positions
(columns). Row ``q`` of a map is where query token ``q`` looked; rows of softmax attention sum
to 1.

matplotlib is imported inside the functions (``pip install 'attnkit[viz]'``), and figures are
built with ``matplotlib.figure.Figure`` rather than pyplot, so nothing global changes and nothing
opens a window. Save them with :func:`save_figure` (atomic; PNG, SVG or PDF by suffix).
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from attnkit.viz._common import as_array, as_attention4d, check_index

__all__ = ["plot_attention", "plot_grid", "plot_heads", "plot_overview", "save_figure"]

# Cells get their value written in them up to this many tokens on either axis.
ANNOTATE_MAX_TOKENS = 12
# Beyond this many tokens, only every n-th tick label is drawn (hovering is the HTML's job).
LABEL_MAX_TOKENS = 80
SAVE_FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(
            "attnkit.viz heat maps need matplotlib: pip install 'attnkit[viz]'"
        ) from exc
    return matplotlib, _figure_class()


@cache
def _figure_class() -> type:
    """``matplotlib.figure.Figure`` that shows itself as a PNG in Jupyter.

    A ``Figure`` made without pyplot is shown in a notebook only where ``%matplotlib inline``
    registered a picture for it; otherwise the notebook prints ``<Figure size ...>``. With
    ``_repr_png_`` it shows as a picture either way (where ``%matplotlib inline`` is on, its
    own printer for figures is used instead, so nothing shows twice).
    """
    from matplotlib.figure import Figure

    class AttentionFigure(Figure):
        def _repr_png_(self) -> bytes:
            buffer = io.BytesIO()
            self.savefig(buffer, format="png", dpi=self.dpi)
            return buffer.getvalue()

    AttentionFigure.__module__ = __name__
    return AttentionFigure


def _short(token: str, limit: int) -> str:
    return token if len(token) <= limit else token[: limit - 1] + "…"


def _ticks(ax: Any, tokens: list[str], axis: str, limit: int = 24) -> None:
    step = max(1, math.ceil(len(tokens) / LABEL_MAX_TOKENS))
    positions = list(range(0, len(tokens), step))
    labels = [_short(tokens[p], limit) for p in positions]
    size = 9 if len(tokens) <= 30 else 6
    # parse_math=False: a token such as "$5" or "$x$" is text, not TeX.
    if axis == "x":
        ax.set_xticks(positions)
        ax.set_xticklabels(labels, rotation=90, fontsize=size, parse_math=False)
    else:
        ax.set_yticks(positions)
        ax.set_yticklabels(labels, fontsize=size, parse_math=False)


def _draw(
    ax: Any,
    weights: np.ndarray,
    q_tokens: list[str],
    k_tokens: list[str],
    *,
    cmap: str,
    vmin: float,
    vmax: float,
    annotate: bool,
    labels: bool,
    xlabels: bool = True,
    ylabels: bool = True,
    limit: int = 24,
    fontsize: float = 7,
) -> Any:
    image = ax.imshow(
        weights, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest"
    )
    if labels and xlabels:
        _ticks(ax, k_tokens, "x", limit)
        ax.set_xlabel("key (j)")
    else:
        ax.set_xticks([])
    if labels and ylabels:
        _ticks(ax, q_tokens, "y", limit)
        ax.set_ylabel("query (i)")
    else:
        ax.set_yticks([])
    if annotate:
        for q in range(weights.shape[0]):
            for k in range(weights.shape[1]):
                w = weights[q, k]
                r, g, b, _ = image.cmap(image.norm(w))
                light = 0.299 * r + 0.587 * g + 0.114 * b > 0.5  # perceived brightness of the cell
                ax.text(
                    k,
                    q,
                    f"{w:.2f}",
                    ha="center",
                    va="center",
                    fontsize=fontsize,
                    color="black" if light else "white",
                )
    return image


def _default_size(q_tokens: list[str], k_tokens: list[str]) -> tuple[float, float]:
    """Inches: room for the cells, the longest (shortened) labels and the colour bar."""
    i, j = len(q_tokens), len(k_tokens)
    n = max(i, j)
    cell = 0.45 if n <= ANNOTATE_MAX_TOKENS else max(0.06, min(0.3, 9.0 / n))

    def label(tokens: list[str]) -> float:
        return 0.6 + 0.075 * min(24, max(len(t) for t in tokens))

    width = j * cell + label(q_tokens) + 1.6
    height = i * cell + label(k_tokens) + 0.7
    # Whole tenths of an inch: whole pixels at the usual dpi values.
    return (round(min(18.0, max(3.5, width)), 1), round(min(18.0, max(3.0, height)), 1))


def plot_attention(
    weights: Any,
    tokens: Sequence[str],
    key_tokens: Sequence[str] | None = None,
    *,
    title: str | None = None,
    annotate: bool | None = None,
    cmap: str = "Blues",
    vmin: float = 0.0,
    vmax: float | None = None,
    colorbar: bool = True,
    figsize: tuple[float, float] | None = None,
    dpi: float = 100,
) -> Any:
    """Heat map of one head, ``weights`` ``(i, j)``; returns a matplotlib ``Figure``.

    Rows are labelled with ``tokens`` (queries), columns with ``key_tokens`` (keys; defaults to
    ``tokens``). ``annotate`` writes each weight in its cell (default: up to 12 tokens).
    ``vmax`` defaults to 1 for weights in [0, 1], else to the maximum.
    """
    arr = as_array(weights, "weights")
    if arr.ndim != 2:
        raise ValueError(
            f"weights must be one head (i, j); got shape {tuple(arr.shape)}: "
            "use plot_heads for (heads, i, j) or plot_overview for (layers, heads, i, j)"
        )
    _, q_tokens, k_tokens = as_attention4d(arr, tokens, key_tokens, name="weights")
    _, Figure = _matplotlib()
    i, j = arr.shape
    if annotate is None:
        annotate = max(i, j) <= ANNOTATE_MAX_TOKENS
    if vmax is None:
        vmax = 1.0 if arr.max() <= 1.0 else float(arr.max())
    fig = Figure(
        figsize=figsize or _default_size(q_tokens, k_tokens), dpi=dpi, layout="constrained"
    )
    ax = fig.add_subplot()
    image = _draw(
        ax, arr, q_tokens, k_tokens, cmap=cmap, vmin=vmin, vmax=vmax, annotate=annotate, labels=True
    )
    if colorbar:
        fig.colorbar(image, ax=ax, label="attention weight")
    if title:
        ax.set_title(title, parse_math=False)
    return fig


def plot_heads(
    attention: Any,
    tokens: Sequence[str],
    key_tokens: Sequence[str] | None = None,
    *,
    layer: int | None = None,
    ncols: int | None = None,
    title: str | None = None,
    cmap: str = "Blues",
    figsize: tuple[float, float] | None = None,
    dpi: float = 100,
) -> Any:
    """A grid with every head of one layer: ``attention`` is ``(h, i, j)``, or ``(l, h, i, j)``
    together with ``layer``. Each panel is labelled with the tokens when they fit."""
    arr, q_tokens, k_tokens = as_attention4d(attention, tokens, key_tokens)
    n_layers, n_heads, i, j = arr.shape
    if n_layers > 1 and layer is None:
        raise ValueError(
            f"attention has {n_layers} layers, shape {tuple(arr.shape)}; pass layer= to pick one"
        )
    layer = check_index(layer, n_layers, "layer") or 0
    heads = arr[layer]  # (h, i, j)
    _, Figure = _matplotlib()
    ncols = ncols or min(n_heads, 4)
    nrows = math.ceil(n_heads / ncols)
    panel = max(2.4, min(4.5, 0.18 * max(i, j) + 1.4))
    fig = Figure(
        figsize=figsize or (panel * ncols + 1.0, panel * nrows + 0.6), dpi=dpi, layout="constrained"
    )
    axes = fig.subplots(nrows, ncols, squeeze=False)
    labels = max(i, j) <= 40
    image = None
    for h, ax in enumerate(axes.flat):
        if h >= n_heads:
            ax.set_visible(False)
            continue
        image = _draw(
            ax,
            heads[h],
            q_tokens,
            k_tokens,
            cmap=cmap,
            vmin=0.0,
            vmax=max(1.0, float(heads.max())),
            annotate=False,
            labels=labels,
            xlabels=h // ncols == nrows - 1 or h + ncols >= n_heads,  # bottom panel of a column
            ylabels=h % ncols == 0,  # first column
            limit=12,
        )
        ax.set_title(f"head {h}", fontsize=9)
        if labels:
            ax.set_xlabel("")
            ax.set_ylabel("")
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    fig.suptitle(title or f"Layer {layer}: all {n_heads} heads", parse_math=False)
    return fig


def plot_overview(
    attention: Any,
    tokens: Sequence[str] | None = None,
    key_tokens: Sequence[str] | None = None,
    *,
    title: str | None = None,
    cmap: str = "Blues",
    figsize: tuple[float, float] | None = None,
    dpi: float = 100,
) -> Any:
    """Thumbnails of every head of every layer, ``(l, h, i, j)``: rows are layers, columns heads.

    Tokens are optional here (thumbnails carry no labels); when given, their lengths are checked.
    """
    arr0 = as_array(attention, "attention")
    if tokens is None and arr0.ndim >= 2:
        tokens = [str(q) for q in range(arr0.shape[-2])]
        key_tokens = [str(k) for k in range(arr0.shape[-1])]
    arr, _, _ = as_attention4d(arr0, tokens or [], key_tokens)
    n_layers, n_heads, _, _ = arr.shape
    _, Figure = _matplotlib()
    fig = Figure(
        figsize=figsize or (1.1 * n_heads + 1.6, 1.1 * n_layers + 1.0),
        dpi=dpi,
        layout="constrained",
    )
    axes = fig.subplots(n_layers, n_heads, squeeze=False)
    vmax = max(1.0, float(arr.max()))
    image = None
    for layer in range(n_layers):
        for h in range(n_heads):
            ax = axes[layer, h]
            image = ax.imshow(
                arr[layer, h], cmap=cmap, vmin=0.0, vmax=vmax, interpolation="nearest"
            )
            ax.set_xticks([])
            ax.set_yticks([])
            if layer == 0:
                ax.set_title(f"h{h}", fontsize=8)
            if h == 0:
                ax.set_ylabel(f"L{layer}", fontsize=8)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    fig.suptitle(title or f"All heads: {n_layers} layers x {n_heads} heads", parse_math=False)
    return fig


def plot_grid(
    attention: Any,
    tokens: Sequence[str],
    key_tokens: Sequence[str] | None = None,
    *,
    title: str | None = None,
    annotate: bool | None = None,
    count_from: int = 0,
    cmap: str = "Blues",
    panel: float = 2.6,
    dpi: float = 100,
) -> Any:
    """Every head of every layer, ``(l, h, i, j)``, each panel labelled (and annotated) in full.

    Rows are layers, columns heads; panels share the 0-1 colour scale. For small maps, such as
    a tabular model's few feature tokens; for a real text's overview use :func:`plot_overview`.
    ``annotate`` writes each weight in its cell (default: up to 12 tokens); ``count_from`` is the
    number of the first layer and head in the panel titles (1 to match text that counts from 1).
    ``panel`` is the size of one panel in inches.
    """
    arr, q_tokens, k_tokens = as_attention4d(attention, tokens, key_tokens)
    n_layers, n_heads, i, j = arr.shape
    if annotate is None:
        annotate = max(i, j) <= ANNOTATE_MAX_TOKENS
    _, Figure = _matplotlib()
    fig = Figure(figsize=(panel * n_heads, panel * n_layers + 0.4), dpi=dpi, layout="constrained")
    axes = fig.subplots(n_layers, n_heads, squeeze=False)
    vmax = max(1.0, float(arr.max()))
    for layer in range(n_layers):
        for h in range(n_heads):
            ax = axes[layer, h]
            _draw(
                ax,
                arr[layer, h],
                q_tokens,
                k_tokens,
                cmap=cmap,
                vmin=0.0,
                vmax=vmax,
                annotate=annotate,
                labels=True,
                limit=12,
                fontsize=6,
            )
            ax.set_xlabel("")
            ax.set_ylabel("")
            ax.set_title(f"layer {layer + count_from} head {h + count_from}", fontsize=8)
    fig.suptitle(
        title or f"{n_layers} layers x {n_heads} heads (rows attend to columns)",
        fontsize=9,
        parse_math=False,
    )
    return fig


def save_figure(fig: Any, path: str | os.PathLike[str], *, dpi: float | None = None) -> Path:
    """Write ``fig`` atomically to ``path``; the format comes from the suffix (.png, .svg, .pdf).

    The picture is ``figsize * dpi`` pixels (no tight cropping), so its size is predictable.
    """
    from attnkit._io import atomic_write_bytes, check_writable

    path = Path(path)
    fmt = SAVE_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(
            f"cannot tell the picture format of {str(path)!r}: use one of {sorted(SAVE_FORMATS)}"
        )
    check_writable(path)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=dpi or fig.dpi)
    return atomic_write_bytes(path, buffer.getvalue())
