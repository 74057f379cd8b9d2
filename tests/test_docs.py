"""Every Python block on every docs page runs, in page order, sharing one namespace per page."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
# docs/source/ pages only include the library's source files (snippets), nothing to run.
PAGES = sorted(
    p
    for p in DOCS.rglob("*.md")
    if "```python" in p.read_text(encoding="utf-8") and p.parent.name != "source"
)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_docs_page_code_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)
    monkeypatch.chdir(tmp_path)  # pages that write files write them here
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for n, code in enumerate(blocks):
        exec(compile(code, f"{page.name} block {n}", "exec"), namespace)


def test_every_page_is_in_the_nav() -> None:
    nav = (DOCS.parent / "mkdocs.yml").read_text(encoding="utf-8")
    for page in DOCS.rglob("*.md"):
        rel = page.relative_to(DOCS).as_posix()
        assert rel in nav, f"{rel} is not in mkdocs.yml's nav"


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    import subprocess
    import sys

    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=DOCS.parent,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


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


def _make_figures_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_figures", DOCS / "make_figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    doc = tmp_path / "benchmarks.md"
    doc.write_text(
        "# Benchmarks\n\n<!-- begin:x -->\n## Table\n| a |\n|---|\n| 1.5 |\n<!-- end:x -->\n"
    )
    page = "Intro\n\n<!-- include:benchmarks:x -->\n\n<!-- include:benchmarks:missing -->\n"
    out = hooks.include_benchmarks(page, doc)
    assert "#### Table\n| a |\n|---|\n| 1.5 |" in out
    assert "`missing` section of the benchmarks page has not been measured" in out
    assert "<!-- include:" not in out


def test_every_concept_page_links_to_its_source() -> None:
    for page in sorted((DOCS / "concepts").glob("*.md")):
        links = re.findall(r"\]\(\.\./source/([\w-]+)\.md\)", page.read_text("utf-8"))
        assert links, f"{page.name} links to no source page (docs/source/*.md)"
        for name in links:
            assert (DOCS / "source" / f"{name}.md").exists(), f"{page.name}: source/{name}.md"
