"""An interactive attention explorer in one self-contained HTML file (no network, no CDN).

Pick a layer and a head; see the map as a heat map (rows = queries ``i``, columns = keys ``j``)
and as lines between the tokens (bertviz's "head view", Vig 2019); hover a cell or a token to read
the exact weight; click a thumbnail in the all-heads overview to jump to it. For self-attention
the "rollout" view shows attention rollout (Abnar and Zuidema 2020) through each layer.

Input: attention ``(l, h, i, j)`` (or ``(h, i, j)``, ``(i, j)``), the query tokens (``i``) and, for
cross-attention, the key tokens (``j``). Weights travel as base64 float32, so a few hundred tokens
by 6 layers by 12 heads stay a few tens of MB at most; large maps are drawn on ``<canvas>``.

Safety: tokens and text are user input. In markup they are HTML-escaped; the data travels in a
``<script type="application/json">`` whose ``<``, ``>``, ``&``, U+2028 and U+2029 are written as
``\\uXXXX``, so even a literal ``</script>`` cannot end the element; the page's JavaScript puts
tokens in the page with ``textContent`` only, never as HTML.

Attention is not explanation (Jain and Wallace 2019; Wiegreffe and Pinter 2019): the page says so.
"""

from __future__ import annotations

import base64
import html as _html
import os
from collections.abc import Sequence
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from attnkit.viz._common import as_attention4d, check_index, json_for_script

__all__ = ["CAVEAT", "AttentionExplorer", "explorer_html", "save_html"]

CAVEAT = (
    "Attention is not explanation. These weights show where each head looked, not why the "
    "model produced its output: different weights can give the same prediction, and a single "
    "head says little about the whole network (Jain and Wallace 2019; Wiegreffe and Pinter 2019). "
    "Rollout (Abnar and Zuidema 2020) follows attention through the residual stream, but it is a "
    "heuristic too."
)


@cache
def _asset(name: str) -> str:
    return resources.files("attnkit.viz").joinpath(name).read_text(encoding="utf-8")


def _b64_float32(arr: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(arr, dtype="<f4").tobytes()).decode("ascii")


