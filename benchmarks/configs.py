"""A configuration sweep: d_model/heads/layers 64/4/2, 128/8/3, 256/16/4.

For each configuration, on Iris and on the review snippets (from-scratch model): parameter count,
test accuracy, training time, and the median inference latency per example (batch of one, eval
mode, no gradients). Latencies are measured in interleaved rounds (config A, B, C, A, B, C, ...)
so a busy machine slows every candidate alike, and are also given as a ratio to the smallest
configuration measured in the same run.

    python benchmarks/configs.py              # Iris seeds 0-2, text 3 epochs; writes the section
    python benchmarks/configs.py --quick      # smaller: 1 Iris seed, 1 text epoch on 2,000 snippets
    python benchmarks/configs.py --text-epochs 1   # all training snippets, one epoch
    attnkit bench configs                     # the same, through the CLI
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import environment, positive_int, thread_count, write_section

from attnkit._progress import progress  # a bar when stderr is a terminal

CONFIGS = [(64, 4, 2), (128, 8, 3), (256, 16, 4)]


def _latency_rounds(fns: list, rounds: int, inner: int) -> list[float]:
    """Median seconds per call of each fn, measured in interleaved rounds."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()  # warm-up
    for _ in range(rounds):
        for k, fn in enumerate(fns):
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            times[k].append((time.perf_counter() - start) / inner)
    return [statistics.median(t) for t in times]


def sweep_iris(seeds: list[int]) -> list[dict]:
    from attnkit.models.classifiers import TabularConfig, count_parameters
    from attnkit.tasks.iris import IRIS_TRAIN, build_iris, iris_datasets
    from attnkit.train.loop import FitOptions, evaluate, fit

    rows, models = [], []
    for d, h, n in progress(CONFIGS, desc="configs", unit="config"):
        accs, secs, epochs = [], [], []
        for seed in seeds:
            train, val, test = iris_datasets(seed)
            model = build_iris(TabularConfig(d_model=d, num_heads=h, num_layers=n), seed)
            recipe = replace(IRIS_TRAIN, seed=seed)
            result = fit(model, train, val, recipe, FitOptions(progress=False))
            accs.append(evaluate(model, test)[1])
            secs.append(result.seconds)
            epochs.append(result.best_epoch)
        rows.append(
            {
                "config": f"{d}/{h}/{n}",
                "params": count_parameters(model),
                "acc": statistics.mean(accs),
                "acc_min": min(accs),
                "acc_max": max(accs),
                "seconds": statistics.mean(secs),
                "epochs": statistics.mean(epochs),
            }
        )
        models.append((model.eval(), test["features"][:1]))
    with torch.no_grad():
        fns = [lambda m=m, x=x: m(x) for m, x in models]
        lat = _latency_rounds(fns, rounds=15, inner=20)
    for row, t in zip(rows, lat, strict=True):
        row.update(latency_ms=t * 1e3, latency_ratio=t / lat[0])
    return rows


def sweep_text(epochs: int, limit_train: int | None, seed: int = 0) -> list[dict]:
    from attnkit.models.classifiers import TextAttentionClassifier, TextConfig, count_parameters
    from attnkit.tasks.text import SCRATCH_TRAIN, scratch_datasets
    from attnkit.train.data import Vocab, load_rotten_tomatoes
    from attnkit.train.loop import FitOptions, evaluate, fit

    data = load_rotten_tomatoes(seed)
    data = data.limited(limit_train)
    vocab = Vocab.build(data.train_texts)
    train, val, test = scratch_datasets(data, vocab, 64)
    config = replace(SCRATCH_TRAIN, epochs=epochs, seed=seed, patience=0)
    rows, models = [], []
    for d, h, n in progress(CONFIGS, desc="configs", unit="config"):
        torch.manual_seed(seed)
        model = TextAttentionClassifier(
            TextConfig(vocab_size=len(vocab), d_model=d, num_heads=h, num_layers=n)
        )
        result = fit(model, train, val, config, FitOptions(progress=False))
        rows.append(
            {
                "config": f"{d}/{h}/{n}",
                "params": count_parameters(model),
                "acc": evaluate(model, test)[1],
                "seconds": result.seconds,
                "epochs": result.best_epoch,
            }
        )
        one = {k: v[:1] for k, v in test.items() if k != "labels"}
        length = int(one["attention_mask"].sum())
        one = {k: v[:, :length] for k, v in one.items()}
        models.append((model.eval(), one))
    with torch.no_grad():
        fns = [lambda m=m, x=x: m(**x) for m, x in models]
        lat = _latency_rounds(fns, rounds=15, inner=10)
    for row, t in zip(rows, lat, strict=True):
        row.update(latency_ms=t * 1e3, latency_ratio=t / lat[0])
    return rows


