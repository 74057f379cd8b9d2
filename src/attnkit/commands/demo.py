"""``attnkit demo``: the main job, a tour of attnkit on real inputs.

Step 1 is a worked example small enough to check by hand: one query over three keys, computed
by attnkit and printed next to the values worked out by hand.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

# The worked example, and its result by hand (3 decimals): scores q.k / sqrt(2) are
# [0.707, 1.414, 2.121], their softmax the weights, and the output the weighted sum of V's rows.
WORKED_QUERY = [[1.0, 2.0]]
WORKED_KEYS = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
WORKED_VALUES = [[0.5, 0.3], [0.8, 0.2], [0.1, 0.9]]
HAND_WEIGHTS = [0.140, 0.284, 0.576]
HAND_OUTPUT = [0.355, 0.617]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="a tour of attnkit: worked example and more")
    parser.add_argument(
        "--out-dir", default=None, help="where the demo writes its files (default: a temp dir)"
    )
    parser.set_defaults(func=run)


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


def run(args: argparse.Namespace) -> int:
    weights, output = worked_example()
    print("1. A worked example: Q = [1, 2], K = [[1, 0], [0, 1], [1, 1]],")
    print("   V = [[0.5, 0.3], [0.8, 0.2], [0.1, 0.9]], scale 1/sqrt(2)")
    print(_row("weights", HAND_WEIGHTS, weights))
    print(_row("output", HAND_OUTPUT, output))
    out_dir = getattr(args, "out_dir", None) or tempfile.mkdtemp(prefix="attnkit-demo-")
    step_explorer(out_dir)
    return 0


EXPLORER_SENTENCE = "The cat sat on the mat because it was warm."


def step_explorer(out_dir: str | os.PathLike[str]) -> Path:
    """Write the attention explorer of the bundled MiniLM for a sentence; returns its path."""
    from attnkit.commands.show import encode, strongest_links
    from attnkit.viz.explorer import AttentionExplorer

    attention, tokens = encode(EXPLORER_SENTENCE)
    explorer = AttentionExplorer(
        attention,
        tokens,
        title="attnkit demo: BERT attention (all-MiniLM-L6-v2)",
        text=EXPLORER_SENTENCE,
    )
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = explorer.save(Path(out_dir) / "attention.html")
    n_layers, n_heads = attention.shape[:2]
    print(f"2. Attention of the bundled MiniLM ({n_layers} layers x {n_heads} heads) for")
    print(f'   "{EXPLORER_SENTENCE}": open the explorer in a browser:')
    print(f"   {path}")
    print("   " + strongest_links(attention, tokens, top=3).replace("\n", "\n   "))
    return path
