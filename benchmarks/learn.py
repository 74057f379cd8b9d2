"""The course's three worked examples against their targets: ``attnkit train vit``,
``translate`` and ``forecast``, seeds 0-2, each beside the baseline it prints.

Each run is the command a learner types (default recipe, one process per run, ``--threads``
torch threads), into a fresh directory; the figures are read back from the ``metrics.json`` it
writes. The targets (issue "Learn attention by building it"):

    vit        mean test accuracy of seeds 0-2 >= 97 % and above the logistic regression
    translate  exact matches on 1,000 unseen dates >= 99 %
    forecast   MAE at the 52-week horizon below seasonal-naive and linear-trend + seasonal

    python benchmarks/learn.py                      # all three, seeds 0-2; docs/benchmarks.md
    python benchmarks/learn.py --tasks vit --seeds 0 --no-write
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import environment, natural_int, thread_count, write_section

TASKS = ["vit", "translate", "forecast"]
METRIC = {"vit": "test_accuracy", "translate": "exact_match", "forecast": "mae"}
TARGET = {
    "vit": "mean test accuracy >= 97 % and above the logistic regression",
    "translate": "exact match >= 99 % on 1,000 unseen dates",
    "forecast": "MAE below both baselines",
}


def run(task: str, seed: int, threads: int, out: Path) -> dict:
    """One training run as a learner starts it; its metrics.json and the wall time."""
    command = [sys.executable, "-m", "attnkit.cli", "train", task, "--seed", str(seed)]
    command += ["--threads", str(threads), "--quiet", "--out", str(out)]
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=sys.stderr)  # its own table: the log, not ours
    metrics = json.loads((out / "metrics.json").read_text())
    return {"task": task, "seed": seed, "wall": time.perf_counter() - start, "metrics": metrics}


def baselines(task: str, metrics: dict) -> dict[str, float]:
    """The baselines' figures on the model's own metric, by name."""
    base = metrics.get("baseline") or {}
    key = METRIC[task]
    if key in base:  # one baseline (vit, translate)
        return {base.get("model", "baseline"): float(base[key])}
    return {  # several (forecast): {name: {"mae": ...}} or {name: value}
        name: float(value[key] if isinstance(value, dict) else value)
        for name, value in base.items()
        if isinstance(value, int | float) or (isinstance(value, dict) and key in value)
    }


def verdict(task: str, rows: list[dict]) -> str:
    values = [r["metrics"][METRIC[task]] for r in rows]
    mean = statistics.mean(values)
    base = [baselines(task, r["metrics"]) for r in rows]
    names = sorted({name for b in base for name in b})
    base_mean = {name: statistics.mean(b[name] for b in base if name in b) for name in names}
    if task == "vit":
        met = mean >= 0.97 and all(mean > v for v in base_mean.values())
    elif task == "translate":
        met = min(values) >= 0.99
    else:
        met = all(v < min(b.values()) for v, b in zip(values, base, strict=True))
    shown = ", ".join(f"{name} {value:.4g}" for name, value in base_mean.items())
    return (
        f"{task}: {METRIC[task]} mean {mean:.4g} (seeds {min(values):.4g}-{max(values):.4g}); "
        f"baseline mean {shown}; target ({TARGET[task]}): {'met' if met else 'MISSED'}"
    )


def render(rows: list[dict], command: str, threads: int, elapsed: float) -> str:
    lines = [
        "## The course's worked examples (`benchmarks/learn.py`)",
        "",
        f"Command: `{command}` ({elapsed / 60:.1f} min). {environment()}; each run is "
        f"`attnkit train TASK --seed N --threads {threads}` with the default recipe, in its own "
        "process; the figures are read from the `metrics.json` it writes, and the baselines are "
        "the ones each run trains or computes on the same split.",
        "",
    ]
    for task in TASKS:
        mine = [r for r in rows if r["task"] == task]
        if mine:
            lines.append(f"- {verdict(task, mine)}")
    lines += [
        "",
        "| task | seed | metric | model | baselines | wall s |",
        "|---|---:|---|---:|---|---:|",
    ]
    for r in rows:
        base = ", ".join(f"{k} {v:.4g}" for k, v in baselines(r["task"], r["metrics"]).items())
        lines.append(
            f"| {r['task']} | {r['seed']} | {METRIC[r['task']]} | "
            f"{r['metrics'][METRIC[r['task']]]:.4g} | {base} | {r['wall']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=TASKS, choices=TASKS)
    parser.add_argument("--seeds", type=natural_int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=thread_count, default=1, help="torch threads per run (1)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = " ".join(
        ["python benchmarks/learn.py", *(argv if argv is not None else sys.argv[1:])]
    )
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for task in args.tasks:
            for seed in args.seeds:
                rows.append(run(task, seed, args.threads, Path(tmp) / f"{task}-{seed}"))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "metrics"}),
                      file=sys.stderr, flush=True)  # fmt: skip
    md = render(rows, command.strip(), args.threads, time.perf_counter() - started)
    print(md)
    if not args.no_write:
        print(f"wrote {write_section('learn', md)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
