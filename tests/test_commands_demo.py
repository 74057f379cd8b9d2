"""`attnkit demo`: the worked example agrees with the values worked out by hand, and the explorer
step writes its page (with the fake BERT of tests/fake_bert.py, then with the bundled MiniLM)."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnkit import cli
from attnkit.cli import main
from attnkit.commands import demo
from fake_bert import FakeBert
from fake_bert import fake as fake


def test_demo_prints_the_worked_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "by hand [0.140, 0.284, 0.576]   attnkit [0.140, 0.284, 0.576]" in out
    assert "by hand [0.355, 0.617]   attnkit [0.355, 0.617]" in out
    assert "NO" not in out.split("agree to 3 decimals:")[1]


def test_demo_step_writes_the_explorer(
    fake: FakeBert, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = demo.step_explorer(tmp_path / "demo")
    assert path == tmp_path / "demo" / "attention.html"
    page = path.read_text(encoding="utf-8")
    assert demo.EXPLORER_SENTENCE in page and "Attention is not explanation" in page
    assert fake.texts == [demo.EXPLORER_SENTENCE]
    out = capsys.readouterr().out
    assert str(path) in out and "Strongest links" in out


@pytest.mark.slow
def test_demo_runs_the_explorer_step_for_real(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["demo", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "attention.html") in out
    assert "cat" in (tmp_path / "attention.html").read_text(encoding="utf-8")
