"""Shared input checks and escaping for the pictures and the HTML explorer.

Shape vocabulary: ``l`` layers, ``h`` heads, ``i`` query positions, ``j`` key positions.
Every view takes attention as ``(l, h, i, j)``, ``(h, i, j)`` or ``(i, j)`` (a torch tensor, a
numpy array or nested lists) plus the query tokens (length ``i``) and, for cross-attention, the
key tokens (length ``j``; by default the query tokens).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "as_array",
    "as_attention4d",
    "check_index",
    "check_tokens",
    "format_weight",
    "json_for_script",
]


def as_array(x: Any, name: str) -> np.ndarray:
    """A float64 numpy copy of a torch tensor, numpy array or nested list."""
    if hasattr(x, "detach"):  # a torch tensor: no torch import needed here
        x = x.detach().to("cpu").double().numpy()
    try:
        arr = np.array(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be a tensor, array or nested list of numbers: {exc}") from exc
    if arr.size and not np.isfinite(arr).all():
        raise ValueError(f"{name} contains NaN or infinite values; attention weights are finite")
    return arr


def check_tokens(tokens: Any, name: str, expected: int | None = None, what: str = "") -> list[str]:
    """A list of strings; when ``expected`` is given its length must match."""
    if isinstance(tokens, str) or not isinstance(tokens, Sequence):
        raise TypeError(f"{name} must be a list of strings, got {type(tokens).__name__}")
    out = list(tokens)
    for pos, tok in enumerate(out):
        if not isinstance(tok, str):
            raise TypeError(f"{name}[{pos}] must be a str, got {type(tok).__name__}")
    if not out:
        raise ValueError(f"{name} is empty; need at least one token")
    if expected is not None and len(out) != expected:
        raise ValueError(f"{name} has {len(out)} tokens but the attention has {expected} {what}")
    return out


def as_attention4d(
    attention: Any,
    tokens: Sequence[str],
    key_tokens: Sequence[str] | None = None,
    *,
    name: str = "attention",
) -> tuple[np.ndarray, list[str], list[str]]:
    """Checks shapes against the tokens; returns ``(weights (l, h, i, j), tokens, key_tokens)``."""
    arr = as_array(attention, name)
    if arr.ndim == 5:
        # transformers' output_attentions is a tuple of per-layer (batch, heads, i, j) tensors,
        # which a tuple index such as [:, 0] cannot pick from.
        pick = (
            "[a[0] for a in attentions] (a tuple or list of one tensor per layer, as "
            "transformers' output_attentions gives)"
            if isinstance(attention, tuple | list)
            else "attentions[:, 0]"
        )
        raise ValueError(
            f"{name} has shape {tuple(arr.shape)}, which looks like (layers, batch, heads, i, j); "
            f"pick one item of the batch first, e.g. {pick}"
        )
    if arr.ndim not in (2, 3, 4):
        raise ValueError(
            f"{name} must have shape (layers, heads, i, j), (heads, i, j) or (i, j); "
            f"got {arr.ndim} dims {tuple(arr.shape)}"
        )
    arr = arr.reshape((1,) * (4 - arr.ndim) + arr.shape)  # (l, h, i, j)
    if 0 in arr.shape:
        raise ValueError(f"{name} has an empty dimension: shape {tuple(arr.shape)}")
    l_, h, i, j = arr.shape
    tokens = check_tokens(tokens, "tokens", i, f"query positions (i) in shape {(l_, h, i, j)}")
    if key_tokens is None:
        if i != j:
            raise ValueError(
                f"{name} is cross-attention with i={i} queries and j={j} keys; "
                "pass key_tokens (length j) as well"
            )
        key_tokens = tokens
    key_tokens = check_tokens(
        key_tokens, "key_tokens", j, f"key positions (j) in shape {(l_, h, i, j)}"
    )
    return arr, tokens, key_tokens


def check_index(value: int | None, size: int, name: str) -> int | None:
    """``None`` or an int in ``[0, size)``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value < size:
        raise ValueError(f"{name}={value} is out of range: there are {size} (0 to {size - 1})")
    return value


# Inside <script>, the HTML parser ends the element at the first "</script" whatever the JSON
# means, and "<!--" changes how it parses; U+2028/2029 broke older JavaScript string literals.
# Escaping these characters as \uXXXX keeps the JSON identical for JSON.parse and inert for HTML.
_SCRIPT_ESCAPES = {
    "<": "\\u003c",
    ">": "\\u003e",
    "&": "\\u0026",
    "\u2028": "\\u2028",
    "\u2029": "\\u2029",
}


def json_for_script(obj: Any) -> str:
    """JSON that is safe to embed verbatim inside an HTML ``<script>`` element."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    for ch, escaped in _SCRIPT_ESCAPES.items():
        text = text.replace(ch, escaped)
    return text


def format_weight(w: float) -> str:
    """Seven significant digits: a float32 weight in full (the explorer shows three decimals)."""
    if w == 0 or not math.isfinite(w):
        return str(w)
    return f"{w:.7g}"
