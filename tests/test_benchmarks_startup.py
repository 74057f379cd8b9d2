"""benchmarks/startup.py: its rows are medians of fresh processes, its ratios are against
`import torch`, and it writes docs/benchmarks.md only with --write."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "startup.py"
spec = importlib.util.spec_from_file_location("bench_startup", SCRIPT)
bench = importlib.util.module_from_spec(spec)
sys.modules["bench_startup"] = bench
spec.loader.exec_module(bench)


def test_the_help_candidate_is_the_console_script_or_the_cli_module() -> None:
    argv = bench.candidates()["attnkit --help"]
    assert argv[-1] == "--help"
    assert Path(argv[0]).name == "attnkit" or argv[-3:-1] == ["-m", "attnkit.cli"]


def test_report_gives_ratios_against_import_torch() -> None:
    medians = {"python -c pass": 0.01, 'python -c "import torch"': 0.8, "attnkit --help": 0.06}
    text = bench.report(medians, rounds=5)
    assert "| `attnkit --help` | 0.060 | 0.07x |" in text  # 0.06 / 0.8 = 0.075 -> 0.07x
    assert '| `python -c "import torch"` | 0.800 | 1.00x |' in text
    assert "medians of 5 interleaved rounds" in text


def test_it_measures_fresh_processes_and_writes_only_when_asked(monkeypatch, capsys) -> None:
    fast = [sys.executable, "-c", "pass"]
    names = ["python -c pass", 'python -c "import torch"', "attnkit --help"]
    monkeypatch.setattr(bench, "candidates", lambda: dict.fromkeys(names, fast))
    monkeypatch.setattr(bench, "write_section", lambda *a: pytest.fail("wrote without --write"))
    assert bench.main(["--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("| `") == 3
    written = []
    monkeypatch.setattr(bench, "write_section", lambda name, md: written.append(name) or name)
    assert bench.main(["--rounds", "1", "--write"]) == 0
    assert written == ["startup"]
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"])
