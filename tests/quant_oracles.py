"""Shared oracles for the tests of the quantised Llama step (tests/test_models_llama_step.py,
tests/test_serve_forward.py): random models whose matrices are quantised modules in several
GGUF block types, and the fused kernel built once per test module (an explicit request; the
tests skip where it cannot be built). A test file takes a fixture by re-exporting it
(``from quant_oracles import kernel as kernel``)."""

from __future__ import annotations

import pytest
import torch

from attnkit.backends.fused import jit
from attnkit.models.llama import LlamaConfig, LlamaModel
from attnkit.quant import ConcatLinear, QuantizedEmbedding, QuantizedLinear, format_of
from attnkit.quant import linear as quant_linear

# ggml types and the byte offsets of their float16 scales in a block.
Q4_0, Q4_1, Q8_0, F16 = 2, 3, 8, 1
SCALES = {Q4_0: (0,), Q4_1: (0, 2), Q8_0: (0,)}

# GQA (6 query heads over 2 key/value heads), head width 16, a vocabulary and FFN width that
# are no power of two.
SMALL = LlamaConfig(
    vocab_size=101, embed_dim=96, num_layers=3, num_heads=6, num_kv_heads=2, ffn_dim=160
)


@pytest.fixture(scope="module")
def kernel():
    """The full fused module, built once (an explicit request) and loaded in this process."""
    try:
        module = jit.build()
    except jit.NotBuilt as reason:
        pytest.skip(f"the fused kernel is unavailable here: {reason}")
    if not hasattr(module, "llama_step"):
        pytest.skip("the fused kernel binds no llama_step")
    return module


@pytest.fixture
def quant_kernel(kernel, monkeypatch):
    """The kernel for the quantised products too (the module path's qmatmul)."""
    monkeypatch.setattr(quant_linear, "_KERNEL", [kernel])
    return kernel


def random_raw(kind: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random GGUF rows of ``kind`` for an (n, k) matrix with small float16 scales."""
    fmt = format_of(kind)
    if kind == F16:
        w = (torch.randn(n, k, generator=gen) * 0.05).half()
        return w.view(torch.uint8).reshape(n, -1).clone()
    blocks = k // fmt.block
    raw = torch.randint(0, 256, (n, blocks, fmt.block_bytes), generator=gen, dtype=torch.uint8)
    for at in SCALES[kind]:
        scale = (torch.randn(n, blocks, 1, generator=gen) * 0.01).half()
        raw[..., at : at + 2] = scale.view(torch.uint8)
    return raw.reshape(n, -1)


def random_quantised(config: LlamaConfig, seed: int = 0) -> LlamaModel:
    """A random model whose matrices are quantised modules: ``in_proj`` a ConcatLinear of three
    types, the FFN in Q4_1 / Q4_0 / Q8_0, the embedding Q8_0, an untied output F16."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = LlamaModel(config).eval()
    c = config
    e, kv = c.embed_dim, c.num_kv_heads * c.head_dim

    def q(kind: int, n: int, k: int) -> QuantizedLinear:
        return QuantizedLinear(k, n, kind, raw=random_raw(kind, n, k, gen))

    model.embed = QuantizedEmbedding(
        c.vocab_size, e, Q8_0, raw=random_raw(Q8_0, c.vocab_size, e, gen)
    )
    for block in model.blocks:
        block.attn.in_proj = ConcatLinear([q(Q4_1, e, e), q(Q4_0, kv, e), q(Q8_0, kv, e)])
        block.attn.out_proj = q(Q4_1, e, e)
        block.ffn.gate, block.ffn.up = q(Q4_1, c.ffn_dim, e), q(Q4_0, c.ffn_dim, e)
        block.ffn.down = q(Q8_0, e, c.ffn_dim)
        with torch.no_grad():
            block.attn_norm.weight.uniform_(0.5, 1.5)
            block.ffn_norm.weight.uniform_(0.5, 1.5)
    if model.lm_head is not None:
        model.lm_head = q(F16, c.vocab_size, e)
    return model
