"""``BertConfig`` (models/bert_config.py): read from the bundled MiniLM's ``config.json``, frozen,
and a config of another architecture refused before any weights are read."""

from __future__ import annotations

import json

import pytest

from attnkit.models.bert_config import BertConfig
from attnkit.models.bert_pretrained import load_pretrained
from bert_oracles import path as path


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
