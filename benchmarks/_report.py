"""Shared by the benchmark scripts: environment, medians, their section of docs/benchmarks.md.

Each script owns one section of ``docs/benchmarks.md``, delimited by
``<!-- begin:NAME -->`` / ``<!-- end:NAME -->``; rewriting it leaves the other sections alone.
"""

from __future__ import annotations

import platform
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from attnkit._io import atomic_write_text

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
HEADER = (
    "# Benchmarks\n\n"
    "Measured on this project's 2-core CPU machine; every table names the command that made it.\n"
)


def environment() -> str:
    return (
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}, Python {platform.python_version()}"
    )


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def write_section(name: str, markdown: str, doc: Path = DOC) -> Path:
    """Replace section ``name`` of docs/benchmarks.md with ``markdown`` (atomically)."""
    begin, end = f"<!-- begin:{name} -->", f"<!-- end:{name} -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    text = doc.read_text(encoding="utf-8") if doc.exists() else HEADER
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), flags=re.S)
    text = (
        pattern.sub(lambda _: block, text)
        if pattern.search(text)
        else f"{text.rstrip()}\n\n{block}\n"
    )
    doc.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(doc, text)
