"""The CLI itself (cli.py): no command is a usage error, user errors are one line and exit 2, the
entry point runs in a fresh process. Each subcommand is tested in tests/test_commands_<name>.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from attnkit import cli


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2


def test_user_errors_become_one_line_and_exit_2(capsys, monkeypatch) -> None:
    from attnkit.commands import demo

    def broken(args):
        raise ValueError("query of shape (2, 3) is not what was expected")

    monkeypatch.setattr(demo, "run", broken)
    assert cli.main(["demo"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "attnkit demo: error: query of shape (2, 3) is not what was expected"


def test_console_entry_point_runs_in_a_fresh_process() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "attnkit.cli", "demo"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "worked example" in proc.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "attnkit.cli", "nonsense"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
