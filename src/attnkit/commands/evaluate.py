"""``attnkit evaluate CHECKPOINT_DIR``: re-test a saved model on its own split.

Prints a table on stdout; ``--out FILE.json`` also writes the metrics there. The checkpoint
directory is only read (it may be read-only, or another user's run).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from attnkit.commands.train import THREADS


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "evaluate", help="re-test a checkpoint written by `attnkit train`; prints a table"
    )
    p.add_argument("checkpoint", type=Path, help="the directory `attnkit train --out` wrote")
    p.add_argument("--out", type=Path, default=None, help="also write the metrics to this .json")
    p.add_argument("--threads", type=THREADS, default=None, help="torch threads")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from attnkit._io import check_writable
    from attnkit.tasks.registry import evaluate_checkpoint, format_table
    from attnkit.train.checkpoint import save_json

    if args.out is not None:
        if args.out.suffix.lower() != ".json":
            raise ValueError(f"--out writes the metrics as JSON: give a .json file, got {args.out}")
        check_writable(args.out)  # fail before the heavy work
    if args.threads:
        torch.set_num_threads(args.threads)
    m = evaluate_checkpoint(args.checkpoint, write=False)
    if "test_accuracy" in m:
        names = {
            "train_accuracy": "train acc",
            "val_accuracy": "val acc",
            "test_accuracy": "test acc",
        }
    elif "exact_match" in m:  # translate
        names = {"val_token_accuracy": "val token acc", "exact_match": "exact match (test)"}
    else:  # forecast: mean absolute error in ppm on the held-out years
        names = {"val_mae": "val MAE", "mae": "test MAE", "mae_week_52": "test MAE week 52"}
    header = ["checkpoint", *names.values(), "params", "seconds"]
    row = [str(args.checkpoint), *(m[k] for k in names), m["params"], m["seconds"]]
    print(format_table([row], header))
    if args.out is not None:
        print(f"wrote {save_json(args.out, m)}")
    return 0
