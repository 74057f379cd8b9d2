"""One decoding step of a quantised Llama decoder as one compiled call (``step.cpp``).

Shape vocabulary: ``b`` rows (one new token each), ``e`` embed_dim, ``h`` query heads, ``h_kv``
key/value heads, ``d`` head width, ``V`` vocabulary, ``L`` positions a cache has room for.

A decoding step of SmolLM2-135M is about 30 layers x 10 module calls, each on one token: the
quantised matrix-vector products are under half of its time, the rest is Python and dispatch.
``step`` hands the whole step to the fused kernel's ``llama_step``, which computes what the
modules compute (``LlamaModel.forward`` with one new token and caches, the reference that stays
the readable path), in float32 with the exact de-quantised weights::

    x = embed(ids)                                        # (b, 1, e)
    for block, cache in zip(blocks, caches):              # appends k, v at cache.length
        x, _ = block(x, rope=angles(1, cache.length), cache=cache)
    logits = project_out(norm(x))                         # (b, 1, V)

The model's weights are packed once (lists of the blocks' uint8 buffers and norm weights, the
RoPE tables for the caches' room), keyed by the identity of its modules, so a step passes
lists it already holds. Where the build prefers it (AVX2 without AVX-512), Q4_0, Q4_1 and Q8_0
buffers are packed as copies with their rows interleaved by 8, made again when a buffer is
written in place. The caches are the model's ``KVCache`` objects: the kernel writes the new
keys and values into their preallocated storage and ``step`` advances their lengths.

``why_not`` says, in a sentence, why a call takes the module path instead: weights not kept
quantised (float32 weights keep the module path), the kernel not loaded in this process (never
compiled here), attention weights asked for, grad enabled, more than one new position, caches
not preallocated or empty (the prefill runs the modules), an attention backend other than auto
or fused. Left-padded batches are served: ``padding`` becomes the step's key mask and each row's
RoPE position counts its real tokens, as ``LlamaModel.angles`` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnkit._numerics import autocast_dtype, compute_dtype
from attnkit.attention import KVCache
from attnkit.backends.fused import jit
from attnkit.backends.fused.decode import KV_DTYPES
from attnkit.backends.fused.paged import POOL_DTYPES
from attnkit.quant import ConcatLinear, QuantizedEmbedding, QuantizedLinear

__all__ = ["calls", "paged_step", "step", "why_not", "why_not_paged"]

calls = 0  # steps served by the kernel in this process (tests read it), dense and paged
_CPU = torch.device("cpu")
_INTERLEAVED = 256  # a kind's flag for rows interleaved by 8 (the kernel's interleaved.h)
_INTERLEAVABLE = (2, 3, 8)  # Q4_0, Q4_1, Q8_0


@dataclass
class _Packed:
    """What ``llama_step`` takes of a model, gathered once (``_pack``)."""

    modules: tuple[int, ...]  # ids of the modules packed: a replaced module repacks
    why: str | None  # why this model cannot take the step, or None
    # The weights copied into the kernel's interleaved layout, with their versions then: one
    # changed in place since repacks.
    sources: tuple[tuple[Tensor, int], ...] = ()
    embed: Tensor | None = None
    embed_kind: int = 0
    weights: list[Tensor] | None = None
    kinds: list[int] | None = None
    parts: list[int] | None = None
    norms: list[Tensor] | None = None
    sizes: dict[str, int] | None = None
    numbers: dict[str, float] | None = None
    cos: Tensor | None = None  # (P, d) float32, positions 0 .. P - 1
    sin: Tensor | None = None

    @property
    def model_args(self) -> tuple:
        """The weights as both kernel steps take them, in their order."""
        return self.embed, self.embed_kind, self.weights, self.kinds, self.parts, self.norms


def _child(module: Any, name: str) -> Any:
    """``module.name`` for a submodule (or None), read from the module's own dict: the walk
    below runs before every step, and ``nn.Module.__getattr__`` (a Python function) made its
    lookups cost a tenth of a decoding step."""
    children = module.__dict__["_modules"]
    return children[name] if name in children else getattr(module, name)


def _modules(model: Any) -> list[Any]:
    out = [_child(model, "embed"), _child(model, "norm"), _child(model, "lm_head")]
    for block in _child(model, "blocks").__dict__["_modules"].values():
        a, f = _child(block, "attn"), _child(block, "ffn")
        out += [_child(block, "attn_norm"), _child(block, "ffn_norm"), a]
        out += [_child(a, "in_proj"), _child(a, "out_proj")]
        out += [_child(f, "gate"), _child(f, "up"), _child(f, "down")]
    return out


def _parts(linear: Any) -> list[QuantizedLinear] | None:
    """The quantised parts of a projection, rows in order, or None (float32 or biased)."""
    parts = list(linear.parts) if isinstance(linear, ConcatLinear) else [linear]
    if all(isinstance(p, QuantizedLinear) and p.bias is None for p in parts):
        return parts
    return None


class _Layout:
    """The layout the kernel multiplies a weight in: GGUF's own rows, or, where this build
    says it is faster (``interleaves``: AVX2 without AVX-512), Q4_0, Q4_1 and Q8_0 rows
    interleaved by 8 (a rearranged copy: the same bytes, the same values; the module keeps its
    own, so a model taking this step holds its matrices twice)."""

    def __init__(self) -> None:
        kernel = jit.loaded()
        interleaves = getattr(kernel, "interleaves", None)
        self.kernel = kernel if interleaves is not None and interleaves() else None
        self.sources: list[tuple[Tensor, int]] = []

    def __call__(self, raw: Tensor, kind: int) -> tuple[Tensor, int]:
        if self.kernel is None or kind not in _INTERLEAVABLE or raw.shape[0] % 8:
            return raw, kind
        self.sources.append((raw, _version(raw)))
        return self.kernel.interleave(raw, kind), kind + _INTERLEAVED


def _version(t: Tensor) -> int:
    """How many times ``t`` was written in place; -1 for a tensor made under inference mode,
    which keeps no count (its copy is not made again after such a write)."""
    return -1 if t.is_inference() else t._version


def _pack(model: Any, modules: tuple[int, ...]) -> _Packed:
    c = model.config
    if not isinstance(model.embed, QuantizedEmbedding):
        return _Packed(modules, "the model's weights are not kept quantised (float32 weights)")
    if model.norm.weight.dtype != torch.float32:
        return _Packed(modules, f"the norms are {model.norm.weight.dtype}, not float32")
    linears, parts, norms = [], [], []
    for n, block in enumerate(model.blocks):
        a = block.attn
        if a.backend not in ("auto", "fused"):
            return _Packed(modules, f"layer {n} asks for attention backend={a.backend!r}")
        if any(x is not None for x in (a.differential, a.sinks, a.variants.softcap)):
            return _Packed(modules, f"layer {n} has an attention variant")
        norms += [block.attn_norm.weight.detach(), block.ffn_norm.weight.detach()]
        for linear in (a.in_proj, a.out_proj, block.ffn.gate, block.ffn.up, block.ffn.down):
            found = _parts(linear)
            if found is None:
                return _Packed(modules, f"layer {n} has a projection that is not quantised")
            linears += found
            parts.append(len(found))
    out = [model.embed] if model.lm_head is None else _parts(model.lm_head)
    if out is None:
        return _Packed(modules, "the output projection is not quantised")
    linears += out
    parts.append(len(out))
    layout = _Layout()
    packed = [layout(p.raw, p.kind) for p in linears]
    weights, kinds = [w for w, _ in packed], [kind for _, kind in packed]
    norms.append(model.norm.weight.detach())
    sizes = {
        "e": c.embed_dim,
        "h": c.num_heads,
        "h_kv": c.num_kv_heads,
        "d": c.head_dim,
        "ffn": c.ffn_dim,
        "vocab": c.vocab_size,
        "layers": c.num_layers,
    }
    numbers = {"eps": float(c.eps), "scale": 1.0 / math.sqrt(c.head_dim)}
    embed = model.embed
    return _Packed(
        modules,
        None,
        tuple(layout.sources),
        embed.raw,
        embed.kind,
        weights,
        kinds,
        parts,
        norms,
        sizes,
        numbers,
    )


def _packed(model: Any) -> _Packed:
    modules = tuple(map(id, _modules(model)))
    packed: _Packed | None = getattr(model, "_llama_step", None)
    if (
        packed is None
        or packed.modules != modules
        or any(_version(raw) != version for raw, version in packed.sources)
    ):
        packed = _pack(model, modules)
        model._llama_step = packed  # a plain attribute: not state, never saved
    return packed


def why_not(
    model: Any,
    ids: Tensor,
    caches: list[KVCache] | None,
    padding: Tensor | None = None,
    need_weights: bool = False,
) -> str | None:
    """Why ``model(ids, caches=caches, padding=padding)`` takes the module path, in a sentence,
    or None when ``step`` serves it (checked per token: reads no file, compiles nothing)."""
    if caches is None or ids.shape[1] != 1:
        return "not one new position over KV caches"
    if need_weights:
        return "the attention weights were asked for"
    kernel = jit.loaded()
    if kernel is None or not hasattr(kernel, "llama_step"):
        return "the fused kernel is not loaded in this process (or binds no llama_step)"
    if torch.is_grad_enabled() or model.training:
        return "grad is enabled or the model is training (the step has no backward)"
    if ids.device != _CPU or autocast_dtype(ids.device) is not None:
        return "the step runs on the CPU without autocast"
    packed = _packed(model)
    if packed.why is not None:
        return packed.why
    first = caches[0]
    storage = first._key
    if storage is None or first.max_len is None or first.length >= first.max_len:
        return "the caches are empty, not preallocated (max_len) or full"
    for cache in caches:
        key, value = cache._key, cache._value
        if (
            cache.length != first.length
            or key is None
            or value is None
            or key.dtype != storage.dtype
            or key.shape != storage.shape
            or value.shape != storage.shape
            or cache.max_len != first.max_len
        ):
            return "the caches differ in length, shape or dtype"
    if storage.dtype not in KV_DTYPES or storage.shape[0] != ids.shape[0]:
        return "the caches hold another batch or a dtype other than float32, bfloat16 or float16"
    return None


def _tables(model: Any, packed: _Packed, positions: int) -> tuple[Tensor, Tensor]:
    """RoPE's cos, sin ``(P, d)`` for positions ``0 .. P - 1`` (P >= positions), the values
    ``LlamaModel.angles`` gives each position (computed per position in float64)."""
    if packed.cos is None or packed.cos.shape[0] < positions:
        cos, sin = model.rope.cos_sin(positions)  # (P, d)
        dtype = compute_dtype(model.norm.weight.dtype)
        packed.cos, packed.sin = cos.to(dtype).contiguous(), sin.to(dtype).contiguous()
    assert packed.sin is not None
    return packed.cos, packed.sin


def step(model: Any, ids: Tensor, caches: list[KVCache], padding: Tensor | None = None) -> Tensor:
    """Logits ``(b, 1, V)`` of the new tokens ``ids (b, 1)`` after what ``caches`` hold, which
    gain the tokens' keys and values (``why_not`` must have said None just before: it packed
    the model's weights, which this reads as they are)."""
    global calls
    packed: _Packed = model._llama_step
    first = caches[0]
    length = first.length
    b = ids.shape[0]
    storage = first._key
    assert storage is not None and first.max_len is not None
    if padding is None:
        positions = [length] * b
        key_mask = None
    else:
        positions = (padding.sum(-1) - 1).clamp(min=0).tolist()  # real tokens before, per row
        key_mask = padding.contiguous()  # (b, length + 1)
    cos, sin = _tables(model, packed, first.max_len)
    sizes = dict(packed.sizes or {}, length=length)
    logits = torch.empty(b, model.config.vocab_size)  # (b, V)
    kernel = jit.loaded()
    assert kernel is not None
    kernel.llama_step(
        ids.reshape(b).long().contiguous(),
        positions,
        *packed.model_args,
        [c._key for c in caches],
        [c._value for c in caches],
        cos,
        sin,
        key_mask,
        sizes,
        packed.numbers,
        logits,
    )
    for cache in caches:
        cache.length += 1
    calls += 1
    return logits[:, None]  # (b, 1, V)


