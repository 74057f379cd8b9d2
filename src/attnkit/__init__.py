"""attnkit: attention mechanisms in PyTorch that read like a textbook and run like production code.

The public surface is re-exported here; everything else is reachable through its module
(``attnkit.masks``, ``attnkit.backends``, ...).
"""

import importlib

# Importing the backends registers them; attnkit.functional registers "math".
import attnkit.backends as backends
import attnkit.masks as masks
from attnkit.attention import KVCache, MultiHeadAttention
from attnkit.backends import available_backends, register_backend
from attnkit.backends.linear import linear_attention
from attnkit.backends.sparse import topk_attention
from attnkit.backends.tiled import tiled_attention
from attnkit.blocks import FeedForward, TransformerBlock
from attnkit.debug import inspect_attention
from attnkit.functional import scaled_dot_product_attention
from attnkit.norms import RMSNorm
from attnkit.positional import (
    LearnedPositionalEmbedding,
    RelativePositionAttention,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    alibi_bias,
    alibi_fn,
    alibi_slopes,
)
from attnkit.stacks import TransformerConfig, TransformerDecoder, TransformerEncoder
from attnkit.variants import AttentionVariants

__version__ = "0.1.0"

# Subpackages with heavier or optional dependencies load on first use: attnkit.models, .viz,
# .train, .distributed, .flex and .integrations (PEP 562).
_LAZY = ("distributed", "flex", "integrations", "models", "train", "viz")


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return importlib.import_module(f"attnkit.{name}")
    raise AttributeError(f"module 'attnkit' has no attribute {name!r}")


__all__ = [
    "AttentionVariants",
    "FeedForward",
    "KVCache",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "RMSNorm",
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
    "backends",
    "distributed",
    "inspect_attention",
    "linear_attention",
    "masks",
    "models",
    "register_backend",
    "scaled_dot_product_attention",
    "tiled_attention",
    "topk_attention",
    "train",
    "viz",
]
