"""Words shaded by a weight: which tokens a classifier's attention (or any score) weighted.

The result is an HTML fragment with inline styles only (no script, no external file), so it can
be put into a page, a notebook or a report as is; :func:`attnkit.viz.save_html` writes it as a
page. Tokens and the title are user input and are HTML-escaped.

Each token is its own bidirectional isolate (``dir="auto"`` and ``unicode-bidi: isolate``, what
``<bdi>`` does; HTML, section "The bdi element"): a right-to-left word is laid out right to left
within its box and cannot reorder its neighbours. Explicit directional formatting characters
(embeddings, overrides, isolates and their pops, U+202A-U+202E and U+2066-U+2069) are shown as
their code points, ``<U+202E>``: inside an isolate an override would reverse the token's own
letters, and a stray U+2069 (pop directional isolate) would close the isolate early and let the
rest of the token act on the words after it.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence

from attnkit.viz._common import as_array, check_tokens, format_weight

__all__ = ["token_highlight_html"]

# Positive weights shade orange, negative ones (signed scores) blue; opacity = |w| / max |w|.
_POSITIVE = "255, 127, 14"
_NEGATIVE = "31, 119, 180"
_BIDI_CONTROLS = re.compile("[\u202a-\u202e\u2066-\u2069]")


def _show_bidi_controls(text: str) -> str:
    """``text`` with each directional formatting character replaced by ``<U+XXXX>``."""
    return _BIDI_CONTROLS.sub(lambda m: f"<U+{ord(m.group()):04X}>", text)


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
            f'<span class="ak-word" dir="auto" title="weight {label}" data-weight="{label}" '
            f'style="background:rgba({colour},{alpha:.3f});color:{ink};padding:1px 3px;'
            f'margin:0 1px;border-radius:3px;white-space:pre-wrap;unicode-bidi:isolate">'
            f"{html.escape(_show_bidi_controls(word))}</span>"
        )
    heading = (
        '<div class="ak-title" dir="auto" style="font-weight:600;margin-bottom:6px">'
        f"{html.escape(_show_bidi_controls(title))}</div>"
        if title
        else ""
    )
    return (
        '<div class="attnkit-highlight" style="font:15px/2 system-ui,sans-serif;color:#111">'
        + heading
        + "".join(spans)
        + "</div>"
    )
