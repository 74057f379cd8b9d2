"""``load_pretrained`` and ``PretrainedBert.encode`` (models/bert_pretrained.py) on the bundled
all-MiniLM-L6-v2: padding and the rows-sum-to-one invariant, sentence embeddings against
``sentence_transformers.SentenceTransformer``, batching order, backends and bad input."""

from __future__ import annotations

import pytest
import torch

from attnkit.models.bert_pretrained import load_pretrained
from bert_oracles import SENTENCES
from bert_oracles import ours32 as ours32
from bert_oracles import path as path


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


def test_weights_need_a_backend_that_returns_them(ours32) -> None:
    with pytest.raises(ValueError, match="does not return the attention weights"):
        ours32.encode(["x"], need_weights=True, backend="torch")
    math = ours32.encode(["two words"], backend="math").hidden_states
    fused = ours32.encode(["two words"], backend="torch").hidden_states
    torch.testing.assert_close(math, fused, atol=1e-5, rtol=0)


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


def test_unknown_backend_and_dtype_are_refused() -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        load_pretrained(backend="nope")
    with pytest.raises(TypeError, match="dtype"):
        load_pretrained(dtype=torch.int64)


def test_encoding_many_texts_shows_a_bar_only_on_a_terminal(ours32, monkeypatch) -> None:
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    texts = [f"text number {k}" for k in range(12)]
    for stderr, bar in ((io.StringIO(), False), (Terminal(), True)):
        monkeypatch.setattr(sys, "stderr", stderr)
        out = ours32.encode(texts, batch_size=4)  # three batches
        assert out.embeddings.shape == (12, 384)
        assert ("encoding:" in stderr.getvalue()) is bar, stderr.getvalue()
    assert "/3 [" in stderr.getvalue()
