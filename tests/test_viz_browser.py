"""The HTML explorer in a real headless Chromium (Debian's), with the network cut off.

Run by `make test`, which installs Debian's `chromium` first (target `system-deps`). Playwright's
own browser downloads are not used: it drives /usr/bin/chromium.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from attnkit.viz import AttentionExplorer, attention_rollout
from attnkit.viz.explorer import ERROR_BOUND

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("ATTNKIT_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
]
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
XSS = "<img src=x onerror=alert(1)>"
TOKENS = ["[CLS]", "the", "cat", XSS, "</script><b>bold</b>", "sat", "[SEP]"]
# The page stores weights within ERROR_BOUND (2**-13) and shows three decimals (half a unit of
# the last: 0.0005) or, in the cells of small maps, two (0.005).
SHOWN = 0.0005 + ERROR_BOUND + 1e-7  # 1e-7: float32 rounding of a head average
CELL = 0.005 + ERROR_BOUND + 1e-7


def _attention(*shape: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(2.0 * torch.randn(*shape, generator=gen), dim=-1)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not (os.access(CHROMIUM, os.X_OK) or shutil.which(CHROMIUM)):
        pytest.fail(
            f"Chromium not found at {CHROMIUM}: run `make test`, which installs Debian's "
            "chromium and chromium-driver (make system-deps)"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        instance = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield instance
        instance.close()


class Page:
    """A page that records console errors, script errors, dialogs and network attempts."""

    def __init__(self, browser: object, tmp_path: Path) -> None:
        self.context = browser.new_context(viewport={"width": 1280, "height": 900})  # type: ignore[attr-defined]
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.context.route("**/*", self._route)
        self.tmp_path = tmp_path

    def _route(self, route: object) -> None:
        url = route.request.url  # type: ignore[attr-defined]
        if url.startswith("file://"):
            route.continue_()  # type: ignore[attr-defined]
        else:  # no network: anything else is recorded and refused
            self.requests.append(url)
            route.abort()  # type: ignore[attr-defined]

    def open(self, explorer: AttentionExplorer, name: str = "e.html") -> object:
        path = explorer.save(self.tmp_path / name)
        self.page.goto(path.as_uri())
        self.page.wait_for_selector(".attnkit-explorer[data-ready]", timeout=60_000)
        return self.page

    def assert_clean(self) -> None:
        assert self.errors == []
        assert self.dialogs == []
        assert self.requests == []


@pytest.fixture
def page(browser: object, tmp_path: Path) -> Iterator[Page]:
    wrapper = Page(browser, tmp_path)
    yield wrapper
    wrapper.context.close()


def _weight(pg: object) -> float:
    return float(pg.inner_text(".ak-readout .ak-weight"))  # type: ignore[attr-defined]


def _weights(pg: object) -> list[float]:
    return [float(t) for t in pg.locator(".ak-readout .ak-weight").all_inner_texts()]  # type: ignore[attr-defined]


def _top(row: torch.Tensor, k: int = 3) -> list[float]:
    return sorted(row.tolist(), reverse=True)[:k]


def _cells(pg: object) -> list[float]:
    return [float(t) for t in pg.locator(".ak-cell").all_inner_texts()]  # type: ignore[attr-defined]


def test_explorer_renders_switches_heads_and_shows_exact_weights(page: Page) -> None:
    att = _attention(3, 4, 7, 7)  # (l, h, i, j)
    explorer = AttentionExplorer(att, TOKENS, title=f"Explorer {XSS}", text=f"A text {XSS}")
    pg = page.open(explorer)

    # heat-map cells and token labels
    assert pg.locator(".ak-cell").count() == 49
    assert pg.locator(".ak-row-label").all_inner_texts() == TOKENS
    assert pg.locator(".ak-col-label").all_inner_texts() == TOKENS
    assert pg.locator(".ak-lines .ak-ltok").count() == 14
    assert pg.locator(".ak-thumb").count() == 15  # 3 layers x (4 heads and their mean)
    assert "Attention is not explanation" in pg.inner_text(".ak-caveat")
    # the XSS text is shown as text and never became an element
    assert pg.locator("img").count() == 0 and pg.locator("b").count() == 0
    assert pg.inner_text("h1") == f"Explorer {XSS}"
    assert XSS in pg.inner_text(".ak-text")
    assert pg.locator(".ak-row-label").nth(3).inner_text() == XSS

    # the last layer's head average first; annotated cells show the weights to two decimals
    assert pg.locator(".ak-head").input_value() == "mean"
    assert pg.locator(".ak-layer").input_value() == "2"
    assert _cells(pg) == pytest.approx(att[2].mean(0).flatten().tolist(), abs=CELL)
    pg.hover(".ak-cell[data-q='2'][data-k='3']")
    assert _weight(pg) == pytest.approx(att[2, :, 2, 3].mean().item(), abs=SHOWN)
    assert "layer 2, mean of 4 heads" in pg.inner_text(".ak-readout")
    assert pg.locator(".ak-thumb.ak-current").get_attribute("data-head") == "mean"

    # hovering a cell shows its weight to three decimals
    pg.select_option(".ak-layer", "0")
    pg.select_option(".ak-head", "0")
    assert _cells(pg) == pytest.approx(att[0, 0].flatten().tolist(), abs=CELL)
    pg.hover(".ak-cell[data-q='2'][data-k='3']")
    assert _weight(pg) == pytest.approx(att[0, 0, 2, 3].item(), abs=SHOWN)
    assert len(pg.inner_text(".ak-readout .ak-weight").split(".")[1]) == 3
    assert XSS in pg.inner_text(".ak-readout")

    # switching layer and head changes the weights to the right values, hover readout included
    pg.select_option(".ak-layer", "2")
    pg.select_option(".ak-head", "3")
    assert _cells(pg) == pytest.approx(att[2, 3].flatten().tolist(), abs=CELL)
    assert _weight(pg) == pytest.approx(att[2, 3, 2, 3].item(), abs=SHOWN)
    pg.hover(".ak-cell[data-q='6'][data-k='0']")
    assert _weight(pg) == pytest.approx(att[2, 3, 6, 0].item(), abs=SHOWN)

    # a thumbnail click selects its head, or a layer's mean
    pg.click(".ak-thumb[data-layer='0'][data-head='mean']")
    assert pg.locator(".ak-head").input_value() == "mean"
    assert _cells(pg) == pytest.approx(att[0].mean(0).flatten().tolist(), abs=CELL)
    pg.click(".ak-thumb[data-layer='1'][data-head='2']")
    assert pg.locator(".ak-head").input_value() == "2"
    assert _cells(pg) == pytest.approx(att[1, 2].flatten().tolist(), abs=CELL)

    # the lines view: hovering a query token lists where it looks most, strongest first
    pg.hover(".ak-col-q .ak-ltok[data-q='1']")
    assert _weights(pg) == pytest.approx(_top(att[1, 2, 1]), abs=SHOWN)

    # rollout view: the map is attention rollout through the chosen layer
    pg.select_option(".ak-view", "rollout")
    rolled = attention_rollout(att.double(), all_layers=True)
    assert _cells(pg) == pytest.approx(rolled[1].flatten().tolist(), abs=CELL)
    pg.select_option(".ak-layer", "2")
    assert _cells(pg) == pytest.approx(rolled[2].flatten().tolist(), abs=CELL)
    page.assert_clean()

    pg.select_option(".ak-view", "heads")
    pg.select_option(".ak-layer", "0")
    pg.select_option(".ak-head", "1")
    pg.hover(".ak-cell[data-q='2'][data-k='1']")
    ARTIFACTS.mkdir(exist_ok=True)
    pg.screenshot(path=str(ARTIFACTS / "explorer-synthetic.png"), full_page=True)
    page.assert_clean()


def _ink(pg: object, x: int) -> set[int]:
    """The token rows (18 px each) that lines touch in column x of the lines canvas."""
    ys = pg.evaluate(  # type: ignore[attr-defined]
        """x => { const c = document.querySelector('.ak-lines-canvas');
        const d = c.getContext('2d').getImageData(x, 0, 1, c.height).data, ys = [];
        for (let y = 0; y < c.height; y++) if (d[4 * y + 3] > 0) ys.push(y);
        return ys; }""",
        x,
    )
    return {y // 18 for y in ys}


def _colours(pg: object) -> list[tuple[int, int, int]]:
    """The distinct colours of the lines canvas where its ink is at least 40 % opaque."""
    found = pg.evaluate(  # type: ignore[attr-defined]
        """() => { const c = document.querySelector('.ak-lines-canvas');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data, seen = {};
        for (let n = 0; n < d.length; n += 4)
          if (d[n + 3] >= 100) seen[[d[n], d[n + 1], d[n + 2]]] = 1;
        return Object.keys(seen).map(k => k.split(',').map(Number)); }"""
    )
    return [tuple(c) for c in found]


def _near(colour: tuple[int, int, int], target: tuple[int, int, int]) -> bool:
    # 12: the canvas keeps colours premultiplied by alpha in 8 bits, so blending drifts a little
    return max(abs(a - b) for a, b in zip(colour, target, strict=True)) <= 12


def test_readout_follows_the_layer_after_hovering_a_token_in_the_lines(page: Page) -> None:
    att = _attention(3, 4, 7, 7, seed=4)
    pg = page.open(AttentionExplorer(att, TOKENS, layer=0, head=1))
    assert _top(att[0, 1, 2]) != pytest.approx(_top(att[2, 1, 2]), abs=2 * SHOWN)  # can fail
    pg.hover(".ak-col-q .ak-ltok[data-q='2']")
    assert _weights(pg) == pytest.approx(_top(att[0, 1, 2]), abs=SHOWN)
    pg.select_option(".ak-layer", "2")
    assert "layer 2, head 1 · query 2" in pg.inner_text(".ak-readout")
    assert _weights(pg) == pytest.approx(_top(att[2, 1, 2]), abs=SHOWN)
    pg.select_option(".ak-head", "mean")
    assert _weights(pg) == pytest.approx(_top(att[2, :, 2].mean(0)), abs=SHOWN)
    # a key token: who looks at it most; then the mouse leaves the lines and the layer changes
    pg.hover(".ak-col-k .ak-ltok[data-k='5']")
    assert _weights(pg) == pytest.approx(_top(att[2, :, :, 5].mean(0)), abs=SHOWN)
    pg.mouse.move(1, 1)
    pg.select_option(".ak-layer", "1")
    assert "layer 1, mean of 4 heads · key 5" in pg.inner_text(".ak-readout")
    assert _weights(pg) == pytest.approx(_top(att[1, :, :, 5].mean(0)), abs=SHOWN)
    # a heat-map cell likewise, through the overview
    pg.hover(".ak-cell[data-q='4'][data-k='6']")
    pg.click(".ak-thumb[data-layer='0'][data-head='3']")
    assert _weight(pg) == pytest.approx(att[0, 3, 4, 6].item(), abs=SHOWN)
    page.assert_clean()


def test_every_head_of_a_layer_in_the_lines_one_colour_each(page: Page) -> None:
    att = _attention(2, 4, 7, 7, seed=6)
    pg = page.open(AttentionExplorer(att, TOKENS, layer=1, head=2))
    assert pg.locator(".ak-swatches").is_hidden()
    assert [_near(c, (33, 113, 181)) for c in _colours(pg)] == [True] * len(_colours(pg))
    pg.check(".ak-overlay")
    assert pg.locator(".ak-swatch").count() == 4
    pg.hover(".ak-col-q .ak-ltok[data-q='3']")
    assert "layer 1, every head · query 3" in pg.inner_text(".ak-readout")
    marks = ".ak-readout .ak-head-mark"
    assert pg.locator(marks).all_inner_texts() == ["H0", "H1", "H2", "H3"]
    assert _weights(pg) == pytest.approx([att[1, h, 3].max().item() for h in range(4)], abs=SHOWN)
    orange, red = (255, 127, 14), (214, 39, 40)  # heads 1 and 3 (Tableau 10)
    for h in (0, 2, 3):  # leave head 1 alone: every line is its colour
        pg.click(f".ak-swatch[data-head='{h}']")
    assert pg.locator(marks).all_inner_texts() == ["H1"]
    colours = _colours(pg)
    assert colours and all(_near(c, orange) for c in colours)
    pg.click(".ak-swatch[data-head='3']")  # and head 3: both colours, each in its lines
    colours = _colours(pg)
    assert any(_near(c, orange) for c in colours) and any(_near(c, red) for c in colours)
    pg.select_option(".ak-layer", "0")  # the readout follows the layer in the overlay too
    assert pg.locator(marks).all_inner_texts() == ["H1", "H3"]
    assert _weights(pg) == pytest.approx([att[0, h, 3].max().item() for h in (1, 3)], abs=SHOWN)
    assert _cells(pg) == pytest.approx(att[0, 2].flatten().tolist(), abs=CELL)  # map: head 2
    pg.uncheck(".ak-overlay")
    assert pg.locator(".ak-swatches").is_hidden()
    assert _weights(pg) == pytest.approx(_top(att[0, 2, 3]), abs=SHOWN)
    page.assert_clean()


def test_sentence_pair_filter_of_the_lines(page: Page) -> None:
    pair = ["[CLS]", "the", "cat", "[SEP]", "it", "sat", "[SEP]"]  # A: 0-3, B: 4-6
    att = _attention(2, 3, 7, 7, seed=5)
    pg = page.open(AttentionExplorer(att, pair, layer=1, head=0))
    assert pg.locator(".ak-pair").is_visible()
    a, b = [0, 1, 2, 3], [4, 5, 6]
    m = att[1, 0]
    for choice, src, dst in (("AB", a, b), ("BA", b, a), ("AA", a, a), ("BB", b, b)):
        pg.mouse.move(1, 1)
        pg.select_option(".ak-pair", choice)
        off_q = pg.locator(".ak-col-q .ak-ltok.ak-off").evaluate_all(
            "e => e.map(t => +t.dataset.q)"
        )
        off_k = pg.locator(".ak-col-k .ak-ltok.ak-off").evaluate_all(
            "e => e.map(t => +t.dataset.k)"
        )
        assert (off_q, off_k) == (
            [q for q in range(7) if q not in src],
            [k for k in range(7) if k not in dst],
        )
        # lines leave only the source sentence's rows and end only at the target's; a line
        # is drawn where its weight is at least 0.02
        drawn = [(q, k) for q in src for k in dst if m[q, k] >= 0.02]
        assert _ink(pg, 0) == {q for q, _ in drawn} and _ink(pg, 149) == {k for _, k in drawn}
        q = src[1]
        pg.hover(f".ak-col-q .ak-ltok[data-q='{q}']")
        assert _weights(pg) == pytest.approx(_top(m[q, dst]), abs=SHOWN)
        pg.hover(f".ak-col-q .ak-ltok[data-q='{off_q[0]}']")  # outside the filter: no change
        assert f"query {q} " in pg.inner_text(".ak-readout")
    pg.select_option(".ak-pair", "all")
    assert pg.locator(".ak-ltok.ak-off").count() == 0
    single = AttentionExplorer(att, ["[CLS]", "a", "b", "c", "d", "e", "[SEP]"])
    pg = page.open(single, "single.html")
    assert pg.locator(".ak-pair").is_hidden()
    page.assert_clean()


def test_long_cross_attention_on_canvas(page: Page) -> None:
    # 300 queries over 257 keys, 2 layers x 3 heads: drawn on a canvas, hover still exact.
    att = _attention(2, 3, 300, 257, seed=1)
    queries = [f"q{n}" for n in range(300)]
    keys = [f"k{n}" for n in range(257)]
    pg = page.open(AttentionExplorer(att, queries, keys, layer=1, head=2))
    assert pg.locator(".ak-cell").count() == 0
    canvas = pg.locator(".ak-matrix-canvas")
    box = canvas.bounding_box()
    q, k = 123, 200
    canvas.scroll_into_view_if_needed()
    box = canvas.bounding_box()
    x = (k + 0.5) * box["width"] / 257
    y = (q + 0.5) * box["height"] / 300
    canvas.hover(position={"x": x, "y": y})
    assert pg.inner_text(".ak-readout").count("q123") == 1
    assert _weight(pg) == pytest.approx(att[1, 2, q, k].item(), abs=SHOWN)
    assert "cross-attention" in pg.inner_text(".ak-summary")
    assert pg.locator(".ak-view").is_disabled()  # no rollout for cross-attention
    pg.select_option(".ak-head", "0")
    assert _weight(pg) == pytest.approx(att[1, 0, q, k].item(), abs=SHOWN)
    page.assert_clean()


def test_jupyter_repr_works_inside_its_iframe(page: Page) -> None:
    att = _attention(2, 2, 4, 4)
    explorer = AttentionExplorer(att, ["a", "b", XSS, "d"])
    host = page.tmp_path / "notebook.html"
    host.write_text(
        "<!DOCTYPE html><meta charset='utf-8'><h1>notebook</h1>" + explorer._repr_html_(),
        encoding="utf-8",
    )
    pg = page.page
    pg.goto(host.as_uri())
    frame = pg.frame_locator("iframe.attnkit-explorer-frame")
    frame.locator(".attnkit-explorer[data-ready]").wait_for(timeout=60_000)
    assert frame.locator(".ak-cell").count() == 16
    assert frame.locator(".ak-row-label").all_inner_texts() == ["a", "b", XSS, "d"]
    assert pg.locator("img").count() == 0 and frame.locator("img").count() == 0
    page.assert_clean()


def test_the_notebook_frame_grows_to_show_the_whole_page(page: Page) -> None:
    # 6 layers x 12 heads over 30 tokens: a page about 2,400 px tall in a 1280 px window, far
    # more than the frame's first 760 px.
    explorer = AttentionExplorer(_attention(6, 12, 30, 30), [f"w{n}" for n in range(30)])
    host = page.tmp_path / "notebook.html"
    host.write_text("<!DOCTYPE html><meta charset='utf-8'>" + explorer._repr_html_(), "utf-8")
    pg = page.page
    pg.goto(host.as_uri())
    frame = pg.frame_locator("iframe.attnkit-explorer-frame")
    frame.locator(".attnkit-explorer[data-ready]").wait_for(timeout=60_000)
    frame_height = "() => document.querySelector('iframe.attnkit-explorer-frame').clientHeight"
    pg.wait_for_function(f"({frame_height})() > 1000", timeout=20_000)
    height = pg.evaluate(frame_height)
    page_height = frame.locator("html").evaluate("html => html.scrollHeight")
    assert height > 1500 and height >= page_height, (height, page_height)
    page.assert_clean()


@pytest.mark.slow
def test_minilm_sized_input_with_300_tokens(page: Page) -> None:
    # The bundled MiniLM's shape (6 layers x 12 heads) over 300 tokens: the page loads, switches
    # heads and answers hovers (canvas heat map, 78 thumbnails, thousands of lines).
    att = _attention(6, 12, 300, 300, seed=2)
    tokens = [f"w{n}" for n in range(300)]
    pg = page.open(AttentionExplorer(att, tokens))
    assert pg.locator(".ak-thumb").count() == 78  # 6 layers x (12 heads and their mean)
    pg.select_option(".ak-layer", "5")
    pg.select_option(".ak-head", "11")
    pg.hover(".ak-col-q .ak-ltok[data-q='17']")
    assert _weights(pg) == pytest.approx(_top(att[5, 11, 17]), abs=SHOWN)
    pg.click(".ak-thumb[data-layer='3'][data-head='4']")
    canvas = pg.locator(".ak-matrix-canvas")
    canvas.scroll_into_view_if_needed()
    box = canvas.bounding_box()
    canvas.hover(position={"x": 250.5 * box["width"] / 300, "y": 40.5 * box["height"] / 300})
    assert _weight(pg) == pytest.approx(att[3, 4, 40, 250].item(), abs=SHOWN)
    page.assert_clean()


@pytest.mark.slow
def test_missing_chromium_fails_with_a_hint(tmp_path: Path) -> None:
    # Without a browser these tests must fail (not skip) and say how to get one.
    import subprocess
    import sys

    env = dict(os.environ, ATTNKIT_CHROMIUM=str(tmp_path / "no-chromium"))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "jupyter"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert "run `make test`" in done.stdout and "1 error" in done.stdout


@pytest.mark.slow
def test_attnkit_show_page_for_the_bundled_minilm(page: Page) -> None:
    # What a person does: `attnkit show TEXT`, then open the page. The text carries markup.
    from attnkit.cli import main
    from attnkit.models.bert_pretrained import load_pretrained

    text = f"The cat sat on the mat. {XSS}"
    out = page.tmp_path / "attention.html"
    assert main(["show", text, "--out", str(out), "--top", "0"]) == 0
    result = load_pretrained().encode([text], need_weights=True)
    tokens, att = result.tokens[0], result.attentions[:, 0]  # (l, h, i, j)

    pg = page.page
    pg.goto(out.as_uri())
    pg.wait_for_selector(".attnkit-explorer[data-ready]", timeout=60_000)
    assert pg.locator(".ak-row-label").all_inner_texts() == tokens
    assert pg.locator(".ak-thumb").count() == 78
    assert text in pg.inner_text(".ak-text")
    assert pg.locator("img").count() == 0
    # it opens on what the command printed: the last layer, the mean of its heads
    assert (pg.locator(".ak-layer").input_value(), pg.locator(".ak-head").input_value()) == (
        "5",
        "mean",
    )
    pg.hover(".ak-cell[data-q='2'][data-k='6']")
    assert _weight(pg) == pytest.approx(att[5, :, 2, 6].mean().item(), abs=SHOWN + 1e-5)
    for layer, head in ((0, 0), (4, 9)):
        pg.select_option(".ak-layer", str(layer))
        pg.select_option(".ak-head", str(head))
        pg.hover(".ak-cell[data-q='2'][data-k='6']")
        assert _weight(pg) == pytest.approx(att[layer, head, 2, 6].item(), abs=SHOWN + 1e-5)
    pg.select_option(".ak-layer", "2")
    pg.select_option(".ak-head", "5")
    pg.hover(".ak-col-q .ak-ltok[data-q='2']")
    ARTIFACTS.mkdir(exist_ok=True)
    pg.screenshot(path=str(ARTIFACTS / "explorer.png"), full_page=True)
    page.assert_clean()
