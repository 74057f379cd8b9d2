"""``attnkit kernels {status,build,calibrate}``: the fused CPU kernel and auto's measurements.

    attnkit kernels status                 # built? measured? where from?
    attnkit kernels build                  # compile the fused kernel now (about a minute)
    attnkit kernels calibrate              # build if needed, then measure this machine for auto
    attnkit kernels calibrate --dtypes float32 --threads 1

``backend="auto"`` does the same in a background process the first time it meets a machine it
has not measured; these commands do it in the foreground, with progress on the terminal.
"""

from __future__ import annotations

import argparse

from attnkit.commands.train import THREADS

DTYPES = ("float32", "bfloat16")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "kernels",
        help="build the fused CPU kernel and measure this machine for backend='auto'",
        description=(
            "The fused CPU kernel is compiled only when asked; auto decides by measurements of "
            "this machine. These commands do both in the foreground (auto otherwise starts "
            "them in a background process, once)."
        ),
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    status = actions.add_parser(
        "status", help="whether the kernel is built and auto has measurements"
    )
    status.set_defaults(func=run_status)
    build = actions.add_parser("build", help="compile the fused kernel now (about a minute)")
    build.add_argument("--force", action="store_true", help="try again after a build that failed")
    build.set_defaults(func=run_build)
    calibrate = actions.add_parser(
        "calibrate", help="build the kernel if needed, then measure this machine for auto"
    )
    calibrate.add_argument(
        "--dtypes",
        nargs="+",
        choices=DTYPES,
        default=list(DTYPES),
        help="the dtypes to measure (float16 is priced as bfloat16, float64 as float32)",
    )
    calibrate.add_argument(
        "--threads",
        type=THREADS,
        default=None,
        help="measure with this many threads (default: torch's current number)",
    )
    calibrate.set_defaults(func=run_calibrate)


def run_status(args: argparse.Namespace) -> int:
    import torch

    from attnkit.backends import cost, rates
    from attnkit.backends.fused import jit

    reason = jit.unavailable()
    print(f"fused kernel: {'built' if reason is None else reason}")
    print(f"cache: {jit.cache_dir()}")
    threads = torch.get_num_threads()
    for row in DTYPES:
        table = rates._read(row, threads)
        where = table.source if table is not None else "not measured (priority list: "
        if table is None:
            where += ", ".join(cost.PRIORITY) + ")"
        print(f"auto, {row}, {threads} threads: {where}")
    return 0


def run_build(args: argparse.Namespace) -> int:
    from attnkit.backends.fused import jit

    try:
        jit.build(force=args.force)
    except jit.NotBuilt as error:
        raise ValueError(str(error)) from None
    print(f"fused kernel: built ({jit.cache_dir() / ('attnkit_fused_' + jit.build_key())})")
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    import torch

    from attnkit.backends import calibration
    from attnkit.backends.fused import jit

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if jit.prerequisites() is None and not jit.is_built():
        try:
            jit.build()
        except jit.NotBuilt as error:
            print(f"fused kernel: {error}; measuring the other backends")
    for row in args.dtypes:
        table = calibration.calibrate(row)
        threads = table.meta["threads"]
        print(f"auto, {row}, {threads} threads: measured in {table.meta['seconds']} s")
    return 0
