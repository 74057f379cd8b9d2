"""The HTML explorer: self-contained, escaped everywhere, exact data, clear errors."""

from __future__ import annotations

import base64
import html
import json
import re
import zlib
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
from attnkit.viz.explorer import ERROR_BOUND, page_weights
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


def _stored(b64: str, shape: tuple[int, ...]) -> np.ndarray:
    """The page's weights decoded by hand: base64, zlib, 16-bit integers in two byte planes,
    low bytes first, in units of 2**-12 (the oracle for the page's own decoder)."""
    raw = zlib.decompress(base64.b64decode(b64))
    n = len(raw) // 2
    ints = [raw[p] + 256 * raw[n + p] for p in range(n)]
    return (np.array(ints, dtype=np.float64) / 4096).reshape(shape)


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


def test_embedded_weights_are_within_the_stated_bound() -> None:
    att = _attention(2, 3, 7, 7)
    page = explorer_html(att, TOKENS, layer=1, head=2)
    data = _data(page)
    assert (data["layers"], data["heads"], data["nq"], data["nk"]) == (2, 3, 7, 7)
    assert (data["layer"], data["head"], data["scale"]) == (1, 2, 4096)
    assert ERROR_BOUND == 2**-13  # half of one step of 1/4096: what the docstring states
    stored = _stored(data["weights"], (2, 3, 7, 7))
    assert np.abs(stored - att.double().numpy()).max() <= ERROR_BOUND
    assert np.abs(stored - att.double().numpy()).max() > 0  # rounded, not copied
    rolled = attention_rollout(att.double(), all_layers=True).numpy()
    stored_rollout = _stored(data["rollout"], (2, 7, 7))
    assert np.abs(stored_rollout - rolled).max() <= ERROR_BOUND
    weights, rollout = page_weights(page)  # the module's reader agrees with the hand decoding
    assert weights.dtype == np.float32 and rollout is not None
    np.testing.assert_array_equal(weights, stored)
    np.testing.assert_array_equal(rollout, stored_rollout)


def test_the_bound_is_reached_and_never_passed() -> None:
    # Exact midpoints between two steps are the worst case (error exactly 2**-13); 0, 1 and
    # multiples of 2**-12 come back exactly; random weights of every size stay within the bound.
    steps = torch.tensor([0, 1, 7, 4095, 4096], dtype=torch.float64) / 4096
    mids = (torch.tensor([0, 1, 2047, 4095], dtype=torch.float64) + 0.5) / 4096
    gen = torch.Generator().manual_seed(3)
    rand = torch.rand(2, 2, 9, 9, generator=gen, dtype=torch.float64) ** 4  # mostly small
    for att in (steps.reshape(1, 5), mids.reshape(1, 4), rand):
        i, j = att.shape[-2:]
        keys = [f"k{n}" for n in range(j)]
        weights, _ = page_weights(explorer_html(att, keys[:i], keys))
        # float64 input is rounded to float32 first (the docstring's 2**-25, none here)
        err = np.abs(weights - att.float().numpy().reshape(weights.shape).astype(np.float64))
        assert err.max() <= ERROR_BOUND
        if att is steps:
            assert err.max() == 0
        if att is mids:
            assert err.max() == ERROR_BOUND


@pytest.mark.slow
def test_a_512_token_page_of_6_layers_by_12_heads_is_at_most_25_mb() -> None:
    # Random weights are the hard case for compression (real maps are smaller, see
    # docs/benchmarks.md); as base64 float32 this page was 109 MB.
    att = torch.softmax(
        2 * torch.randn(6, 12, 512, 512, generator=torch.Generator().manual_seed(0)), -1
    )
    page = explorer_html(att, [f"w{n}" for n in range(512)])
    assert len(page.encode("utf-8")) <= 25_000_000


def test_opens_on_the_last_layers_head_average_by_default() -> None:
    att = _attention(3, 4, 7, 7)
    explorer = AttentionExplorer(att, TOKENS)
    assert (explorer.layer, explorer.head) == (2, None)
    data = _data(explorer.to_html())
    assert (data["layer"], data["head"]) == (2, None)
    assert (_data(explorer_html(att, TOKENS, layer=0))["layer"], data["head"]) == (0, None)
    assert _data(explorer_html(att, TOKENS, head=3))["layer"] == 2


