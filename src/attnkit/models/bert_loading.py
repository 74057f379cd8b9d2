"""Files of a Hugging Face BERT directory: weights, name mapping, tokenizer.

A model directory holds ``config.json``, the weights (``model.safetensors``, or
``pytorch_model.bin`` which is read with ``torch.load(weights_only=True)``: never plain pickle)
and ``tokenizer.json`` (read by the ``tokenizers`` library; WordPiece is not re-implemented here).

Hugging Face names and attnkit names differ (``encoder.layer.3.attention.self.query.weight`` vs
``layers.3.attn...``); ``hf_state_dict_to_attnkit`` translates them, and ``load_bert_weights``
reports every missing or unexpected tensor by name and every shape mismatch with both shapes.

``config.json`` is not trusted to size the model: ``check_config_matches_weights`` compares it
with the tensor names and shapes the weights file lists (``read_tensor_shapes`` reads only the
safetensors header), before anything is allocated, so a config that claims 100,000 layers is
refused in milliseconds instead of growing a model of gigabytes.
Safetensors and tokenizers are imported inside the functions that need them (the ``bert`` extra).
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor, nn

from attnkit.models.bert_config import BertConfig

__all__ = [
    "IGNORED_HF_TENSORS",
    "TokenizedBatch",
    "WordPieceTokenizer",
    "check_config_matches_weights",
    "find_weights_file",
    "hf_parameter_names",
    "hf_state_dict_to_attnkit",
    "layer_mismatch",
    "load_bert_weights",
    "read_state_dict",
    "read_tensor_shapes",
]

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")

# Buffers Hugging Face saves that carry no learned value: position_ids is arange(max_positions),
# token_type_ids a zero buffer. They are dropped silently.
IGNORED_HF_TENSORS = ("embeddings.position_ids", "embeddings.token_type_ids")


def _extra_hint(package: str) -> str:
    return f"{package} is needed to load BERT weights; install attnkit[bert]"


def check_model_dir(path: str | os.PathLike[str]) -> Path:
    """The directory as a Path, or a FileNotFoundError that names what is missing."""
    directory = Path(path)
    if not directory.exists():
        raise FileNotFoundError(f"model directory {str(directory)!r} does not exist")
    if not directory.is_dir():
        raise NotADirectoryError(f"model path {str(directory)!r} is not a directory")
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(directory)!r} has no config.json")
    return directory


def find_weights_file(directory: Path) -> Path:
    """``model.safetensors`` if present, else ``pytorch_model.bin``; a clear error if neither."""
    for name in WEIGHT_FILES:
        candidate = directory / name
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"model directory {str(directory)!r} has no weights file (expected one of {WEIGHT_FILES})"
    )


def read_state_dict(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Read a weights file into a dict of tensors, without executing any pickled code.

    ``.safetensors`` files are read with safetensors; ``.bin``/``.pt`` files with
    ``torch.load(weights_only=True)``, which refuses any pickled object that is not a tensor or a
    plain container, so a tampered checkpoint fails instead of running code.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {str(path)!r} does not exist")
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError as err:  # pragma: no cover - the bert extra is installed in CI
            raise ImportError(_extra_hint("safetensors")) from err
        try:
            return load_file(str(path), device="cpu")
        except Exception as err:
            raise ValueError(f"could not read safetensors file {str(path)!r}: {err}") from err
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(
            f"could not load {str(path)!r} with torch.load(weights_only=True) (attnkit never "
            f"unpickles arbitrary objects): {err}"
        ) from err
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"{str(path)!r} does not hold a dict of tensors (a state dict)")
    return state


def read_tensor_shapes(path: str | os.PathLike[str]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a weights file.

    A ``.safetensors`` file is read through its header only (no tensor data); a ``.bin`` file
    through ``read_state_dict`` (its tensors are as large as the file, never larger).
    """
    path = Path(path)
    if path.suffix != ".safetensors":
        return {k: tuple(v.shape) for k, v in read_state_dict(path).items()}
    if not path.is_file():
        raise FileNotFoundError(f"weights file {str(path)!r} does not exist")
    try:
        from safetensors import safe_open
    except ImportError as err:  # pragma: no cover - the bert extra is installed in CI
        raise ImportError(_extra_hint("safetensors")) from err
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}  # noqa: SIM118
    except Exception as err:
        raise ValueError(f"could not read safetensors file {str(path)!r}: {err}") from err


