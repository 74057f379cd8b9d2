"""What happens to a scaled score before the softmax, as one description (``ScoreModification``):
logit soft-capping, an additive bias (tensor or function) and FlexAttention's ``score_mod``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit.masks import BiasFn

__all__ = ["ScoreMod", "ScoreModification"]

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
"""``score_mod(score, b, h, i, j) -> score``: a score modification (FlexAttention's)."""


@dataclass(frozen=True)
class ScoreModification:
    """What happens to a scaled score ``s = scale * q.k`` before masks and the softmax, as data:
    one description for the reference and every engine, applied in this order::

        s = softcap * tanh(s / softcap)     softcap: caps q.k alone (Gemma 2, section 2)
        s = s + bias                        a bias tensor, or bias_fn(b, h, i, j)
        s = score_mod(s, b, h, i, j)        FlexAttention's score modification

    ``bias=`` and ``softcap=`` of ``scaled_dot_product_attention`` are the special cases a
    backend may have a fast path for; ``apply`` is the order above, written once, used by the
    reference (``attention_math``) and the tiled engine. A backend reads the parts it serves
    (``parts``) and names the others in ``why_not`` (``unserved``).
    """

    softcap: float | None = None
    bias: Tensor | None = None  # float, broadcastable to the scores
    bias_fn: BiasFn | None = None
    score_mod: ScoreMod | None = None

    @property
    def parts(self) -> tuple[str, ...]:
        """The parts present, in the order they apply: ``"softcap"``, ``"bias"``,
        ``"bias_fn"``, ``"score_mod"``."""
        present = (self.softcap, self.bias, self.bias_fn, self.score_mod)
        names = ("softcap", "bias", "bias_fn", "score_mod")
        return tuple(n for n, x in zip(names, present, strict=True) if x is not None)

    def unserved(self, serves: Iterable[str], who: str) -> str | None:
        """Why ``who`` (a backend, in words) cannot serve this modification, given the parts it
        ``serves``; None when it serves every part present."""
        missing = [p for p in self.parts if p not in set(serves)]
        if not missing:
            return None
        words = {
            "softcap": "logit soft-capping (softcap)",
            "bias": "additive bias tensor (bias)",
            "bias_fn": "bias function (bias)",
            "score_mod": "score modification (score_mod)",
        }
        return f"{who} has no {' and no '.join(words[p] for p in missing)}; 'tiled' has"

    def apply(
        self,
        s: Tensor,
        bias: Tensor | None = None,
        index: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
        *,
        unit: float = 1.0,
        slope: bool = False,
        inplace: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """The modified scores of ``s`` and, when ``slope``, ``d capped / d raw = 1 - tanh^2``
        (None without a cap): the backward's chain rule through the cap.

        ``s`` holds scores in units of ``unit`` (1: natural; ``log2(e)``: base 2, as the tiled
        engine keeps them), in any layout; ``bias`` the values of ``self.bias`` and
        ``self.bias_fn`` for these scores, natural units, broadcastable to ``s`` or to ``s``
        with its rows split as ``(queries, g)`` (one more axis, a relative table's strided
        view); ``index`` the ``(b, h, i, j)`` position of each score as tensors broadcastable to
        ``s``, read only by ``score_mod``, which is called on ``s`` itself (natural units)
        whatever its layout, so an engine passes its own tensor and no layout copy is made.
        ``inplace`` rewrites ``s`` where it can (an engine's tile); the reference keeps autograd's
        graph with ``inplace=False``."""
        cap_slope = None
        if self.softcap is not None:
            cap = self.softcap * unit
            if inplace:
                s.div_(cap).tanh_()
                if slope:
                    cap_slope = s.square().neg_().add_(1.0)
                s.mul_(cap)
            else:
                t = torch.tanh(s / cap)
                cap_slope = 1.0 - t.square() if slope else None
                s = cap * t
        if bias is not None:
            target = s
            if bias.dim() == s.dim() + 1:  # rows (queries * g) split as (queries, g)
                target = s.view(*s.shape[:-2], bias.shape[-3], -1, s.shape[-1])  # (..., i, g, j)
            if inplace:
                target.add_(bias, alpha=unit)
            else:
                s = (target + bias * unit).view(s.shape)  # (..., i g, j) again
        if self.score_mod is not None:
            if index is None:
                raise ValueError("ScoreModification.apply: a score_mod needs the index tensors")
            if unit != 1.0:  # to natural units, and back: arithmetic, no layout copy
                s = s.mul_(1.0 / unit) if inplace else s / unit
            s = self._modified(s, index)
            if unit != 1.0:
                s = s * unit
        return s, cap_slope

    def _modified(self, s: Tensor, index: tuple[Tensor, Tensor, Tensor, Tensor]) -> Tensor:
        """``score_mod`` on scores ``s`` (natural units), its result checked."""
        assert self.score_mod is not None
        out = self.score_mod(s, *index)
        if not isinstance(out, Tensor) or out.shape != s.shape:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(
                f"score_mod must return a tensor of the score's shape {tuple(s.shape)}, got {got}"
            )
        return out.to(s.dtype)
