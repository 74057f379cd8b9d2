"""Small transformers layers and whole models beside attnkit's copies with the same weights (for
tests/test_mla.py, test_dsa.py and test_gated_delta.py), and the checks those files share.

* ``deepseek_config`` / ``deepseek_attention`` / ``deepseek_forward``: one DeepseekV3Attention
  (or DeepseekV32Attention with its indexer, ``sparse``) of the small shapes ``E, H, D_C, D_Q,
  D_N, D_R, D_V`` with random weights, and its causal forward; ``mla_module``: attnkit's
  ``MultiHeadLatentAttention`` of the same shapes.
* ``qwen3_next_config`` / ``gated_delta_layer``: one Qwen3NextGatedDeltaNet of small shapes.
* ``assert_equal_with_input_gradients``: outputs and the gradient of a random projection of
  them with respect to the input, equal to ``1e-10``; ``assert_same_model``: logits and greedy
  generation of a whole model pair.

* ``deepseek_pair(...)``: a DeepSeek-V3- (or V3.2-) style decoder: ``MultiHeadLatentAttention``
  (or ``DeepSeekSparseAttention``) + SwiGLU ``FeedForward`` + ``RMSNorm``, every layer dense.
* ``qwen3_next_pair(...)``: a Qwen3-Next-style hybrid: ``GatedDeltaNet`` layers interleaved with
  gated softmax attention (``MultiHeadAttention`` with qk-norm, an element-wise output gate and
  RoPE on the first quarter of each head), dense SwiGLU MLPs. Qwen3-Next's norms scale by
  ``1 + w``; the copy stores ``1 + w`` in attnkit's ``RMSNorm``.

Both transformers models come from ``hf_float64`` (their float32 casts kept in float64), built
from configs in code with random weights; nothing is downloaded.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit import (
    DeepSeekSparseAttention,
    FeedForward,
    GatedDeltaNet,
    KVCache,
    MultiHeadAttention,
    MultiHeadLatentAttention,
    RMSNorm,
    RotaryEmbedding,
)
from attnkit.dsa import SparseLatentCache
from attnkit.gated_delta import GatedDeltaCache
from attnkit.mla import LatentCache
from attnkit.variants import AttentionVariants
from hf_float64 import float64_module

F64 = torch.float64
# The small DeepSeek attention: width, heads, KV latent, query latent, no-RoPE / RoPE / value
# head widths, and the DSA indexer's keys per query.
E, H, D_C, D_Q, D_N, D_R, D_V = 32, 4, 10, 12, 6, 4, 5
TOP_K = 5
DSA_INDEXER = dict(index_topk=TOP_K, index_n_heads=16, index_head_dim=8)


def deepseek_config(sparse: bool = False, **overrides):
    """A one-layer ``DeepseekV3Config`` (``DeepseekV32Config`` with ``sparse``) of the small
    shapes; ``overrides`` replace any setting."""
    if sparse:
        from transformers import DeepseekV32Config as Config
    else:
        from transformers import DeepseekV3Config as Config

    settings = dict(
        hidden_size=E,
        num_attention_heads=H,
        num_key_value_heads=H,
        q_lora_rank=D_Q,
        kv_lora_rank=D_C,
        qk_nope_head_dim=D_N,
        qk_rope_head_dim=D_R,
        v_head_dim=D_V,
        vocab_size=50,
        num_hidden_layers=1,
        intermediate_size=16,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0},
        attn_implementation="eager",
        **(DSA_INDEXER if sparse else {}),
    )
    settings.update(overrides)
    return Config(**settings)


def deepseek_attention(module, sparse: bool = False, dtype=F64, **overrides):
    """``(attention, rotary)`` of transformers' ``module`` (``DeepseekV3Attention``, or
    ``DeepseekV32Attention`` with ``sparse``) with random weights, norms away from 1."""
    config = deepseek_config(sparse, **overrides)
    torch.manual_seed(0)
    if sparse:
        attention = module.DeepseekV32Attention(config, 0).to(dtype)
        with torch.no_grad():
            for name, p in attention.named_parameters():
                if "norm" in name and name.endswith("weight"):
                    p.uniform_(0.5, 1.5)
            attention.indexer.k_norm.bias.normal_()
        return attention, module.DeepseekV32RotaryEmbedding(config).to(dtype)
    attention = module.DeepseekV3Attention(config, 0).to(dtype)
    with torch.no_grad():
        for name, p in attention.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_()
    return attention, module.DeepseekV3RotaryEmbedding(config).to(dtype)


def deepseek_forward(attention, rotary, x: Tensor) -> Tensor:
    """Transformers' attention on ``x (b, n, E)``, causal (an additive mask, finite minimum)."""
    b, n, _ = x.shape
    positions = torch.arange(n)[None]
    cos, sin = rotary(x, positions)
    blocked = torch.finfo(x.dtype).min
    mask = torch.full((n, n), blocked, dtype=x.dtype).triu(1).expand(b, 1, n, n)
    return attention(x, (cos, sin), mask, position_ids=positions)[0]