def _expected_hf_shapes(
    config: BertConfig, layers: int
) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """HF name -> (the shape the config implies, the config fields that set it)."""
    e, f = config.hidden_size, config.intermediate_size
    hidden = ("hidden_size",)
    out = {
        "embeddings.word_embeddings.weight": ((config.vocab_size, e), ("vocab_size", *hidden)),
        "embeddings.position_embeddings.weight": (
            (config.max_position_embeddings, e),
            ("max_position_embeddings", *hidden),
        ),
        "embeddings.token_type_embeddings.weight": (
            (config.type_vocab_size, e),
            ("type_vocab_size", *hidden),
        ),
        "embeddings.LayerNorm.weight": ((e,), hidden),
        "embeddings.LayerNorm.bias": ((e,), hidden),
        "pooler.dense.weight": ((e, e), hidden),
        "pooler.dense.bias": ((e,), hidden),
    }
    for n in range(layers):
        p = f"encoder.layer.{n}."
        for part in ("self.query", "self.key", "self.value", "output.dense"):
            out[f"{p}attention.{part}.weight"] = ((e, e), hidden)
            out[f"{p}attention.{part}.bias"] = ((e,), hidden)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            out[f"{p}{norm}.weight"] = ((e,), hidden)
            out[f"{p}{norm}.bias"] = ((e,), hidden)
        out[f"{p}intermediate.dense.weight"] = ((f, e), ("intermediate_size", *hidden))
        out[f"{p}intermediate.dense.bias"] = ((f,), ("intermediate_size",))
        out[f"{p}output.dense.weight"] = ((e, f), ("intermediate_size", *hidden))
        out[f"{p}output.dense.bias"] = ((e,), hidden)
    return out


_LAYER = re.compile(r"encoder\.layer\.(\d+)\.")
_SIZES = (
    "vocab_size",
    "max_position_embeddings",
    "type_vocab_size",
    "hidden_size",
    "intermediate_size",
)


def layer_mismatch(found: set[int], n: int, missing: str, beyond: str) -> str | None:
    """``None`` when the layer indices ``found`` in a weights file are exactly ``0 .. n - 1``
    (``n``: the layer count a config claims); else why not, in words: the first index below
    ``n`` that no tensor has (``missing`` with ``{}`` for the index names what is absent), or
    the largest index found, past ``n`` (``beyond``, formatted alike). The work grows with
    ``found``, never with ``n``: a config may claim 2**31 - 1 layers, and nothing may be built
    from that number before the weights bear it out."""
    if len(found) == n and (not found or max(found) == n - 1):
        return None
    gap = next((k for k in range(min(n, len(found) + 1)) if k not in found), None)
    if gap is not None:
        return f"there is no {missing.format(gap)}"
    return f"{beyond.format(max(found))} is beyond it"


