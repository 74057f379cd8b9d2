"""Shared oracles for the Llama tests (tests/test_models_llama*.py).

* ``tiny_hf(...)``: a randomly initialised Hugging Face ``LlamaForCausalLM`` built from a config
  in code, saved as a Hugging Face directory, and the same weights read into attnkit's
  ``LlamaModel`` through ``attnkit.models.llama_loading`` (what ``load_pretrained`` uses).
* ``bundled`` / ``hf_bundled`` / ``hf_tokenizer``: the bundled SmolLM2 GGUF, loaded once per test
  module by attnkit (de-quantised to float32, ``weights="float32"``) and by transformers
  (``from_pretrained(dir, gguf_file=...)``), offline; ``bundled_gguf``: attnkit's model that
  keeps the file's blocks (``load_pretrained()``'s default).

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
    return load_pretrained(weights="float32")


@functools.cache
def _bundled_gguf():
    return load_pretrained(weights="gguf")


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
def bundled_gguf():
    return _bundled_gguf()


@pytest.fixture(scope="module")
def hf_bundled():
    return _hf_bundled()


@pytest.fixture(scope="module")
def hf_tokenizer():
    return _hf_tokenizer()


# --- small GGUF files written with the gguf package -----------------------------------------

BYTE_TOKENS = 256  # a byte-level vocabulary: one token per byte, then the control tokens
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def gguf_tiny_config(**overrides):
    """A Hugging Face config whose shapes suit GGUF's 32-wide quantisation blocks."""
    settings = dict(
        vocab_size=BYTE_TOKENS + len(CONTROL_TOKENS),
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        num_hidden_layers=2,
        rope_theta=10000.0,
    )
    settings.update(overrides)
    return tiny_hf_config(**settings)


def _byte_vocab() -> list[str]:
    from attnkit.models.llama_tokenizer import _byte_alphabet

    alphabet = _byte_alphabet()
    return [alphabet[b] for b in range(256)] + CONTROL_TOKENS


def write_gguf(
    path: Path,
    hf_model,
    *,
    arch: str = "llama",
    qtype: str = "F32",
    skip: tuple[str, ...] = (),
    reshape: dict[str, tuple[int, ...]] | None = None,
    block_count: int | None = None,
    user_tokens: tuple[str, ...] = (),
    qtypes: dict[str, str] | None = None,
) -> Path:
    """Write ``hf_model``'s weights as llama.cpp's converter does: GGUF names, q/k rows
    permuted (``LlamaModel.permute`` in convert_hf_to_gguf.py, written out here), 2-D weights in
    ``qtype``, norms in F32, and a byte-level tokenizer with a chat template. ``block_count``:
    the layer count the metadata claims (default: the model's). ``user_tokens``: user-defined
    tokens after the vocabulary, with ``llama.vocab_size`` still the model's (so their ids lie
    past the embedding). ``qtypes``: GGUF name suffix -> type, overriding ``qtype`` for the
    2-D tensors whose names end with it (``{"attn_v.weight": "Q8_0"}``)."""
    import gguf
    import numpy as np

    c = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers if block_count is None else block_count)
    writer.add_uint32(f"{arch}.context_length", c.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", c.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", c.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", c.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", c.num_key_value_heads)
    writer.add_float32(f"{arch}.rope.freq_base", c.rope_parameters["rope_theta"])
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_string("tokenizer.ggml.pre", "smollm")
    vocab = _byte_vocab() + list(user_tokens)
    writer.add_token_list(vocab)
    writer.add_token_types([1] * BYTE_TOKENS + [3] * len(CONTROL_TOKENS) + [4] * len(user_tokens))
    if user_tokens:
        writer.add_vocab_size(c.vocab_size)
    writer.add_token_merges([])
    writer.add_bos_token_id(vocab.index("<|im_start|>"))
    writer.add_eos_token_id(vocab.index("<|im_end|>"))
    writer.add_chat_template(TEMPLATE)

    def permute(w, heads):
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2)

    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    layer = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    for n in range(c.num_hidden_layers):
        for hf_name, g_name in layer.items():
            names[f"model.layers.{n}.{hf_name}.weight"] = f"blk.{n}.{g_name}.weight"
    if not c.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    state = hf_model.state_dict()
    for hf_name, g_name in names.items():
        if g_name in skip:
            continue
        w = state[hf_name].detach().float().numpy()
        if g_name.endswith("attn_q.weight"):
            w = permute(w, c.num_attention_heads).reshape(w.shape)
        elif g_name.endswith("attn_k.weight"):
            w = permute(w, c.num_key_value_heads).reshape(w.shape)
        if reshape and g_name in reshape:
            w = np.resize(w, reshape[g_name])
        w = np.ascontiguousarray(w)
        this = next((t for end, t in (qtypes or {}).items() if g_name.endswith(end)), qtype)
        if w.ndim == 2 and this != "F32":
            kind = gguf.GGMLQuantizationType[this]
            if this == "F16":
                writer.add_tensor(g_name, w.astype(np.float16))
            else:
                writer.add_tensor(g_name, gguf.quants.quantize(w, kind), raw_dtype=kind)
        else:
            writer.add_tensor(g_name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
