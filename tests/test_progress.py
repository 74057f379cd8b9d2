"""Progress bars (attnkit/_progress.py): drawn on stderr only when it is a terminal."""

from __future__ import annotations

import io
import sys

from attnkit._progress import progress, terminal


class FakeTerminal(io.StringIO):
    """A stderr that says it is a terminal and keeps what is written to it."""

    def isatty(self) -> bool:
        return True


def test_not_a_terminal_gives_back_the_items_and_writes_nothing(monkeypatch) -> None:
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    items = range(50)
    assert not terminal()
    assert progress(items, desc="working") is items
    assert list(progress(iter(items), total=50)) == list(items)
    assert pipe.getvalue() == ""


def test_a_terminal_shows_a_bar_and_the_same_items(monkeypatch) -> None:
    tty = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", tty)
    assert terminal()
    assert list(progress(range(50), desc="working", unit="batch")) == list(range(50))
    shown = tty.getvalue()
    assert "working:" in shown and "/50 [" in shown and "batch/s" in shown
    assert shown.endswith(" " * 20 + "\r")  # cleared when done: the program's output stays


def test_too_few_steps_or_no_tqdm_means_no_bar(monkeypatch) -> None:
    tty = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", tty)
    one = [1]
    assert progress(one) is one  # a single step: nothing to watch
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if tqdm were not installed
    items = range(50)
    assert progress(items) is items
    assert tty.getvalue() == ""
