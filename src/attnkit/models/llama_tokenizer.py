"""The tokenizer and chat template of a Llama checkpoint, built with the ``tokenizers`` library.

A GGUF file has no ``tokenizer.json``: it stores the vocabulary (``tokenizer.ggml.tokens``), each
token's type (``tokenizer.ggml.token_type``: 1 normal, 3 control, 4 user-defined, 6 byte), the
BPE merges (``tokenizer.ggml.merges``, ``"a b"`` strings, best first), the special ids and the
chat template (a Jinja template, ``tokenizer.chat_template``). For a byte-level BPE vocabulary
(``tokenizer.ggml.model == "gpt2"``, as SmolLM2's) that is exactly what ``tokenizers.models.BPE``
takes, with GPT-2's byte-level pre-tokenizer and decoder (Radford et al. 2019, section 2.2:
bytes mapped to printable characters, text split by GPT-2's regex before merging). Control
tokens (``<|im_start|>``, ``<|im_end|>``, ...) are added as special tokens so they are matched
whole in the text and dropped when decoding.

A Hugging Face directory brings its own ``tokenizer.json`` and ``tokenizer_config.json``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

__all__ = ["LlamaTokenizer"]

# GGUF's token types (llama.cpp's llama_token_type).
CONTROL = 3
USER_DEFINED = 4

# Bounds on rendering a chat template (a template comes from a file, so it may be hostile):
# characters of output beyond the messages' own text, and items of all its range() calls.
TEMPLATE_CHARS = 1 << 20
TEMPLATE_STEPS = 1_000_000

# Pre-tokenizer names (tokenizer.ggml.pre) whose split is GPT-2's byte-level regex.
GPT2_SPLIT_PRE = {None, "default", "gpt2", "gpt-2", "smollm"}


def _need(package: str) -> ImportError:
    return ImportError(f"{package} is needed for the Llama tokenizer; install attnkit[llm]")


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (``bytes_to_unicode`` in its
    encoder.py): printable Latin-1 bytes map to themselves, the rest to U+0100 onwards."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


_BYTE_OF_CHAR = {char: byte for byte, char in _byte_alphabet().items()}


class LlamaTokenizer:
    """Text <-> token ids, and chat messages -> prompt text.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        chat_template: the model's Jinja chat template, or ``None``.
        bos_token, eos_token: the special tokens the template may use (strings).
        add_bos: whether ``encode`` puts ``bos_token`` first (the checkpoint says).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = add_bos
        self.bos_id = None if bos_token is None else tokenizer.token_to_id(bos_token)
        self.eos_id = None if eos_token is None else tokenizer.token_to_id(eos_token)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def control_tokens(self) -> list[str]:
        """The special tokens ``encode`` matches whole in text (the chat's turn markers)."""
        added = self.tokenizer.get_added_tokens_decoder().values()
        return sorted(t.content for t in added if t.special)

    @property
    def max_id(self) -> int:
        """The largest id ``encode`` can give (added tokens included); -1 for no vocabulary."""
        return max(self.tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are matched whole."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        # A batch of one: the same ids as ``Tokenizer.encode``, which holds the GIL throughout
        # (a server's streams would wait for a long text); ``encode_batch`` lets go of it.
        ids = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        if self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def token(self, token_id: int) -> str | None:
        """The token's string as the vocabulary spells it (byte-level characters)."""
        return self.tokenizer.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes the token stands for: its byte-level spelling read back (a token may hold
        part of a UTF-8 character), or the UTF-8 of its decoded text where the vocabulary is
        not spelled in bytes."""
        spelled = self.token(token_id)
        if spelled and all(ch in _BYTE_OF_CHAR for ch in spelled):
            return bytes(_BYTE_OF_CHAR[ch] for ch in spelled)
        return self.decode([token_id], skip_special=False).encode("utf-8")

    @cached_property
    def _template(self) -> Any:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; pass plain text instead")
        from jinja2.exceptions import SecurityError, TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        class Bounded(ImmutableSandboxedEnvironment):
            """``'x' * n`` and ``a ** b`` are checked before they run: one expression could
            build a string of any length, or an integer with billions of digits."""

            intercepted_binops = frozenset(["*", "**"])

            def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
                sizes = [len(x) for x in (left, right) if isinstance(x, (str, list, tuple))]
                counts = [x for x in (left, right) if isinstance(x, int)]
                if operator == "*" and sizes and counts and sizes[0] * counts[0] > TEMPLATE_CHARS:
                    raise SecurityError(f"a repetition of {sizes[0] * counts[0]:,} items")
                if operator == "**" and len(counts) == 2 and abs(left) > 1 and abs(right) > 64:
                    raise SecurityError(f"the power {left} ** {right}")
                return super().call_binop(context, operator, left, right)

        # The environment Hugging Face renders chat templates in: a sandbox (templates come
        # from files), blocks trimmed, loop controls, and raise_exception for the template's
        # own checks; here also with bounded repetitions and powers.
        env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for ``messages`` (``[{"role": ..., "content": ...}, ...]``), ending
        with the assistant's turn opened when ``add_generation_prompt``.

        Control-token text inside a message (``<|im_end|>``, ``<|im_start|>``, ...) is not
        escaped: ``encode`` matches it whole, so a message can close its turn and open another.
        Hugging Face's ``apply_chat_template`` does the same. Remove the strings
        ``control_tokens`` lists from text of an untrusted source before it goes into a message.

        The template runs with bounds (``TEMPLATE_CHARS`` of output beyond four times the
        messages' text, ``TEMPLATE_STEPS`` loop items, no huge repetition, power or endless
        recursion): a template that passes one is a ``ValueError``.
        """
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
        if not messages:
            raise ValueError("messages is empty: give at least one message")
        for k, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise ValueError(f"message {k} must be a dict with a 'role' string, got {m!r}")
            if not isinstance(m.get("content"), str):
                raise ValueError(f"message {k} must have a 'content' string, got {m!r}")
        from jinja2.exceptions import TemplateError

        # The output may hold the messages a few times over, plus the template's own text; the
        # loops' range() calls together give at most TEMPLATE_STEPS items. Both are checked as
        # the template runs, so a hostile template stops early instead of filling memory or
        # looping for hours.
        limit = TEMPLATE_CHARS + 4 * sum(len(m["role"]) + len(m["content"]) for m in messages)
        steps = [TEMPLATE_STEPS]

        def bounded_range(*args: int) -> range:
            items = range(*args)
            steps[0] -= len(items)
            if steps[0] < 0:
                raise TemplateError(f"its loops ask for more than {TEMPLATE_STEPS:,} steps")
            return items

        pieces: list[str] = []
        size = 0
        try:
            for piece in self._template.generate(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                range=bounded_range,
            ):
                size += len(piece)
                if size > limit:
                    raise TemplateError(f"its output passed {limit:,} characters")
                pieces.append(piece)
        except TemplateError as err:
            raise ValueError(f"the chat template refused these messages: {err}") from err
        except RecursionError as err:
            raise ValueError("the chat template recursed without end") from err
        except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError) as err:
            # the template's own expressions failed (1/0, a missing key): a broken template
            raise ValueError(f"the chat template failed: {type(err).__name__}: {err}") from err
        return "".join(pieces)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> LlamaTokenizer:
        """From a GGUF file's ``tokenizer.*`` metadata (byte-level BPE vocabularies)."""
        try:
            from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
        except ImportError as err:  # pragma: no cover - the llm extra is installed in CI
            raise _need("tokenizers") from err
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"the GGUF tokenizer is {kind!r}; attnkit builds byte-level BPE ('gpt2') ones"
            )
        pre = meta.get("tokenizer.ggml.pre")
        if pre not in GPT2_SPLIT_PRE:
            raise ValueError(
                f"the GGUF pre-tokenizer {pre!r} is not supported (supported: GPT-2's split, "
                f"{sorted(p for p in GPT2_SPLIT_PRE if p)})"
            )
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        if len(types) != len(tokens):
            raise ValueError(
                f"tokenizer.ggml.token_type has {len(types):,} entries for {len(tokens):,} "
                "tokenizer.ggml.tokens"
            )
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        alphabet = set(_byte_alphabet().values())
        spell = _byte_alphabet()

        def spelled(token: str) -> str:
            # A vocabulary entry outside the byte alphabet (a few files store one as plain
            # text) is spelled byte by byte, so BPE can reach it.
            if set(token) <= alphabet:
                return token
            return "".join(spell[b] for b in token.encode("utf-8"))

        vocab = {spelled(t): i for i, t in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        control = [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types, strict=True)
            if kind == CONTROL and set(t) <= alphabet
        ]
        user = [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types, strict=True)
            if kind == USER_DEFINED
        ]
        tok.add_special_tokens(control)
        if user:
            tok.add_tokens(user)

        def name(key: str) -> str | None:
            index = meta.get(f"tokenizer.ggml.{key}")
            if index is None:
                return None
            if not 0 <= int(index) < len(tokens):
                raise ValueError(
                    f"tokenizer.ggml.{key}={index} is not a token id (the vocabulary has "
                    f"{len(tokens):,} tokens)"
                )
            return tokens[int(index)]

        return cls(
            tok,
            chat_template=meta.get("tokenizer.chat_template"),
            bos_token=name("bos_token_id"),
            eos_token=name("eos_token_id"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        )

    @classmethod
    def from_hf_dir(cls, directory: str | Path) -> LlamaTokenizer:
        """From a Hugging Face directory's ``tokenizer.json`` and ``tokenizer_config.json``."""
        try:
            from tokenizers import Tokenizer
        except ImportError as err:  # pragma: no cover - the llm extra is installed in CI
            raise _need("tokenizers") from err
        directory = Path(directory)
        file = directory / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"model directory {str(directory)!r} has no tokenizer.json")
        tok = Tokenizer.from_file(str(file))
        tok.no_padding()
        tok.no_truncation()
        config: dict[str, Any] = {}
        config_file = directory / "tokenizer_config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text(encoding="utf-8"))
        template = config.get("chat_template")
        template_file = directory / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text(encoding="utf-8")

        def token(key: str) -> str | None:
            value = config.get(key)
            return value.get("content") if isinstance(value, dict) else value

        return cls(
            tok,
            chat_template=template if isinstance(template, str) else None,
            bos_token=token("bos_token"),
            eos_token=token("eos_token"),
            add_bos=bool(config.get("add_bos_token", False)),
        )
