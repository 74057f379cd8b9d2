"""The course (docs/learn): every chapter made into a notebook (jupytext, as the site does) and
executed with nbclient in a fresh kernel, so the downloadable notebooks never rot; the site
hook's notebooks and download links."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
CHAPTERS = sorted((DOCS / "learn").glob("[0-9][0-9]-*.md"))
SRC = Path(__file__).resolve().parents[1] / "src"


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_chapter_becomes_a_notebook_with_one_code_cell_per_block() -> None:
    hooks = _hooks()
    assert [p.name for p in hooks.chapters()] == [p.name for p in CHAPTERS]
    for chapter in CHAPTERS:
        nb = json.loads(hooks.chapter_notebook(chapter))
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        assert len(code) == chapter.read_text("utf-8").count("```python"), chapter.name
        assert nb["metadata"]["kernelspec"]["name"] == "python3"


def test_chapter_pages_link_their_notebook() -> None:
    hooks = _hooks()
    page = hooks.download_link("# 2. Masks\n\ntext", "02-masks", directory_urls=True)
    assert page.startswith("# 2. Masks\n") and 'href="../02-masks.ipynb" download' in page
    assert 'href="02-masks.ipynb"' in hooks.download_link("# t\n", "02-masks", False)


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_chapter_notebook_executes(chapter: Path, tmp_path: Path, monkeypatch) -> None:
    import nbclient
    import nbformat

    nb = nbformat.reads(_hooks().chapter_notebook(chapter), as_version=4)
    # The kernel imports this checkout's attnkit and does no background work.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("ATTNKIT_BACKGROUND", "0")
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
    ]
    assert not errors