class AttentionExplorer:
    """The interactive explorer for one input; shows itself in Jupyter.

    Args:
        attention: ``(l, h, i, j)``, ``(h, i, j)`` or ``(i, j)`` weights (tensor, array, lists).
        tokens: the ``i`` query tokens.
        key_tokens: the ``j`` key tokens for cross-attention (default: ``tokens``).
        title: page heading. text: the input text, shown under it (both escaped).
        layer, head: what the page shows first.
        rollout: offer the rollout view (self-attention only; ``None`` = when ``i == j``).
    """

    def __init__(
        self,
        attention: Any,
        tokens: Sequence[str],
        key_tokens: Sequence[str] | None = None,
        *,
        title: str = "Attention explorer",
        text: str | None = None,
        layer: int | None = 0,
        head: int | None = 0,
        rollout: bool | None = None,
    ) -> None:
        arr, q_tokens, k_tokens = as_attention4d(attention, tokens, key_tokens)
        n_layers, n_heads, i, j = arr.shape
        self.weights = arr.astype(np.float32)  # (l, h, i, j): what the page shows, exactly
        self.tokens = q_tokens
        self.key_tokens = k_tokens
        self.title = str(title)
        self.text = text
        self.layer = check_index(layer, n_layers, "layer") or 0  # None: the first
        self.head = check_index(head, n_heads, "head") or 0
        if rollout and i != j:
            raise ValueError(f"rollout needs self-attention (i == j), got i={i}, j={j}")
        self.rollout = (i == j) if rollout is None else bool(rollout)
        self.cross = i != j or (key_tokens is not None and list(key_tokens) != list(tokens))

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.weights.shape  # type: ignore[return-value]

    def _data(self) -> dict[str, Any]:
        n_layers, n_heads, i, j = self.shape
        data: dict[str, Any] = {
            "layers": n_layers,
            "heads": n_heads,
            "nq": i,
            "nk": j,
            "queryTokens": self.tokens,
            "keyTokens": self.key_tokens,
            "weights": _b64_float32(self.weights),
            "rollout": None,
            "layer": self.layer,
            "head": self.head,
        }
        if self.rollout:
            import torch

            from attnkit.viz.rollout import attention_rollout

            rolled = attention_rollout(
                torch.from_numpy(self.weights.astype(np.float64)), all_layers=True
            )  # (l, i, i)
            data["rollout"] = _b64_float32(rolled.numpy())
        return data

    def to_html(self) -> str:
        """The whole page: one self-contained HTML document."""
        n_layers, n_heads, i, j = self.shape
        kind = "cross-attention" if self.cross else "self-attention"
        summary = (
            f"{n_layers} layer{'s' * (n_layers != 1)} × {n_heads} "
            f"head{'s' * (n_heads != 1)}, {i} queries × {j} keys ({kind})"
        )
        text = (
            ""
            if self.text is None
            else (f'<p class="ak-text">Input: <q>{_html.escape(self.text)}</q></p>')
        )
        return _PAGE.format(
            title=_html.escape(self.title),
            text=text,
            summary=_html.escape(summary),
            caveat=_html.escape(CAVEAT),
            css=_asset("explorer.css"),
            data=json_for_script(self._data()),
            js=_asset("explorer.js"),
        )

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the page atomically to ``path``; returns it."""
        return save_html(self.to_html(), path)

    def _repr_html_(self) -> str:
        # A sandboxed iframe keeps the page's ids, styles and script apart from the notebook's.
        return (
            '<iframe class="attnkit-explorer-frame" sandbox="allow-scripts" '
            'style="width:100%;height:760px;border:1px solid #ddd" '
            f'srcdoc="{_html.escape(self.to_html(), quote=True)}"></iframe>'
        )


def explorer_html(
    attention: Any,
    tokens: Sequence[str],
    key_tokens: Sequence[str] | None = None,
    **kwargs: Any,
) -> str:
    """The explorer page as a string; see :class:`AttentionExplorer` for the arguments."""
    return AttentionExplorer(attention, tokens, key_tokens, **kwargs).to_html()


def save_html(html: str | AttentionExplorer, path: str | os.PathLike[str]) -> Path:
    """Write HTML atomically (the file is either the old one or complete); returns the path.

    Accepts a whole document, a fragment (such as :func:`token_highlight_html` returns; it is
    wrapped in a minimal UTF-8 page) or an :class:`AttentionExplorer`.
    """
    from attnkit._io import atomic_write_text, check_writable

    html_text = html.to_html() if isinstance(html, AttentionExplorer) else html
    if not isinstance(html_text, str):
        raise TypeError(f"html must be a str, got {type(html_text).__name__}")
    check_writable(path)
    head = html_text.lstrip()[:15].lower()
    if not (head.startswith("<!doctype") or head.startswith("<html")):
        html_text = (
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            "<title>attnkit</title></head>\n<body>\n" + html_text + "\n</body></html>\n"
        )
    return atomic_write_text(path, html_text)


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
{css}
</style>
</head>
<body>
<div class="attnkit-explorer">
<header>
<h1>{title}</h1>
{text}
<p class="ak-summary">{summary}</p>
<p class="ak-caveat" role="note"><strong>Note.</strong> {caveat}</p>
</header>
<div class="ak-controls">
<label>View <select class="ak-view"><option value="heads">one head</option></select></label>
<label>Layer <select class="ak-layer"></select></label>
<label>Head <select class="ak-head"></select></label>
<label><input type="checkbox" class="ak-stretch"> stretch colours to this map's maximum</label>
</div>
<div class="ak-readout" aria-live="polite">Hover a cell or a token to read its weight.</div>
<div class="ak-panels">
<section class="ak-panel">
<h2>Heat map <small>(rows: queries i, columns: keys j)</small></h2>
<div class="ak-legend"></div>
<div class="ak-matrix"></div>
</section>
<section class="ak-panel">
<h2>Lines <small>(query → key; hover a token)</small></h2>
<div class="ak-lines"></div>
</section>
</div>
<section class="ak-overview-panel">
<h2>All heads <small>(click one to show it)</small></h2>
<div class="ak-overview"></div>
</section>
<noscript>This explorer needs JavaScript; the static heat maps in attnkit.viz do not.</noscript>
<script type="application/json" class="ak-data">{data}</script>
</div>
<script>
{js}
</script>
</body>
</html>
"""
