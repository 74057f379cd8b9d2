"""Shared oracles for the Llama tests (tests/test_models_llama*.py).

* ``tiny_hf(...)``: a randomly initialised Hugging Face ``LlamaForCausalLM`` built from a config
  in code, saved as a Hugging Face directory, and the same weights read into attnkit's
  ``LlamaModel`` through ``attnkit.models.llama_loading`` (what ``load_pretrained`` uses).
* ``bundled`` / ``hf_bundled`` / ``hf_tokenizer``: the bundled SmolLM2 GGUF, loaded once per test
  module by attnkit and by transformers (``from_pretrained(dir, gguf_file=...)``), offline.

``transformers`` is imported inside the functions that need it; a test file that uses them
declares ``pytest.importorskip("transformers")`` itself. A test file takes a fixture by
re-exporting it (``from llama_oracles import bundled as bundled``).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from attnkit.models.llama import LlamaModel, bundled_model_path, load_pretrained
from attnkit.models.llama_loading import read_checkpoint

# Real text of different kinds: prose, chat markup, code, numbers, unicode and whitespace runs.
TEXTS = [
    "Once upon a time",
    "What is the capital of France?",
    "The quick brown fox jumps over the lazy dog. 1234567 + 89 = 1234656!",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Café, naïve, Zürich, 東京, Ελληνικά, emoji 🙂🚀 and a zero-width\u200bjoiner.",
    "   leading spaces\t\ttabs\n\n\nand   runs   of    spaces   ",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "",
]


def tiny_hf_config(**overrides):
    from transformers import LlamaConfig

    settings = dict(
        vocab_size=101,
        hidden_size=48,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=80,
        num_hidden_layers=2,
        rope_theta=500.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


def tiny_hf(directory: Path, seed: int = 0, **overrides):
    """``(hf_model, attnkit_model)`` with the same random weights, both float32, eval mode."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    hf = LlamaForCausalLM(tiny_hf_config(**overrides)).eval()
    with torch.no_grad():  # weights of a trained model's size, so the test is not trivial
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(directory)
    return hf, model_from(directory)


def model_from(path: Path) -> LlamaModel:
    ckpt = read_checkpoint(path)
    model = LlamaModel(ckpt.config)
    model.load_state_dict(ckpt.read())
    return model.eval()


@functools.cache
def _bundled():
    return load_pretrained()


@functools.cache
def _hf_bundled():
    import transformers

    path = bundled_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


@functools.cache
def _hf_tokenizer():
    import transformers

    path = bundled_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def bundled():
    return _bundled()


@pytest.fixture(scope="module")
def hf_bundled():
    return _hf_bundled()


@pytest.fixture(scope="module")
def hf_tokenizer():
    return _hf_tokenizer()
