"""A Llama-family decoder built from attnkit's modules, and the bundled SmolLM2 chat model.

Shape vocabulary: ``b`` batch, ``i`` new positions (this call), ``j`` key positions (cached and
new), ``e`` embed_dim, ``h`` query heads, ``h_kv`` key/value heads, ``d`` head width, ``V``
vocabulary.

The network (Touvron et al. 2023, "LLaMA", section 2.2), one block::

    x = x + attn(rms_norm(x))        # causal GQA self-attention, RoPE on q and k, no biases
    x = x + ffn(rms_norm(x))         # SwiGLU: down(silu(gate(x)) * up(x))

then a final RMSNorm and logits through the token embedding (tied) or an output matrix.
Every piece is attnkit's: ``MultiHeadAttention`` (``in_proj`` holds ``[q; k; v]``),
``RotaryEmbedding``, ``FeedForward(activation="swiglu")``, ``RMSNorm``, ``KVCache``.

Left padding: rows of a batch have different lengths, so shorter prompts are padded on the left
and ``padding`` (``(b, j)``, ``True`` = a real token) says which keys exist. A row's positions
count its real tokens only (the first real token is position 0), so a padded row computes what it
would alone; pad keys are masked out, and a pad query (which sees only pads) gives zeros.

``load_pretrained()`` gives the bundled SmolLM2-135M-Instruct (GGUF) with its tokenizer, ready to
``generate`` text and ``chat``. A GGUF file's weights stay in their block formats
(``attnkit.quant``): the projections and the embedding become ``QuantizedLinear`` and
``QuantizedEmbedding`` modules in the same places, and the tied output projection multiplies by
the embedding's own bytes (``LlamaModel.project_out``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit._memory import check_fits
from attnkit._numerics import compute_dtype
from attnkit._progress import progress
from attnkit.attention import KVCache, MultiHeadAttention
from attnkit.blocks import FeedForward
from attnkit.models import llama_step
from attnkit.models.llama_config import LlamaConfig
from attnkit.models.llama_generate import Sampling, decode, stop_strings, text_pieces
from attnkit.models.llama_loading import (
    CheckpointError,
    bundled_model_path,
    read_checkpoint,
)
from attnkit.models.llama_tokenizer import LlamaTokenizer
from attnkit.models.llama_weights import choose_weights, column_major, keep_blocks
from attnkit.norms import RMSNorm
from attnkit.positional import RotaryEmbedding
from attnkit.quant import QuantizedEmbedding, prepare_kernel

__all__ = [
    "LlamaBlock",
    "LlamaConfig",
    "LlamaModel",
    "LlamaOutput",
    "PretrainedLlama",
    "Sampling",
    "bundled_model_path",
    "load_pretrained",
]


_ID_DTYPES = (torch.int64, torch.int32)


@dataclass(frozen=True)
class _Angles:
    """RoPE for the exact positions of one forward call, shared by every layer.

    ``cos``/``sin`` are ``(i, d)``, or ``(b, 1, i, d)`` when rows start at different positions
    (left padding). ``rotate`` ignores the ``offset`` the attention passes (its cache length):
    the positions already include it.
    """

    cos: Tensor
    sin: Tensor

    def rotate(self, x: Tensor, offset: int = 0) -> Tensor:
        return RotaryEmbedding.apply(x, self.cos, self.sin)


class LlamaBlock(nn.Module):
    """One pre-norm Llama layer: ``attn_norm``, ``attn``, ``ffn_norm``, ``ffn`` (see module doc)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        c = config
        self.attn_norm = RMSNorm(c.embed_dim, eps=c.eps)
        self.attn = MultiHeadAttention(
            c.embed_dim, c.num_heads, num_kv_heads=c.num_kv_heads, bias=False, backend=c.backend
        )
        self.ffn_norm = RMSNorm(c.embed_dim, eps=c.eps)
        self.ffn = FeedForward(c.embed_dim, c.ffn_dim, activation="swiglu", bias=False)

    def forward(
        self,
        x: Tensor,
        *,
        rope: _Angles,
        mask: Tensor | None = None,
        cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """``x (b, i, e)`` -> ``(x (b, i, e), weights (b, h, i, j) or None)``."""
        h, weights = self.attn(
            self.attn_norm(x),
            mask=mask,
            # One new token sees every cached key and itself: causal changes nothing, and
            # without it the backend needs no mask at all (the common decoding step).
            is_causal=x.shape[1] > 1,
            rope=rope,
            cache=cache,
            need_weights=need_weights,
        )
        x = x + h
        x = x + self.ffn(self.ffn_norm(x))
        return x, weights


@dataclass(frozen=True)
class LlamaOutput:
    """``logits (b, i, V)`` (only the last position's, ``(b, 1, V)``, with ``last_only``) and,
    with ``need_weights``, one ``(b, h, i, j)`` attention tensor per layer."""

    logits: Tensor
    weights: list[Tensor] | None = None


class LlamaModel(nn.Module):
    """The decoder: ``embed``, ``blocks``, ``norm`` and, when embeddings are not tied, ``lm_head``.

    ``forward(ids, *, caches=None, padding=None, last_only=False, need_weights=False)``:

    * ``ids``: ``(b, i)`` token ids, the new tokens of this call.
    * ``caches``: one ``KVCache`` per layer (``new_caches()``), or ``None`` for a plain forward.
      The new tokens follow what the caches hold: causal attention aligned bottom-right, so
      decoding one token at a time gives the logits of one forward over the whole sequence.
    * ``padding``: bool ``(b, j)``, ``True`` = a real token, over the cached *and* the new
      positions (``j = cache length + i``); ``None`` means every position is real.
    * ``last_only``: compute logits for the last position only (what generation needs; the
      output projection is the largest matmul of a step).

    A decoding step (one new token over preallocated caches, no grad, no weights asked) of a
    model whose weights stay quantised runs as one compiled call when the fused kernel is loaded
    (``attnkit.models.llama_step``, the same values in float32); ``llama_step.why_not`` says why
    a step takes the modules instead.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        # Shapes for a loader to fill (on meta) get no random values: normal_ on meta costs a
        # second, the first time in a process (it imports torch._dynamo).
        shapes_only = torch.get_default_device().type == "meta"
        weight = torch.empty(c.vocab_size, c.embed_dim) if shapes_only else None
        self.embed = nn.Embedding(c.vocab_size, c.embed_dim, _weight=weight)
        self.rope = RotaryEmbedding(c.head_dim, base=c.rope_base)
        self.blocks = nn.ModuleList(LlamaBlock(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.embed_dim, eps=c.eps)
        self.lm_head = (
            None if c.tie_embeddings else nn.Linear(c.embed_dim, c.vocab_size, bias=False)
        )
        if not shapes_only:
            nn.init.normal_(self.embed.weight, std=0.02)  # Llama's initializer_range

    def new_caches(
        self, max_len: int | None = None, *, kv_dtype: torch.dtype | None = None
    ) -> list[KVCache]:
        """One empty ``KVCache`` per layer (``max_len``: preallocate that many positions;
        ``kv_dtype``: ``torch.float16``, ``torch.bfloat16`` or ``torch.float32``, ``None``: the
        model's dtype)."""
        return [KVCache(max_len, kv_dtype=kv_dtype) for _ in self.blocks]

    def angles(self, n: int, offset: int, padding: Tensor | None, device: torch.device) -> _Angles:
        """RoPE angles for the ``n`` new positions after ``offset`` cached ones, cast once to
        the dtype the rotation computes in (every layer reuses them)."""
        if padding is None:
            cos, sin = self.rope.cos_sin(n, offset, device=device)  # (i, d)
        else:
            positions = (padding.long().cumsum(-1) - 1).clamp(min=0)  # (b, j): real tokens before
            cos, sin = self.rope.cos_sin_at(positions[:, None, -n:], device=device)  # (b, 1, i, d)
        dtype = compute_dtype(self.norm.weight.dtype)
        return _Angles(cos.to(dtype), sin.to(dtype))

    def forward(
        self,
        ids: Tensor,
        *,
        caches: list[KVCache] | None = None,
        padding: Tensor | None = None,
        last_only: bool = False,
        need_weights: bool = False,
    ) -> LlamaOutput:
        c = self.config
        if not isinstance(ids, Tensor) or ids.ndim != 2 or ids.dtype not in _ID_DTYPES:
            raise ValueError(
                f"ids must be token ids (b, i) of an integer dtype, got "
                f"{getattr(ids, 'dtype', type(ids).__name__)} of shape "
                f"{tuple(getattr(ids, 'shape', ()))}"
            )
        if caches is not None and len(caches) != c.num_layers:
            raise ValueError(f"caches must hold one KVCache per layer ({c.num_layers})")
        b, i = ids.shape
        offset = caches[0].length if caches else 0
        mask = None
        if padding is not None:
            if padding.dtype != torch.bool or tuple(padding.shape) != (b, offset + i):
                raise ValueError(
                    f"padding must be a bool (b, j) = ({b}, {offset + i}) tensor over the cached "
                    f"and new positions, got {padding.dtype} {tuple(padding.shape)}"
                )
            mask = padding[:, None, None, :]  # (b, 1, 1, j): keys that exist
        if (
            caches is not None
            and i == 1
            and llama_step.why_not(self, ids, caches, padding, need_weights) is None
        ):  # a decoding step of a quantised model: one compiled call (llama_step.py)
            return LlamaOutput(llama_step.step(self, ids, caches, padding))
        rope = self.angles(i, offset, padding, ids.device)
        x = self.embed(ids)  # (b, i, e)
        weights: list[Tensor] = []
        for n, block in enumerate(self.blocks):
            cache = None if caches is None else caches[n]
            x, w = block(x, rope=rope, mask=mask, cache=cache, need_weights=need_weights)
            if w is not None:
                weights.append(w)
        if last_only:
            x = x[:, -1:]  # (b, 1, e)
        x = self.norm(x)
        logits = self.project_out(x)  # (b, i, V)
        return LlamaOutput(logits, weights if need_weights else None)

    def project_out(self, x: Tensor) -> Tensor:
        """``x (..., e)`` -> logits ``(..., V)``: ``lm_head``, or the tied embedding's matrix
        (a ``QuantizedEmbedding`` multiplies by its blocks, never by a float32 copy)."""
        if self.lm_head is not None:
            return self.lm_head(x)
        if isinstance(self.embed, QuantizedEmbedding):
            return self.embed.linear(x)
        return F.linear(x, self.embed.weight)


# --- the pretrained model with its tokenizer ---------------------------------------------------

Prompt = str | Sequence[int] | Tensor
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class PretrainedLlama:
    """A ``LlamaModel`` with its tokenizer: ``generate`` text, ``stream`` it, ``chat``.

    Attributes: ``model`` (in eval mode), ``tokenizer`` (``LlamaTokenizer``), ``config``,
    ``path``.
    """

    def __init__(self, model: LlamaModel, tokenizer: LlamaTokenizer, path: Path | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config
        self.path = path

    def __repr__(self) -> str:
        c = self.config
        return (
            f"PretrainedLlama({c.num_layers} layers, width {c.embed_dim}, heads "
            f"{c.num_heads}/{c.num_kv_heads}, vocab {c.vocab_size}, path={str(self.path)!r})"
        )

    @property
    def eos_id(self) -> int | None:
        return self.config.eos_id if self.config.eos_id is not None else self.tokenizer.eos_id

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        return self.tokenizer.decode(ids)

    def prompt_ids(
        self, prompt: Prompt | Sequence[str] | Sequence[Sequence[int]]
    ) -> list[list[int]]:
        """Token ids of one prompt or a batch: text, a list of ids, a 1-D or 2-D id tensor, or a
        list of texts or of id lists. Every prompt must have at least one token."""
        batch = _as_batch(prompt)
        out = []
        for k, p in enumerate(batch):
            ids = self.encode(p) if isinstance(p, str) else list(p)
            if not ids:
                raise ValueError(f"prompt {k} is empty: give at least one token of text")
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.config.vocab_size]
            if bad:
                top = self.config.vocab_size - 1
                raise ValueError(f"prompt {k} has token ids outside 0..{top}: {bad[:5]}")
            out.append(ids)
        return out

    def generate_ids(
        self,
        prompt: Prompt | Sequence[str] | Sequence[Sequence[int]],
        max_new_tokens: int = 128,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> list[list[int]]:
        """The new token ids of each prompt (a batch is padded on the left and decoded at once),
        ending with the end-of-sequence id when the model produced it."""
        steps = self.steps(prompt, max_new_tokens, temperature, top_k, top_p, seed)
        prompts = next(steps)
        bar = progress(steps, total=max_new_tokens, desc="generating", unit="token")
        tokens = [s.tolist() for s in bar]  # a bar on a terminal: the text comes at the end
        out: list[list[int]] = [[] for _ in prompts]
        for row in range(len(prompts)):
            for step in tokens:
                out[row].append(step[row])
                if step[row] == self.eos_id:
                    break
        return out

    def steps(
        self,
        prompt: Prompt | Sequence[str] | Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> Iterator[Any]:
        """First the prompts' ids, then each step's tokens ``(b,)``: checks happen on the first
        ``next``, before any model work."""
        if (
            not isinstance(max_new_tokens, int)
            or isinstance(max_new_tokens, bool)
            or (max_new_tokens < 0)
        ):
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        sampling = Sampling(temperature, top_k, top_p)
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        prompts = self.prompt_ids(prompt)
        if max_new_tokens:
            self._check_cache_fits(len(prompts), max(map(len, prompts)), max_new_tokens)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.model.norm.weight.device).manual_seed(seed)
        pad = self.config.pad_id if self.config.pad_id is not None else (self.eos_id or 0)
        yield prompts
        yield from decode(
            self.model,
            prompts,
            max_new_tokens,
            sampling,
            eos_id=self.eos_id,
            pad_id=pad,
            generator=generator,
        )

    def _check_cache_fits(self, b: int, n: int, max_new_tokens: int) -> None:
        """The KV caches decoding preallocates (every layer's keys and values for ``b`` rows of
        ``n`` prompt and ``max_new_tokens`` new positions) must fit the device's memory: a huge
        ``max_new_tokens`` is refused here, not by the allocator inside the first step."""
        # The caches hold activations, in the dtype of the (never quantised) norms.
        c, weight = self.config, self.model.norm.weight
        per_position = 2 * c.num_layers * c.num_kv_heads * c.head_dim * weight.element_size()
        positions = n + max_new_tokens
        check_fits(
            b * positions * per_position,
            f"max_new_tokens={max_new_tokens:,}: the KV cache for {b} x {positions:,} positions "
            f"({c.num_layers} layers, keys and values of {c.num_kv_heads} x {c.head_dim} in "
            f"{weight.dtype})",
            weight.device,
        )

    def stream(
        self,
        prompt: Prompt,
        max_new_tokens: int = 128,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        on_token: Callable[[int], object] | None = None,
    ) -> Iterator[str]:
        """The continuation of one prompt as pieces of text, each yielded as soon as it is
        certain: a token that ends inside a UTF-8 character, or text that may be the start of a
        ``stop`` string, waits for the next token. Stops at the end-of-sequence token, at a
        ``stop`` string (not included) or after ``max_new_tokens``. ``on_token`` is called with
        each generated token id (the end-of-sequence id included). Arguments are checked here,
        before the first token."""
        stops = stop_strings(stop)
        steps = self.steps(prompt, max_new_tokens, temperature, top_k, top_p, seed)
        prompts = next(steps)
        if len(prompts) != 1:
            raise ValueError(f"stream takes one prompt, got {len(prompts)}: use generate")

        def tokens() -> Iterator[int]:
            for step in steps:
                token = int(step[0])
                if on_token is not None:
                    on_token(token)
                yield token

        return text_pieces(self.tokenizer, tokens(), self.eos_id, stops)

    def attention(self, ids: Sequence[int] | Tensor) -> Tensor:
        """Every layer's attention for one token sequence, ``(l, h, n, n)`` float32; row ``t`` is
        what token ``t`` attends to (keys ``0..t``).

        During generation the step that produces token ``t + 1`` computes exactly row ``t``
        (the cache holds the keys of the earlier positions), so the rows of generated tokens
        are the generation's attention over the prompt and the cache."""
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        x = torch.tensor([list(ids)], device=self.model.norm.weight.device)  # (1, n)
        with torch.no_grad():
            out = self.model(x, need_weights=True)
        assert out.weights is not None
        return torch.stack([w[0] for w in out.weights]).float()  # (l, h, n, n)

    def generate(
        self,
        prompt: Prompt | Sequence[str] | Sequence[Sequence[int]],
        max_new_tokens: int = 128,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        on_text: Callable[[str], object] | None = None,
    ) -> str | list[str]:
        """The generated text (without the prompt) of one prompt, or a list for a batch.

        ``prompt``: text, token ids (a list or a 1-D tensor), or a batch of either (a list of
        texts, a list of id lists, a 2-D tensor); a batch is padded on the left and decoded at
        once, giving the same tokens as one prompt at a time. ``temperature=0`` is greedy;
        ``top_k``, ``top_p`` and ``seed`` apply when sampling (``Sampling``). ``stop``: text
        that ends the answer (not included). ``on_text``: called with each piece of text as it
        is generated (one prompt only).
        """
        batch = _is_batch(prompt)
        if not batch:
            pieces = self.stream(
                prompt,  # type: ignore[arg-type]
                max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=seed,
                stop=stop,
            )
            text = []
            for piece in pieces:
                text.append(piece)
                if on_text is not None:
                    on_text(piece)
            return "".join(text)
        if on_text is not None:
            raise ValueError("on_text streams one prompt; a batch returns its texts at the end")
        stops = stop_strings(stop)
        ids = self.generate_ids(
            prompt, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed
        )
        return ["".join(text_pieces(self.tokenizer, iter(row), self.eos_id, stops)) for row in ids]

    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        max_new_tokens: int = 256,
        **kwargs: Any,
    ) -> str:
        """The assistant's answer to ``messages`` (``[{"role": "user", "content": ...}]``), the
        conversation rendered with the model's chat template; keyword arguments as ``generate``."""
        prompt = self.chat_prompt(messages)
        answer = self.generate(prompt, max_new_tokens, **kwargs)
        assert isinstance(answer, str)
        return answer

    def chat_prompt(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt text ``chat`` generates from (the template with the assistant's turn open)."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def _is_batch(prompt: object) -> bool:
    if isinstance(prompt, Tensor):
        return prompt.ndim == 2
    if isinstance(prompt, (list, tuple)) and prompt:
        return all(isinstance(p, (str, list, tuple, Tensor)) for p in prompt)
    return False


def _as_batch(prompt: object) -> list[str | list[int]]:
    if isinstance(prompt, Tensor):
        if prompt.ndim not in (1, 2) or prompt.is_floating_point() or prompt.is_complex():
            raise ValueError(
                f"a tensor prompt must hold integer token ids (i,) or (b, i), got "
                f"{prompt.dtype} {tuple(prompt.shape)}"
            )
        return [prompt.tolist()] if prompt.ndim == 1 else prompt.tolist()
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            raise ValueError("prompt is empty: give text or at least one token id")
        if _is_batch(prompt):
            return [p if isinstance(p, str) else _as_batch(p)[0] for p in prompt]
        return [list(prompt)]
    raise TypeError(
        f"prompt must be text, token ids or a batch of either, got {type(prompt).__name__}"
    )


def load_pretrained(
    path: str | os.PathLike[str] | None = None,
    dtype: torch.dtype = torch.float32,
    weights: str | None = None,
) -> PretrainedLlama:
    """A Llama checkpoint with its tokenizer, ready to generate.

    ``path``: a ``.gguf`` file or a Hugging Face directory (``config.json``,
    ``model.safetensors``, ``tokenizer.json``); ``None`` means the bundled SmolLM2-135M-Instruct
    (``bundled_model_path()``), which works offline. Names and shapes are checked before any
    tensor is read (``attnkit.models.llama_loading``).

    ``weights``:

    * ``"gguf"`` (a GGUF file's default): every matrix stays in its block format
      (``attnkit.quant``; the bundled model takes about 100 MB instead of 540 MB) and the model
      computes in float32 with exactly the de-quantised values. Tensors of a block type
      ``attnkit.quant`` does not implement are de-quantised to float32, with a warning naming
      them. ``dtype`` must be float32.
    * ``"float32"`` (a Hugging Face directory's default and only choice): every tensor is
      de-quantised to float32, then cast to ``dtype``. The output matrix is stored column-major
      (``llama_weights.column_major``), which makes decoding faster and changes no value.

    ``weights=None`` with a ``dtype`` other than float32 means ``"float32"``.
    """
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be a floating-point torch dtype, got {dtype!r}")
    ckpt = read_checkpoint(bundled_model_path() if path is None else path)
    weights = choose_weights(weights, dtype, ckpt)
    if ckpt.tokenizer["format"] == "gguf":
        tokenizer = LlamaTokenizer.from_gguf_metadata(ckpt.tokenizer["metadata"])
    else:
        tokenizer = LlamaTokenizer.from_hf_dir(ckpt.tokenizer["directory"])
    if tokenizer.max_id >= ckpt.config.vocab_size:  # its ids would index past the embedding
        raise CheckpointError(
            f"{str(ckpt.path)!r}: the tokenizer gives ids up to {tokenizer.max_id:,} (user-defined "
            f"and added tokens included), but the model embeds {ckpt.config.vocab_size:,} tokens"
        )
    with torch.device("meta"):
        model = LlamaModel(ckpt.config)  # shapes only: the weights come from the file
    if weights == "gguf":
        assert ckpt.read_blocks is not None
        keep_blocks(model, ckpt.read_blocks())
        prepare_kernel()  # looks the kernel up; starts its build in the background if missing
        return PretrainedLlama(model, tokenizer, ckpt.path)
    model.load_state_dict(ckpt.read(), strict=True, assign=True)
    return PretrainedLlama(column_major(model.to(dtype)), tokenizer, ckpt.path)
