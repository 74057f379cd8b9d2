"""Words shaded by a weight (viz/highlight.py): opacity |w| / max |w| worked out by hand, the
colour by sign, exact weights in the markup, user text escaped, and bad input named."""

from __future__ import annotations

import html
import re

import numpy as np
import pytest
import torch

from attnkit.viz import token_highlight_html
from hostile_html import CLOSER, XSS


def test_token_highlight_html_shades_by_weight_and_escapes() -> None:
    tokens, weights = ["a", XSS, "film", CLOSER], [0.1, 0.4, 0.8, 0.0]
    frag = token_highlight_html(tokens, np.array(weights), title=f"why? {XSS}")
    assert "<img" not in frag and "<script" not in frag and "</script" not in frag
    spans = re.findall(
        r'<span class="ak-word" title="weight ([^"]*)" data-weight="([^"]*)" '
        r'style="background:rgba\(([^)]*)\);[^"]*">(.*?)</span>',
        frag,
    )
    assert [html.unescape(s[3]) for s in spans] == tokens
    assert [float(s[1]) for s in spans] == weights
    alphas = [float(s[2].split(",")[-1]) for s in spans]
    assert alphas == [0.125, 0.5, 1.0, 0.0]  # |w| / max |w|
    assert "why? &lt;img src=x onerror=alert(1)&gt;" in frag
    signed = token_highlight_html(["up", "down"], torch.tensor([0.5, -1.0]))
    assert "rgba(255, 127, 14,0.500)" in signed and "rgba(31, 119, 180,1.000)" in signed


@pytest.mark.parametrize(
    ("tokens", "weights", "message"),
    [
        (["a", "b"], [0.1], "one value per token: 2 tokens"),
        (["a"], [[0.1]], "one value per token"),
        (["a"], [float("inf")], "NaN or infinite"),
        ([], [], "empty"),
    ],
)
def test_token_highlight_html_bad_input(tokens: list, weights: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        token_highlight_html(tokens, weights)
