"""Checkpoint files: exact round trips, no pickle, clear errors for corrupt or mismatched files."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from torch import nn

from attnkit.train import checkpoint as C


def test_tensors_round_trip_exactly_with_metadata(tmp_path):
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5), "s": torch.tensor(2.5)}
    C.save_tensors(tmp_path / "t.safetensors", tensors, metadata={"epoch": "3"})
    back, meta = C.load_tensors(tmp_path / "t.safetensors")
    assert meta == {"epoch": "3"}
    assert set(back) == set(tensors)
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_files_are_safetensors_not_pickle(tmp_path):
    path = C.save_tensors(tmp_path / "m.safetensors", {"w": torch.ones(2)})
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])  # safetensors: u64 header length, then JSON
    header = json.loads(raw[8 : 8 + header_len])
    assert header["w"]["dtype"] == "F32" and header["w"]["shape"] == [2]
    assert raw[:1] != b"\x80" and raw[:2] != b"PK"  # neither a pickle nor torch's zip format


def test_corrupt_file_is_a_one_line_value_error(tmp_path):
    path = tmp_path / "model.safetensors"
    C.save_tensors(path, {"w": torch.ones(100)})
    path.write_bytes(path.read_bytes()[:50])  # truncated
    with pytest.raises(ValueError, match="corrupt") as info:
        C.load_tensors(path)
    assert "\n" not in str(info.value)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        C.read_config(tmp_path)


def test_mismatched_weights_name_the_problem(tmp_path):
    C.save_tensors(tmp_path / "m.safetensors", nn.Linear(3, 2).state_dict())
    with pytest.raises(ValueError, match=r"wrong shape \(e\.g\. weight \(2, 3\) vs model \(4, 3\)"):
        C.load_model_weights(nn.Linear(3, 4), tmp_path / "m.safetensors")
    C.save_tensors(tmp_path / "w.safetensors", {"weight": torch.ones(2, 3), "extra": torch.ones(1)})
    with pytest.raises(
        ValueError, match=r"missing 1 \(e\.g\. bias\); unexpected 1 \(e\.g\. extra\)"
    ):
        C.load_model_weights(nn.Linear(3, 2), tmp_path / "w.safetensors")
    model = nn.Linear(3, 2)
    C.load_model_weights(model, tmp_path / "m.safetensors")  # the right shape loads


def test_config_format_is_checked(tmp_path):
    C.save_json(tmp_path / "config.json", {"format": "something-else"})
    with pytest.raises(ValueError, match="not an attnkit checkpoint"):
        C.read_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        C.read_config(tmp_path / "nowhere")
