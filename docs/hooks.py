"""MkDocs hook: pages include measured sections of docs/benchmarks.md instead of copying them.

A line ``<!-- include:benchmarks:NAME -->`` on a page becomes the section between
``<!-- begin:NAME -->`` and ``<!-- end:NAME -->`` of docs/benchmarks.md (written by a script in
benchmarks/), so the numbers a page shows are always the last measured ones. A section that has
not been measured yet becomes a note saying so: the docs never show invented numbers.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent / "benchmarks.md"
INCLUDE = re.compile(r"^<!-- include:benchmarks:([\w-]+) -->$", flags=re.M)


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


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return include_benchmarks(markdown)
