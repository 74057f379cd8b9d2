"""attnkit: attention mechanisms in PyTorch that read like a textbook and run like production code.

The public surface is re-exported here; everything else is reachable through its module
(``attnkit.masks``, ``attnkit.backends``, ...).
"""

from attnkit import masks, models, viz
from attnkit.attention import KVCache, MultiHeadAttention
from attnkit.backends import available_backends, register_backend
from attnkit.blocks import (
    FeedForward,
    TransformerBlock,
    TransformerConfig,
    TransformerDecoder,
    TransformerEncoder,
)
from attnkit.debug import inspect_attention
from attnkit.functional import scaled_dot_product_attention
from attnkit.positional import (
    LearnedPositionalEmbedding,
    RelativePositionAttention,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    alibi_bias,
    alibi_fn,
    alibi_slopes,
)

__version__ = "0.1.0"

__all__ = [
    "FeedForward",
    "KVCache",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "RelativePositionAttention",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "TransformerBlock",
    "TransformerConfig",
    "TransformerDecoder",
    "TransformerEncoder",
    "__version__",
    "alibi_bias",
    "alibi_fn",
    "alibi_slopes",
    "available_backends",
    "inspect_attention",
    "masks",
    "models",
    "register_backend",
    "scaled_dot_product_attention",
    "viz",
]
