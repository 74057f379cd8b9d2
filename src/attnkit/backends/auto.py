"""``explain``: which backend ``backend="auto"`` would take for a call, and why, in sentences.

    >>> print(explain(q, k, v, bias=alibi_fn(8)))          # doctest: +SKIP
    auto takes tiled for query (1, 8, 4096, 64), key (1, 8, 4096, 64), float32, forward;
    bias: relative function; memory budget 1.0 GiB
      tiled: chosen, the cheapest estimate: about 180 ms; 128 tiles of 256 x 512, 100% of pairs
      torch: not chosen: 1.52x the chosen, about 274 ms; builds the bias function as a ...
      sparse: cannot serve this call: the sparse backend needs a mask function that ...

The estimates come from ``attnkit.backends.cost``; the sentences from ``registry.Verdict``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit.backends import cost
from attnkit.functional import make_call
from attnkit.masks import BiasFn, MaskFn, structure_of
from attnkit.registry import (
    AttentionCall,
    Verdict,
    _bytes,
    forced_backend,
    get_memory_budget,
    weigh,
)

__all__ = ["Explanation", "explain"]


@dataclass(frozen=True)
class Explanation:
    """Auto's choice for one call: ``backend`` (None when nothing can serve it), every
    candidate's ``verdicts`` (the chosen one first), and what it weighed (``summary``).
    ``str()`` and ``repr()`` give one sentence per candidate."""

    backend: str | None
    verdicts: tuple[Verdict, ...]
    summary: str
    budget: int
    forced: str | None = None
    source: str = ""  # where the numbers come from (this machine's measurements, or none)

    def lines(self) -> list[str]:
        best = self.verdicts[0].estimate if self.verdicts and self.verdicts[0].chosen else None
        seconds = best.seconds if best is not None else None
        head = f"auto takes {self.backend}" if self.backend else "no backend can serve"
        out = [f"{head} for {self.summary}; memory budget {_bytes(self.budget)}"]
        if self.source:
            out.append(f"  ({self.source})")
        out += [f"  {v.sentence(seconds)}" for v in self.verdicts]
        if self.forced is not None:
            out.append(f"  (inside use({self.forced!r}): calls here run on {self.forced})")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    __repr__ = __str__


def explain(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | MaskFn | None = None,
    *,
    bias: Tensor | BiasFn | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    generator: torch.Generator | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    score_mod=None,
) -> Explanation:
    """Which backend ``scaled_dot_product_attention(..., backend="auto")`` would take for these
    arguments (the same as its), and one sentence per candidate: why it cannot serve the
    call, or its estimated cost. Gradients count as needed when grad mode is on and an input
    requires grad, as in the call itself. Nothing is computed but the estimates."""
    call = make_call(
        query,
        key,
        value,
        mask,
        bias=bias,
        is_causal=is_causal,
        scale=scale,
        dropout_p=dropout_p,
        return_weights=return_weights,
        generator=generator,
        softcap=softcap,
        sinks=sinks,
        score_mod=score_mod,
    )
    return explain_call(call)


def explain_call(call: AttentionCall) -> Explanation:
    """``explain`` for a validated call."""
    verdicts = tuple(weigh(call))
    chosen = verdicts[0].backend if verdicts and verdicts[0].chosen else None
    forced = forced_backend()
    return Explanation(
        chosen,
        verdicts,
        _summary(call),
        get_memory_budget(),
        None if forced in (None, "auto") else forced,
        cost.source(call),
    )


def _summary(call: AttentionCall) -> str:
    q, k = call.query, call.key
    words = [
        f"query {tuple(q.shape)}, key {tuple(k.shape)}",
        str(q.dtype).removeprefix("torch."),
        "forward and backward" if call.needs_grad else "forward",
    ]
    for name, value in (("mask", call.mask), ("bias", call.bias)):
        if isinstance(value, Tensor):
            words.append(f"{name}: tensor {tuple(value.shape)}")
        elif value is not None:
            structure = structure_of(value)
            kind = "function" if str(structure) == "no structure" else f"function, {structure}"
            words.append(f"{name}: {kind}")
    if call.is_causal:
        words.append("causal")
    if call.score_mod is not None:
        words.append("score_mod")
    if call.return_weights:
        words.append("weights returned")
    if call.dropout_p > 0:
        words.append(f"dropout {call.dropout_p}")
    return ", ".join(words)
