"""Attention backends: one algorithm per file, one signature, registered by name.

See ``registry.py`` for the contract. The reference math lives in ``attnkit.functional``.
"""

from attnkit.backends import (
    chunked,  # noqa: F401  (registers "chunked")
    sparse,  # noqa: F401  (registers "sparse")
    tiled,  # noqa: F401  (registers "tiled")
    torch_sdpa,  # noqa: F401  (registers "torch")
)
from attnkit.backends.registry import (
    AUTO_ORDER,
    AttentionCall,
    Backend,
    BackendUnavailable,
    available_backends,
    get_backend,
    register_backend,
    select_backend,
)

__all__ = [
    "AUTO_ORDER",
    "AttentionCall",
    "Backend",
    "BackendUnavailable",
    "available_backends",
    "get_backend",
    "register_backend",
    "select_backend",
]
