"""Weights kept in GGUF's quantised block formats, and the layers that multiply by them.

    formats.py   the block formats as data (``BlockFormat``) and ``dequantize``, the reference
    linear.py    ``QuantizedLinear`` and ``QuantizedEmbedding``: ``nn.Linear``/``nn.Embedding``
                 whose weight stays in its blocks (the fused kernel's ``qmatmul`` when built)

A quantised model holds its matrices as uint8 buffers of whole blocks (SmolLM2-135M's Q4_1 and
Q8_0: about 100 MB instead of 540 MB of float32) and computes with exactly the float32 values
``dequantize`` gives, on every path.
"""

from attnkit.quant.formats import FORMATS, BlockFormat, dequantize, format_of
from attnkit.quant.linear import (
    ConcatLinear,
    QuantizedEmbedding,
    QuantizedLinear,
    kernel,
    prepare_kernel,
)

__all__ = [
    "FORMATS",
    "BlockFormat",
    "ConcatLinear",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "dequantize",
    "format_of",
    "kernel",
    "prepare_kernel",
]