def mla_module(**overrides) -> MultiHeadLatentAttention:
    """attnkit's ``MultiHeadLatentAttention`` of the small shapes (float32, initial weights)."""
    settings = dict(kv_rank=D_C, nope_dim=D_N, rope_dim=D_R, v_dim=D_V, q_rank=D_Q)
    settings.update(overrides)
    return MultiHeadLatentAttention(E, H, **settings)


def qwen3_next_config(**overrides):
    """A ``Qwen3NextConfig`` whose Gated DeltaNet layers have 2 key heads of 8 and 4 value heads
    of 6 on a width of 32; ``overrides`` set the rest."""
    from transformers import Qwen3NextConfig

    settings = dict(
        hidden_size=32,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=4,
        head_dim=8,
        rms_norm_eps=1e-6,
    )
    settings.update(overrides)
    return Qwen3NextConfig(**settings)


def _randomise_gated_delta(layer: nn.Module) -> None:
    with torch.no_grad():  # away from the initial values, so every parameter matters
        layer.norm.weight.uniform_(0.5, 1.5)
        layer.dt_bias.normal_()


def gated_delta_layer(module) -> nn.Module:
    """One ``Qwen3NextGatedDeltaNet`` of transformers' ``module``, float64, random weights."""
    config = qwen3_next_config(
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        vocab_size=50,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=16,
    )
    torch.manual_seed(0)
    layer = module.Qwen3NextGatedDeltaNet(config, 0).double()
    _randomise_gated_delta(layer)
    return layer


def assert_equal_with_input_gradients(out: Tensor, ref: Tensor, x: Tensor) -> None:
    """``out == ref`` and the gradients of ``(out * w).sum()`` and ``(ref * w).sum()`` with
    respect to ``x`` equal, for a random ``w``, to ``1e-10`` (float64)."""
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    w = torch.randn_like(ref)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), x)
    (g_out,) = torch.autograd.grad((out * w).sum(), x)
    torch.testing.assert_close(g_out, g_ref, rtol=0, atol=1e-10)


def assert_same_model(hf: nn.Module, ours: nn.Module) -> None:
    """Logits to ``1e-10`` in float64 on a batch of 2 x 11 tokens, and the same 6 greedy tokens
    as transformers' ``generate()`` (ours through its layers' caches)."""
    ids = torch.randint(0, 53, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=0, atol=1e-10)
    expected = hf.generate(ids[:1], max_new_tokens=6, do_sample=False)
    assert torch.equal(ours.greedy(ids[:1], 6), expected)


