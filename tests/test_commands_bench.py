"""`attnkit bench NAME` runs benchmarks/NAME.py from the checkout and explains bad names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from attnkit.cli import main
from attnkit.commands.bench import available, benchmarks_dir, script_args

ROOT = Path(__file__).resolve().parents[1]


def test_finds_the_checkout_benchmarks() -> None:
    assert benchmarks_dir() == ROOT / "benchmarks"
    assert "attention" in available(benchmarks_dir())
    assert "_report" not in available(benchmarks_dir())


def test_unknown_name_lists_the_available_ones(capsys) -> None:
    assert main(["bench", "no-such-bench"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'no-such-bench'" in err and "attention" in err


def test_arguments_pass_through() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "attnkit.cli", "bench", "attention", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--quick" in proc.stdout and "--sizes" in proc.stdout


def test_the_docs_are_written_only_with_write() -> None:
    folder = benchmarks_dir()
    attention, flex = folder / "attention.py", folder / "flex.py"  # --no-write / --write scripts
    assert script_args(attention, ["--quick"]) == ["--quick", "--no-write"]
    assert script_args(attention, ["--quick", "--write"]) == ["--quick"]
    assert script_args(attention, ["--no-write"]) == ["--no-write"]
    assert script_args(flex, ["--quick"]) == ["--quick"]
    assert script_args(flex, ["--write"]) == ["--write"]
