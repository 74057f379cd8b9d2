"""Shared by the benchmark scripts: checks of their numeric arguments, environment, medians,
their section of docs/benchmarks.md, and the charts at the top of that page.

Each script owns one section of ``docs/benchmarks.md``, delimited by
``<!-- begin:NAME -->`` / ``<!-- end:NAME -->``; rewriting it leaves the other sections alone.
The site shows a summary of each section on the benchmarks page and all of it on the log page
(``docs/hooks.py``: what comes before a ``<!-- more -->`` line, else up to the first table's end).
Charts are PNGs in ``docs/images/benchmarks/``, drawn by ``write_chart`` from the rows a script
measured (``benchmarks/charts.py`` redraws them from the tables already recorded).
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnkit._io import atomic_write_bytes, atomic_write_text
from attnkit.commands.arguments import number

if TYPE_CHECKING:  # torch loads on first use: a script checks its arguments before that
    import torch

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
CHARTS = DOC.parent / "images" / "benchmarks"
HEADER = (
    "# Benchmarks\n\n"
    "Measured on this project's 2-core CPU machine; every table names the command that made it.\n"
)


MAX_THREADS = 1024  # threads, processes or cores one run may ask for
MAX_SECONDS = 1_000_000  # a time limit (11.6 days); far larger ones overflow the OS's timers


# argparse types: each refuses, in one line naming the value, what is not a number in range.
positive_int = number(int, 1, "a whole number of at least 1")  # a count, a size, rounds
natural_int = number(int, 0, "a whole number of at least 0")  # warm-up rounds, a seed
thread_count = number(int, 1, f"a whole number from 1 to {MAX_THREADS}", MAX_THREADS)
# a TCP port a server may listen on, the next one free for another (llama.cpp's)
port_number = number(int, 1, "a whole number from 1 to 65534", 65534)
positive_float = number(float, 1e-300, "a finite number above 0")  # a size in GB
natural_float = number(float, 0, "a finite number of at least 0")
time_limit = number(
    float, 1e-300, f"a finite number above 0 and at most {MAX_SECONDS:,}", MAX_SECONDS
)


def cpu() -> str:
    """The CPU's model name, its vector class (AVX-512, avx512_bf16, AVX2) and whether it has
    AMX (bfloat16 matrix tiles), from /proc/cpuinfo."""
    info = Path("/proc/cpuinfo")
    text = info.read_text() if info.exists() else ""
    names = [ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")]
    if not names:
        return platform.processor() or platform.machine()
    flags = set(text.split())
    if "avx512f" in flags:
        vector = "AVX-512 with avx512_bf16" if "avx512_bf16" in flags else "AVX-512"
    else:
        vector = "AVX2, no AVX-512" if "avx2" in flags else "no AVX2"
    return f"{names[0]} ({vector}, {'with AMX' if 'amx_tile' in flags else 'no AMX'})"


def environment() -> str:
    import torch

    return (
        f"CPU {cpu()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.machine()}, Python {platform.python_version()}"
    )


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``: reset the peak first with
    ``echo 5 > /proc/self/clear_refs``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def grad_step(fn: Callable[[], torch.Tensor], mode: str, tensors: Iterable[torch.Tensor]) -> None:
    """One timed step: ``fn()`` without autograd (``mode="fwd"``), or ``fn()`` and the
    backward of its float32 sum (``"fwdbwd"``), the gradients of ``tensors`` then dropped."""
    import torch

    if mode == "fwd":
        with torch.no_grad():
            fn()
        return
    fn().float().sum().backward()
    for t in tensors:
        t.grad = None


def run_worker(script: str, job: dict, timeout: float) -> dict:
    """Run ``script --worker JOB`` in a fresh interpreter on this checkout's ``src`` and return
    the JSON object its last line of output holds."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, str(Path(script).resolve()), "--worker", json.dumps(job)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {job} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _section_pattern(name: str) -> re.Pattern[str]:
    return re.compile(
        re.escape(f"<!-- begin:{name} -->") + "\n?(.*?)" + re.escape(f"<!-- end:{name} -->"),
        flags=re.S,
    )


def read_section(name: str, doc: Path = DOC) -> str | None:
    """The markdown of section ``name`` of docs/benchmarks.md, or None when it has none."""
    found = _section_pattern(name).search(doc.read_text(encoding="utf-8")) if doc.exists() else None
    return None if found is None else found.group(1)


