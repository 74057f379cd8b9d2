"""Backend "tiled": FlashAttention's algorithm in PyTorch (Dao et al. 2022, arXiv:2205.14135).

The scores ``(b, h, i, j)`` are never built. Queries are cut into blocks of ``block_q`` rows and,
for each block, the keys into tiles of ``block_k``; a running shift and sum make the softmax
exact one tile at a time (the online softmax), and the backward recomputes each tile's weights
from the saved log-sum-exp. Extra memory is O(n * block). One idea per file:

    softmax.py    the online-softmax state, its one update rule, finish, and ``merge``
    tiles.py      which key tiles a query block visits; one tile's masked, biased logits
    skipping.py   leaving out heads whose weights are negligible (Cauchy-Schwarz bounds)
    relative.py   bias functions that depend on ``j - i`` only: one table, strided views
    layout.py     grouped-query row layout and the flattened ``(b * h_kv)`` matmul axis
    forward.py    the forward loop          backward.py   the recomputing backward
    api.py        ``tiled_attention``, the ring-attention block steps, the registry entries

Masks and biases: bool and float tensors broadcastable to ``(b, h, i, j)`` are sliced per tile;
mask and bias *functions* ``fn(b, h, i, j)`` are evaluated per tile. Tiles a mask function
declares all blocked (``masks.Structure``: causal, windows, block layouts) are skipped
unevaluated; other tiles that evaluate all blocked are skipped after evaluation. Causal
attention: ``is_causal`` is bottom-right; top-left is ``mask_fn=masks.causal_fn(0)``.

A fully masked query row gives output 0 and zero (finite) gradients, like the reference.
Not supported (``why_not`` says so): ``dropout_p > 0`` (the dropout mask is not replayed per
tile) and ``return_weights`` (the weights are never built). Gradients do not flow into a bias
*function*'s parameters: pass a learnable bias as a tensor.

For ring attention (one K/V shard at a time, several devices), the block step is public:
``forward_blocks`` (normalised partial output and log-sum-exp for one shard), ``merge`` (combine
two partial results) and ``backward_blocks`` (gradients for one shard given the *global* output
and log-sum-exp). ``tiled_attention`` is the differentiable whole.
"""

from attnkit.backends.tiled.api import (
    backward_blocks,
    forward_blocks,
    run_call,
    tiled_attention,
    why_not,
)
from attnkit.backends.tiled.softmax import merge
from attnkit.backends.tiled.tiles import BLOCK_K, BLOCK_K_BIAS, BLOCK_Q, BLOCK_Q_BIAS

__all__ = [
    "BLOCK_K",
    "BLOCK_K_BIAS",
    "BLOCK_Q",
    "BLOCK_Q_BIAS",
    "backward_blocks",
    "forward_blocks",
    "merge",
    "run_call",
    "tiled_attention",
    "why_not",
]
