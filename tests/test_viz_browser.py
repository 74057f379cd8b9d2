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
    assert pg.locator(".ak-thumb").count() == 12
    assert "Attention is not explanation" in pg.inner_text(".ak-caveat")
    # the XSS text is shown as text and never became an element
    assert pg.locator("img").count() == 0 and pg.locator("b").count() == 0
    assert pg.inner_text("h1") == f"Explorer {XSS}"
    assert XSS in pg.inner_text(".ak-text")
    assert pg.locator(".ak-row-label").nth(3).inner_text() == XSS

    # layer 0, head 0 first; annotated cells show the weights to two decimals
    expected = att[0, 0].flatten().tolist()
    assert _cells(pg) == pytest.approx(expected, abs=0.005 + 1e-9)

    # hovering a cell shows its exact (float32) weight
    pg.hover(".ak-cell[data-q='2'][data-k='3']")
    assert _weight(pg) == pytest.approx(att[0, 0, 2, 3].item(), rel=1e-6, abs=1e-12)
    assert XSS in pg.inner_text(".ak-readout")

    # switching layer and head changes the weights to the right values, hover readout included
    pg.select_option(".ak-layer", "2")
    pg.select_option(".ak-head", "3")
    assert _cells(pg) == pytest.approx(att[2, 3].flatten().tolist(), abs=0.005 + 1e-9)
    assert _weight(pg) == pytest.approx(att[2, 3, 2, 3].item(), rel=1e-6, abs=1e-12)
    pg.hover(".ak-cell[data-q='6'][data-k='0']")
    assert _weight(pg) == pytest.approx(att[2, 3, 6, 0].item(), rel=1e-6, abs=1e-12)

    # a thumbnail click selects its head
    pg.click(".ak-thumb[data-layer='1'][data-head='2']")
    assert pg.locator(".ak-head").input_value() == "2"
    assert _cells(pg) == pytest.approx(att[1, 2].flatten().tolist(), abs=0.005 + 1e-9)

    # the lines view: hovering a query token lists where it looks most, strongest first
    pg.hover(".ak-col-q .ak-ltok[data-q='1']")
    row = att[1, 2, 1]
    weights = [float(t) for t in pg.locator(".ak-readout .ak-weight").all_inner_texts()]
    assert weights == pytest.approx(sorted(row.tolist(), reverse=True)[:3], rel=1e-6)

    # rollout view: the map is attention rollout through the chosen layer
    pg.select_option(".ak-view", "rollout")
    rolled = attention_rollout(att.double(), all_layers=True)
    assert _cells(pg) == pytest.approx(rolled[1].flatten().tolist(), abs=0.005 + 1e-9)
    pg.select_option(".ak-layer", "2")
    assert _cells(pg) == pytest.approx(rolled[2].flatten().tolist(), abs=0.005 + 1e-9)
    page.assert_clean()

    pg.select_option(".ak-view", "heads")
    pg.select_option(".ak-layer", "0")
    pg.select_option(".ak-head", "1")
    pg.hover(".ak-cell[data-q='2'][data-k='1']")
    ARTIFACTS.mkdir(exist_ok=True)
    pg.screenshot(path=str(ARTIFACTS / "explorer-synthetic.png"), full_page=True)
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
    assert _weight(pg) == pytest.approx(att[1, 2, q, k].item(), rel=1e-6, abs=1e-12)
    assert "cross-attention" in pg.inner_text(".ak-summary")
    assert pg.locator(".ak-view").is_disabled()  # no rollout for cross-attention
    pg.select_option(".ak-head", "0")
    assert _weight(pg) == pytest.approx(att[1, 0, q, k].item(), rel=1e-6, abs=1e-12)
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


@pytest.mark.slow
def test_minilm_sized_input_with_300_tokens(page: Page) -> None:
    # The bundled MiniLM's shape (6 layers x 12 heads) over 300 tokens: the page loads, switches
    # heads and answers hovers (canvas heat map, 72 thumbnails, thousands of lines).
    att = _attention(6, 12, 300, 300, seed=2)
    tokens = [f"w{n}" for n in range(300)]
    pg = page.open(AttentionExplorer(att, tokens))
    assert pg.locator(".ak-thumb").count() == 72
    pg.select_option(".ak-layer", "5")
    pg.select_option(".ak-head", "11")
    pg.hover(".ak-col-q .ak-ltok[data-q='17']")
    weights = [float(t) for t in pg.locator(".ak-readout .ak-weight").all_inner_texts()]
    assert weights == pytest.approx(sorted(att[5, 11, 17].tolist(), reverse=True)[:3], rel=1e-6)
    pg.click(".ak-thumb[data-layer='3'][data-head='4']")
    canvas = pg.locator(".ak-matrix-canvas")
    canvas.scroll_into_view_if_needed()
    box = canvas.bounding_box()
    canvas.hover(position={"x": 250.5 * box["width"] / 300, "y": 40.5 * box["height"] / 300})
    assert _weight(pg) == pytest.approx(att[3, 4, 40, 250].item(), rel=1e-6, abs=1e-12)
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
    assert pg.locator(".ak-thumb").count() == 72
    assert text in pg.inner_text(".ak-text")
    assert pg.locator("img").count() == 0
    for layer, head in ((0, 0), (4, 9)):
        pg.select_option(".ak-layer", str(layer))
        pg.select_option(".ak-head", str(head))
        pg.hover(".ak-cell[data-q='2'][data-k='6']")
        assert _weight(pg) == pytest.approx(att[layer, head, 2, 6].item(), rel=1e-5, abs=1e-7)
    pg.select_option(".ak-layer", "2")
    pg.select_option(".ak-head", "5")
    pg.hover(".ak-col-q .ak-ltok[data-q='2']")
    ARTIFACTS.mkdir(exist_ok=True)
    pg.screenshot(path=str(ARTIFACTS / "explorer.png"), full_page=True)
    page.assert_clean()
