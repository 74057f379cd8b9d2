"""How long the ``attnkit`` command takes to start, against the interpreter and torch alone.

Each candidate is a fresh process, timed from start to exit (wall clock); the candidates are
interleaved round by round so that a change in the machine's load hits all of them, and each
row is the median over the rounds:

- ``python -c pass``: the interpreter alone;
- ``python -c "import torch"``: torch alone;
- ``attnkit --help``: the console script parsing its arguments (no torch: every command
  imports its work only once its input is valid);
- ``python -c "import attnkit"``: the package, which loads its names on first use;
- ``python -c "import attnkit; attnkit.MultiHeadAttention"``: the first name used loads the core
  (and with it torch and the backends).

Run: ``python benchmarks/startup.py`` (``--rounds N``; ``--write`` to update its section of
docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import cpu, environment, positive_int, write_section

from attnkit._progress import progress


def candidates() -> dict[str, list[str]]:
    py = sys.executable
    script = Path(py).with_name("attnkit")
    cli = [str(script)] if script.exists() else [py, "-m", "attnkit.cli"]
    return {
        "python -c pass": [py, "-c", "pass"],
        'python -c "import torch"': [py, "-c", "import torch"],
        "attnkit --help": [*cli, "--help"],
        'python -c "import attnkit"': [py, "-c", "import attnkit"],
        "import attnkit + first name used": [
            py,
            "-c",
            "import attnkit; attnkit.MultiHeadAttention",
        ],
    }


def measure(rounds: int) -> dict[str, float]:
    """Median wall seconds of each candidate over ``rounds`` interleaved rounds."""
    runs = candidates()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    for argv in runs.values():  # warm the file cache once; its time is not counted
        subprocess.run(argv, capture_output=True, check=True, env=env)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in progress(range(rounds), desc="rounds", unit="round"):
        for name, argv in runs.items():
            start = time.perf_counter()
            subprocess.run(argv, capture_output=True, check=True, env=env)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def report(medians: dict[str, float], rounds: int) -> str:
    base = medians['python -c "import torch"']
    lines = [
        "## Start-up of the `attnkit` command",
        "",
        "| process | wall time (s) | vs import torch |",
        "|---|---:|---:|",
    ]
    for name, seconds in medians.items():
        lines.append(f"| `{name}` | {seconds:.3f} | {seconds / base:.2f}x |")
    lines += [
        "",
        f"Fresh processes, medians of {rounds} interleaved rounds; CPU {cpu()}, "
        f"load average {os.getloadavg()[0]:.1f} at the end (a shared machine). "
        "`python benchmarks/startup.py --write`.",
        "",
        environment(),
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=positive_int, default=7, help="interleaved rounds (default 7)"
    )
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    markdown = report(measure(args.rounds), args.rounds)
    print(markdown)
    if args.write:
        print(f"wrote {write_section('startup', markdown)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
