"""Words shaded by a weight: which tokens a classifier's attention (or any score) weighted.

The result is an HTML fragment with inline styles only (no script, no external file), so it can
be put into a page, a notebook or a report as is; :func:`attnkit.viz.save_html` writes it as a
page. Tokens and the title are user input and are HTML-escaped.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from attnkit.viz._common import as_array, check_tokens, format_weight

__all__ = ["token_highlight_html"]

# Positive weights shade orange, negative ones (signed scores) blue; opacity = |w| / max |w|.
_POSITIVE = "255, 127, 14"
_NEGATIVE = "31, 119, 180"


def token_highlight_html(tokens: list[str], weights: Sequence[float], *, title: str = "") -> str:
    """An HTML fragment with each token shaded by its weight (strongest = fully shaded).

    Hovering a word shows its exact weight (the ``title`` attribute). ``weights`` has one finite
    number per token (a list, numpy array or 1-d tensor).
    """
    words = check_tokens(tokens, "tokens")
    w = as_array(weights, "weights")
    if w.ndim != 1 or w.shape[0] != len(words):
        raise ValueError(
            f"weights must have one value per token: {len(words)} tokens, "
            f"weights of shape {tuple(w.shape)}"
        )
    if not isinstance(title, str):
        raise TypeError(f"title must be a str, got {type(title).__name__}")
    top = float(abs(w).max()) or 1.0
    spans = []
    for word, value in zip(words, w.tolist(), strict=True):
        alpha = abs(value) / top
        colour = _POSITIVE if value >= 0 else _NEGATIVE
        ink = "#fff" if alpha > 0.65 else "#111"
        label = html.escape(format_weight(value), quote=True)
        spans.append(
            f'<span class="ak-word" title="weight {label}" data-weight="{label}" '
            f'style="background:rgba({colour},{alpha:.3f});color:{ink};padding:1px 3px;'
            f'margin:0 1px;border-radius:3px;white-space:pre-wrap">{html.escape(word)}</span>'
        )
    heading = (
        '<div class="ak-title" style="font-weight:600;margin-bottom:6px">'
        f"{html.escape(title)}</div>"
        if title
        else ""
    )
    return (
        '<div class="attnkit-highlight" style="font:15px/2 system-ui,sans-serif;color:#111">'
        + heading
        + "".join(spans)
        + "</div>"
    )