def test_sentence_pairs_from_sep_or_token_types() -> None:
    att = _attention(1, 2, 7, 7)
    pair = ["[CLS]", "a", "b", "[SEP]", "c", "d", "[SEP]"]
    assert AttentionExplorer(att, pair).segments == [0, 0, 0, 0, 1, 1, 1]
    assert _data(explorer_html(att, pair))["segments"] == [0, 0, 0, 0, 1, 1, 1]
    single = ["[CLS]", "a", "b", "c", "d", "e", "[SEP]"]
    assert AttentionExplorer(att, single).segments is None  # one sentence: no filter
    assert _data(explorer_html(att, single))["segments"] is None
    types = torch.tensor([0, 0, 1, 1, 1, 1, 1])  # e.g. a tokenizer's token_type_ids[0]
    assert AttentionExplorer(att, single, token_types=types).segments == types.tolist()
    assert AttentionExplorer(att, pair, token_types=[0] * 7).segments is None
    queries, keys = ["q0", "q1", "q2"], ["k0", "k1", "k2", "[SEP]", "k4"]
    assert AttentionExplorer(_attention(3, 5), queries, keys).segments is None


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


def test_texts_under_their_labels_and_the_kind_of_map_as_given() -> None:
    tokens = ["a", "b", "c"]
    page = AttentionExplorer(_attention(3, 3), tokens, text="a <b> c").to_html()
    assert '<p class="ak-text"><bdi>Input</bdi>: <q><bdi>a &lt;b&gt; c</bdi></q></p>' in page
    assert "3 queries × 3 keys (self-attention)" in page
    # A decoder's last two rows over its whole sequence: causal self-attention, not square.
    rows = _attention(2, 5)
    page = AttentionExplorer(
        rows,
        ["→ d", "→ e"],
        ["a", "b", "c", "d", "e"],
        text={"Prompt": "a b c", "Generated": "d <e>"},
        kind="causal self-attention",
    ).to_html()
    assert '<p class="ak-text"><bdi>Prompt</bdi>: <q><bdi>a b c</bdi></q></p>' in page
    assert '<p class="ak-text"><bdi>Generated</bdi>: <q><bdi>d &lt;e&gt;</bdi></q></p>' in page
    assert "Input:" not in page and "cross-attention" not in page
    assert "2 queries × 5 keys (causal self-attention)" in page
    with pytest.raises(TypeError, match="text must be a str or a mapping"):
        AttentionExplorer(rows, ["x", "y"], list("abcde"), text=["a"])


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
        (
            torch.tensor([[0.5, 1.5], [0.2, 0.8]]),
            ["a", "b"],
            None,
            {},
            ValueError,
            r"must lie in \[0, 1\].*from 0.2 to 1.5",
        ),
        (-_attention(2, 2), ["a", "b"], None, {}, ValueError, r"must lie in \[0, 1\]"),
        (
            _attention(2, 2),
            ["a", "b"],
            None,
            {"token_types": [0, 2]},
            ValueError,
            r"0 \(sentence A\) or 1 \(sentence B\) for each of the 2 tokens; got 2 values, "
            r"among them 2",
        ),
        (_attention(2, 2), ["a", "b"], None, {"token_types": [0]}, ValueError, "got 1 values"),
        (_attention(2, 2), ["a", "b"], None, {"token_types": "01"}, TypeError, "list of 0 and 1"),
        (
            _attention(2, 3),
            ["a", "b"],
            ["x", "y", "z"],
            {"token_types": [0, 1]},
            ValueError,
            "token_types needs self-attention",
        ),
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
        r'<iframe id="([\w-]+)"[^>]*sandbox="allow-scripts"[^>]*srcdoc="([^"]*)"></iframe>'
        r"<script>(.*)</script>",
        snippet,
        flags=re.S,
    )
    assert match is not None
    assert html.unescape(match.group(2)) == explorer.to_html()
    # The script after the frame fits the frame's height to the page, found by its own id.
    assert f'getElementById("{match.group(1)}")' in match.group(3)
    assert match.group(1) != re.match(r'<iframe id="([\w-]+)"', explorer._repr_html_()).group(1)


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


def test_title_and_texts_are_isolated_from_the_page_s_direction() -> None:
    """A right-to-left override (U+202E) in the title or a text turns only that text around:
    each sits in its own <bdi> (the tab title between FSI and PDI), so it cannot reverse the
    labels, summary and controls that follow it."""
    rlo = "\u202e"
    page = AttentionExplorer(
        _attention(1, 2, 7, 7),
        TOKENS,
        title=f"{rlo}evil title",
        text={f"{rlo}Prompt": f"{rlo}the text", "Generated": "fine"},
    ).to_html()
    assert f"<h1><bdi>{rlo}evil title</bdi></h1>" in page
    assert f"<title>\u2068{rlo}evil title\u2069</title>" in page
    assert f'<p class="ak-text"><bdi>{rlo}Prompt</bdi>: <q><bdi>{rlo}the text</bdi></q></p>' in page
    # every occurrence of the override is inside an isolate
    body = page.split("<body>", 1)[1].split("<script", 1)[0]
    assert body.count(rlo) == len(re.findall(f"<bdi>{rlo}", body)) == 3
