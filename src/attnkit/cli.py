"""The ``attnkit`` command line: a thin shell over the library.

Each subcommand lives in ``attnkit/commands/<name>.py`` and exposes ``register(subparsers)``,
which adds its parser and sets ``func`` to a function ``(args) -> int``. Heavy imports happen
inside those functions, so ``attnkit --help`` stays fast.

Errors the user can fix (bad arguments, missing files, bad shapes) are ``ValueError``,
``TypeError``, ``FileNotFoundError`` or ``PermissionError``: they print one line on stderr and
exit with code 2, never a traceback. So is a missing optional package (``ImportError``): the
line names the extra that installs it (``pip install 'attnkit[bert]'``, see
``attnkit.commands.extras``), and each command checks its packages before doing any work.
A warning (a text cut to the model's length, ...) is one line too, ``attnkit CMD: warning:
...``, without the file and source line that Python's warnings show.

When the reader of stdout goes away (``attnkit generate ... | head -c 1``), the command stops
quietly with exit code 141, as a Unix tool killed by SIGPIPE does (128 + 13): no traceback, and
no "Exception ignored" message from the interpreter's last flush.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

# One line per subcommand module; order is the order of `attnkit --help`.
COMMAND_MODULES = [
    "attnkit.commands.demo",
    "attnkit.commands.show",
    "attnkit.commands.train",
    "attnkit.commands.evaluate",
    "attnkit.commands.generate",
    "attnkit.commands.serve",
    "attnkit.commands.bench",
    "attnkit.commands.kernels",
]

USER_ERRORS = (
    ValueError,
    TypeError,
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    OSError,  # the file system's answer (a name too long, no space left): the user's to fix
)


def _version() -> str:
    """The installed distribution's version (pyproject.toml's ``version``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("attnkit")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (``attnkit train: error: ...``) and exit
    code 2, like every other user error; ``--help`` still shows the usage. Subcommand parsers
    are made of the same class (``add_subparsers`` uses the parent's)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="attnkit", description="Attention mechanisms you can read, run and look at."
    )
    parser.add_argument("--version", action="version", version=f"attnkit {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


CLOSED_PIPE = 128 + 13  # the exit status of a process killed by SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        return code
    except BrokenPipeError:
        # Later writes (the interpreter flushes stdout on exit) go nowhere instead of failing.
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return CLOSED_PIPE


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit:  # --help and --version have printed: flush while a closed pipe is caught
        sys.stdout.flush()
        raise
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return 2
    from attnkit.commands import extras

    try:
        with warnings.catch_warnings():  # puts the warnings' settings back afterwards
            warnings.showwarning = _one_line_warning(args.command)
            extras.require(args)  # before any work: a missing package leaves no files behind
            return int(args.func(args) or 0)
    except BrokenPipeError:  # a reader that went away: the entry point ends quietly
        raise
    except USER_ERRORS as exc:
        print(f"attnkit {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        line = extras.install_line(exc, extras.prefer(args.command))
        if line is None:  # attnkit's own module: a bug, keep its traceback
            raise
        print(f"attnkit {args.command}: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"attnkit {args.command}: interrupted", file=sys.stderr)
        return 130


def _one_line_warning(command: str) -> Any:
    def show(message: Warning | str, *args: Any, **kwargs: Any) -> None:
        text = " ".join(str(message).split())  # a message of several lines becomes one
        print(f"attnkit {command}: warning: {text}", file=sys.stderr)

    return show


if __name__ == "__main__":
    sys.exit(main())
