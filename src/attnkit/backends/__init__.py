"""Attention backends: one algorithm per file (or folder), one signature, registered by name.

See ``attnkit.registry`` for the contract. The reference math lives in ``attnkit.functional``.
Importing this package registers "chunked", "sparse", "tiled" and "torch" ("math" is registered
by ``attnkit.functional``).
"""

from attnkit.backends import (
    chunked,  # noqa: F401  (registers "chunked")
    sparse,  # noqa: F401  (registers "sparse")
    tiled,  # noqa: F401  (registers "tiled")
    torch_sdpa,  # noqa: F401  (registers "torch")
)
from attnkit.registry import (
    AUTO_ORDER,
    AttentionCall,
    Backend,
    BackendUnavailable,
    available_backends,
    get_backend,
    register_backend,
    select_backend,
    use,
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
    "use",
]