def check_config_matches_weights(
    config: BertConfig,
    shapes: dict[str, tuple[int, ...]],
    *,
    source: str,
    config_source: str = "config.json",
) -> None:
    """Refuse a config that the weights file does not bear out, before anything is allocated.

    ``shapes`` (name -> shape, from ``read_tensor_shapes``) must hold exactly the layers
    ``0 .. num_hidden_layers - 1``; every tensor that the config sizes must have the shape the
    config implies; and each size (vocabulary, positions, token types, hidden, feed-forward) must
    be borne out by at least one tensor. Missing or unexpected tensors of an otherwise consistent
    file are left to ``load_bert_weights`` (``strict=False`` relaxes those); sizes are always
    checked. The work grows with the file's tensor count, never with the config's claims.
    """
    prefix = "bert." if any(k.startswith("bert.") for k in shapes) else ""
    own = {k[len(prefix) :]: v for k, v in shapes.items() if k.startswith(prefix)}
    layers = {int(m.group(1)) for k in own if (m := _LAYER.match(k))}
    n = config.num_hidden_layers
    layer = f"{prefix}encoder.layer.{{}}."
    why = layer_mismatch(layers, n, layer + "attention.self.query.weight", layer + "*")
    if why is not None:
        raise ValueError(
            f"{source}: {config_source} says num_hidden_layers={n}, but the weights hold "
            f"{len(layers)} layer(s) ({why})"
        )
    expected = _expected_hf_shapes(config, n)
    wrong = [
        f"{prefix}{name}: checkpoint {own[name]} vs config {shape} ({', '.join(fields)})"
        for name, (shape, fields) in expected.items()
        if name in own and own[name] != shape
    ]
    if wrong:
        more = f"; and {len(wrong) - 5} more" if len(wrong) > 5 else ""
        raise ValueError(
            f"{source}: tensor shapes do not match {config_source}: " + "; ".join(wrong[:5]) + more
        )
    confirmed = {field for name, (_, fields) in expected.items() if name in own for field in fields}
    unconfirmed = [
        f"{field}={getattr(config, field)}" for field in _SIZES if field not in confirmed
    ]
    if unconfirmed:
        raise ValueError(
            f"{source}: no tensor bears out {config_source}'s {', '.join(unconfirmed)} (the "
            "tensors of that size are missing); refusing to build a model of unchecked size"
        )


