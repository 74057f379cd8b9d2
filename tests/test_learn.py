"""attnkit.learn.check: the solutions in docs/learn/solutions.py pass every topic; wrong answers
are told what differs, in words; a wrong signature is named plainly; every chapter's exercises
name real topics, two to four per chapter."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

from attnkit.learn import TOPICS, CheckResult, check

LEARN = Path(__file__).resolve().parents[1] / "docs" / "learn"
# topic -> the solution's function name, where they differ
NAMES = {
    "masks": "causal_mask",
    "window": "window_mask",
    "alibi": "alibi_slopes",
    "padding": "padding_mask",
}


@pytest.fixture(scope="module")
def solutions():
    spec = importlib.util.spec_from_file_location("learn_solutions", LEARN / "solutions.py")
    module = importlib.util.module_from_spec(spec)
    sys.dont_write_bytecode, before = True, sys.dont_write_bytecode
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = before
    return module


@pytest.mark.parametrize("topic", list(TOPICS))
def test_the_solution_passes(solutions, topic: str, capsys) -> None:
    result = check(topic, getattr(solutions, NAMES.get(topic, topic)))
    assert isinstance(result, CheckResult) and result.passed, result.message
    assert "agree with attnkit" in capsys.readouterr().out


def test_a_wrong_signature_is_named_with_the_expected_one() -> None:
    result = check("masks", lambda i: i, quiet=True)
    assert not result
    assert "<lambda>(i)" in result.message and "2 arguments" in result.message
    assert "causal_mask(i, j)" in result.message


def test_what_differs_is_said_in_words() -> None:
    top_left = check("masks", lambda i, j: torch.ones(i, j, dtype=torch.bool).tril(), quiet=True)
    assert "entries differ; the first at (0, 1): yours is False, expected True" in top_left.message
    naive = check("softmax", lambda x: x.exp() / x.exp().sum(-1, keepdim=True), quiet=True)
    assert "NaN or infinity" in naive.message
    unscaled = check("scores", lambda q, k: q @ k.transpose(-2, -1), quiet=True)
    assert "values differ by up to" in unscaled.message
    shape = check("merge_heads", lambda x: x, quiet=True)
    assert "shape (1, 2, 3, 4), expected (1, 3, 8)" in shape.message
    empty = check("attention", lambda q, k, v: None, quiet=True)
    assert "returned None" in empty.message
    ints = check("masks", lambda i, j: torch.ones(i, j).tril(j - i), quiet=True)
    assert "dtype torch.float32, expected torch.bool" in ints.message


def test_an_error_inside_the_function_is_reported_not_raised() -> None:
    result = check("patches", lambda images, patch: images.reshape(-1, 7), quiet=True)
    assert not result and "raised RuntimeError" in result.message


def test_unknown_topics_and_non_functions_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown topic 'mask'; the exercises are: scores"):
        check("mask", lambda i, j: None)
    with pytest.raises(TypeError, match="fn must be a function, got int"):
        check("masks", 3)


CHAPTERS = sorted(LEARN.glob("[0-9][0-9]-*.md"))


def test_ten_to_twelve_chapters_each_with_two_to_four_checked_exercises() -> None:
    assert 10 <= len(CHAPTERS) <= 12
    for chapter in CHAPTERS:
        topics = re.findall(r'^check\("(\w+)"', chapter.read_text("utf-8"), flags=re.M)
        assert 2 <= len(topics) <= 4, chapter.name
        assert set(topics) <= set(TOPICS), chapter.name
