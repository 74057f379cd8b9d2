"""The HTML explorer: self-contained, escaped everywhere, exact data, clear errors."""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from attnkit.viz import (
    CAVEAT,
    AttentionExplorer,
    attention_rollout,
    explorer_html,
    save_html,
    token_highlight_html,
)
from hostile_html import CLOSER, XSS

TOKENS = ["[CLS]", XSS, "a&b", CLOSER, "line\u2028sep", "<!--", "[SEP]"]


def _attention(*shape: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(*shape, generator=gen), dim=-1)


def _data(page: str) -> dict:
    match = re.search(
        r'<script type="application/json" class="ak-data">(.*?)</script>', page, flags=re.S
    )
    assert match is not None
    return json.loads(match.group(1))


def _floats(b64: str, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype="<f4").reshape(shape)


def test_page_is_self_contained() -> None:
    page = explorer_html(_attention(2, 3, 7, 7), TOKENS)
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page)
    assert "<link" not in page and "@import" not in page and "url(" not in page
    assert not re.search(r"<script[^>]*\bsrc=", page)
    assert "https://" not in page and "http://" not in page
    assert CAVEAT in page.replace("&#x27;", "'")
    assert "Attention is not explanation" in page


def test_tokens_and_text_are_escaped_everywhere() -> None:
    page = explorer_html(
        _attention(2, 3, 7, 7), TOKENS, title=f"title {XSS}", text=f"text {CLOSER} {XSS}"
    )
    # Only the page's own two script elements open and close; no user markup survives.
    assert page.count("<script") == 2 and page.count("</script") == 2
    assert "<img" not in page and "<!--" not in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page  # title and text, escaped
    data = _data(page)
    assert data["queryTokens"] == TOKENS and data["keyTokens"] == TOKENS


def test_embedded_weights_are_exact() -> None:
    att = _attention(2, 3, 7, 7)
    data = _data(explorer_html(att, TOKENS, layer=1, head=2))
    assert (data["layers"], data["heads"], data["nq"], data["nk"]) == (2, 3, 7, 7)
    assert (data["layer"], data["head"]) == (1, 2)
    np.testing.assert_array_equal(_floats(data["weights"], (2, 3, 7, 7)), att.numpy())
    rolled = attention_rollout(att.double(), all_layers=True).numpy()
    np.testing.assert_allclose(_floats(data["rollout"], (2, 7, 7)), rolled, rtol=1e-6)


def test_cross_attention_and_lower_ranks() -> None:
    queries, keys = ["q0", "q1", "q2"], ["k0", "k1", "k2", "k3", "k4"]
    explorer = AttentionExplorer(_attention(3, 5), queries, keys)  # (i, j) -> (1, 1, i, j)
    assert explorer.shape == (1, 1, 3, 5)
    page = explorer.to_html()
    assert "3 queries × 5 keys (cross-attention)" in page
    data = _data(page)
    assert data["rollout"] is None and data["keyTokens"] == keys
    assert AttentionExplorer(_attention(4, 2, 2), ["a", "b"]).shape == (1, 4, 2, 2)
    with pytest.raises(ValueError, match="rollout needs self-attention"):
        AttentionExplorer(_attention(3, 5), queries, keys, rollout=True)


@pytest.mark.parametrize(
    ("att", "tokens", "keys", "kwargs", "error", "message"),
    [
        (
            _attention(2, 3, 7, 7),
            ["a"] * 6,
            None,
            {},
            ValueError,
            r"tokens has 6 tokens but the attention has 7 query positions \(i\) in shape "
            r"\(2, 3, 7, 7\)",
        ),
        (_attention(2, 3, 3, 5), ["a"] * 3, None, {}, ValueError, "pass key_tokens"),
        (
            _attention(2, 3, 3, 5),
            ["a"] * 3,
            ["k"] * 4,
            {},
            ValueError,
            "key_tokens has 4 tokens but the attention has 5 key positions",
        ),
        (_attention(2, 1, 3, 3, 3), ["a"] * 3, None, {}, ValueError, "pick one item"),
        (_attention(5), ["a"] * 5, None, {}, ValueError, "got 1 dims"),
        (torch.full((2, 2), float("nan")), ["a", "b"], None, {}, ValueError, "NaN"),
        (
            _attention(2, 3, 2, 2),
            ["a", "b"],
            None,
            {"layer": 2},
            ValueError,
            r"layer=2 is out of range: there are 2",
        ),
        (_attention(2, 3, 2, 2), ["a", "b"], None, {"head": -1}, ValueError, "head=-1"),
        (_attention(2, 2), ["a", 3], None, {}, TypeError, r"tokens\[1\] must be a str"),
        (_attention(2, 2), "ab", None, {}, TypeError, "list of strings"),
        ("weights", ["a"], None, {}, TypeError, "attention must be a tensor"),
    ],
)
def test_bad_input_names_the_problem(
    att: object, tokens: object, keys: object, kwargs: dict, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        AttentionExplorer(att, tokens, keys, **kwargs)  # type: ignore[arg-type]


def test_repr_html_is_a_sandboxed_iframe_of_the_page() -> None:
    explorer = AttentionExplorer(_attention(1, 2, 7, 7), TOKENS, title=XSS)
    snippet = explorer._repr_html_()
    match = re.fullmatch(
        r'<iframe [^>]*sandbox="allow-scripts"[^>]*srcdoc="([^"]*)"></iframe>', snippet
    )
    assert match is not None
    assert html.unescape(match.group(1)) == explorer.to_html()


def test_save_is_atomic_and_checks_the_path(tmp_path: Path) -> None:
    explorer = AttentionExplorer(_attention(1, 2, 3, 3), ["a", "b", "c"])
    path = explorer.save(tmp_path / "e.html")
    assert path.read_text(encoding="utf-8") == explorer.to_html()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        explorer.save(tmp_path / "missing" / "e.html")
    with pytest.raises(IsADirectoryError):
        explorer.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.html"]  # no temporary left over


def test_save_html_wraps_fragments_and_keeps_documents(tmp_path: Path) -> None:
    fragment = token_highlight_html(["good", "film"], [0.2, 0.8])
    text = save_html(fragment, tmp_path / "f.html").read_text(encoding="utf-8")
    assert (
        text.startswith("<!DOCTYPE html>") and fragment in text and '<meta charset="utf-8">' in text
    )
    page = explorer_html(_attention(2, 2), ["a", "b"])
    assert save_html(page, tmp_path / "p.html").read_text(encoding="utf-8") == page
    with pytest.raises(TypeError, match="html must be a str"):
        save_html(b"<p>", tmp_path / "b.html")  # type: ignore[arg-type]
