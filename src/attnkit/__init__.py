"""attnkit: attention mechanisms in PyTorch that read like a textbook and run like production code.

The public surface is re-exported here; everything else is reachable through its module
(``attnkit.masks``, ``attnkit.backends``, ...).

``import attnkit`` itself imports nothing (not even torch, about a second to load), so the
``attnkit`` command starts at once. The first public name used loads the core, which imports
the backends and so registers them, exactly as an eager import would (PEP 562). Modules that
route by backend name (``attnkit.attention`` and everything built on it) import the backends
themselves; code that imports only ``attnkit.functional`` has the reference math until
``attnkit.backends`` is imported (any public name of ``attnkit`` does that).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the same names, for type checkers and readers; loaded on first use below
    # (not the subpackages that load on first use: the layer contracts keep train for the CLI)
    import attnkit.backends as backends
    import attnkit.masks as masks
    from attnkit.attention import KVCache, MultiHeadAttention
    from attnkit.backends import available_backends, register_backend
    from attnkit.backends.linear import linear_attention
    from attnkit.backends.sparse import topk_attention
    from attnkit.backends.tiled import tiled_attention
    from attnkit.blocks import FeedForward, TransformerBlock
    from attnkit.debug import inspect_attention
    from attnkit.dsa import DeepSeekSparseAttention, LightningIndexer
    from attnkit.functional import scaled_dot_product_attention
    from attnkit.gated_delta import GatedDeltaNet, gated_delta_rule
    from attnkit.mla import MultiHeadLatentAttention
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

# public name -> the module that defines it
_NAMES = {
    "KVCache": "attnkit.attention",
    "MultiHeadAttention": "attnkit.attention",
    "available_backends": "attnkit.backends",
    "register_backend": "attnkit.backends",
    "linear_attention": "attnkit.backends.linear",
    "topk_attention": "attnkit.backends.sparse",
    "tiled_attention": "attnkit.backends.tiled",
    "FeedForward": "attnkit.blocks",
    "TransformerBlock": "attnkit.blocks",
    "inspect_attention": "attnkit.debug",
    "DeepSeekSparseAttention": "attnkit.dsa",
    "LightningIndexer": "attnkit.dsa",
    "scaled_dot_product_attention": "attnkit.functional",
    "GatedDeltaNet": "attnkit.gated_delta",
    "gated_delta_rule": "attnkit.gated_delta",
    "MultiHeadLatentAttention": "attnkit.mla",
    "RMSNorm": "attnkit.norms",
    "LearnedPositionalEmbedding": "attnkit.positional",
    "RelativePositionAttention": "attnkit.positional",
    "RotaryEmbedding": "attnkit.positional",
    "SinusoidalPositionalEncoding": "attnkit.positional",
    "alibi_bias": "attnkit.positional",
    "alibi_fn": "attnkit.positional",
    "alibi_slopes": "attnkit.positional",
    "TransformerConfig": "attnkit.stacks",
    "TransformerDecoder": "attnkit.stacks",
    "TransformerEncoder": "attnkit.stacks",
    "AttentionVariants": "attnkit.variants",
}
# Public submodules: the core two, and those with heavier or optional dependencies.
_MODULES = ("backends", "masks", "distributed", "flex", "integrations", "models", "train", "viz")


def __getattr__(name: str) -> object:
    if name in _MODULES:
        importlib.import_module("attnkit.backends")  # registers the backends
        return importlib.import_module(f"attnkit.{name}")
    if name not in _NAMES:
        raise AttributeError(f"module 'attnkit' has no attribute {name!r}")
    importlib.import_module("attnkit.backends")
    value = getattr(importlib.import_module(_NAMES[name]), name)
    globals()[name] = value  # later uses are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "AttentionVariants",
    "DeepSeekSparseAttention",
    "FeedForward",
    "GatedDeltaNet",
    "KVCache",
    "LearnedPositionalEmbedding",
    "LightningIndexer",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
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
    "gated_delta_rule",
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
