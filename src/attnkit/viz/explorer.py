"""An interactive attention explorer in one self-contained HTML file (no network, no CDN).

Pick a layer and a head, or the mean of a layer's heads; see the map as a heat map (rows =
queries ``i``, columns = keys ``j``) and as lines between the tokens (bertviz's "head view", Vig
2019), one head or every head of the layer at once in its own colour; hover a cell or a token to
read the weight; click a thumbnail in the overview to jump to it. For a sentence pair
(``[CLS] A [SEP] B [SEP]``, or ``token_types``) the lines can be limited to A -> B, B -> A, A -> A
or B -> B. For self-attention the "rollout" view shows attention rollout (Abnar and Zuidema 2020)
through each layer.

Input: attention ``(l, h, i, j)`` (or ``(h, i, j)``, ``(i, j)``) with weights in ``[0, 1]``, the
query tokens (``i``) and, for cross-attention, the key tokens (``j``). Large maps are drawn on
``<canvas>``.

Storage: every weight ``w`` travels as ``k = round(w * 4096)``, a 16-bit integer (low bytes, then
high bytes), deflate-compressed and base64-encoded; the page inflates it with the browser's
``DecompressionStream`` and uses ``k / 4096``. So for a float32 weight ``w`` the page's ``w'``
obeys exactly ``|w' - w| <= 2**-13`` (:data:`ERROR_BOUND`, about 0.00012, a quarter of the 0.0005
that three decimals need; float64 input is first rounded to float32, which adds at most 2**-25),
and the page shows three decimals. The head average is the mean of the stored weights, within the
same bound of the true mean plus float32 rounding (below 1e-7); rollout is computed from the
weights in float64 and stored the same way, within 2**-13. 6 layers x 12 heads over 512 tokens
make a page of about 12-16 MB (109 MB as base64 float32). :func:`page_weights` reads them back.

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
import re
import uuid
import zlib
from collections.abc import Mapping, Sequence
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from attnkit.viz._common import as_attention4d, check_index, json_for_script

__all__ = [
    "CAVEAT",
    "ERROR_BOUND",
    "AttentionExplorer",
    "explorer_html",
    "page_weights",
    "save_html",
]

SCALE = 4096  # weights travel as multiples of 1 / SCALE (a power of two: k / SCALE is exact)
ERROR_BOUND = 0.5 / SCALE  # 2**-13: the largest |shown - original| of a stored weight
_RANGE_SLACK = 1e-6  # float rounding of a softmax may leave a weight just outside [0, 1]

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


def _encode(arr: np.ndarray) -> str:
    """Weights in ``[0, 1]`` as base64 of deflate(low bytes ++ high bytes of round(w * SCALE)).

    Splitting the bytes into two planes lets deflate squeeze the high bytes, nearly all zero.
    """
    w = np.clip(arr, 0.0, 1.0)  # float32 weights or float64 rollout, rounded once from either
    k = np.rint(w * SCALE).astype("<u2")  # w * SCALE is exact: SCALE is a power of two
    planes = k.reshape(-1, 1).view(np.uint8).T  # (2, n): low bytes, then high bytes
    # Level 1: deflate's higher levels take 5x longer here for 5-8 % smaller pages.
    return base64.b64encode(zlib.compress(planes.tobytes(), 1)).decode("ascii")


def _decode(b64: str, shape: tuple[int, ...]) -> np.ndarray:
    """The inverse of :func:`_encode`, as the page does it: ``k / SCALE`` in float32."""
    planes = np.frombuffer(zlib.decompress(base64.b64decode(b64)), dtype=np.uint8)
    n = planes.size // 2
    k = planes[:n].astype(np.uint16) | (planes[n:].astype(np.uint16) << 8)
    return (k.astype(np.float32) / SCALE).reshape(shape)


def page_weights(page: str) -> tuple[np.ndarray, np.ndarray | None]:
    """``(weights (l, h, i, j), rollout (l, i, i) or None)`` as an explorer page stores them.

    Each stored weight is within :data:`ERROR_BOUND` (``2**-13``) of the weight it was made from.
    """
    import json

    match = re.search(r'<script type="application/json" class="ak-data">(.*?)</script>', page, re.S)
    if match is None:
        raise ValueError('page holds no explorer data (no <script class="ak-data"> element)')
    data = json.loads(match.group(1))
    l_, h, i, j = data["layers"], data["heads"], data["nq"], data["nk"]
    rollout = None if data["rollout"] is None else _decode(data["rollout"], (l_, i, i))
    return _decode(data["weights"], (l_, h, i, j)), rollout


def _pair_segments(
    tokens: list[str], token_types: Sequence[int] | None, cross: bool
) -> list[int] | None:
    """0 for sentence A and 1 for sentence B per token, or ``None`` when the input is no pair."""
    if token_types is None:
        if cross or "[SEP]" not in tokens[:-1]:
            return None
        sep = tokens.index("[SEP]")  # [CLS] A [SEP] B [SEP]: A ends at the first [SEP]
        return [0] * (sep + 1) + [1] * (len(tokens) - sep - 1)
    if cross:
        raise ValueError("token_types needs self-attention (the same query and key tokens)")
    if hasattr(token_types, "tolist"):  # a tensor or an array, e.g. token_type_ids[0]
        token_types = token_types.tolist()
    if isinstance(token_types, str) or not isinstance(token_types, Sequence):
        raise TypeError(f"token_types must be a list of 0 and 1, got {type(token_types).__name__}")
    bad = [t for t in token_types if isinstance(t, bool) or t not in (0, 1)]
    if len(token_types) != len(tokens) or bad:
        raise ValueError(
            f"token_types must hold 0 (sentence A) or 1 (sentence B) for each of the "
            f"{len(tokens)} tokens; got {len(token_types)} values"
            + (f", among them {bad[0]!r}" if bad else "")
        )
    types = [int(t) for t in token_types]
    return types if set(types) == {0, 1} else None


class AttentionExplorer:
    """The interactive explorer for one input; shows itself in Jupyter.

    Args:
        attention: ``(l, h, i, j)``, ``(h, i, j)`` or ``(i, j)`` weights (tensor, array, lists).
        tokens: the ``i`` query tokens.
        key_tokens: the ``j`` key tokens for cross-attention (default: ``tokens``).
        title: page heading. text: the input text, shown under it as "Input: ..."; a mapping
            from labels to texts shows each under its own label, e.g. ``{"Prompt": ...,
            "Generated": ...}`` (all escaped).
        layer: the layer shown first; ``None`` = the last one.
        head: the head shown first; ``None`` = the mean of the layer's heads. The defaults show
            what ``attnkit show`` summarises by default: the last layer's head average.
        rollout: offer the rollout view (self-attention only; ``None`` = when ``i == j``).
        token_types: 0 (sentence A) or 1 (sentence B) per token, as BERT's ``token_type_ids``,
            for the A/B filter of the lines; ``None`` = from the tokens when a ``[SEP]`` comes
            before the last token (``[CLS] A [SEP] B [SEP]``), else no filter.
        kind: what the map is, in the page's summary line; ``None`` = ``"self-attention"`` when
            the queries are the key tokens, else ``"cross-attention"``. A map whose queries are
            some positions of the keys' own sequence (the rows of a decoder generating over its
            cache) is self-attention although it is not square: say so here.
    """

    def __init__(
        self,
        attention: Any,
        tokens: Sequence[str],
        key_tokens: Sequence[str] | None = None,
        *,
        title: str = "Attention explorer",
        text: str | Mapping[str, str] | None = None,
        layer: int | None = None,
        head: int | None = None,
        rollout: bool | None = None,
        token_types: Sequence[int] | None = None,
        kind: str | None = None,
    ) -> None:
        arr, q_tokens, k_tokens = as_attention4d(attention, tokens, key_tokens)
        n_layers, n_heads, i, j = arr.shape
        low, high = float(arr.min()), float(arr.max())
        if low < -_RANGE_SLACK or high > 1 + _RANGE_SLACK:
            raise ValueError(
                f"attention weights must lie in [0, 1] (the page stores multiples of 1/{SCALE}); "
                f"got values from {low:.6g} to {high:.6g} in shape {tuple(arr.shape)}"
            )
        self.weights = arr.astype(np.float32)  # (l, h, i, j), as given
        self.tokens = q_tokens
        self.key_tokens = k_tokens
        self.title = str(title)
        self.text = text
        if text is not None and not isinstance(text, str | Mapping):
            raise TypeError(f"text must be a str or a mapping of labels to str, got {text!r}")
        checked = check_index(layer, n_layers, "layer")
        self.layer = n_layers - 1 if checked is None else checked
        self.head = check_index(head, n_heads, "head")  # None: the mean of the heads
        if rollout and i != j:
            raise ValueError(f"rollout needs self-attention (i == j), got i={i}, j={j}")
        self.rollout = (i == j) if rollout is None else bool(rollout)
        self.cross = i != j or (key_tokens is not None and list(key_tokens) != list(tokens))
        inferred = "cross-attention" if self.cross else "self-attention"
        self.kind = inferred if kind is None else str(kind)
        self.segments = _pair_segments(q_tokens, token_types, self.cross)

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
            "scale": SCALE,
            "weights": _encode(self.weights),
            "rollout": None,
            "layer": self.layer,
            "head": self.head,
            "segments": self.segments,
        }
        if self.rollout:
            import torch

            from attnkit.viz.rollout import attention_rollout

            rolled = attention_rollout(
                torch.from_numpy(self.weights.astype(np.float64)), all_layers=True
            )  # (l, i, i)
            data["rollout"] = _encode(rolled.numpy())
        return data

    def to_html(self) -> str:
        """The whole page: one self-contained HTML document."""
        n_layers, n_heads, i, j = self.shape
        summary = (
            f"{n_layers} layer{'s' * (n_layers != 1)} × {n_heads} "
            f"head{'s' * (n_heads != 1)}, {i} queries × {j} keys ({self.kind}); "
            f"weights shown to 3 decimals (stored within ±{ERROR_BOUND:.5f})"
        )
        texts = {"Input": self.text} if isinstance(self.text, str) else dict(self.text or {})
        text = "\n".join(
            f'<p class="ak-text"><bdi>{_html.escape(str(label))}</bdi>: '
            f"<q><bdi>{_html.escape(str(body))}</bdi></q></p>"
            for label, body in texts.items()
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
        # The page posts its height to the notebook, and the script after the frame sets the
        # frame's height to it (the page is 700 to 4,500 px tall, depending on the tokens,
        # layers and heads). Where a notebook runs no scripts of its outputs (an untrusted
        # notebook), the frame stays 760 px tall, scrolls, and can be dragged taller.
        frame_id = f"attnkit-explorer-{uuid.uuid4().hex}"
        return (
            f'<iframe id="{frame_id}" class="attnkit-explorer-frame" sandbox="allow-scripts" '
            'style="width:100%;height:760px;border:1px solid #ddd;resize:vertical" '
            f'srcdoc="{_html.escape(self.to_html(), quote=True)}"></iframe>'
            + _FIT_FRAME.replace("FRAME_ID", frame_id)
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


# Sets the frame's height to the one its page posts (explorer.js), once the page has drawn.
_FIT_FRAME = """<script>
(function () {
  var frame = document.getElementById("FRAME_ID");
  window.addEventListener("message", function (event) {
    var height = event.data && event.data.attnkitExplorerHeight;
    if (frame && event.source === frame.contentWindow && typeof height === "number") {
      frame.style.height = Math.ceil(height) + 2 + "px";
    }
  });
})();
</script>"""

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>⁨{title}⁩</title>
<style>
{css}
</style>
</head>
<body>
<div class="attnkit-explorer">
<header>
<h1><bdi>{title}</bdi></h1>
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
<div class="ak-readout" aria-live="polite">Loading the weights…</div>
<div class="ak-panels">
<section class="ak-panel">
<h2>Heat map <small>(rows: queries i, columns: keys j)</small></h2>
<div class="ak-legend"></div>
<div class="ak-matrix"></div>
</section>
<section class="ak-panel">
<h2>Lines <small>(query → key; hover a token)</small></h2>
<div class="ak-lines-controls">
<label><input type="checkbox" class="ak-overlay"> every head of the layer, one colour each</label>
<label class="ak-pair-label" hidden>Sentences <select class="ak-pair">
<option value="all">all</option><option value="AB">A → B</option><option value="BA">B → A</option>
<option value="AA">A → A</option><option value="BB">B → B</option></select></label>
</div>
<div class="ak-swatches" hidden></div>
<div class="ak-lines"></div>
</section>
</div>
<section class="ak-overview-panel">
<h2>All heads <small>(and each layer's mean; click one to show it)</small></h2>
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
