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
