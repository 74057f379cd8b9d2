"""MkDocs hook: pages include measured sections of docs/benchmarks.md instead of copying them.

A line ``<!-- include:benchmarks:NAME -->`` on a page becomes the section between
``<!-- begin:NAME -->`` and ``<!-- end:NAME -->`` of docs/benchmarks.md (written by a script in
benchmarks/), so the numbers a page shows are always the last measured ones. A section that has
not been measured yet becomes a note saying so: the docs never show invented numbers.

docs/benchmarks.md holds every measured section in full (the scripts write there, and
``benchmarks/charts.py`` reads its tables back), but the site shows it on two pages:

- the benchmarks page keeps, of each section, its summary: what comes before a line
  ``<!-- more -->`` in the section, or, without one, everything up to the end of its first
  table (the whole section when only prose follows that table); the rest is replaced by a link
  to the same section on the log page;
- the log page (docs/benchmarks-log.md) shows every section in full where it has the line
  ``<!-- include:benchmarks:all -->``.

A script that rewrites its section drops a ``<!-- more -->`` line, so its summary falls back to
the first table.

The course (docs/learn/NN-*.md) is also offered as Jupyter notebooks: after the build, each
chapter becomes ``learn/NN-*.ipynb`` in the site (jupytext, from the same Markdown: one code cell
per ``python`` block), and each chapter page gets a download link to its notebook at the top.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent / "benchmarks.md"
INCLUDE = re.compile(r"^<!-- include:benchmarks:([\w-]+) -->$", flags=re.M)
SECTION = re.compile(r"<!-- begin:([\w-]+) -->\n?(.*?)<!-- end:\1 -->", flags=re.S)
MORE = re.compile(r"^<!-- more -->\n?", flags=re.M)
LOG_PAGE = "benchmarks-log.md"
ALL = "<!-- include:benchmarks:all -->"


def benchmark_section(name: str, doc: Path = BENCHMARKS) -> str | None:
    """The measured markdown of section ``name``, or None when it is not in the file."""
    text = doc.read_text(encoding="utf-8") if doc.exists() else ""
    found = re.search(
        rf"<!-- begin:{re.escape(name)} -->\n?(.*?)<!-- end:{re.escape(name)} -->", text, flags=re.S
    )
    return None if found is None else found.group(1).strip()


def include_benchmarks(markdown: str, doc: Path = BENCHMARKS) -> str:
    def replace(match: re.Match[str]) -> str:
        section = benchmark_section(match.group(1), doc)
        if section is None:
            return (
                f'!!! note "Not measured yet"\n    The `{match.group(1)}` section of the '
                "benchmarks page has not been measured in this checkout."
            )
        # Headings inside the section move down so the highest becomes level 4 and sits under
        # the page's own section headings (which are levels 2 and 3).
        levels = [len(h) for h in re.findall(r"^(#+) ", section, flags=re.M)]
        shift = max(0, 4 - min(levels)) if levels else 0
        deeper = lambda h: "#" * (len(h.group(1)) + shift) + " "  # noqa: E731
        return re.sub(r"^(#+) ", deeper, section, flags=re.M)

    return INCLUDE.sub(replace, markdown)


def _first_table_end(body: str) -> int | None:
    """The offset just past the first pipe table of ``body``, or None when it has none."""
    lines = body.splitlines(keepends=True)
    offset, in_table = 0, False
    for at, line in enumerate(lines):
        is_row = line.lstrip().startswith("|") and line.rstrip().endswith("|")
        header = (
            is_row
            and at + 1 < len(lines)
            and re.fullmatch(r"\s*\|(\s*:?-+:?\s*\|)+\s*", lines[at + 1])
        )
        if in_table and not is_row:
            return offset
        in_table = in_table or bool(header)
        offset += len(line)
    return offset if in_table else None


def _anchor(body: str) -> str:
    """The id the site gives the section's first heading (``#...``), or "" without one."""
    from markdown.extensions.toc import slugify

    heading = re.search(r"^#+ (.+)$", body, flags=re.M)
    if heading is None:
        return ""
    text = re.sub(r"[`*]", "", heading.group(1))
    return "#" + slugify(text, "-")


def summarize_benchmarks(markdown: str, log_page: str = LOG_PAGE) -> str:
    """The benchmarks page as the site shows it: each measured section cut to its summary."""

    def cut(match: re.Match[str]) -> str:
        name, body = match.group(1), match.group(2)
        more = MORE.search(body)
        end = more.start() if more else _first_table_end(body)
        rest = "" if end is None else MORE.sub("", body[end:])
        if not more and _first_table_end(rest) is None and not re.search(r"^#", rest, re.M):
            rest = ""  # only prose after the first table: the section is its own summary
        if rest.strip():
            link = f"This section's every table, command and earlier run: [the log]({log_page}"
            body = f"{body[:end].rstrip()}\n\n{link}{_anchor(body)}).\n"
        return f"<!-- begin:{name} -->\n{MORE.sub('', body)}<!-- end:{name} -->"

    return SECTION.sub(cut, markdown)


def benchmarks_log(markdown: str, doc: Path = BENCHMARKS) -> str:
    """The log page: ``<!-- include:benchmarks:all -->`` becomes every section in full."""
    text = doc.read_text(encoding="utf-8") if doc.exists() else ""
    sections = [MORE.sub("", m.group(2)).strip() for m in SECTION.finditer(text)]
    return markdown.replace(ALL, "\n\n".join(sections))


LEARN = Path(__file__).resolve().parent / "learn"
CHAPTER = re.compile(r"^learn/(\d\d-[\w-]+)\.md$")


def chapters(learn: Path = LEARN) -> list[Path]:
    """The course's chapters, in order (``NN-name.md``; not the index)."""
    return sorted(p for p in learn.glob("[0-9][0-9]-*.md"))


def chapter_notebook(path: Path) -> str:
    """The chapter at ``path`` as notebook JSON (jupytext's Markdown format, "md")."""
    try:
        import jupytext
    except ImportError as exc:
        raise ImportError(
            "the course's notebooks need jupytext: pip install 'attnkit[learn]'"
        ) from exc
    notebook = jupytext.read(path, fmt="md")
    notebook.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    return jupytext.writes(notebook, fmt="ipynb")


def download_link(markdown: str, stem: str, directory_urls: bool) -> str:
    """The chapter's page with a download link to its notebook under the first heading."""
    href = f"../{stem}.ipynb" if directory_urls else f"{stem}.ipynb"
    link = (
        f'<p class="notebook-link"><a href="{href}" download>Download this chapter as a '
        "Jupyter notebook</a></p>"
    )
    head, _, rest = markdown.partition("\n")
    return f"{head}\n\n{link}\n{rest}"


def on_post_build(config: Any, **kwargs: Any) -> None:
    site = Path(config["site_dir"]) / "learn"
    site.mkdir(parents=True, exist_ok=True)
    for path in chapters():
        (site / f"{path.stem}.ipynb").write_text(chapter_notebook(path), encoding="utf-8")


def on_page_markdown(markdown: str, page: Any = None, config: Any = None, **kwargs: Any) -> str:
    name = page.file.src_uri if page is not None else ""
    chapter = CHAPTER.match(name)
    if chapter:
        directory_urls = True if config is None else bool(config.get("use_directory_urls", True))
        return download_link(markdown, chapter.group(1), directory_urls)
    if name == "benchmarks.md":
        return summarize_benchmarks(markdown)
    if name == LOG_PAGE:
        return benchmarks_log(markdown)
    return include_benchmarks(markdown)