class TinyDecoder(nn.Module):
    """Pre-norm decoder: ``x += mixer(norm(x)); x += mlp(norm(x))`` per layer."""

    def __init__(self, embed, mixers, mlps, norms, final_norm, lm_head, new_cache) -> None:
        super().__init__()
        self.embed = embed
        self.mixers = nn.ModuleList(mixers)
        self.mlps = nn.ModuleList(mlps)
        self.norms = nn.ModuleList(norms)  # two per layer
        self.final_norm, self.lm_head = final_norm, lm_head
        self.new_cache = new_cache  # layer -> an empty cache of its kind

    def forward(self, ids: Tensor, caches: list | None = None) -> Tensor:
        x = self.embed(ids)
        for n, (mixer, mlp) in enumerate(zip(self.mixers, self.mlps, strict=True)):
            cache = None if caches is None else caches[n]
            x = x + mixer(self.norms[2 * n](x), is_causal=True, cache=cache)[0]
            x = x + mlp(self.norms[2 * n + 1](x))
        return self.lm_head(self.final_norm(x))

    @torch.no_grad()
    def greedy(self, ids: Tensor, steps: int) -> Tensor:
        """Greedy decoding through the layers' caches (one prefill, then a token per call)."""
        caches = [self.new_cache(m) for m in self.mixers]
        logits = self(ids, caches)
        out = ids
        for _ in range(steps):
            token = logits[:, -1:].argmax(-1)
            out = torch.cat([out, token], dim=1)
            logits = self(token, caches)
        return out


def _copy(dst: nn.Module, src: nn.Module) -> nn.Module:
    with torch.no_grad():
        dst.weight.copy_(src.weight)
    return dst


def _swiglu(mlp: nn.Module) -> FeedForward:
    e, hidden = mlp.gate_proj.in_features, mlp.gate_proj.out_features
    ff = FeedForward(e, hidden, activation="swiglu", bias=False).to(F64)
    _copy(ff.gate, mlp.gate_proj), _copy(ff.up, mlp.up_proj), _copy(ff.down, mlp.down_proj)
    return ff


def _randomise(model: nn.Module, norm_range: tuple[float, float]) -> None:
    with torch.no_grad():  # away from the initial values, so every parameter matters
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.uniform_(*norm_range)
            elif name.endswith("bias"):
                p.normal_()


