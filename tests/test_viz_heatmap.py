"""Static heat maps: pixel sizes of saved pictures, labels equal to tokens, the drawn data."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest
import torch

from attnkit.viz import plot_attention, plot_grid, plot_heads, plot_overview, save_figure

TOKENS = ["[CLS]", "the", "cat", "sat", "$x$", "[SEP]"]


def _attention(*shape: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(*shape, generator=gen), dim=-1)


def _labels(ticks: list) -> list[str]:
    return [t.get_text() for t in ticks]


def test_png_has_the_requested_pixel_size(tmp_path: Path) -> None:
    fig = plot_attention(_attention(6, 6), TOKENS, figsize=(4.0, 3.0), dpi=50)
    path = save_figure(fig, tmp_path / "head.png")
    image = mpimg.imread(path)
    assert image.shape[:2] == (150, 200)  # (height, width) = figsize * dpi


def test_default_size_is_what_the_figure_says(tmp_path: Path) -> None:
    fig = plot_attention(_attention(6, 6), TOKENS)
    width, height = (fig.get_size_inches() * fig.dpi).round().astype(int)
    image = mpimg.imread(save_figure(fig, tmp_path / "head.png"))
    assert image.shape[:2] == (height, width)
    # a bigger picture on request: dpi given to save_figure scales the pixels
    image2 = mpimg.imread(save_figure(fig, tmp_path / "head2.png", dpi=2 * fig.dpi))
    assert image2.shape[:2] == (2 * height, 2 * width)


def test_tick_labels_are_the_tokens_and_the_image_is_the_weights() -> None:
    weights = _attention(6, 6)
    fig = plot_attention(weights, TOKENS)
    ax = fig.axes[0]
    assert _labels(ax.get_xticklabels()) == TOKENS  # keys on x ("$x$" stays text, not TeX)
    assert _labels(ax.get_yticklabels()) == TOKENS  # queries on y
    np.testing.assert_allclose(np.asarray(ax.images[0].get_array()), weights.numpy(), atol=1e-7)
    # short sequences are annotated with each weight, two decimals
    texts = [t.get_text() for t in ax.texts]
    assert texts == [f"{w:.2f}" for w in weights.flatten().tolist()]
    assert len(fig.axes) == 2  # the heat map and its colour bar


def test_cross_attention_labels_each_axis() -> None:
    queries, keys = ["a", "b", "c"], ["k0", "k1", "k2", "k3", "k4"]
    fig = plot_attention(_attention(3, 5), queries, keys, title="cross")
    ax = fig.axes[0]
    assert _labels(ax.get_xticklabels()) == keys
    assert _labels(ax.get_yticklabels()) == queries
    assert ax.get_title() == "cross"


def test_long_sequences_are_not_annotated_and_long_tokens_are_shortened() -> None:
    tokens = [f"tok{n}" for n in range(19)] + ["a" * 40]
    fig = plot_attention(_attention(20, 20), tokens)
    ax = fig.axes[0]
    assert len(ax.texts) == 0
    labels = _labels(ax.get_xticklabels())
    assert labels[:19] == tokens[:19]
    assert labels[19] == "a" * 23 + "…"


def test_svg(tmp_path: Path) -> None:
    path = save_figure(plot_attention(_attention(3, 3), ["x", "y", "z"]), tmp_path / "h.svg")
    text = path.read_text(encoding="utf-8")
    assert "<svg" in text and "</svg>" in text


def test_figures_show_themselves_in_a_notebook_without_matplotlib_inline() -> None:
    from matplotlib.figure import Figure

    att = _attention(2, 3, 4, 4)
    tokens = ["a", "b", "c", "d"]
    figures = [
        plot_attention(att[0, 0], tokens, figsize=(4.0, 3.0), dpi=50),
        plot_heads(att, tokens, layer=1),
        plot_overview(att, tokens),
        plot_grid(att, tokens),
    ]
    for fig in figures:
        assert isinstance(fig, Figure)
        # Jupyter looks the method up on the class: a PNG of the figure at its own size.
        png = type(fig)._repr_png_(fig)
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = (fig.get_size_inches() * fig.dpi).round().astype(int)
        image = mpimg.imread(io.BytesIO(png), format="png")
        assert image.shape[:2] == (height, width)


def test_grid_of_heads() -> None:
    att = _attention(2, 5, 4, 4)  # (l, h, i, j)
    fig = plot_heads(att, ["a", "b", "c", "d"], layer=1)
    panels = [ax for ax in fig.axes if ax.images and ax.get_visible() and ax.get_title()]
    assert [ax.get_title() for ax in panels] == [f"head {h}" for h in range(5)]
    for h, ax in enumerate(panels):
        np.testing.assert_allclose(np.asarray(ax.images[0].get_array()), att[1, h].numpy())
    assert _labels(panels[0].get_yticklabels()) == ["a", "b", "c", "d"]  # first column
    assert _labels(panels[4].get_xticklabels()) == ["a", "b", "c", "d"]  # bottom row
    assert fig.get_suptitle() == "Layer 1: all 5 heads"
    with pytest.raises(ValueError, match="pass layer="):
        plot_heads(att, ["a", "b", "c", "d"])
    with pytest.raises(ValueError, match="layer=2 is out of range"):
        plot_heads(att, ["a", "b", "c", "d"], layer=2)


def test_overview_layers_by_heads(tmp_path: Path) -> None:
    att = _attention(3, 4, 5, 5)
    fig = plot_overview(att, title="overview")
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == 12
    for n, ax in enumerate(panels):
        np.testing.assert_allclose(np.asarray(ax.images[0].get_array()), att[n // 4, n % 4])
    assert panels[0].get_ylabel() == "L0" and panels[4].get_ylabel() == "L1"
    image = mpimg.imread(save_figure(fig, tmp_path / "o.png", dpi=40))
    w, h = fig.get_size_inches() * 40
    assert image.shape[:2] == (round(h), round(w))


def test_grid_of_layers_and_heads_labelled_and_annotated(tmp_path: Path) -> None:
    att = _attention(2, 3, 4, 4)  # (l, h, i, j)
    tokens = ["a", "b", "c", "d"]
    fig = plot_grid(att, tokens, count_from=1, cmap="viridis", panel=2.0)
    panels = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in panels] == [
        f"layer {layer} head {h}" for layer in (1, 2) for h in (1, 2, 3)
    ]
    for n, ax in enumerate(panels):
        np.testing.assert_allclose(np.asarray(ax.images[0].get_array()), att[n // 3, n % 3])
        assert _labels(ax.get_xticklabels()) == tokens and _labels(ax.get_yticklabels()) == tokens
        cells = {(round(t.get_position()[1]), round(t.get_position()[0])): t for t in ax.texts}
        assert len(cells) == 16  # every weight written in its cell
        assert cells[0, 0].get_text() == f"{float(att[n // 3, n % 3, 0, 0]):.2f}"
    # The ink follows the cell's brightness: viridis is dark at 0 and light (yellow) at 1.
    ones = plot_grid(torch.eye(2)[None, None], ["x", "y"], cmap="viridis")
    ink = {t.get_text(): t.get_color() for t in ones.axes[0].texts}
    assert ink == {"1.00": "black", "0.00": "white"}
    assert fig.get_suptitle() == "2 layers x 3 heads (rows attend to columns)"
    image = mpimg.imread(save_figure(fig, tmp_path / "grid.png", dpi=50))
    assert image.shape[:2] == (round((2 * 2.0 + 0.4) * 50), round(3 * 2.0 * 50))


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda: plot_attention(_attention(4, 4), ["a", "b"]),
            ValueError,
            r"tokens has 2 tokens but the attention has 4 query positions \(i\)",
        ),
        (lambda: plot_attention(_attention(3, 4), ["a", "b", "c"]), ValueError, "key_tokens"),
        (
            lambda: plot_attention(_attention(3, 4), ["a", "b", "c"], ["k"]),
            ValueError,
            "key_tokens has 1 tokens but the attention has 4 key positions",
        ),
        (lambda: plot_attention(_attention(2, 3, 3), ["a", "b", "c"]), ValueError, "plot_heads"),
        (lambda: plot_attention(_attention(2, 2), "ab"), TypeError, "list of strings"),
        (lambda: plot_attention(_attention(2, 2), ["a", 1]), TypeError, r"tokens\[1\]"),
        (lambda: plot_overview(_attention(2, 1, 3, 3, 3)), ValueError, "batch"),
    ],
)
def test_bad_input_names_the_problem(call: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        call()  # type: ignore[operator]


def test_save_figure_errors_leave_no_file(tmp_path: Path) -> None:
    fig = plot_attention(_attention(2, 2), ["a", "b"])
    with pytest.raises(ValueError, match="picture format"):
        save_figure(fig, tmp_path / "h.jpg")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        save_figure(fig, tmp_path / "missing" / "h.png")
    (tmp_path / "dir.png").mkdir()
    with pytest.raises(IsADirectoryError):
        save_figure(fig, tmp_path / "dir.png")
    (tmp_path / "dir.png").rmdir()

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("renderer failed")

    fig.savefig = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        save_figure(fig, tmp_path / "h.png")
    assert list(tmp_path.iterdir()) == []


def test_without_matplotlib_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'attnkit\[viz\]'"):
        plot_attention(_attention(2, 2), ["a", "b"])


@pytest.mark.slow  # a fresh interpreter imports torch: several seconds on a busy machine
def test_importing_viz_does_not_import_matplotlib() -> None:
    code = "import sys, attnkit.viz; assert 'matplotlib' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