def _table(rows: list[dict], iris: bool) -> str:
    head = (
        "| d_model/heads/layers | params | test accuracy | train s | best epoch "
        "| latency/example (ms) | vs 64/4/2 |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        acc = f"{r['acc']:.3f}" + (f" ({r['acc_min']:.3f}-{r['acc_max']:.3f})" if iris else "")
        lines.append(
            f"| {r['config']} | {r['params']:,} | {acc} | {r['seconds']:.1f} | {r['epochs']:.0f} | "
            f"{r['latency_ms']:.3f} | {r['latency_ratio']:.2f}x |"
        )
    return "\n".join(lines)


def _reading(name: str, rows: list[dict]) -> str:
    """A sentence computed from the numbers, not written in advance."""
    small, large = rows[0], rows[-1]
    return (
        f"{name}: {large['config']} has {large['params'] / small['params']:.0f}x the parameters "
        f"of {small['config']}, {large['latency_ratio']:.1f}x its latency and "
        f"{large['seconds'] / max(small['seconds'], 1e-9):.1f}x its training time, for a test "
        f"accuracy change of {100 * (large['acc'] - small['acc']):+.1f} points."
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller, faster sweep")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--threads", type=thread_count, default=2, help="1 on a busy machine")
    parser.add_argument(
        "--text-epochs",
        type=positive_int,
        default=None,
        help="text epochs (default 3; 1 with --quick)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    seeds = [0] if args.quick else [0, 1, 2]
    text_epochs, limit = (1, 2000) if args.quick else (3, None)
    text_epochs = args.text_epochs or text_epochs
    started = time.perf_counter()
    iris = sweep_iris(seeds)
    text = sweep_text(text_epochs, limit)
    took = time.perf_counter() - started
    cmd = "python benchmarks/configs.py" + (" --quick" if args.quick else "")
    cmd += f" --threads {args.threads}" if args.threads != 2 else ""
    cmd += f" --text-epochs {args.text_epochs}" if args.text_epochs else ""
    md = (
        "## Configuration sweep (Iris and review snippets)\n\n"
        f"`{cmd}` ({environment()}; {took / 60:.1f} min in all). Latency: median per example, "
        "batch of one, eval mode, candidates interleaved; the ratio is to 64/4/2 in the same "
        "run.\n\n"
        f"**Iris** (seeds {', '.join(map(str, seeds))}: mean test accuracy with min-max; "
        "30 test flowers per seed; training with early stopping):\n\n"
        f"{_table(iris, True)}\n\n"
        f"**Review snippets**, from-scratch model, seed 0, {text_epochs} epoch(s)"
        f"{' on all training snippets' if limit is None else f' on {limit} training snippets'}, "
        f"{len(load_test_size())} test snippets:\n\n"
        f"{_table(text, False)}\n\n"
        f"{_reading('Iris', iris)} {_reading('Reviews', text)}\n"
    )
    print(md)
    if not args.no_write:
        write_section("configs", md)
    return 0


def load_test_size() -> list[str]:
    from attnkit.train.data import load_rotten_tomatoes

    return load_rotten_tomatoes(0).test_texts


if __name__ == "__main__":
    sys.exit(main())
