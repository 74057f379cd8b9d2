"""``attnkit evaluate CHECKPOINT_DIR``: re-test a saved model on its own split."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "evaluate", help="re-test a checkpoint written by `attnkit train`; prints a table"
    )
    p.add_argument("checkpoint", type=Path, help="the directory `attnkit train --out` wrote")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from attnkit.tasks.registry import evaluate_checkpoint, format_table

    if args.threads:
        torch.set_num_threads(args.threads)
    m = evaluate_checkpoint(args.checkpoint)
    header = ["checkpoint", "train acc", "val acc", "test acc", "params", "seconds"]
    row = [
        str(args.checkpoint),
        m["train_accuracy"],
        m["val_accuracy"],
        m["test_accuracy"],
        m["params"],
        m["seconds"],
    ]
    print(format_table([row], header))
    return 0