def write_section(name: str, markdown: str, doc: Path = DOC) -> Path:
    """Replace section ``name`` of docs/benchmarks.md with ``markdown`` (atomically)."""
    begin, end = f"<!-- begin:{name} -->", f"<!-- end:{name} -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    text = doc.read_text(encoding="utf-8") if doc.exists() else HEADER
    pattern = _section_pattern(name)
    text = (
        pattern.sub(lambda _: block, text)
        if pattern.search(text)
        else f"{text.rstrip()}\n\n{block}\n"
    )
    doc.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(doc, text)


def write_chart(
    name: str,
    rows: Iterable[Mapping[str, object]],
    *,
    panels: Sequence[tuple[str, str, str]],
    title: str,
    x: str = "n",
    x_label: str = "sequence length n",
    baselines: Iterable[str] = (),
    group: Callable[[str], str] | None = None,
    log_y: bool = True,
    out_dir: Path = CHARTS,
) -> Path:
    """Draw ``out_dir/NAME.png``: one panel per ``(key, title, unit)`` in ``panels``, each a line
    per series against ``x`` on log-log axes (a linear y axis from 0 with ``log_y=False``), and
    write it atomically.

    ``rows`` are flat dicts: ``"series"`` (the line's label, in order of first appearance),
    ``x`` and the panels' keys; a value that is None (not measured, skipped) is left out of its
    line, and so is one at or below 0 on a log axis. Series named in ``baselines`` (what attnkit is
    compared with) are drawn dashed; series with the same ``group(series)`` share a colour.
    """
    import io

    import matplotlib

    matplotlib.use("Agg")  # no display: the scripts run on headless machines
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator
    from PIL import Image

    rows = list(rows)
    series = list(dict.fromkeys(str(r["series"]) for r in rows))
    if not series or not panels:
        raise ValueError(f"write_chart({name!r}): needs rows with a 'series' and panels to draw")
    baselines = set(baselines)
    groups = list(dict.fromkeys(group(line) if group else line for line in series))
    palette = plt.get_cmap("tab10" if len(groups) <= 10 else "tab20").colors
    colour = {g: palette[i % len(palette)] for i, g in enumerate(groups)}
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.0), squeeze=False)
    markers = "osD^vPXh<>"
    for ax, (key, heading, unit) in zip(axes[0], panels, strict=True):
        for index, line in enumerate(series):
            values = [(r[x], r.get(key)) for r in rows if r["series"] == line]
            points = sorted((float(a), float(v)) for a, v in values if _drawable(v, log_y))
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker=markers[index % len(markers)], markersize=4, linewidth=1.5,
                    label=line, color=colour[group(line) if group else line],
                    linestyle="--" if line in baselines else "-")  # fmt: skip
        ax.set_xscale("log", base=2)
        ticks = sorted({float(r[x]) for r in rows})  # type: ignore[arg-type]
        ax.set_xticks(ticks, [f"{t:,.0f}" for t in ticks])
        ax.minorticks_off()
        if log_y:  # ticks at 1, 2, 5 x 10^k, written as plain numbers
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,g}"))
            ax.yaxis.set_minor_locator(NullLocator())
        else:
            ax.set_ylim(bottom=0)
        ax.set_xlabel(x_label)
        ax.set_ylabel(unit)
        ax.set_title(heading, fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:  # a series missing from the first panel still gets its entry
        for handle, text in zip(*ax.get_legend_handles_labels(), strict=True):
            if text not in labels:
                handles.append(handle)
                labels.append(text)
    columns = min(len(labels), 2 * len(panels))
    fit_title(fig, title, fontsize=11)
    fig.legend(handles, labels, loc="lower center", ncols=columns, fontsize=9, frameon=False)
    rows_of_legend = -(-len(labels) // columns)
    fig.tight_layout(rect=(0, 0.03 + 0.06 * rows_of_legend, 1, 1))
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)
    # A 256-colour palette: line charts lose nothing and the files stay small.
    image = Image.open(io.BytesIO(png.getvalue())).convert("RGB").quantize(256)
    out = io.BytesIO()
    image.save(out, format="png", optimize=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    return atomic_write_bytes(out_dir / f"{name}.png", out.getvalue())


def fit_title(fig: Any, title: str, *, fontsize: float) -> Any:
    """``fig``'s title, broken at spaces into as many lines as it needs to fit the figure's width
    (one line wider than the figure is cut off at both edges of the picture)."""
    import textwrap

    text = fig.suptitle(title, fontsize=fontsize)
    renderer = fig.canvas.get_renderer()
    room = 0.96 * fig.bbox.width
    width = len(title)
    while width > 10 and text.get_window_extent(renderer).width > room:
        width -= max(1, width // 20)
        text.set_text(textwrap.fill(title, width))
    return text


def _drawable(value: object, log_y: bool) -> bool:
    return isinstance(value, int | float) and (value > 0 or not log_y)
