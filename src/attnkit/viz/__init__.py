"""Looking at attention: static heat maps, an interactive HTML explorer, attention rollout.

- :func:`plot_attention`, :func:`plot_heads`, :func:`plot_overview`, :func:`plot_grid`,
  :func:`save_figure`: matplotlib pictures (PNG/SVG/PDF); matplotlib is imported only when you
  draw (``pip install 'attnkit[viz]'``).
- :class:`AttentionExplorer`, :func:`explorer_html`, :func:`save_html`: one self-contained,
  offline HTML page; shows itself in Jupyter.
- :func:`attention_rollout`, :func:`plot_rollout`: attention followed through the layers
  (Abnar and Zuidema 2020).
- :func:`token_highlight_html`: words shaded by a weight, for a text classifier's attention.

Attention is not explanation (Jain and Wallace 2019): these are views of what the heads computed,
not of why the model decided.
"""

from attnkit.viz.explorer import CAVEAT, AttentionExplorer, explorer_html, save_html
from attnkit.viz.heatmap import (
    plot_attention,
    plot_grid,
    plot_heads,
    plot_overview,
    save_figure,
)
from attnkit.viz.highlight import token_highlight_html
from attnkit.viz.rollout import attention_rollout, plot_rollout

__all__ = [
    "CAVEAT",
    "AttentionExplorer",
    "attention_rollout",
    "explorer_html",
    "plot_attention",
    "plot_grid",
    "plot_heads",
    "plot_overview",
    "plot_rollout",
    "save_figure",
    "save_html",
    "token_highlight_html",
]
