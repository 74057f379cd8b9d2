"""The scheduler: continuous batching over a paged KV cache, in one thread that owns the model.

A static batch waits for its slowest row; a server cannot. So every *step* re-forms the batch
(Yu et al. 2022, "Orca", section 3.2, iteration-level scheduling):

1. cancelled sequences are retired and their blocks returned;
2. waiting requests join while there is room (``max_batch`` sequences, and free KV blocks for
   the prompt), their first full blocks taken from the prefix cache when known;
3. every decoding sequence brings its one new token; prompts still being prefilled share the
   rest of the step's token budget (``chunk_tokens``) in chunks, so a 2,000-token prompt is
   split over several steps and the running streams keep getting a token every step (the
   chunked prefill of Agrawal et al. 2024, "Sarathi-Serve"); beside them a chunk is measured by
   its work, attention included, so a long prompt's late chunks are shorter;
4. one ``paged_forward`` over all of them; each sequence whose last known token was in the step
   gets its next token, and finished ones leave at once.

A sequence is one list of tokens (prompt, then generated) and ``computed``, how many of them
have their keys in the pool: prefill and decoding are the same operation, "compute the keys of
the tokens not yet computed and sample after the last one". When a sequence needs a block and
none is free, the most recently admitted sequence is *preempted*: its blocks are returned and it
waits at the front of the queue to be recomputed (its full blocks usually come back from the
prefix cache).

Threads: ``submit`` and ``cancel`` may be called from any thread; ``on_event`` callbacks run on
the engine's thread and must be quick (the server hands them to its event loop).
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import torch

from attnkit.backends.fused.paged import POOL_DTYPES
from attnkit.models import llama_step
from attnkit.models.llama import LlamaModel
from attnkit.models.llama_generate import Sampling
from attnkit.serve.forward import PagedBatch, paged_forward
from attnkit.serve.paged import BlockPool, PoolExhausted
from attnkit.serve.prefix import PrefixCache, block_hashes
from attnkit.serve.requests import EventFn, Generation, Scoring, TokenLogprob

__all__ = ["Engine", "EngineStopped", "Generation", "QueueFull", "Scoring", "TokenLogprob"]

log = logging.getLogger("attnkit.serve")


class QueueFull(RuntimeError):
    """The waiting queue holds ``max_waiting`` requests already (the server answers 429)."""


class EngineStopped(RuntimeError):
    """The engine is shutting down and accepts nothing new (the server answers 503)."""


class Engine:
    """Continuous batching for a ``LlamaModel`` (see the module doc).

    Args:
        model: the decoder (its modules are called; quantised projections work too).
        num_blocks, block_size: the KV pool, ``num_blocks * block_size`` positions in all.
        max_batch: sequences that run at once.
        max_waiting: requests that may wait; ``submit`` raises ``QueueFull`` beyond it.
        chunk_tokens: tokens per step (decoding tokens first, prompt chunks share the rest).
        prefix_caching: share full blocks of equal prefixes between requests.
        eos_id: the end-of-sequence token (``None``: only ``max_tokens`` ends a sequence).
        kv_dtype: how the pool stores keys and values: ``torch.float32``, ``torch.float16`` or
            ``torch.bfloat16`` (the last two: half the memory, so twice the positions in the
            same bytes, and a decoding step reads half as much; float16 keeps 11 significant
            bits to bfloat16's 8; attention still computes in float32); ``None``: the model's
            float dtype (float32 for a quantised model).
        threads: torch's intra-op threads for the steps of ``start``'s thread (``None``: the
            count torch has when the engine is made). A thread's count is its own (OpenMP's);
            the thread that loaded the model should run at one (``torch.set_num_threads(1)``
            before loading, as ``attnkit serve`` does): a second thread that computes in
            parallel keeps a second pool of OpenMP threads, and with more of them than cores
            the steps' threads sleep between the step's parallel regions instead of waiting
            awake, and a step takes longer.
    """

    def __init__(
        self,
        model: LlamaModel,
        *,
        num_blocks: int = 512,
        block_size: int = 16,
        max_batch: int = 16,
        max_waiting: int = 64,
        chunk_tokens: int = 256,
        prefix_caching: bool = True,
        eos_id: int | None = None,
        threads: int | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        if kv_dtype is not None and kv_dtype not in POOL_DTYPES:
            raise ValueError(
                "kv_dtype must be torch.float32, torch.bfloat16 or torch.float16 (or None: the "
                f"model's), got {kv_dtype!r}"
            )
        counts = {"max_batch": max_batch, "chunk_tokens": chunk_tokens}
        if threads is not None:
            counts["threads"] = threads
        for name, value in counts.items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting must be an int >= 0, got {max_waiting!r}")
        if chunk_tokens < max_batch:
            raise ValueError(
                f"chunk_tokens ({chunk_tokens}) must be at least max_batch ({max_batch}): every "
                "running sequence decodes one token per step"
            )
        c = model.config
        self.model = model.eval()
        weight = next(model.parameters())
        self.pool = BlockPool(
            num_blocks,
            block_size,
            num_layers=c.num_layers,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            dtype=kv_dtype or (weight.dtype if weight.is_floating_point() else torch.float32),
            device=weight.device,
        )
        self.cache = PrefixCache(self.pool, enabled=prefix_caching)
        # Where the compiled step serves this model, its weights are packed for it now, not
        # in the first request's step (on AVX2 that packing copies the matrices with their
        # rows interleaved: about 0.2 s for SmolLM2).
        with torch.inference_mode():
            llama_step.why_not_paged(self.model, self.pool.keys, self.pool.values)
        self.max_len = c.max_len
        # Keys whose attention costs a token as much as its products (multiply-adds per token
        # of the projections and the feed-forward, over 2 h d per key): 3,072 for SmolLM2-135M.
        hd, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        per_token = 2 * c.embed_dim * hd + 2 * c.embed_dim * kv + 3 * c.embed_dim * c.ffn_dim
        self.keys_per_token = per_token / (2 * hd)
        self.max_batch, self.max_waiting, self.chunk_tokens = max_batch, max_waiting, chunk_tokens
        self.eos_id = eos_id
        self.threads = threads if threads is not None else torch.get_num_threads()
        self.waiting: deque[Generation] = deque()
        self.running: list[Generation] = []
        self.counters = dict.fromkeys(
            ("requests", "prompt_tokens", "generated_tokens", "prefill_tokens", "steps"), 0
        )
        self.counters.update(preemptions=0, cancelled=0, errors=0)
        self._cond = threading.Condition()
        self._accepting = True
        self._abort = False
        self._thread: threading.Thread | None = None
        # Called after every step, on the thread that ran it: a server hands the step's events
        # to its event loop at once here instead of waking the loop for each token.
        self.after_step: list[Callable[[], None]] = []
        self._snapshot()

    # --- the callers' side (any thread) --------------------------------------------------------

    def submit(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        sampling: Sampling | None = None,
        *,
        seed: int | None = None,
        ignore_eos: bool = False,
        on_event: EventFn | None = None,
        scoring: Scoring | None = None,
    ) -> Generation:
        """Queue a request. Raises ``ValueError`` for a request that can never run (an empty
        or too long prompt, ``max_tokens`` < 1 or past the context, a biased token outside
        the vocabulary, a seed torch cannot take), ``QueueFull`` or ``EngineStopped`` for one
        the server cannot take now."""
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Iterable):
            raise TypeError(f"prompt must be a sequence of token ids, got {type(prompt).__name__}")
        prompt = list(prompt)
        for name, value, kind in (("sampling", sampling, Sampling), ("scoring", scoring, Scoring)):
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"{name} must be a {kind.__name__} or None, got {value!r}")
        if on_event is not None and not callable(on_event):
            raise TypeError(f"on_event must be a function (token, reason), got {on_event!r}")
        vocab = self.model.config.vocab_size
        scoring = scoring or Scoring()
        outside = [t for t, _ in scoring.logit_bias if t >= vocab]
        if outside:
            raise ValueError(f"logit_bias names token {outside[0]}, outside 0..{vocab - 1}")
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        for t in prompt:  # ints, numpy's too (operator.index), never bools or floats
            if isinstance(t, bool) or not hasattr(type(t), "__index__"):
                raise TypeError(f"the prompt's token ids must be ints, got {t!r}")
        prompt = [operator.index(t) for t in prompt]
        if not all(0 <= t < vocab for t in prompt):
            raise ValueError(f"the prompt has token ids outside 0..{vocab - 1}")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if len(prompt) + max_tokens > self.max_len:
            raise ValueError(
                f"the prompt ({len(prompt)} tokens) and max_tokens ({max_tokens}) exceed the "
                f"model's context of {self.max_len} tokens"
            )
        if seed is not None and (
            not isinstance(seed, int) or isinstance(seed, bool) or not -(2**63) <= seed < 2**64
        ):
            raise ValueError(
                f"seed must be an int in -2**63..2**64 - 1 (torch.Generator's seeds), got {seed!r}"
            )
        capacity = self.pool.num_blocks * self.pool.block_size
        if len(prompt) + 1 > capacity:
            raise ValueError(
                f"the prompt ({len(prompt)} tokens) does not fit the server's KV cache of "
                f"{capacity} positions (--kv-blocks)"
            )
        events: queue.SimpleQueue | None = None
        if on_event is None:
            events = queue.SimpleQueue()
            on_event = lambda token, reason: events.put((token, reason))  # noqa: E731
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.pool.keys[0].device).manual_seed(seed)
        gen = Generation(
            prompt_len=len(prompt),
            max_tokens=max_tokens,
            sampling=sampling or Sampling(),
            tokens=prompt,
            on_event=on_event,
            generator=generator,
            ignore_eos=ignore_eos,
            scoring=scoring,
            _events=events,
        )
        with self._cond:
            if not self._accepting:
                raise EngineStopped("the server is shutting down")
            if len(self.waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self.waiting)} requests are waiting already")
            self.waiting.append(gen)
            self.counters["requests"] += 1
            self.counters["prompt_tokens"] += len(prompt)
            self._cond.notify()
        return gen

    def cancel(self, gen: Generation) -> None:
        """Stop ``gen`` (a client went away): its blocks return at the next step."""
        with self._cond:
            gen.cancelled = True
            self._cond.notify()

    def start(self) -> Engine:
        """Run steps in a background thread until ``stop``."""
        self._thread = threading.Thread(target=self._loop, name="attnkit-serve-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Accept nothing new, let what runs finish for up to ``timeout`` seconds, cancel the
        rest, and end the thread."""
        with self._cond:
            self._accepting = False
            self._cond.notify()
        if self._thread is not None:
            with self._cond:
                self._cond.wait_for(lambda: not self._busy(), timeout=timeout)
                self._abort = True
                for gen in [*self.waiting, *self.running]:
                    gen.cancelled = True
                self._cond.notify()
            self._thread.join()
            self._thread = None
        else:
            self._abort = True
            for gen in [*self.waiting, *self.running]:
                gen.cancelled = True
            self.step()

    def run_until_idle(self) -> None:
        """Run steps in the calling thread until nothing waits or runs (without ``start``)."""
        while self._busy():
            self.step()

    # --- the engine's side ----------------------------------------------------------------------

    def _busy(self) -> bool:
        return bool(self.waiting or self.running)

    def _loop(self) -> None:
        torch.set_num_threads(self.threads)  # this thread's own count (see ``threads``)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._busy() or self._abort)
                if self._abort and not self._busy():
                    return
            try:
                self.step()
            except Exception:  # a bug must not leave the clients hanging: fail the batch
                log.exception("an engine step failed; its sequences end with an error")
                self.counters["errors"] += 1
                with self._cond:  # the waiting too: one of them may be what fails every step
                    for gen in [*self.running, *self.waiting]:
                        self._finish(gen, "error")
                    self.waiting.clear()
            with self._cond:
                self._cond.notify_all()  # stop() waits for the engine to be idle

    @property
    def accepting(self) -> bool:
        """False once ``stop`` began: ``submit`` raises ``EngineStopped``."""
        return self._accepting

    @property
    def started(self) -> bool:
        return self._thread is not None

    def step(self) -> None:
        """One iteration: retire, admit, compute one batch, sample, retire finished ones."""
        try:
            self._step()
        finally:
            self._snapshot()
            for fn in self.after_step:
                with contextlib.suppress(Exception):  # a listener's failure is its own
                    fn()

    def _snapshot(self) -> None:
        """Gauges for other threads (``/metrics``), replaced whole after every step."""
        free, cached = self.pool.num_free, self.cache.num_evictable
        self.gauges = {
            "waiting": len(self.waiting),
            "running": len(self.running),
            "blocks_free": free,
            "blocks_cached": cached,
            "blocks_used": self.pool.num_blocks - free - cached,
            "prefix_hit_tokens": self.cache.hit_tokens,
            "prefix_evictions": self.cache.evictions,
        }

    def _step(self) -> None:
        with self._cond:
            for gen in [g for g in self.waiting if g.cancelled]:
                self.waiting.remove(gen)
                self._finish(gen, "cancelled")
        for gen in [g for g in self.running if g.cancelled]:
            self._finish(gen, "cancelled")
        self._admit()
        plan = self._plan()
        if not plan:
            return
        batch = PagedBatch.build(
            [g.tokens[g.computed : g.computed + n] for g, n in plan],
            [g.computed for g, _ in plan],
            [g.table for g, _ in plan],
            self.pool.block_size,
            device=self.pool.keys[0].device,
        )
        with torch.inference_mode():
            logits = paged_forward(self.model, batch, self.pool)  # (b, V)
        self.counters["steps"] += 1
        for row, (gen, n) in enumerate(plan):
            if gen.computed < gen.prompt_len:
                self.counters["prefill_tokens"] += min(n, gen.prompt_len - gen.computed)
            gen.computed += n
            self._publish(gen)
            if gen.computed == len(gen.tokens):
                scores = logits[row : row + 1]  # (1, V)
                token = int(gen.sampling.next_token(gen.scores(scores), gen.generator)[0])
                gen.record(scores, token)
                gen.tokens.append(token)
                self.counters["generated_tokens"] += 1
                try:
                    gen.on_event(token, None)
                except Exception:  # its owner's failure ends its request, not the batch's
                    log.exception("a request's on_event failed; that request ends with an error")
                    self.counters["errors"] += 1
                    self._finish(gen, "error")
                    continue
                reason = self._finished(gen)
                if reason is not None:
                    self._finish(gen, reason)

    def _finished(self, gen: Generation) -> str | None:
        if self.eos_id is not None and gen.tokens[-1] == self.eos_id and not gen.ignore_eos:
            return "stop"
        if len(gen.generated) >= gen.max_tokens or len(gen.tokens) >= self.max_len:
            return "length"
        return None

    def _admit(self) -> None:
        with self._cond:
            while self.waiting and len(self.running) < self.max_batch:
                gen = self.waiting[0]
                s = self.pool.block_size
                blocks = -(-len(gen.tokens) // s)
                if blocks > self.pool.num_blocks:  # preempted after outgrowing the whole pool
                    self.waiting.popleft()
                    self._finish(gen, "length")
                    continue
                full = (len(gen.tokens) - 1) // s  # keep one token to compute: its logits
                hashes = block_hashes(gen.tokens[: full * s], s)
                matched = self.cache.match(hashes)
                need = blocks - len(matched)
                if need > self.pool.num_free + self.cache.num_evictable:
                    for block in matched:
                        self.pool.release(block)
                    self.cache.hit_tokens -= len(matched) * s
                    return  # the first in line waits for blocks (no overtaking)
                self.waiting.popleft()
                gen.table, gen.hashes = matched, hashes[: len(matched)]
                gen.computed = gen.cached_tokens = len(matched) * s
                self.running.append(gen)

    def _plan(self) -> list[tuple[Generation, int]]:
        """Which sequences compute how many tokens this step, with the blocks they need."""
        budget = self.chunk_tokens
        plan: list[tuple[Generation, int]] = []
        decoding = [g for g in self.running if len(g.tokens) - g.computed == 1]
        prefilling = [g for g in self.running if len(g.tokens) - g.computed > 1]
        for gen in decoding + prefilling:
            if gen not in self.running:  # preempted to make room for an earlier one
                continue
            n = min(len(gen.tokens) - gen.computed, budget)
            if n > 1 and decoding:  # beside streams: the budget's worth of work, not of tokens
                n = min(n, self._tokens_of_work(gen.computed, budget))
            if n <= 0:
                break
            if self._grow(gen, gen.computed + n):
                plan.append((gen, n))
                budget -= n
        return [(g, n) for g, n in plan if g in self.running]

    def _tokens_of_work(self, start: int, work: int) -> int:
        """How many prompt tokens from position ``start`` on cost about ``work`` tokens' worth of
        a step (at least 1). A token at position p costs its products, the same at every p,
        plus its attention over p keys: 1 + p / ``keys_per_token`` in all. So a chunk beside
        decoding streams shrinks as its context grows, and their steps stay about as long as
        one of ``chunk_tokens`` tokens at the start of a prompt, where they would grow with it."""
        # n tokens from start cost n + (n start + n (n - 1) / 2) / K: the root of that = work
        k = self.keys_per_token
        b = 1 + (start - 0.5) / k
        n = int((-b + math.sqrt(b * b + 2 * work / k)) * k)
        return max(1, min(work, n))

    def _grow(self, gen: Generation, length: int) -> bool:
        """Give ``gen`` blocks for ``length`` positions, preempting the most recently admitted
        sequences if needed. False if ``gen`` itself was preempted."""
        while len(gen.table) * self.pool.block_size < length:
            try:
                gen.table.append(self.cache.allocate())
            except PoolExhausted:
                if self.running == [gen]:  # alone, and the whole pool is not enough: it ends
                    self._finish(gen, "length")
                    return False
                victim = self.running[-1]
                self._preempt(victim)
                if victim is gen:
                    return False
        return True

    def _preempt(self, gen: Generation) -> None:
        self.counters["preemptions"] += 1
        self.running.remove(gen)
        self._release(gen)
        gen.computed = 0
        with self._cond:
            self.waiting.appendleft(gen)

    def _publish(self, gen: Generation) -> None:
        """Name every newly filled block by its hash, so later requests can share it."""
        s = self.pool.block_size
        done = len(gen.hashes)
        full = gen.computed // s
        if full > done:
            parent = gen.hashes[-1] if gen.hashes else b""
            new = block_hashes(gen.tokens[done * s : full * s], s, parent)
            for k, h in enumerate(new, done):
                self.cache.publish(h, gen.table[k])
            gen.hashes.extend(new)

    def _release(self, gen: Generation) -> None:
        for block in gen.table:
            self.pool.release(block)
        gen.table, gen.hashes = [], []

    def _finish(self, gen: Generation, reason: str) -> None:
        if gen in self.running:
            self.running.remove(gen)
        self._release(gen)
        if reason == "cancelled":
            self.counters["cancelled"] += 1
        gen.finish_reason = reason
        with contextlib.suppress(Exception):  # a callback's failure is its owner's business
            gen.on_event(None, reason)
