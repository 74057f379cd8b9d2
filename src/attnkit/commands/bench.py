"""``attnkit bench NAME [ARGS...]``: run ``benchmarks/NAME.py`` from the source checkout.

The benchmark scripts live next to ``src/`` in a checkout, not in the installed package, so
this command finds them relative to the package (``<checkout>/benchmarks``) and passes every
remaining argument through: ``attnkit bench attention --quick``. A benchmark writes its section
of the tracked ``docs/benchmarks.md`` only when asked, with ``--write``: for the scripts that
write unless told ``--no-write``, this command adds ``--no-write`` when ``--write`` is absent.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def benchmarks_dir() -> Path:
    # <checkout>/src/attnkit/commands/bench.py -> <checkout>/benchmarks
    return Path(__file__).resolve().parents[3] / "benchmarks"


def available(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="run a benchmark script from the source checkout (benchmarks/NAME.py)",
        description="Run benchmarks/NAME.py from the source checkout; extra args pass through.",
    )
    parser.add_argument("name", help="benchmark name, e.g. 'attention'")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import subprocess
    import sys

    folder = benchmarks_dir()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"no benchmarks folder at {folder}: `attnkit bench` runs from a source checkout "
            "(git clone, then pip install -e .)"
        )
    names = available(folder)
    if args.name not in names:
        raise ValueError(
            f"unknown benchmark {args.name!r}; available: {', '.join(names) or '(none)'}"
        )
    script = folder / f"{args.name}.py"
    return subprocess.call([sys.executable, str(script), *script_args(script, args.args)])


def script_args(script: Path, given: list[str]) -> list[str]:
    """The arguments for ``script``: it writes the docs only if ``--write`` is among them."""
    if '"--no-write"' not in script.read_text(encoding="utf-8"):
        return list(given)  # the script writes only with --write already (or never)
    if "--write" in given:
        return [a for a in given if a != "--write"]
    return [*given, "--no-write"] if "--no-write" not in given else list(given)
