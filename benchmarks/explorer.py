"""How the HTML attention explorer scales: page size, writing it, opening it, switching views.

Workload: MiniLM's shape (6 layers x 12 heads) of random softmax attention over 128, 256 and 512
tokens (random maps are the hard case for the page's compression), and the bundled MiniLM's own
attention over a 512-token text when the model is installed. For each page: its size against
what the same weights took as base64 float32 (the format before the 16-bit storage; computed,
not written), the largest |stored - original| weight (the bound is 2**-13), the median time to
build and write it in Python, the median time from navigation until the page is drawn in
headless Debian Chromium (file://, no network), and median times measured inside the page
(performance.now() around the change event) of a head switch, a layer switch and turning on the
overlay of all 12 heads in the lines. Pages are interleaved across repeats.

Run: ``PYTHONPATH=src python benchmarks/explorer.py`` (``--repeats N``, ``--no-model``,
``--no-write``). Needs /usr/bin/chromium (``make system-deps``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import environment, positive_int, write_section

from attnkit._progress import progress  # a bar when stderr is a terminal
from attnkit.viz.explorer import ERROR_BOUND, AttentionExplorer, page_weights

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
SIZES = (128, 256, 512)
CHANGE = """([sel, value]) => { const s = document.querySelector(sel);
  if (s.type === 'checkbox') s.checked = value; else s.value = String(value);
  const t = performance.now(); s.dispatchEvent(new Event('change'));
  return performance.now() - t; }"""
TEXT = (
    "Attention lets every token of a sentence look at every other token, and each head of "
    "each layer learns its own way of looking: some follow the previous word, some the next, "
    "some gather at the separator, and a few link a pronoun to the noun it stands for. "
)


def _random(n: int, gen: torch.Generator) -> tuple[str, torch.Tensor, list[str]]:
    att = torch.softmax(2 * torch.randn(6, 12, n, n, generator=gen), -1)  # (l, h, i, j)
    return f"{n}, random", att, [f"w{k}" for k in range(n)]


def _minilm() -> tuple[str, torch.Tensor, list[str]] | None:
    try:
        from attnkit.models.bert_pretrained import load_pretrained

        model = load_pretrained()
    except (ImportError, OSError, FileNotFoundError) as exc:
        print(f"no MiniLM row: {exc}", file=sys.stderr)
        return None
    with warnings.catch_warnings():  # the text is cut to the model's 512 positions, on purpose
        warnings.simplefilter("ignore")
        result = model.encode([TEXT * 12], need_weights=True)
    tokens = list(result.tokens[0])
    n = len(tokens)
    return f"{n}, MiniLM text", result.attentions[:, 0, :, :n, :n], tokens  # (l, h, i, j)


def _float32_b64_bytes(att: torch.Tensor) -> int:
    l_, h, i, j = att.shape
    floats = l_ * h * i * j + (l_ * i * j if i == j else 0)  # weights and rollout
    return 4 * math.ceil(4 * floats / 3)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--no-model", action="store_true", help="leave out the MiniLM row")
    parser.add_argument("--no-write", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from playwright.sync_api import sync_playwright

    gen = torch.Generator().manual_seed(0)
    cases = [_random(n, gen) for n in SIZES]
    if not args.no_model and (real := _minilm()) is not None:
        cases.append(real)
    names = [name for name, _, _ in cases]
    explorers = {name: AttentionExplorer(att, toks) for name, att, toks in cases}
    originals = {name: att for name, att, _ in cases}
    tmp = Path(tempfile.mkdtemp(prefix="attnkit-bench-"))
    runs: dict[str, dict[str, list[float]]] = {
        name: {k: [] for k in ("write", "open", "head", "layer", "overlay")} for name in names
    }
    size: dict[str, int] = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        for r in progress(range(args.repeats), desc="rounds", unit="round"):
            for name in names if r % 2 == 0 else reversed(names):
                t = time.perf_counter()
                path = explorers[name].save(tmp / "e.html")
                runs[name]["write"].append(time.perf_counter() - t)
                size[name] = path.stat().st_size
                page = browser.new_page()
                t = time.perf_counter()
                page.goto(path.as_uri())
                page.wait_for_selector(".attnkit-explorer[data-ready]", timeout=300_000)
                runs[name]["open"].append(time.perf_counter() - t)
                for h in range(12):
                    runs[name]["head"].append(page.evaluate(CHANGE, [".ak-head", h]))
                for layer in range(6):
                    runs[name]["layer"].append(page.evaluate(CHANGE, [".ak-layer", layer]))
                for on in (True, False, True):
                    ms = page.evaluate(CHANGE, [".ak-overlay", on])
                    if on:
                        runs[name]["overlay"].append(ms)
                page.close()
        browser.close()
    errors = {}
    for name in names:
        weights, _ = page_weights(explorers[name].to_html())
        errors[name] = float(np.abs(weights - originals[name].numpy()).max())

    def med(name: str, key: str) -> float:
        return statistics.median(runs[name][key])

    base = med(names[0], "open")
    rows = [
        "| tokens, weights | page | as base64 float32 | largest error | write (s) | "
        "open until drawn, median / slowest (s) | vs 128 | head switch (ms) | layer switch (ms) | "
        "overlay of 12 heads (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        f32 = _float32_b64_bytes(originals[name])
        rows.append(
            f"| {name} | {size[name] / 1e6:.1f} MB | {f32 / 1e6:.1f} MB "
            f"({size[name] / f32:.2f}x) | {errors[name]:.2e} | {med(name, 'write'):.2f} | "
            f"{med(name, 'open'):.2f} / {max(runs[name]['open']):.2f} | "
            f"{med(name, 'open') / base:.1f}x | "
            f"{med(name, 'head'):.1f} | {med(name, 'layer'):.1f} | {med(name, 'overlay'):.1f} |"
        )
    md = (
        "### HTML attention explorer (6 layers x 12 heads)\n\n" + "\n".join(rows) + "\n\n"
        f"Medians of {args.repeats} runs (head switch: of {12 * args.repeats}, layer switch: "
        f"of {6 * args.repeats}); headless Debian Chromium, file://, no network. Weights are "
        f"stored as multiples of 2^-12 (bound {ERROR_BOUND:.3g}, shown to 3 decimals). "
        "`PYTHONPATH=src python benchmarks/explorer.py`.\n\n" + environment() + "\n"
    )
    print(md)
    if not args.no_write:
        print("wrote", write_section("explorer", md))


if __name__ == "__main__":
    main()
