"""Every Python block on every docs page runs, in page order, sharing one namespace per page."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
HOME = DOCS / "index.md"
# docs/source/ pages only include the library's source files (snippets), nothing to run; the
# home page's snippet has a test of its own below.
PAGES = sorted(
    p
    for p in DOCS.rglob("*.md")
    if "```python" in p.read_text(encoding="utf-8") and p.parent.name != "source" and p != HOME
)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_docs_page_code_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)
    monkeypatch.chdir(tmp_path)  # pages that write files write them here
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for n, code in enumerate(blocks):
        exec(compile(code, f"{page.name} block {n}", "exec"), namespace)


def test_home_page_says_what_installs_and_runs_ten_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The home page: what attnkit is, the pip line, one snippet of about ten lines that runs
    (it checks the tiled backend against the reference and draws MiniLM's heads), one figure."""
    text = HOME.read_text(encoding="utf-8")
    (snippet,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert text.index("attnkit is a") < text.index("pip install 'attnkit[viz,bert]'")
    assert text.index("pip install 'attnkit[viz,bert]'") < text.index("```python")
    assert 8 <= len([line for line in snippet.splitlines() if line.strip()]) <= 12
    assert all(len(line) <= 80 for line in snippet.splitlines())  # fits the page's column
    figures = re.findall(r"!\[[^\]]*\]\((figures/[\w.-]+)\)", text)
    assert len(figures) == 1 and (DOCS / figures[0]).is_file()
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet, "index.md snippet", "exec"), {"__name__": "__docs__"})
    difference = float(re.search(r"reference: ([\d.e+-]+)", capsys.readouterr().out).group(1))
    assert difference < 1e-5
    assert (tmp_path / "heads.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_efficient_attention_tells_the_idea_and_points_to_the_measurements() -> None:
    """The concept page explains (online softmax, tiles, skipping, the recomputing backward,
    tuning notes); the measured tables live on the benchmarks page, which it links to."""
    text = (DOCS / "concepts" / "efficient.md").read_text("utf-8")
    assert "<!-- include:benchmarks:" not in text
    assert not re.search(r"^\|.*\|$", text, flags=re.M), "a table: move it to benchmarks.md"
    for heading in ("## Tiling", "### The backward pass", "### Tuning notes", "## Sparse"):
        assert f"\n{heading}" in text
    links = set(re.findall(r"\]\(\.\./benchmarks\.md#([\w-]+)\)", text))
    assert {"efficient-attention-on-cpu-benchmarksattentionpy", "tuning-the-tiled-backend"} <= links


def test_every_page_is_in_the_nav() -> None:
    nav = (DOCS.parent / "mkdocs.yml").read_text(encoding="utf-8")
    for page in DOCS.rglob("*.md"):
        rel = page.relative_to(DOCS).as_posix()
        assert rel in nav, f"{rel} is not in mkdocs.yml's nav"


@pytest.fixture(scope="module")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once per module with `mkdocs build --strict` (a warning fails it)."""
    import subprocess
    import sys

    site = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=DOCS.parent,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return site


@pytest.mark.slow
def test_mkdocs_build_strict(built_site: Path) -> None:
    for page in ("index.html", "api/functional/index.html", "benchmarks/index.html"):
        assert (built_site / page).is_file(), page
    # The course: every chapter is also a notebook, linked from its page.
    for chapter in sorted((DOCS / "learn").glob("[0-9][0-9]-*.md")):
        notebook = json.loads((built_site / "learn" / f"{chapter.stem}.ipynb").read_text("utf-8"))
        assert notebook["nbformat"] == 4 and notebook["cells"], chapter.name
        page = (built_site / "learn" / chapter.stem / "index.html").read_text("utf-8")
        assert f'href="../{chapter.stem}.ipynb" download' in page, chapter.name


_MEASURE = """() => {
  const column = document.querySelector('.md-content__inner').getBoundingClientRect().width;
  const codes = [...document.querySelectorAll('.md-typeset pre > code')];
  const tables = [...document.querySelectorAll('.md-typeset table')];
  return {
    height: document.documentElement.scrollHeight,
    code: codes.length,
    cut: codes.filter(c => c.scrollWidth > c.clientWidth + 1).length,
    wide: tables.filter(t => t.getBoundingClientRect().width > column + 1).length,
  };
}"""


@pytest.mark.slow
@pytest.mark.browser
def test_code_and_tables_fit_the_column_in_chromium(built_site: Path) -> None:
    """In a 1280 x 900 window, no code block hides its line ends (the "# result" comments)
    behind a scroll bar, no table is wider than the column, and the benchmarks page is a summary
    (57,000 px tall with every run log on it; about 14,000 px without)."""
    from playwright.sync_api import sync_playwright

    from test_viz_browser import ARGS, CHROMIUM

    pages = ["index.html", "migration/index.html", "pitfalls/index.html"]
    pages += [f"concepts/{p.stem}/index.html" for p in sorted((DOCS / "concepts").glob("*.md"))]
    pages += ["benchmarks/index.html", "benchmarks-log/index.html"]
    found = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        for rel in pages:
            page.goto((built_site / rel).as_uri())
            found[rel] = page.evaluate(_MEASURE)
        browser.close()
    assert sum(f["code"] for f in found.values()) > 50
    bad = {rel: f for rel, f in found.items() if f["cut"] or f["wide"]}
    assert not bad, bad
    assert found["benchmarks/index.html"]["height"] < 20_000, found["benchmarks/index.html"]


# An object's block on an API page: its kind, the heading's id, the heading, and what follows.
_OBJECT = re.compile(
    r'<div class="doc doc-object doc-(\w+)">\s*<h(\d) id="([^"]+)" class="doc doc-heading">'
    r"(.*?)</h\d>\s*(<div class=\"doc-signature[^>]*>.*?</div>)?",
    flags=re.S,
)


def _text(fragment: str) -> str:
    import html

    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", "", fragment))).strip()


def _api_objects(site: Path) -> dict[str, tuple[str, str, str]]:
    """Every documented object on the API pages: id -> (kind, name in its heading, signature)."""
    found = {}
    for page in sorted((site / "api").glob("*/index.html")):
        html_text = page.read_text("utf-8")
        blocks = len(re.findall(r'<div class="doc doc-object doc-(?!module)\w+">', html_text))
        objects = _OBJECT.findall(html_text)
        assert len(objects) == blocks, f"{page.parent.name}: an object without a heading"
        for kind, _level, ident, heading, signature in objects:
            name = re.search(r'<span class="doc doc-object-name[^"]*">(.*?)</span>', heading)
            found[ident] = (kind, _text(name.group(1)) if name else "", _text(signature))
    return found


@pytest.mark.slow
def test_api_pages_give_every_object_a_heading_and_a_signature(built_site: Path) -> None:
    objects = _api_objects(built_site)
    assert len(objects) > 150
    for ident, (kind, heading, signature) in objects.items():
        name = ident.rsplit(".", 1)[-1]
        assert heading == name, (ident, heading)
        if kind == "function":
            assert signature.startswith(f"{name}("), (ident, signature)
    kind, _, signature = objects["attnkit.functional.scaled_dot_product_attention"]
    assert kind == "function"
    assert signature.startswith("scaled_dot_product_attention( query: Tensor, key: Tensor,")
    assert "is_causal: bool = False" in signature and "backend: str = 'auto'" in signature.replace(
        '"', "'"
    )
    # Classes show their constructor's signature.
    for ident, argument in (
        ("attnkit.attention.MultiHeadAttention", "embed_dim: int"),
        ("attnkit.flex.BlockMask", "("),
        ("attnkit.models.bert.BertModel", "config: BertConfig"),
    ):
        kind, heading, signature = objects[ident]
        assert kind == "class" and signature.startswith(f"{heading}("), (ident, signature)
        assert argument in signature, (ident, signature)
    for ident in ("attnkit.functional.make_call", "attnkit.functional.attention_math"):
        assert objects[ident][2].startswith(ident.rsplit(".", 1)[-1] + "(")


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def test_pitfall_tests_exist() -> None:
    """Every `tests/x.py::name` a page cites (the pitfalls page cites many) is a real test."""
    cited = 0
    for page in _pages():
        for path, name in re.findall(r"tests/([\w/]+\.py)::(\w+)", page.read_text("utf-8")):
            source = DOCS.parent / "tests" / path
            assert source.exists(), f"{page.name} cites tests/{path}, which does not exist"
            assert re.search(rf"^\s*def {name}\(", source.read_text("utf-8"), flags=re.M), (
                f"{page.name} cites tests/{path}::{name}, which is not a test function there"
            )
            cited += 1
    pitfalls = (DOCS / "pitfalls.md").read_text("utf-8")
    assert len(re.findall(r"tests/[\w/]+\.py::\w+", pitfalls)) >= 10
    assert cited >= 10


def _docs_module(name: str):
    """``docs/NAME.py`` as a module (docs/ is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"docs_{name}", DOCS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _make_figures_module():
    return _docs_module("make_figures")


def test_every_picture_shown_is_made_by_the_script() -> None:
    script = _make_figures_module()
    made = {f"{name}.png" for name in script.FIGURES} | {f"{name}.html" for name in script.PAGES}
    shown = set()
    for page in _pages():
        shown |= set(
            re.findall(r"\((?:\.\./)?figures/([\w-]+\.(?:png|html))\)", page.read_text("utf-8"))
        )
    assert shown, "no page shows a figure"
    assert shown <= made, f"shown but not made by docs/make_figures.py: {shown - made}"
    committed = {p.name for p in (DOCS / "figures").iterdir()}
    assert committed == made, "docs/figures/ is out of date: run docs/make_figures.py"
    for path in (DOCS / "figures").iterdir():
        limit = 100_000 if path.suffix == ".png" else 500_000  # the explorer carries its script
        assert path.stat().st_size < limit, f"{path.name} is {path.stat().st_size} bytes"


@pytest.mark.slow
def test_make_figures_runs(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, str(DOCS / "make_figures.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    script = _make_figures_module()
    assert {p.stem for p in tmp_path.glob("*.png")} == set(script.FIGURES)
    assert {p.stem for p in tmp_path.glob("*.html")} == set(script.PAGES)
    for png in tmp_path.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert 2_000 < png.stat().st_size < 100_000, f"{png.name}: {png.stat().st_size} bytes"
    for html in tmp_path.glob("*.html"):
        text = html.read_text("utf-8")
        assert text.startswith("<!DOCTYPE html>") and "Attention is not explanation" in text
        assert "http://" not in text and "https://" not in text  # works offline


def test_benchmark_sections_are_included_not_invented(tmp_path: Path) -> None:
    hooks = _hooks()
    doc = tmp_path / "benchmarks.md"
    doc.write_text(
        "# Benchmarks\n\n<!-- begin:x -->\n## Table\n| a |\n|---|\n| 1.5 |\n<!-- end:x -->\n"
    )
    page = "Intro\n\n<!-- include:benchmarks:x -->\n\n<!-- include:benchmarks:missing -->\n"
    out = hooks.include_benchmarks(page, doc)
    assert "#### Table\n| a |\n|---|\n| 1.5 |" in out
    assert "`missing` section of the benchmarks page has not been measured" in out
    assert "<!-- include:" not in out


def _hooks():
    return _docs_module("hooks")


def _table_count(markdown: str) -> int:
    return len(re.findall(r"^\|(\s*:?-+:?\s*\|)+\s*$", markdown, flags=re.M))


def test_the_benchmarks_page_shows_a_summary_and_the_log_page_everything(tmp_path: Path) -> None:
    hooks = _hooks()
    table = "| a |\n|---|\n| {} |\n"
    doc = (
        "# Benchmarks\n\n![chart](images/x.png)\n\n"
        "<!-- begin:two -->\n## Two `tables` (x.py)\n\nlead\n\n"
        + table.format(1)
        + "\nafter\n\n### Earlier run\n\n"
        + table.format(2)
        + "<!-- end:two -->\n\n"
        "<!-- begin:one -->\n## One table\n\n" + table.format(3) + "\nprose only\n"
        "<!-- end:one -->\n\n"
        "<!-- begin:marked -->\n## Marked\n\nsummary\n\n<!-- more -->\n\n"
        + table.format(4)
        + "<!-- end:marked -->\n"
    )
    page = hooks.summarize_benchmarks(doc)
    assert "![chart](images/x.png)" in page and "lead" in page and "| 1 |" in page
    assert "| 2 |" not in page and "Earlier run" not in page and "after" not in page
    assert "(benchmarks-log.md#two-tables-xpy)" in page  # the id the site gives the heading
    assert "| 3 |" in page and "prose only" in page and "#one-table" not in page
    assert "summary" in page and "| 4 |" not in page and "(benchmarks-log.md#marked)" in page
    assert "<!-- more -->" not in page
    source = tmp_path / "benchmarks.md"
    source.write_text(doc)
    log = hooks.benchmarks_log("# Log\n\n<!-- include:benchmarks:all -->\n", source)
    assert all(f"| {k} |" in log for k in range(1, 5)) and "### Earlier run" in log
    assert "<!-- more -->" not in log and "<!-- include:" not in log


def test_the_benchmarks_page_keeps_one_table_per_section() -> None:
    hooks = _hooks()
    text = (DOCS / "benchmarks.md").read_text("utf-8")
    page = hooks.summarize_benchmarks(text)
    sections = hooks.SECTION.findall(text)
    assert sections
    for name, _ in sections:
        assert f"<!-- begin:{name} -->" in page  # each section is still there, cut
    shown = [_table_count(m.group(2)) for m in hooks.SECTION.finditer(page)]
    assert max(shown) <= 1, shown
    log = hooks.benchmarks_log((DOCS / "benchmarks-log.md").read_text("utf-8"))
    assert _table_count(log) == sum(_table_count(body) for _, body in sections)
    assert len(page) < len(text) / 2


def test_every_concept_page_links_to_its_source() -> None:
    for page in sorted((DOCS / "concepts").glob("*.md")):
        links = re.findall(r"\]\(\.\./source/([\w-]+)\.md\)", page.read_text("utf-8"))
        assert links, f"{page.name} links to no source page (docs/source/*.md)"
        for name in links:
            assert (DOCS / "source" / f"{name}.md").exists(), f"{page.name}: source/{name}.md"