def deepseek_pair(sparse: bool = False, layers: int = 2, seed: int = 0):
    """``(hf_model, ours)``: DeepSeek-V3 (or V3.2 with ``sparse``) style, float64, eval mode."""
    if sparse:
        module = float64_module("deepseek_v32.modeling_deepseek_v32")
        model_cls = module.DeepseekV32ForCausalLM
    else:
        module = float64_module("deepseek_v3.modeling_deepseek_v3")
        model_cls = module.DeepseekV3ForCausalLM
    config = deepseek_config(
        sparse,
        vocab_size=53,
        num_hidden_layers=layers,
        first_k_dense_replace=layers,  # dense MLPs only: the attention is what is compared
        intermediate_size=24,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    hf = model_cls(config).to(F64).eval()
    _randomise(hf, (0.5, 1.5))
    if sparse:
        for layer in hf.model.layers:
            nn.init.normal_(layer.self_attn.indexer.k_norm.bias)
    base = hf.model
    mixer_cls = DeepSeekSparseAttention if sparse else MultiHeadLatentAttention
    mixers = [mixer_cls.from_transformers(layer.self_attn) for layer in base.layers]
    norms = []
    for layer in base.layers:
        for hf_norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norms.append(_copy(RMSNorm(32, eps=hf_norm.variance_epsilon).to(F64), hf_norm))
    ours = TinyDecoder(
        _copy(nn.Embedding(53, 32).to(F64), base.embed_tokens),
        mixers,
        [_swiglu(layer.mlp) for layer in base.layers],
        norms,
        _copy(RMSNorm(32, eps=base.norm.variance_epsilon).to(F64), base.norm),
        _copy(nn.Linear(32, 53, bias=False).to(F64), hf.lm_head),
        lambda m: SparseLatentCache() if sparse else LatentCache(),
    ).eval()
    return hf, ours


class PartialRope(nn.Module):
    """RoPE on the first ``rotary_dim`` channels of each head (Qwen3-Next rotates a quarter)."""

    def __init__(self, head_dim: int, rotary_dim: int, base: float) -> None:
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        self.rope = RotaryEmbedding(rotary_dim, base=base)

    def rotate(self, x: Tensor, offset: int = 0) -> Tensor:
        x_r, x_pass = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        return torch.cat([self.rope.rotate(x_r, offset), x_pass], dim=-1)


class GatedSoftmaxAttention(nn.Module):
    """Qwen3-Next's full-attention layer as ``MultiHeadAttention`` with qk-norm, an element-wise
    sigmoid output gate and partial RoPE, taking a ``KVCache``."""

    def __init__(self, attention: MultiHeadAttention, rope: PartialRope) -> None:
        super().__init__()
        self.attention, self.rope = attention, rope

    def forward(self, x: Tensor, *, is_causal: bool, cache: KVCache | None):
        return self.attention(x, is_causal=is_causal, cache=cache, rope=self.rope)


def _qwen_attention(hf_attn: nn.Module, config) -> GatedSoftmaxAttention:
    h, h_kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    e = config.hidden_size
    variants = AttentionVariants(qk_norm="rms", gate="element")
    mha = MultiHeadAttention(e, h, num_kv_heads=h_kv, bias=False, variants=variants).to(F64)
    q, gate = hf_attn.q_proj.weight.view(h, 2 * d, e).split([d, d], dim=1)  # per head [q; gate]
    with torch.no_grad():
        mha.in_proj.weight.copy_(
            torch.cat([q.reshape(h * d, e), hf_attn.k_proj.weight, hf_attn.v_proj.weight])
        )
        mha.gate.proj.weight.copy_(gate.reshape(h * d, e))
        mha.gate.proj.bias.zero_()
        mha.out_proj.weight.copy_(hf_attn.o_proj.weight)
        for ours, theirs in ((mha.q_norm, hf_attn.q_norm), (mha.k_norm, hf_attn.k_norm)):
            ours.norm.weight.copy_(1 + theirs.weight)  # Qwen3-Next scales by (1 + w)
            ours.norm.eps = theirs.eps
    rotary = int(d * config.rope_parameters["partial_rotary_factor"])
    rope = PartialRope(d, rotary, float(config.rope_parameters["rope_theta"]))
    return GatedSoftmaxAttention(mha, rope)


def _one_plus(hf_norm: nn.Module, width: int) -> RMSNorm:
    norm = RMSNorm(width, eps=hf_norm.eps).to(F64)
    with torch.no_grad():
        norm.weight.copy_(1 + hf_norm.weight)
    return norm


def qwen3_next_pair(seed: int = 0):
    """``(hf_model, ours)``: a Qwen3-Next-style hybrid (linear, linear, full), float64, eval."""
    module = float64_module("qwen3_next.modeling_qwen3_next")
    types = ["linear_attention", "linear_attention", "full_attention"]
    config = qwen3_next_config(
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=len(types),
        layer_types=types,
        mlp_only_layers=list(range(len(types))),  # dense MLPs only
        vocab_size=53,
        intermediate_size=24,
        max_position_embeddings=64,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 100.0,
            "partial_rotary_factor": 0.25,
        },
        attn_implementation="eager",
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    hf = module.Qwen3NextForCausalLM(config).to(F64).eval()
    _randomise(hf, (-0.4, 0.4))  # Qwen3-Next's (1 + w) norms; the output norm's w directly
    for layer in hf.model.layers:
        if layer.block_type == "linear_attention":
            _randomise_gated_delta(layer.linear_attn)
    base = hf.model
    mixers = []
    for layer in base.layers:
        if layer.block_type == "linear_attention":
            mixers.append(GatedDeltaNet.from_transformers(layer.linear_attn))
        else:
            mixers.append(_qwen_attention(layer.self_attn, config))
    norms = []
    for layer in base.layers:
        norms += [
            _one_plus(layer.input_layernorm, 32),
            _one_plus(layer.post_attention_layernorm, 32),
        ]
    ours = TinyDecoder(
        _copy(nn.Embedding(53, 32).to(F64), base.embed_tokens),
        mixers,
        [_swiglu(layer.mlp) for layer in base.layers],
        norms,
        _one_plus(base.norm, 32),
        _copy(nn.Linear(32, 53, bias=False).to(F64), hf.lm_head),
        lambda m: GatedDeltaCache() if isinstance(m, GatedDeltaNet) else KVCache(),
    ).eval()
    return hf, ours
