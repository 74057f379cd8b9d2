"""A request as the engine holds it: what it asked for (``Scoring``, ``Sampling``) and what it
has got so far (``Generation``: its tokens, its blocks, its log-probabilities), and how it is
told (``EventFn``). ``attnkit.serve.engine`` schedules them."""

from __future__ import annotations

import functools
import math
import queue
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from attnkit.models.llama_generate import Sampling

__all__ = ["EventFn", "Generation", "Scoring", "TokenLogprob"]

# on_event(token, finish_reason): a new token (finish None), then once (None, reason) where
# reason is "stop" (end of sequence), "length", "cancelled" or "error".
EventFn = Callable[[int | None, str | None], object]


@dataclass(frozen=True)
class Scoring:
    """What a request changes in the scores before sampling, and what it asks to be told.

    ``logit_bias``: token id -> a number in [-100, 100] added to its logit (-100 all but bans
    it). ``presence_penalty`` and ``frequency_penalty`` (each in [-2, 2]): every token that was
    generated ``c`` times so far has ``c * frequency_penalty + (c > 0) * presence_penalty``
    taken off its logit (OpenAI's definition). ``logprobs``: ``None``, or how many of the most
    likely tokens to report with each generated token's log-probability (0..20), both from the
    model's own distribution (before the bias, the penalties, temperature and top_p)."""

    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(f"logit_bias: token ids must be ints >= 0, got {token!r}")
            if not _finite(bias) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias: a bias must be in [-100, 100], got {bias!r}")
        n = self.logprobs
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= 20):
            raise ValueError(f"logprobs must be None or an int in 0..20, got {n!r}")

    @property
    def changes_scores(self) -> bool:
        return bool(self.logit_bias) or bool(self.presence_penalty or self.frequency_penalty)

    @functools.cached_property
    def bias(self) -> tuple[Tensor, Tensor]:
        """``logit_bias`` as its token ids and biases (float64), made once per request, not
        once per step: a request may bias every token of the vocabulary."""
        ids = torch.tensor([t for t, _ in self.logit_bias], dtype=torch.long)
        return ids, torch.tensor([b for _, b in self.logit_bias], dtype=torch.float64)


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# One generated token's log-probability and the ``logprobs`` most likely (token, log-probability)
# pairs of its step, most likely first.
TokenLogprob = tuple[float, list[tuple[int, float]]]


@dataclass(eq=False)
class Generation:
    """One request as the engine runs it. ``tokens`` is the prompt then the generated tokens."""

    prompt_len: int
    max_tokens: int
    sampling: Sampling
    tokens: list[int]
    on_event: EventFn
    generator: torch.Generator | None = None
    ignore_eos: bool = False  # run to max_tokens (benchmarks: every request the same length)
    computed: int = 0  # tokens whose keys are in the pool
    table: list[int] = field(default_factory=list)  # block table
    hashes: list[bytes] = field(default_factory=list)  # of the full blocks, published
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (last admission)
    finish_reason: str | None = None
    cancelled: bool = False
    scoring: Scoring = field(default_factory=Scoring)
    counts: dict[int, int] = field(default_factory=dict)  # generated tokens (the penalties)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated token
    _events: queue.SimpleQueue | None = None

    def scores(self, logits: Tensor) -> Tensor:
        """``logits (1, V)`` with the bias and the penalties applied (the same tensor if none)."""
        sc = self.scoring
        if not sc.changes_scores:
            return logits
        out = logits.clone()
        if sc.logit_bias:
            ids, bias = sc.bias
            out[0, ids] += bias.to(out.dtype)  # each bias rounded once, as from the floats
        if self.counts and (sc.presence_penalty or sc.frequency_penalty):
            ids = torch.tensor(list(self.counts))
            c = torch.tensor(list(self.counts.values()), dtype=out.dtype)
            out[0, ids] -= c * sc.frequency_penalty + sc.presence_penalty
        return out

    def record(self, logits: Tensor, token: int) -> None:
        """After sampling ``token`` from ``logits (1, V)``: its log-probability and the top
        ones (when asked for), and its count (the penalties)."""
        n = self.scoring.logprobs
        if n is not None:
            logp = torch.log_softmax(logits[0].double(), dim=-1)  # (V,)
            pairs: list[tuple[int, float]] = []
            if n:
                top = logp.topk(n)
                pairs = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            self.logprobs.append((float(logp[token]), pairs))
        if self.scoring.presence_penalty or self.scoring.frequency_penalty:
            self.counts[token] = self.counts.get(token, 0) + 1

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    def result(self, timeout: float | None = None) -> tuple[list[int], str]:
        """Wait for the end (only without ``on_event``): the generated tokens and the reason."""
        if self._events is None:
            raise ValueError("result() needs a Generation submitted without on_event")
        while True:
            _, reason = self._events.get(timeout=timeout)
            if reason is not None:
                return self.generated, reason
