"""The Llama tokenizer built from GGUF metadata: metadata that cannot describe a vocabulary (a
token-type list of another length, a special token id past the tokens) is refused by name."""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")

from attnkit.models.llama_tokenizer import LlamaTokenizer
from llama_oracles import _byte_vocab


def _meta(**changes):
    tokens = _byte_vocab()
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 256 + [3] * (len(tokens) - 256),
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
    }
    meta.update(changes)
    return meta


def test_the_metadata_builds_a_byte_level_tokenizer() -> None:
    tok = LlamaTokenizer.from_gguf_metadata(_meta())
    assert tok.decode(tok.encode("héllo <|im_end|>")) == "héllo "
    assert tok.max_id == len(_byte_vocab()) - 1 and tok.eos_token == "<|im_end|>"


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"tokenizer.ggml.token_type": [1] * 10}, r"token_type has 10 entries for 260 tokenizer"),
        ({"tokenizer.ggml.eos_token_id": 260}, r"eos_token_id=260 is not a token id \(the voc"),
        ({"tokenizer.ggml.bos_token_id": -1}, r"bos_token_id=-1 is not a token id"),
    ],
)
def test_metadata_that_cannot_describe_the_vocabulary_is_refused(changes, match) -> None:
    with pytest.raises(ValueError, match=match):
        LlamaTokenizer.from_gguf_metadata(_meta(**changes))
