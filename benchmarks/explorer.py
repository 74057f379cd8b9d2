"""How the HTML attention explorer scales: file size, writing it, opening it, switching heads.

Workload: MiniLM's shape (6 layers x 12 heads) of random softmax attention over 64, 300 and 512
tokens. For each size: the page's size, the median time to build and write it in Python, the
median time from navigation until the page is drawn in headless Debian Chromium (file://, no
network), and the median time of one head switch measured inside the page (performance.now()
around the change event: heat map, lines, legend). The 64-token page is the baseline of the ratio
column. Sizes are interleaved across repeats.

Run: ``PYTHONPATH=src python benchmarks/explorer.py`` (``--repeats N``, ``--no-write``).
Needs /usr/bin/chromium (``make system-deps``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import environment, write_section

from attnkit.viz import AttentionExplorer

ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
]
SIZES = (64, 300, 512)
SWITCH = """h => { const s = document.querySelector('.ak-head'); s.value = String(h);
  const t = performance.now(); s.dispatchEvent(new Event('change'));
  return performance.now() - t; }"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    gen = torch.Generator().manual_seed(0)
    explorers = {
        n: AttentionExplorer(
            torch.softmax(2 * torch.randn(6, 12, n, n, generator=gen), -1),
            [f"w{k}" for k in range(n)],
        )
        for n in SIZES
    }
    tmp = Path(tempfile.mkdtemp(prefix="attnkit-bench-"))
    write = {n: [] for n in SIZES}
    load = {n: [] for n in SIZES}
    switch = {n: [] for n in SIZES}
    size = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        for r in range(args.repeats):
            for n in SIZES if r % 2 == 0 else reversed(SIZES):
                t = time.perf_counter()
                path = explorers[n].save(tmp / f"e{n}.html")
                write[n].append(time.perf_counter() - t)
                size[n] = path.stat().st_size
                page = browser.new_page()
                t = time.perf_counter()
                page.goto(path.as_uri())
                page.wait_for_selector(".attnkit-explorer[data-ready]", timeout=300_000)
                load[n].append(time.perf_counter() - t)
                switch[n].extend(page.evaluate(SWITCH, h) for h in range(1, 12))
                page.close()
        browser.close()
    base = statistics.median(load[SIZES[0]])
    rows = [
        "| tokens | page | write (s) | open until drawn (s) | vs 64 tokens | head switch (ms) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for n in SIZES:
        lm = statistics.median(load[n])
        rows.append(
            f"| {n} | {size[n] / 1e6:.1f} MB | {statistics.median(write[n]):.2f} | "
            f"{lm:.2f} | {lm / base:.1f}x | {statistics.median(switch[n]):.1f} |"
        )
    md = (
        "### HTML attention explorer (6 layers x 12 heads)\n\n" + "\n".join(rows) + "\n\n"
        f"Medians of {args.repeats} runs (head switch: of {11 * args.repeats}); headless "
        "Debian Chromium, file://, no network. `PYTHONPATH=src python benchmarks/explorer.py`.\n\n"
        + environment()
        + "\n"
    )
    print(md)
    if not args.no_write:
        print("wrote", write_section("explorer", md))


if __name__ == "__main__":
    main()