def why_not_paged(model: Any, key_pools: list[Tensor], value_pools: list[Tensor]) -> str | None:
    """Why a paged forward (``attnkit.serve.forward.paged_forward``) of ``model`` over these
    pools (one ``(N, s, h_kv, d)`` per layer) takes the modules, in a sentence, or None when
    ``paged_step`` serves it (checked per step: reads no file, compiles nothing)."""
    kernel = jit.loaded()
    if kernel is None or not hasattr(kernel, "llama_paged_step"):
        return "the fused kernel is not loaded in this process (or binds no llama_paged_step)"
    if torch.is_grad_enabled() or model.training:
        return "grad is enabled or the model is training (the step has no backward)"
    if autocast_dtype(_CPU) is not None:
        return "the step runs on the CPU without autocast"
    packed = _packed(model)
    if packed.why is not None:
        return packed.why
    c = model.config
    first = key_pools[0]
    if len(key_pools) != c.num_layers or len(value_pools) != c.num_layers:
        return "the pools do not hold one tensor per layer"
    if first.device != _CPU or first.dtype not in POOL_DTYPES:
        return "the pools are not float32, bfloat16 or float16 CPU tensors"
    if first.dim() != 4 or tuple(first.shape[2:]) != (c.num_kv_heads, c.head_dim):
        return "the pools are not (N, s, h_kv, d) for this model"
    return None


