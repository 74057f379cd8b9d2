"""Progress bars for long loops: a tqdm bar on stderr when stderr is a terminal, nothing else.

A bar is for a person watching. In a pipe, a log file, a notebook or a test, stderr is not a
terminal and ``progress`` hands back the iterable unchanged, so nothing is written; the same
happens when tqdm (in the ``bert``, ``llm`` and ``train`` extras) is not installed: a missing
bar never stops the work.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

__all__ = ["progress", "terminal"]

T = TypeVar("T")


def terminal() -> bool:
    """Whether stderr is a terminal (where a bar can redraw itself in place)."""
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def progress(
    items: Iterable[T],
    *,
    total: int | None = None,
    desc: str | None = None,
    unit: str = "it",
    min_total: int = 2,
) -> Iterable[T]:
    """``items`` with a progress bar when stderr is a terminal and there are at least
    ``min_total`` steps (``total``, or ``len(items)``); otherwise ``items`` itself.

    The bar disappears when the loop ends (``leave=False``): what stays on the screen is the
    program's own output.
    """
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    if (total is not None and total < min_total) or not terminal():
        return items
    try:
        from tqdm import tqdm  # lazy: only a terminal shows a bar
    except ImportError:
        return items
    return _closing(tqdm(items, total=total, desc=desc, unit=unit, leave=False, file=sys.stderr))


def _closing(bar: Any) -> Iterator[Any]:
    """Iterate the tqdm ``bar``; close it even when the loop stops early (``break``, an error)."""
    try:
        yield from bar
    finally:
        bar.close()
