"""Words shaded by a weight (viz/highlight.py): opacity |w| / max |w| worked out by hand, the
colour by sign, exact weights in the markup, user text escaped, every token its own bidirectional
isolate (a right-to-left override cannot reach its neighbours), and bad input named."""

from __future__ import annotations

import html
import re
from html.parser import HTMLParser

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
        r'<span class="ak-word" dir="auto" title="weight ([^"]*)" data-weight="([^"]*)" '
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


RLO, PDI, PDF = "\u202e", "\u2069", "\u202c"  # right-to-left override, pop isolate, pop embedding


class _Tree(HTMLParser):
    """The fragment's elements: for each ``ak-word`` span, its attributes and its text."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[tuple[str, dict]] = []
        self.words: list[tuple[dict, str]] = []
        self.loose_text: list[str] = []  # text outside every word span and the title

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.stack.append((tag, dict(attrs)))
        if dict(attrs).get("class") == "ak-word":
            self.words.append((dict(attrs), ""))

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1][0] == tag, f"</{tag}> closes {self.stack[-1:]}"
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        inside = [attrs.get("class") for _, attrs in self.stack]
        if "ak-word" in inside:
            attrs, text = self.words[-1]
            self.words[-1] = (attrs, text + data)
        elif "ak-title" not in inside:
            self.loose_text.append(data)


@pytest.mark.parametrize(
    "hostile",
    [
        f"evil{RLO}reversed",
        f"{RLO}",
        f"x{PDI}{RLO}after an early pop",  # a stray pop must not end the isolate early
        f"{PDF}{PDI}{PDI}{RLO}",
        "\u2067rli\u202bemb",
    ],
)
def test_every_token_is_a_direction_isolate_a_bidi_override_cannot_escape(hostile: str) -> None:
    tokens = ["before", hostile, "after", "مرحبا", "42"]
    frag = token_highlight_html(tokens, [0.1, 0.9, 0.2, 0.3, 0.4], title=f"t{RLO}itle")
    tree = _Tree()
    tree.feed(frag)
    tree.close()
    assert not tree.stack and tree.loose_text == []  # balanced; no text between the words
    assert len(tree.words) == len(tokens)
    for attrs, _ in tree.words:  # each word is isolated: its direction stays inside its box
        assert attrs["dir"] == "auto"
        assert "unicode-bidi:isolate" in attrs["style"].replace(" ", "")
    # No directional formatting character reaches the page: each is shown as its code point, so
    # nothing (not even a stray pop of the isolate) can act beyond its own token.
    assert not re.search("[\u202a-\u202e\u2066-\u2069]", frag)
    shown = [text for _, text in tree.words]
    assert shown[0] == "before" and shown[2:] == ["after", "مرحبا", "42"]
    assert shown[1] == re.sub(
        "[\u202a-\u202e\u2066-\u2069]", lambda m: f"<U+{ord(m.group()):04X}>", hostile
    )
    assert "<U+202E>" in shown[1] or "\u202e" not in hostile
    assert "t&lt;U+202E&gt;itle" in frag
