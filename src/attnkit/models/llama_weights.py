"""How a loaded Llama model stores its weights: in the GGUF file's blocks, or as float32.

Shape vocabulary: ``n`` weight rows (output features), ``k`` values per row (input features),
``V`` vocabulary, ``e`` embed_dim.

* ``choose_weights``: which of the two a ``load_pretrained`` call asks for.
* ``keep_blocks(model, parts)``: the matrices stay in their GGUF block formats
  (``attnkit.quant``); what ``load_pretrained(weights="gguf")`` does.
* ``column_major(model)``: the float32 model's output matrix in the memory order that decodes
  fastest; what ``load_pretrained(weights="float32")`` does.

Both take a ``LlamaModel`` (by its attribute names; this module sits below ``llama``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from attnkit.models.llama_loading import Blocks, LlamaCheckpoint
from attnkit.quant import ConcatLinear, QuantizedEmbedding, QuantizedLinear, dequantize

__all__ = ["WEIGHTS", "choose_weights", "column_major", "keep_blocks"]

WEIGHTS = ("gguf", "float32")


def choose_weights(weights: str | None, dtype: torch.dtype, ckpt: LlamaCheckpoint) -> str:
    """``load_pretrained``'s ``weights`` checked against the checkpoint and ``dtype``; ``None``
    means ``"gguf"`` for a GGUF file loaded in float32, else ``"float32"``."""
    if weights is not None and weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS} or None, got {weights!r}")
    is_gguf = ckpt.read_blocks is not None
    if weights is None:
        return "gguf" if is_gguf and dtype == torch.float32 else "float32"
    if weights == "gguf" and not is_gguf:
        raise ValueError(
            f"weights='gguf' keeps a GGUF file's quantised blocks, but {str(ckpt.path)!r} is a "
            "Hugging Face directory of float tensors: pass weights='float32' (or None)"
        )
    if weights == "gguf" and dtype != torch.float32:
        raise ValueError(
            f"dtype={dtype} applies to weights='float32'; a model that keeps its GGUF blocks "
            "computes in float32 (pass weights='float32' to cast every weight)"
        )
    return weights


def keep_blocks(model: nn.Module, parts: Mapping[str, list[Blocks | Tensor]]) -> nn.Module:
    """Give ``model`` (a ``LlamaModel``, typically built on the meta device) the weights of
    ``parts`` (``LlamaCheckpoint.read_blocks``) with every matrix kept in its GGUF blocks.

    Every ``nn.Linear`` and the embedding is replaced by its ``attnkit.quant`` twin holding the
    file's bytes; norms are float32 parameters. ``in_proj`` is one ``QuantizedLinear`` over the
    stacked byte rows of ``[q; k; v]`` when the three share a type (one product per step, as the
    float model); otherwise a ``ConcatLinear`` of its parts (a file may store ``attn_v`` in a
    finer type than ``attn_q``/``attn_k``), which computes the same values in more products.
    A part that was de-quantised (an unimplemented type) becomes a float32 ``nn.Linear``. A tied
    output projection needs no module of its own: ``LlamaModel.project_out`` multiplies by the
    embedding's bytes.
    """
    model.embed = _embedding(parts["embed.weight"][0])
    model.norm.weight = nn.Parameter(_float(parts["norm.weight"][0]))
    for n, block in enumerate(model.blocks):
        p = f"blocks.{n}."
        block.attn_norm.weight = nn.Parameter(_float(parts[p + "attn_norm.weight"][0]))
        block.ffn_norm.weight = nn.Parameter(_float(parts[p + "ffn_norm.weight"][0]))
        block.attn.in_proj = _linear(parts[p + "attn.in_proj.weight"])
        block.attn.out_proj = _linear(parts[p + "attn.out_proj.weight"])
        block.ffn.gate = _linear(parts[p + "ffn.gate.weight"])
        block.ffn.up = _linear(parts[p + "ffn.up.weight"])
        block.ffn.down = _linear(parts[p + "ffn.down.weight"])
    if model.lm_head is not None:
        model.lm_head = _linear(parts["lm_head.weight"])
    return model.eval()


def _float(part: Blocks | Tensor) -> Tensor:
    """A norm's weight as float32 (GGUF stores them as F32, or F16 in some files)."""
    if isinstance(part, Tensor):
        return part.float().reshape(-1)
    return dequantize(part.raw, part.kind, part.shape[1]).reshape(-1)


def _embedding(part: Blocks | Tensor) -> nn.Module:
    if isinstance(part, Tensor):
        return nn.Embedding.from_pretrained(part.float(), freeze=False)
    v, e = part.shape
    return QuantizedEmbedding(v, e, part.kind, raw=part.raw)  # raw (V, row_bytes)


def _linear(parts: list[Blocks | Tensor]) -> nn.Module:
    """One projection from its parts (``LlamaCheckpoint.read_blocks``: rows in order)."""
    if len(parts) > 1:
        return ConcatLinear([_linear([p]) for p in parts])
    (part,) = parts
    if isinstance(part, Blocks):
        n, k = part.shape
        return QuantizedLinear(k, n, part.kind, raw=part.raw)  # raw (n, row_bytes)
    linear = nn.Linear(part.shape[1], part.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(part.float())  # (n, k): a type attnkit.quant does not read
    return linear


def column_major(model: nn.Module) -> nn.Module:
    """Store the output matrix ``(V, e)`` as the transpose of a contiguous ``(e, V)``.

    Its values and shape stay the same; only the memory order changes. Each decoding step
    multiplies one row vector by this matrix (the largest of the model: 49,152 x 576 in
    SmolLM2), and ``x @ W.T`` with ``W.T`` contiguous reads it faster than with ``W`` contiguous
    (MKL's matrix-vector product: docs/benchmarks.md, "Tuning the decoding kernels"). The
    logits then differ from the row-major product by float rounding only (another summation
    order). The blocks' projections keep their layout: column-major ones would be faster too,
    but their rounding, carried through 30 layers, moves the logits of short prompts by up to
    1.1e-4. The tied embedding gathers strided rows, at no visible cost.
    """
    out = model.embed if model.lm_head is None else model.lm_head
    with torch.no_grad():
        out.weight.data = out.weight.data.t().contiguous().t()  # (V, e), strides (1, V)
    return model