def paged_step(
    model: Any,
    ids: Tensor,
    positions: Tensor,
    slots: Tensor,
    block_tables: Tensor,
    lengths: Tensor,
    starts: Tensor,
    out_rows: Tensor,
    key_pools: list[Tensor],
    value_pools: list[Tensor],
) -> Tensor:
    """Logits ``(len(out_rows), V)`` of the packed new tokens ``ids (t,)`` of several sequences
    (``positions``, ``slots (t,)``, ``block_tables (b, m)``, ``lengths (b,)``, ``starts
    (b + 1,)`` as ``attnkit.serve.forward.PagedBatch`` holds them; every tensor int64), whose
    keys and values are written into the pools at ``slots`` (``why_not_paged`` must have said
    None just before: it packed the model's weights, which this reads as they are)."""
    global calls
    packed: _Packed = model._llama_step
    # The tables cover the model's context at once (the kernel refuses positions past them).
    cos, sin = _tables(model, packed, int(model.config.max_len))
    logits = torch.empty(out_rows.shape[0], model.config.vocab_size)  # (rows, V)
    kernel = jit.loaded()
    assert kernel is not None
    kernel.llama_paged_step(
        ids.contiguous(),
        positions.contiguous(),
        slots.contiguous(),
        block_tables,
        lengths.contiguous(),
        starts.contiguous(),
        out_rows.contiguous(),
        *packed.model_args,
        key_pools,
        value_pools,
        cos,
        sin,
        packed.sizes,
        packed.numbers,
        logits,
    )
    calls += 1
    return logits
