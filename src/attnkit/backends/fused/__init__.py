"""Backend "fused": the tiled backend's algorithm as one C++ kernel per direction, for CPU.

The same online softmax over tiles as ``attnkit.backends.tiled`` (FlashAttention, Dao et al.
2022; the backward's loop order of FlashAttention-2, Dao 2023), compiled: the scaling, bias,
mask, exponentials and row sums of a tile are one pass over it in registers (ATen's vectorised
types), between two matmuls of oneDNN's small-matrix kernel (``cpublas::brgemm``). bfloat16
tiles are multiplied as bfloat16 pairs with float32 accumulation; float16 is computed in
float32; softmax statistics are float32 (float64 for float64 inputs). One file per step:

    fused.h       the problem (Spec), the tile matmul, one row of a tile's logits
    forward.cpp   the forward loop          backward.cpp   the recomputing backward
    decode.cpp    one decoding step over a KV cache (flash-decoding; ``decode.py`` wraps it)
    paged.cpp     a server's ragged step over a paged KV cache, read through block tables
                  (``paged.py`` wraps it; ``attnkit.serve`` takes it once it is loaded)
    module.cpp    the Python bindings
    jit.py        the build when asked (or in the background for auto), cached and verified
    plan.py       masks and biases as the kernel evaluates them (band, layout, relative, dense)
    api.py        ``fused_attention``, the autograd function, the registry entry

It serves what the tiled backend serves except soft-capping, attention sinks and score
modifications: scale, causal of both alignments, windows and block layouts (empty tiles are
never visited), relative bias functions as one ``n_i + n_j - 1`` table per head (ALiBi,
T5-style buckets), dense mask and bias tensors (with the bias's gradient), grouped-query
attention, fully masked rows (output 0) and NaN propagation as in the reference.

Where no C++ compiler (or ninja) is available, the build failed or the kernel is not built yet,
``why_not`` says so in a sentence and ``backend="auto"`` takes another route (see ``jit``).
"""

from attnkit.backends.fused.api import BLOCK_K, BLOCK_Q, fused_attention, run, why_not
from attnkit.backends.fused.decode import decode_attention
from attnkit.backends.fused.jit import NotBuilt, build, cache_dir, is_built, load, unavailable

__all__ = [
    "BLOCK_K",
    "BLOCK_Q",
    "NotBuilt",
    "build",
    "cache_dir",
    "decode_attention",
    "fused_attention",
    "is_built",
    "load",
    "run",
    "unavailable",
    "why_not",
]