# Hugging Face BERT name -> attnkit BertModel name. ``{n}`` is the layer index. The attention
# projections are not listed: query/key/value are handled by ``_QKV`` because attnkit's
# MultiHeadAttention may hold them fused into one matrix.
_RENAMES: list[tuple[str, str]] = [
    (r"embeddings\.word_embeddings\.(weight)", r"embeddings.word.\1"),
    (r"embeddings\.position_embeddings\.(weight)", r"embeddings.position.\1"),
    (r"embeddings\.token_type_embeddings\.(weight)", r"embeddings.token_type.\1"),
    (r"embeddings\.LayerNorm\.(weight|bias)", r"embeddings.norm.\1"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.(weight|bias)", r"layers.\1.{attn_out}.\2"),
    (
        r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.(weight|bias)",
        r"layers.\1.{norm1}.\2",
    ),
    (r"encoder\.layer\.(\d+)\.intermediate\.dense\.(weight|bias)", r"layers.\1.{ff_in}.\2"),
    (r"encoder\.layer\.(\d+)\.output\.dense\.(weight|bias)", r"layers.\1.{ff_out}.\2"),
    (r"encoder\.layer\.(\d+)\.output\.LayerNorm\.(weight|bias)", r"layers.\1.{norm2}.\2"),
    (r"pooler\.dense\.(weight|bias)", r"pooler.dense.\1"),
]
_QKV = re.compile(r"encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.(weight|bias)")


def hf_parameter_names(num_layers: int, *, pooler: bool = True) -> list[str]:
    """Every tensor name of a Hugging Face ``BertModel`` with ``num_layers`` layers."""
    names = [
        "embeddings.word_embeddings.weight",
        "embeddings.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight",
        "embeddings.LayerNorm.weight",
        "embeddings.LayerNorm.bias",
    ]
    parts = [
        "attention.self.query",
        "attention.self.key",
        "attention.self.value",
        "attention.output.dense",
        "attention.output.LayerNorm",
        "intermediate.dense",
        "output.dense",
        "output.LayerNorm",
    ]
    for n in range(num_layers):
        names += [f"encoder.layer.{n}.{p}.{kind}" for p in parts for kind in ("weight", "bias")]
    if pooler:
        names += ["pooler.dense.weight", "pooler.dense.bias"]
    return names


def hf_state_dict_to_attnkit(
    state: dict[str, Tensor],
    names: dict[str, str],
    pack_qkv: Callable[[Tensor, Tensor, Tensor], dict[str, Tensor]],
) -> tuple[dict[str, Tensor], list[str], dict[str, str]]:
    """Translate Hugging Face names to attnkit's.

    Args:
        state: the checkpoint; names may carry a ``bert.`` prefix (``BertFor...`` checkpoints).
        names: where each BERT sub-layer lives inside an attnkit layer, e.g.
            ``{"attn_out": "attn.out_proj", "norm1": "attn_norm", ...}`` (``BertModel.HF_NAMES``).
        pack_qkv: ``pack_qkv(q, k, v) -> {suffix: tensor}`` turns HF's separate query/key/value
            weights (or biases) into the attention module's parameters, e.g. one stacked
            ``in_proj``.

    Returns:
        ``(translated, unexpected, origin)``: the attnkit state dict; the checkpoint names that
        map to nothing (ignored buffers such as ``embeddings.position_ids`` are not reported); and
        for each attnkit name the checkpoint name(s) it came from, for error messages.
    """
    prefixed = any(k.startswith("bert.") for k in state)
    prefix = "bert." if prefixed else ""
    out: dict[str, Tensor] = {}
    origin: dict[str, str] = {}
    unexpected: list[str] = []
    qkv: dict[tuple[str, str], dict[str, Tensor]] = {}
    for full_name, tensor in state.items():
        if prefixed and not full_name.startswith(prefix):
            unexpected.append(full_name)  # a task head (cls., classifier., ...)
            continue
        name = full_name[len(prefix) :]
        if name in IGNORED_HF_TENSORS:
            continue
        match = _QKV.fullmatch(name)
        if match:
            layer, which, kind = match.groups()
            qkv.setdefault((layer, kind), {})[which] = tensor
            continue
        for pattern, template in _RENAMES:
            if re.fullmatch(pattern, name):
                new = re.sub(pattern, template.format(**names), name)
                out[new], origin[new] = tensor, full_name
                break
        else:
            unexpected.append(full_name)
    for (layer, kind), parts in sorted(qkv.items()):
        sources = {w: f"{prefix}encoder.layer.{layer}.attention.self.{w}.{kind}" for w in parts}
        if len(parts) != 3:
            # An incomplete triple: its parts are reported as unexpected, and the attnkit
            # parameter they would fill as missing.
            unexpected.extend(sorted(sources.values()))
            continue
        shapes = {w: tuple(t.shape) for w, t in parts.items()}
        if len(set(shapes.values())) != 1:
            raise ValueError(
                "query, key and value projections must share a shape; got "
                + ", ".join(f"{sources[w]} {shapes[w]}" for w in ("query", "key", "value"))
            )
        for suffix, tensor in pack_qkv(parts["query"], parts["key"], parts["value"]).items():
            new = f"layers.{layer}.{names['attn']}.{suffix}.{kind}"
            out[new] = tensor
            origin[new] = sources["query"].replace(".query.", ".{query,key,value}.")
    return out, unexpected, origin


def load_bert_weights(
    model: nn.Module,
    state: dict[str, Tensor],
    *,
    source: str,
    strict: bool = True,
    unexpected: Sequence[str] = (),
    origin: dict[str, str] | None = None,
) -> None:
    """Copy an (already translated) state dict into ``model``, reporting every problem by name.

    Names are reported as the checkpoint spells them, with attnkit's name in brackets. Shape
    mismatches always raise (naming the tensor and both shapes). Missing and ``unexpected``
    tensors raise when ``strict`` (the default), else they are reported by a warning.
    """
    origin = origin or {}

    def label(name: str) -> str:
        return f"{origin[name]} ({name})" if name in origin else name

    own = model.state_dict()
    mismatched = [
        f"{label(name)}: checkpoint {tuple(t.shape)} vs model {tuple(own[name].shape)}"
        for name, t in state.items()
        if name in own and t.shape != own[name].shape
    ]
    if mismatched:
        raise ValueError(
            f"{source}: tensor shapes do not match the config: " + "; ".join(mismatched)
        )
    missing = [label(n) for n in sorted(set(own) - set(state))]
    extra = sorted([*unexpected, *(set(state) - set(own))])
    if missing or extra:
        message = f"{source}: missing tensors {missing}; unexpected tensors {extra}"
        if strict:
            raise ValueError(message + " (pass strict=False to load anyway)")
        warnings.warn(message, stacklevel=4)
    with torch.no_grad():
        for name, tensor in state.items():
            if name in own:
                own[name].copy_(tensor)


@dataclass(frozen=True)
class TokenizedBatch:
    """Token ids of a batch, right-padded to its longest text.

    ``input_ids`` and ``token_type_ids`` are ``(b, i)`` int64; ``lengths`` ``(b,)`` counts real
    tokens (``[CLS]`` and ``[SEP]`` included); ``tokens`` lists each text's token strings without
    padding; ``truncated`` the indices of the texts that were cut to ``max_length``.
    """

    input_ids: Tensor
    token_type_ids: Tensor
    lengths: Tensor
    tokens: list[list[str]]
    truncated: list[int]


class WordPieceTokenizer:
    """The model's own ``tokenizer.json`` through the ``tokenizers`` library.

    Padding and truncation settings stored in the file are switched off and replaced by ours:
    pad to the longest text of the batch, and handle texts longer than ``max_length`` as
    ``on_too_long`` says (``"warn"``: truncate, keeping the final ``[SEP]``, and warn;
    ``"error"``: raise a ValueError naming the texts).
    """

    def __init__(self, path: str | os.PathLike[str], *, max_length: int, pad_id: int = 0) -> None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist")
        try:
            from tokenizers import Tokenizer
        except ImportError as err:  # pragma: no cover - the bert extra is installed in CI
            raise ImportError(
                "tokenizers is needed to tokenize text; install attnkit[bert]"
            ) from err
        self.path = path
        self.tokenizer = Tokenizer.from_file(str(path))
        self.tokenizer.no_padding()
        self.max_length = 0
        self.set_max_length(max_length)
        self.pad_id = pad_id

    def set_max_length(self, max_length: int) -> None:
        """Most tokens per text, ``[CLS]`` and ``[SEP]`` included."""
        if max_length != self.max_length:
            self.tokenizer.enable_truncation(max_length=max_length)
            self.max_length = max_length

    def __call__(
        self,
        texts: Sequence[str],
        *,
        on_too_long: Literal["warn", "error"] = "warn",
    ) -> TokenizedBatch:
        encodings = self.tokenizer.encode_batch(list(texts))
        truncated = [n for n, e in enumerate(encodings) if e.overflowing]
        if truncated:
            shown = ", ".join(str(n) for n in truncated[:10]) + (
                ", ..." if len(truncated) > 10 else ""
            )
            what = (
                f"{len(truncated)} text(s) (index {shown}) are longer than max_length="
                f"{self.max_length} tokens"
            )
            if on_too_long == "error":
                raise ValueError(f"texts: {what}; shorten them or pass on_too_long='warn'")
            warnings.warn(f"{what}; truncated to {self.max_length} tokens", stacklevel=3)
        lengths = [len(e.ids) for e in encodings]
        longest = max(lengths)
        ids = torch.full((len(encodings), longest), self.pad_id, dtype=torch.long)
        types = torch.zeros((len(encodings), longest), dtype=torch.long)
        for n, e in enumerate(encodings):
            ids[n, : lengths[n]] = torch.tensor(e.ids, dtype=torch.long)
            types[n, : lengths[n]] = torch.tensor(e.type_ids, dtype=torch.long)
        return TokenizedBatch(
            input_ids=ids,
            token_type_ids=types,
            lengths=torch.tensor(lengths, dtype=torch.long),
            tokens=[list(e.tokens) for e in encodings],
            truncated=truncated,
        )
