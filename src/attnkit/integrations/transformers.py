"""attnkit as an attention implementation for Hugging Face transformers.

transformers (4.48 and later) computes attention through two registries: each model projects
its queries, keys and values and calls the function registered under its
``attn_implementation`` (``AttentionInterface``), with the mask built by the function
registered under the same name (``AttentionMaskInterface``). ``register()`` puts attnkit in
both, so every model on the interface (BERT, GPT-2, Llama, Mistral, Qwen2, Gemma 2, gpt-oss,
T5 and a few hundred more) runs its attention on attnkit's backends::

    import attnkit.integrations.transformers as akt
    name = akt.register()                 # "attnkit"; registering again is harmless
    model = AutoModel.from_pretrained(path, attn_implementation=name)

Shapes at the boundary (transformers' layout in and out, attnkit's inside)::

    b batch   h query heads   h_kv key/value heads   i query positions   j key positions

    query (b, h, i, d), key and value (b, h_kv, j, d)  ->  output (b, i, h, d), weights (b, h, i, j)

The mask. transformers describes a layer's mask as a function of absolute positions (causal,
a sliding window, key padding) and then materialises a ``(b, 1, i, j)`` tensor. The mask
function registered here keeps the common patterns as structure instead (``LayerMask``: a
``masks.Band`` and the key padding), so a sliding window becomes ``masks.window_fn`` and the
tiled backend visits only the key tiles inside the window, with no ``i x j`` tensor. Any other
pattern (packed sequences, image-token overlays, chunked attention, custom functions) gets
transformers' own dense bool mask, ``True`` = may attend, which is attnkit's convention too.
Registering the attention function without its mask function would lose causality silently:
transformers then builds no mask at all (transformers PR 45811), so ``register`` does both.

Every keyword argument a model passes is either honoured (``scaling``, ``dropout``,
``is_causal``, ``sliding_window``, ``softcap``, ``s_aux``, ``position_bias``,
``output_attentions``), known not to change the math (``PASSIVE``), or refused with
``UnsupportedOption`` naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

import attnkit.backends  # noqa: F401  (registers the backends `attnkit:<name>` names)
from attnkit.functional import scaled_dot_product_attention
from attnkit.integrations.transformers_mask import LayerMask, UnsupportedModel, band_fn
from attnkit.masks import Band, MaskFn
from attnkit.registry import get_backend

__all__ = [
    "PASSIVE",
    "LayerMask",
    "UnsupportedModel",
    "UnsupportedOption",
    "attention_function",
    "layer_mask",
    "register",
]

INSTALL_HINT = "pip install 'attnkit[hf]'"

# Names transformers gives its own implementations; registering attnkit under one would
# replace it for every model in the process.
_RESERVED = frozenset(
    {"eager", "sdpa", "flex_attention", "paged|eager", "flash_attention_2", "flash_attention_3"}
)

PASSIVE = frozenset(
    {
        # Positions and caches are applied to q, k, v by the model before attention.
        "position_ids",
        "cache_position",
        "position_embeddings",
        "past_key_values",
        "past_key_value",
        "use_cache",
        # Output bookkeeping (attention weights are ``output_attentions``, read separately).
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
        "num_items_in_batch",
        # Cross-attention keys and values arrive already projected.
        "encoder_hidden_states",
        # flash-attention's description of packed sequences and its determinism switch: for
        # every other implementation the mask carries the packing (built from position_ids).
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "seq_idx",
        "deterministic",
    }
)
"""Keyword arguments models pass through attention that do not change its result."""


class UnsupportedOption(ValueError):
    """A model passed an attention option attnkit cannot honour; the message names it."""


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            f"attnkit.integrations.transformers needs Hugging Face transformers: {INSTALL_HINT}"
        ) from exc
    return transformers


def register(name: str = "attnkit", backend: str = "auto") -> str:
    """Register attnkit's attention and mask functions with transformers under ``name``.

    ``backend`` is the attnkit backend every call asks for (``"auto"``: the registry picks,
    see ``attnkit.registry``; ``"math"``, ``"tiled"``, ...). Registering again replaces the
    entry (with the new ``backend``), so calling this twice is harmless. Returns ``name``,
    ready for ``attn_implementation=name`` or ``model.set_attn_implementation(name)``.
    """
    if not isinstance(name, str) or not name or name in _RESERVED:
        raise ValueError(
            f"name must be a non-empty string other than transformers' own implementations "
            f"({', '.join(sorted(_RESERVED))}); got {name!r}"
        )
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    if backend != "auto":
        get_backend(backend)  # an unknown name fails here, not at the first forward
    _transformers()
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(name, attention_function(backend))
    AttentionMaskInterface.register(name, layer_mask)
    return name


# --- the mask ---------------------------------------------------------------------------------


def layer_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., Tensor] | None = None,
    attention_mask: Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> LayerMask | Tensor:
    """transformers' mask-interface function: a ``LayerMask`` for causal, bidirectional and
    sliding-window masks, transformers' dense bool mask ``(b, 1, i, j)`` for anything else.

    Arguments as in ``transformers.masking_utils.sdpa_mask``: queries sit at absolute positions
    ``q_offset ..``, keys at ``kv_offset ..``; ``attention_mask`` is the 2-D padding mask over
    absolute positions; ``local_size`` the window of sliding-window (or chunked) layers. A
    pattern is kept as structure only where transformers would allow skipping the tensor
    (``allow_is_*_skip``) and ``mask_function`` is one of its own: the plain causal and
    bidirectional functions by identity, windows checked against ``mask_function`` itself on
    a few query rows (chunked attention, which also passes ``local_size``, fails that check).
    """
    mu = _transformers().masking_utils
    _check_model(kwargs.get("config"))
    q_offset = int(q_offset)  # static caches pass a 0-d tensor
    found, band = _known_band(
        mu,
        mask_function,
        local_size,
        allow_is_causal_skip and not use_vmap,
        allow_is_bidirectional_skip and not use_vmap,
        (batch_size, q_length, kv_length, q_offset, kv_offset),
    )
    if not found:
        return mu.sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function or mu.causal_mask_function,
            attention_mask=attention_mask,
            local_size=local_size,
            allow_is_causal_skip=False,  # never None: None would leave causality to a guess
            allow_is_bidirectional_skip=False,
            use_vmap=use_vmap,
            device=device,
        )
    if band is not None:  # absolute positions -> rows and columns of this call's tensors
        band = Band(band.left, band.right, q_offset - kv_offset)
    padding = None
    if attention_mask is not None:
        keep = attention_mask.to(device=device, dtype=torch.bool)
        missing = kv_offset + kv_length - keep.shape[-1]
        if missing > 0:  # keys beyond the 2-D mask (a static cache's free slots) are blocked
            keep = torch.nn.functional.pad(keep, (0, missing), value=False)
        keep = keep[:, kv_offset : kv_offset + kv_length]  # (b, j)
        padding = None if bool(keep.all()) else keep
    return LayerMask(band, padding, (batch_size, 1, q_length, kv_length))


_VERDICTS: dict[str, str | None] = {}  # model type -> why attnkit cannot serve it, or None


def _check_model(config: Any) -> None:
    """Refuse, by name, a model that supports no attention implementation but eager.

    Such a model declares none of ``_supports_attention_backend``, ``_supports_sdpa`` and
    ``_supports_flex_attn`` (transformers then refuses ``sdpa`` for it, GIT for one): its
    layers compute attention themselves and add the mask to their scores, so a bool mask
    from here would mask nothing. A model that supports sdpa or flex but not the backend flag
    (T5) runs its attention through the interface and is served.
    """
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str):
        return
    if model_type not in _VERDICTS:
        _VERDICTS[model_type] = _verdict(model_type)
    reason = _VERDICTS[model_type]
    if reason is not None:
        raise UnsupportedModel(reason)


def _verdict(model_type: str) -> str | None:
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = MODEL_MAPPING_NAMES.get(model_type)
    name = name[0] if isinstance(name, tuple) else name
    try:
        model = getattr(_transformers(), name) if name else None
    except (AttributeError, ImportError, RuntimeError):  # a model its extras cannot import
        return None
    flags = ("_supports_attention_backend", "_supports_sdpa", "_supports_flex_attn")
    if model is None or any(getattr(model, flag, False) for flag in flags):
        return None
    return (
        f"{name} (model type {model_type!r}) is not supported by attnkit: it does not support "
        "transformers' attention interface (_supports_attention_backend, _supports_sdpa and "
        "_supports_flex_attn are all False), so its layers compute attention themselves and "
        "would add attnkit's bool mask to their scores, masking nothing. Use "
        "attn_implementation='eager' for this model"
    )


def _known_band(
    mu: Any,
    fn: Callable[..., Tensor] | None,
    local_size: int | None,
    causal_ok: bool,
    bidirectional_ok: bool,
    sizes: tuple[int, int, int, int, int],
) -> tuple[bool, Band | None]:
    """``(True, band)`` when ``fn`` is transformers' causal (``Band(None, 0)``), bidirectional
    (``None``), causal-window (``Band(w - 1, 0)``) or bidirectional-window (``Band(w, w)``)
    function, in absolute positions; ``(False, None)`` for anything else."""
    if fn is None or fn is mu.causal_mask_function:
        return causal_ok, Band(None, 0)
    if fn is mu.bidirectional_mask_function:
        return bidirectional_ok, None
    if local_size is None:
        return False, None
    candidates = []
    if causal_ok:
        candidates.append(Band(local_size - 1, 0))  # sliding_window_causal_mask_function
    if bidirectional_ok:
        candidates.append(Band(local_size, local_size))  # ..._bidirectional_mask_function
    for band in candidates:
        if _agrees(fn, band, *sizes):
            return True, band
    return False, None


def _probe_rows(q_length: int) -> list[int]:
    """A few query rows spread over the call: the first and last four and eight in between."""
    spread = torch.linspace(0, max(q_length - 1, 0), 8).round().long().tolist()
    return sorted({*range(min(4, q_length)), *range(max(0, q_length - 4), q_length), *spread})


def _agrees(
    fn: Callable[..., Tensor],
    band: Band,
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int,
    kv_offset: int,
) -> bool:
    """Whether transformers' ``fn`` equals ``band`` (absolute positions) on a few query rows.

    Chunked attention passes a ``local_size`` too; it differs from a window on every row but
    the last of each chunk, so rows next to each other tell them apart.
    """
    rows = _probe_rows(q_length)
    b = torch.arange(batch_size).view(-1, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    i = (torch.tensor(rows, dtype=torch.long) + q_offset).view(1, 1, -1, 1)
    j = (torch.arange(kv_length) + kv_offset).view(1, 1, 1, -1)
    try:
        theirs = torch.as_tensor(fn(b, h, i, j)).to("cpu", torch.bool)
    except Exception:  # a function that needs vmap or other devices: not a plain window
        return False
    window = band_fn(band)
    assert window is not None
    ours = window(b, h, i, j)
    shape = (batch_size, 1, len(rows), kv_length)
    return bool(torch.equal(theirs.expand(shape), ours.expand(shape)))


# --- the attention function -------------------------------------------------------------------


def attention_function(backend: str = "auto") -> Callable[..., tuple[Tensor, Tensor | None]]:
    """transformers' attention-interface function running on attnkit's ``backend``.

    The returned function has transformers' signature ``(module, query, key, value,
    attention_mask, scaling=None, dropout=0.0, **kwargs) -> (output (b, i, h, d), weights)``.
    """

    def attnkit_attention(
        module: torch.nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: LayerMask | Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        return _attend(module, query, key, value, attention_mask, scaling, dropout, backend, kwargs)

    return attnkit_attention


_REFUSED = {
    "head_mask": "per-head multiplication of the weights (head_mask)",
    "cache": "transformers' paged cache (continuous batching)",
    "indices": "sparse top-k key indices (DeepSeek-style sparse attention)",
    "block_indices": "block-sparse key indices",
}


def _attend(
    module: torch.nn.Module,
    query: Tensor,  # (b, h, i, d)
    key: Tensor,  # (b, h_kv, j, d)
    value: Tensor,  # (b, h_kv, j, dv)
    attention_mask: LayerMask | Tensor | None,
    scaling: float | None,
    dropout: float,
    backend: str,
    kwargs: dict[str, Any],
) -> tuple[Tensor, Tensor | None]:
    options = dict(kwargs)
    sliding_window = options.pop("sliding_window", None)
    window_ok = isinstance(sliding_window, int) and not isinstance(sliding_window, bool)
    if sliding_window is not None and not (window_ok and sliding_window >= 1):
        raise ValueError(
            f"sliding_window must be a whole number of keys >= 1 (or None), got {sliding_window!r}"
        )
    softcap = options.pop("softcap", None)
    sinks = options.pop("s_aux", None)  # (h,): gpt-oss's attention sinks
    bias = options.pop("position_bias", None)  # (b or 1, h, i, j): T5's relative bias
    is_causal = options.pop("is_causal", None)
    want_weights = bool(options.pop("output_attentions", False)) or _weights_recorded()
    for name, given in options.items():
        if name in PASSIVE or given is None:
            continue
        what = _REFUSED.get(name, "an option attnkit does not know")
        raise UnsupportedOption(
            f"{type(module).__name__} passed {name}= to attention: {what}, which attnkit "
            f"cannot honour; use attn_implementation='eager' for this model"
        )
    if sinks is not None and sinks.ndim != 1:
        raise UnsupportedOption(
            f"s_aux of shape {tuple(sinks.shape)}: attnkit's sinks are one logit per head, (h,)"
        )

    n_queries, n_keys = query.shape[-2], key.shape[-2]
    if isinstance(attention_mask, Tensor):
        _check_mask_fits(module, attention_mask, n_queries, n_keys)
    mask: Tensor | MaskFn | None = None
    causal = False
    if isinstance(attention_mask, LayerMask) and attention_mask.edited:
        mask = attention_mask.dense()  # the model edited it: the tensor, not the band
    elif isinstance(attention_mask, LayerMask):
        mask, causal = _from_layer_mask(attention_mask, sliding_window, n_queries, n_keys)
    elif isinstance(attention_mask, Tensor):
        # transformers' own masks already hold the window; sdpa and eager rely on that too.
        if attention_mask.dtype == torch.bool:
            mask = attention_mask
        else:  # an additive float mask (a ready-made 4-D mask passed to the model)
            bias = attention_mask if bias is None else bias + attention_mask
    elif attention_mask is None:
        # No mask: the layer's own flag decides, as in transformers' sdpa. With more keys than
        # queries and no mask, the keys past the queries are a static cache's free slots, so
        # causality is aligned top-left there.
        wanted = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
        if wanted and n_queries > 1:
            layout = LayerMask(Band(None, 0, 0), None, (query.shape[0], 1, n_queries, n_keys))
            mask, causal = _from_layer_mask(layout, sliding_window, n_queries, n_keys)
    else:
        raise UnsupportedOption(
            f"attention_mask of type {type(attention_mask).__name__}: attnkit takes the masks "
            f"its own mask function builds, bool or float tensors, or None"
        )

    result = scaled_dot_product_attention(
        query,
        key,
        value,
        mask,
        bias=bias,
        is_causal=causal,
        scale=scaling,
        # eager applies dropout only while training; models pass 0.0 at evaluation anyway
        dropout_p=float(dropout) if getattr(module, "training", False) else 0.0,
        return_weights=want_weights,
        backend=backend,
        softcap=softcap,
        sinks=sinks,
    )
    output, weights = result if isinstance(result, tuple) else (result, None)
    return output.transpose(1, 2).contiguous(), weights  # (b, h, i, d) -> (b, i, h, d)


def _from_layer_mask(
    layout: LayerMask, sliding_window: int | None, n_queries: int, n_keys: int
) -> tuple[Tensor | MaskFn | None, bool]:
    """attnkit's ``(mask, is_causal)`` for a ``LayerMask``, with a ``sliding_window`` option
    applied on top (a no-op when the mask already has that window)."""
    band = layout.band
    if sliding_window is not None:
        band = _with_window(band, int(sliding_window))
    padding = None if layout.padding is None else layout.padding[:, None, None, :]  # (b, 1, 1, j)
    if band is None:
        return padding, False
    if band == Band(None, 0, n_keys - n_queries):
        # Plain causal attention aligned bottom-right: attnkit's is_causal and the padding as a
        # tensor, which torch's fused kernel takes.
        return padding, True
    return LayerMask(band, layout.padding, layout.shape).mask_fn(), False


def _check_mask_fits(module: torch.nn.Module, mask: Tensor, n_queries: int, n_keys: int) -> None:
    """A mask built for other queries or keys than attention got: the model changed them after
    building it (DeepSeek-V4 appends compressed keys), which the interface cannot describe."""
    shape = tuple(mask.shape)
    if len(shape) >= 2 and shape[-2] in (1, n_queries) and shape[-1] in (1, n_keys):
        return
    raise UnsupportedModel(
        f"{type(module).__name__} is not supported by attnkit through transformers' attention "
        f"interface: its attention_mask {shape} was built for other queries or keys than "
        f"attention got ({n_queries} queries, {n_keys} keys); the model changes its keys after "
        "the mask is built (a compressed or selected KV cache), which the interface does not "
        "describe. Use attn_implementation='eager' for this model"
    )


def _with_window(band: Band | None, window: int) -> Band:
    """``band`` limited to transformers' causal window: key ``k`` visible from query ``q`` when
    ``q - window < k <= q`` (``sliding_window_overlay``)."""
    if band is None or band.right != 0:
        if band is not None and band.left is not None:
            return band  # a bidirectional window of the mask's own: that is the layer's window
        raise UnsupportedOption(
            f"sliding_window={window} on a bidirectional mask without a window: transformers' "
            "masks and its flash-attention path read that differently"
        )
    left = window - 1 if band.left is None else min(band.left, window - 1)
    return Band(left, 0, band.offset)


def _weights_recorded() -> bool:
    """Whether the model is recording attention weights (``output_attentions=True``) though the
    option did not reach attention (GPT-2 consumes it before): transformers' output collector."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # older transformers pass output_attentions down instead
        return False
    collected = _active_collector.get()
    return isinstance(collected, dict) and any(k.endswith("attentions") for k in collected)
