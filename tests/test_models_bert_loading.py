"""The files of a Hugging Face BERT directory (models/bert_loading.py): the tokenizer against
Hugging Face's, weights files (safetensors, ``pytorch_model.bin`` read with ``weights_only``),
name translation (a ``bert.`` prefix, task heads), errors that name every tensor, and a
``config.json`` checked against the weights file before anything is allocated (under a memory
limit and a time bound)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from attnkit.models.bert_pretrained import load_pretrained
from bert_oracles import SENTENCES, hf_state
from bert_oracles import hf_tokenizer as hf_tokenizer
from bert_oracles import ours32 as ours32
from bert_oracles import path as path
from bert_oracles import tiny_dir as tiny_dir

transformers = pytest.importorskip("transformers", reason="the hf extra holds the oracles")


def test_tokens_match_hugging_face(ours32, hf_tokenizer) -> None:
    enc = ours32.encode(SENTENCES)
    for t, text in enumerate(SENTENCES):
        ids = hf_tokenizer(text)["input_ids"]
        assert enc.tokens[t] == hf_tokenizer.convert_ids_to_tokens(ids)
        assert enc.input_ids[t, : len(ids)].tolist() == ids
        assert enc.lengths[t].item() == len(ids)
    assert enc.tokens[3] == ["[CLS]", "[SEP]"]
    assert "##" in "".join(enc.tokens[6])  # WordPiece really split a word


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


def test_bert_prefix_and_pytorch_bin_are_accepted(tiny_dir) -> None:
    state = hf_state(tiny_dir)
    (tiny_dir / "model.safetensors").unlink()
    torch.save({f"bert.{k}": v for k, v in state.items()}, tiny_dir / "pytorch_model.bin")
    ours = load_pretrained(tiny_dir)
    reference = dict(ours.model.state_dict())
    torch.testing.assert_close(
        reference["embeddings.word.weight"], state["embeddings.word_embeddings.weight"]
    )


def test_shape_mismatch_is_reported_with_both_shapes(tiny_dir) -> None:
    from safetensors.torch import save_file

    state = hf_state(tiny_dir)
    state["encoder.layer.1.intermediate.dense.weight"] = torch.zeros(25, 16)
    save_file(state, str(tiny_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"checkpoint \(25, 16\) vs config \(24, 16\)") as err:
        load_pretrained(tiny_dir)
    assert "encoder.layer.1.intermediate.dense.weight" in str(err.value)
    assert "model.safetensors" in str(err.value) and "intermediate_size" in str(err.value)


def test_missing_and_unexpected_tensors_are_named(tiny_dir) -> None:
    from safetensors.torch import save_file

    state = hf_state(tiny_dir)
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
    state = hf_state(tiny_dir)
    (tiny_dir / "model.safetensors").unlink()
    torch.save({**state, "payload": _Trap(marker)}, tiny_dir / "pytorch_model.bin")
    with pytest.raises(ValueError, match="weights_only=True"):
        load_pretrained(tiny_dir)
    assert not marker.exists()
    # The same file unpickled without weights_only would have run the payload:
    torch.load(tiny_dir / "pytorch_model.bin", weights_only=False)
    assert marker.exists()


def test_task_heads_of_a_prefixed_checkpoint_are_reported(tiny_dir) -> None:
    from safetensors.torch import save_file

    state = {f"bert.{k}": v for k, v in hf_state(tiny_dir).items()}
    state["cls.predictions.bias"] = torch.zeros(30522)
    save_file(state, str(tiny_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected tensors \['cls\.predictions\.bias'\]"):
        load_pretrained(tiny_dir)
    with pytest.warns(UserWarning, match="cls.predictions.bias"):
        ours = load_pretrained(tiny_dir, strict=False)
    torch.testing.assert_close(
        ours.model.embeddings.word.weight, state["bert.embeddings.word_embeddings.weight"]
    )


# Runs in a fresh process whose address space is limited to what it uses after the imports plus
# 1.5 GiB: building the model the config describes would need terabytes.
_LOAD_UNDER_A_LIMIT = """
import json, resource, sys, time
from attnkit.models.bert_pretrained import load_pretrained
with open("/proc/self/status") as f:
    used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (used + 1536 * 2**20, resource.RLIM_INFINITY))
started = time.perf_counter()
try:
    load_pretrained(sys.argv[1])
    outcome = {"error": None}
except Exception as exc:
    outcome = {"error": type(exc).__name__, "message": str(exc)}
outcome["seconds"] = time.perf_counter() - started
print(json.dumps(outcome))
"""


def _big_config(directory: Path, path: Path, **changes: object) -> None:
    """The bundled model's files, its config.json changed."""
    config = json.loads((path / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))
    (directory / "model.safetensors").symlink_to(path / "model.safetensors")
    (directory / "tokenizer.json").symlink_to(path / "tokenizer.json")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmSize (Linux)")
@pytest.mark.parametrize("layers", [100_000, 2**31 - 1])
def test_an_oversized_config_is_refused_in_under_a_second_within_a_memory_limit(
    tmp_path, path, layers: int
) -> None:
    _big_config(tmp_path, path, num_hidden_layers=layers)
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_UNDER_A_LIMIT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    outcome = json.loads(proc.stdout.strip().splitlines()[-1])
    assert outcome["error"] == "ValueError", outcome
    message = outcome["message"]
    assert "model.safetensors" in message and f"num_hidden_layers={layers}" in message
    assert "the weights hold 6 layer(s)" in message
    assert "encoder.layer.6.attention.self.query.weight" in message
    assert outcome["seconds"] < 1.0, outcome


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"hidden_size": 768}, r"embeddings\.word_embeddings\.weight: checkpoint \(30522, 384\) "
         r"vs config \(30522, 768\) \(vocab_size, hidden_size\)"),
        ({"vocab_size": 10**9}, r"checkpoint \(30522, 384\) vs config \(1000000000, 384\)"),
        ({"intermediate_size": 10**6}, r"intermediate\.dense\.weight: checkpoint \(1536, 384\)"),
        ({"num_hidden_layers": 3}, r"num_hidden_layers=3, but the weights hold 6 layer\(s\) "
         r"\(encoder\.layer\.5\.\* is beyond it\)"),
    ],
)  # fmt: skip
def test_config_sizes_the_weights_do_not_bear_out_are_refused(
    tmp_path, path, changes: dict, expected: str
) -> None:
    _big_config(tmp_path, path, **changes)
    with pytest.raises(ValueError, match=expected) as err:
        load_pretrained(tmp_path, strict=False)  # sizes are checked even when not strict
    assert str(tmp_path / "model.safetensors") in str(err.value)


def test_a_size_no_tensor_confirms_is_refused(tiny_dir) -> None:
    from safetensors.torch import save_file

    state = hf_state(tiny_dir)
    del state["embeddings.word_embeddings.weight"]  # nothing left to check vocab_size against
    save_file(state, str(tiny_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"no tensor bears out .*config\.json'.s vocab_size=30522"):
        load_pretrained(tiny_dir, strict=False)
