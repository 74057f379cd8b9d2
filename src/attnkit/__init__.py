"""attnkit: attention mechanisms in PyTorch that read like a textbook and run like production code.

The public surface is re-exported here; everything else is reachable through its module
(``attnkit.masks``, ``attnkit.backends``, ...).
"""

from attnkit import masks
from attnkit.backends import available_backends, register_backend
from attnkit.backends.linear import linear_attention
from attnkit.backends.sparse import topk_attention
from attnkit.backends.tiled import tiled_attention
from attnkit.functional import scaled_dot_product_attention

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "available_backends",
    "linear_attention",
    "masks",
    "register_backend",
    "scaled_dot_product_attention",
    "tiled_attention",
    "topk_attention",
]
