"""Checked numbers for command lines: an argparse ``type`` that refuses, in one line naming the
value, what is not a number in range (the commands' options and the benchmark scripts')."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def number(kind: type, least: float, words: str, most: float = math.inf) -> Callable[[str], float]:
    """An argparse ``type``: ``kind(text)`` from ``least`` to ``most``, else "'text' is not
    {words}". A float must also be finite (every number here is a finite setting)."""

    def parse(text: str) -> float:
        try:
            if isinstance(text, bool):  # a default given as a bool is no number
                raise ValueError
            value = kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r} is not {words}") from None
        if not least <= value <= most or (kind is float and not math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{text!r} is not {words}")
        return value

    parse.__name__ = words  # argparse names the type in its messages
    return parse
