"""The mask attnkit's transformers integration hands to models: ``LayerMask``, structure that is
also the bool tensor transformers' sdpa mask function would have built.

    b batch    i query positions    j key positions

``attnkit.integrations.transformers.layer_mask`` builds one per layer pattern (causal, a
sliding window, bidirectional, with key padding); attention reads its band and padding, any
other code reads the tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map_only

from attnkit.masks import Band, MaskFn, all_of, causal_fn, materialize, to_additive, window_fn

__all__ = ["LayerMask", "UnsupportedModel", "band_fn"]


class UnsupportedModel(ValueError):
    """A model attnkit cannot serve through the attention interface; the message says why."""


class LayerMask(Tensor):
    """One layer's mask as structure: which keys a query may see, without an ``i x j`` tensor.

    Local query ``q`` (row ``q`` of the query tensor) may attend local key ``k`` when ``k`` lies
    in ``band`` (``None``: every key; ``band.offset`` is the queries' start minus the keys'
    start, in absolute positions) and ``padding[b, k]`` is True (``None``: no padding).
    ``shape`` is ``(b, 1, i, j)``, the shape of the tensor this stands for. For a causal
    window of ``w`` keys (Mistral's ``sliding_window = w``)::

        band = Band(left=w - 1, right=0, offset)    key k visible from q when
                                                    0 <= (q + offset) - k <= w - 1

    It is also that tensor: a bool ``torch.Tensor`` of ``shape`` (``True`` = may attend), the
    one transformers' sdpa mask function builds, so code between the mask function and
    attention (generation's ``.contiguous()``, a model's own ``ndim == 4`` checks, slicing)
    reads it as it reads sdpa's mask. Metadata costs nothing; any other operation runs on
    ``dense()`` (built once) and returns plain tensors, with two exceptions:

    * added to floating-point scores or biases (eager-style code: ``bias + attention_mask``),
      it is the additive mask eager would have built, ``0`` where allowed and the dtype's
      finite minimum where not, never a bool that adds 0 or 1 and masks nothing;
    * concatenated or padded along the keys, it raises ``UnsupportedModel``: the model changes
      its keys after the mask was built, which the attention interface cannot describe.

    An in-place operation edits ``dense()``; attention then reads that tensor, not the band.
    """

    band: Band | None
    padding: Tensor | None
    _dense: Tensor | None
    _edited: bool

    @staticmethod
    def __new__(
        cls, band: Band | None, padding: Tensor | None, shape: tuple[int, int, int, int]
    ) -> LayerMask:
        device = torch.device("cpu") if padding is None else padding.device
        self = Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=torch.bool, device=device)
        self.band, self.padding, self._dense, self._edited = band, padding, None, False
        return self

    def __init__(self, *args: Any) -> None:  # everything is set in __new__
        pass

    __torch_function__ = torch._C._disabled_torch_function_impl  # plain tensors out

    @property
    def edited(self) -> bool:
        """Whether an in-place operation changed the mask: attention must read ``dense()``."""
        return self._edited

    def mask_fn(self) -> MaskFn | None:
        """The mask as an attnkit mask function that declares its band (``None``: no mask)."""
        parts: list[MaskFn | None] = [band_fn(self.band)]
        if self.padding is not None:
            keep = self.padding

            def key_padding(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
                return keep[b, j]  # (b, 1, 1, j) for b (b, 1, 1, 1) and j (1, 1, 1, j)

            parts.append(key_padding)
        return all_of(*parts)

    def dense(self) -> Tensor:
        """The equivalent bool tensor ``(b, 1, i, j)``, ``True`` = may attend (built once)."""
        if self._dense is None:
            fn, shape = self.mask_fn(), tuple(self.shape)
            if fn is None:
                self._dense = torch.ones(shape, dtype=torch.bool, device=self.device)
            else:
                self._dense = materialize(fn, shape, device=self.device).expand(shape)
        return self._dense

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        _refuse_growing_keys(func, args)
        if func in _ADDITIONS:
            args = _as_additive(args)
        for mask in _written(func, args, kwargs):  # edited in place: attention reads the tensor
            mask._dense = mask.dense().contiguous()
            mask._edited = True
        args, kwargs = tree_map_only(LayerMask, LayerMask.dense, (args, kwargs))
        return func(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> LayerMask:
        padding = None if self.padding is None else self.padding.clone()
        copy = LayerMask(self.band, padding, tuple(self.shape))
        if self._edited:
            copy._dense, copy._edited = self.dense().clone(), True
        return copy

    def __str__(self) -> str:
        band = "every key" if self.band is None else str(self.band)
        padded = "no padding" if self.padding is None else "key padding"
        return f"LayerMask {tuple(self.shape)}: {band}, {padded}"

    __repr__ = __str__


_aten = torch.ops.aten
_ADDITIONS = {_aten.add.Tensor, _aten.add_.Tensor}
_GROWS = {_aten.cat.default, _aten.constant_pad_nd.default}


def _written(func: Any, args: tuple, kwargs: dict) -> list[LayerMask]:
    """The ``LayerMask`` arguments an operation writes to (``mask.masked_fill_(...)``)."""
    if not func._schema.is_mutable:
        return []
    written = []
    for k, arg in enumerate(func._schema.arguments):
        value = args[k] if k < len(args) else kwargs.get(arg.name)
        if isinstance(value, LayerMask) and arg.alias_info is not None and arg.alias_info.is_write:
            written.append(value)
    return written


def _as_additive(args: tuple) -> tuple:
    """``(a, b, ...)`` of an addition with a ``LayerMask`` in the additive form eager adds, when
    the other operand is floating point (a bool or integer one keeps the bool tensor)."""
    a, b, *rest = args
    other = b if isinstance(a, LayerMask) else a
    if not (isinstance(other, Tensor) and other.is_floating_point()):
        return args
    convert = lambda t: to_additive(t.dense(), other.dtype) if isinstance(t, LayerMask) else t  # noqa: E731
    return (convert(a), convert(b), *rest)


def _refuse_growing_keys(func: Any, args: tuple) -> None:
    """A ``LayerMask`` concatenated or padded along its keys: the model changed its keys after
    the mask was built (a compressed or selected KV cache); say so before anything is done."""
    if func not in _GROWS:
        return
    tensors = args[0] if func is _aten.cat.default else [args[0]]
    mask = next((t for t in tensors if isinstance(t, LayerMask)), None)
    if mask is None:
        return
    if func is _aten.cat.default:
        dim = args[1] if len(args) > 1 else 0
        grows = dim % 4 == 3
    else:
        grows = any(args[1][:2])  # F.pad's (left, right) of the last axis
    if grows:
        raise UnsupportedModel(
            f"the model extends attnkit's mask {tuple(mask.shape)} along its keys: it changes "
            "its keys after the mask was built (a compressed or selected KV cache, as "
            "DeepSeek-V4's), which transformers' attention interface does not describe, so "
            "attnkit cannot serve this model; use attn_implementation='eager'"
        )


def band_fn(band: Band | None) -> MaskFn | None:
    """The mask function of a causal band or a window (``None``: no band, every key)."""
    if band is None:
        return None
    if band.left is None and band.right == 0:
        return causal_fn(band.offset)
    if band.left is not None and band.right is not None:
        return window_fn(band.left, band.right, band.offset)
    raise AssertionError(f"no mask function for {band}")  # layer_mask builds no other band
