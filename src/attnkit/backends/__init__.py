"""Attention backends: one algorithm per file (or folder), one signature, registered by name.

See ``attnkit.registry`` for the contract. The reference math lives in ``attnkit.functional``.
Importing this package registers "chunked", "fused", "sparse", "tiled" and "torch" ("math" is
registered by ``attnkit.functional``) and the cost model ``backend="auto"`` weighs them with
(``cost``); ``explain`` says what auto would take for a call and why, ``memory_budget`` and
``set_memory_budget`` limit the masks and biases it may build.
"""

from attnkit.backends import (
    chunked,  # noqa: F401  (registers "chunked")
    cost,  # noqa: F401  (registers the cost of each backend above)
    fused,  # noqa: F401  (registers "fused"; its kernel is built on first use)
    sparse,  # noqa: F401  (registers "sparse")
    tiled,  # noqa: F401  (registers "tiled")
    torch_sdpa,  # noqa: F401  (registers "torch")
)
from attnkit.backends.auto import Explanation, explain
from attnkit.registry import (
    DEFAULT_MEMORY_BUDGET,
    AttentionCall,
    Backend,
    BackendUnavailable,
    Estimate,
    Verdict,
    available_backends,
    get_backend,
    get_memory_budget,
    memory_budget,
    register_backend,
    register_cost,
    select_backend,
    set_memory_budget,
    use,
    weigh,
)

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "AttentionCall",
    "Backend",
    "BackendUnavailable",
    "Estimate",
    "Explanation",
    "Verdict",
    "available_backends",
    "explain",
    "get_backend",
    "get_memory_budget",
    "memory_budget",
    "register_backend",
    "register_cost",
    "select_backend",
    "set_memory_budget",
    "use",
    "weigh",
]
