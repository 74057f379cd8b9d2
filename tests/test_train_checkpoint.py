"""Checkpoint files: exact round trips, no pickle, clear errors for corrupt, changed, incomplete or
mismatched files, and for runs written in the layout before manifests."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from torch import nn

from attnkit.train import checkpoint as C
from attnkit.train.manifest import commit, open_checkpoint


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


def test_a_run_from_before_manifests_is_refused_with_a_reason(tmp_path):
    # The layout attnkit wrote before: plain files, format 1, no SHA-256 anywhere.
    C.save_json(tmp_path / "config.json", {"format": "attnkit-checkpoint/1", "task": "iris"})
    C.save_tensors(tmp_path / "model.safetensors", {"w": torch.ones(2)})
    with pytest.raises(ValueError, match=r"format 'attnkit-checkpoint/1'.*trained again"):
        C.read_config(tmp_path)
    with pytest.raises(ValueError, match=r"older layout"):
        C.load_model_weights(nn.Linear(2, 1), open_checkpoint(tmp_path))


def test_config_and_weights_are_read_through_their_sha256(tmp_path):
    run = {"format": C.FORMAT, "task": "iris", "seed": 3}
    model = nn.Linear(3, 2)
    commit(tmp_path, {"config.json": C.json_bytes(run)})
    commit(tmp_path, {"model.safetensors": C.tensors_bytes(model.state_dict())})
    assert C.read_config(tmp_path) == run  # carried over beside the weights
    C.load_model_weights(nn.Linear(3, 2), open_checkpoint(tmp_path))
    ckpt = open_checkpoint(tmp_path)
    for name in ("config.json", "model.safetensors"):
        data = bytearray(ckpt.path(name).read_bytes())
        data[len(data) // 2] ^= 0x01  # one bit: the JSON may still parse, the weights still load
        ckpt.path(name).write_bytes(bytes(data))
        with pytest.raises(ValueError, match=rf"{name}' is damaged: its SHA-256"):
            if name == "config.json":
                C.read_config(tmp_path)
            else:
                C.load_model_weights(nn.Linear(3, 2), open_checkpoint(tmp_path))
        data[len(data) // 2] ^= 0x01
        ckpt.path(name).write_bytes(bytes(data))


def test_require_keys_names_the_file_and_the_key(tmp_path):
    source = tmp_path / "config.json"
    assert C.require_keys({"model": {}, "seed": 1}, {"model": dict, "seed": int}, source)
    with pytest.raises(ValueError, match=r"config\.json' lacks 'model'"):
        C.require_keys({"seed": 1}, {"model": dict, "seed": int}, source)
    with pytest.raises(ValueError, match=r"'seed' must be int, got str"):
        C.require_keys({"model": {}, "seed": "1"}, {"model": dict, "seed": int}, source)
    with pytest.raises(ValueError, match=r"'stopped_early' must be bool, got int"):
        C.require_keys({"stopped_early": 1}, {"stopped_early": bool}, source)
    with pytest.raises(ValueError, match=r"'epoch' must be int, got bool"):
        C.require_keys({"epoch": True}, {"epoch": int}, source)
    with pytest.raises(ValueError, match="expected a JSON object, got list"):
        C.require_keys([], {"model": dict}, source)


def test_start_run_commits_fresh_and_checks_a_resume(tmp_path):
    run = {"format": C.FORMAT, "task": "text", "seed": 0}
    vocab = {"vocab.json": C.json_bytes(["[PAD]", "good"])}
    tmp_path.joinpath("run").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):  # nothing to resume
        C.start_run(tmp_path / "run", run, resume=True, writer=True, files=vocab)
    C.start_run(tmp_path / "run", run, resume=False, writer=True, files=vocab)
    assert sorted(open_checkpoint(tmp_path / "run").files) == ["config.json", "vocab.json"]
    C.start_run(tmp_path / "run", run, resume=True, writer=True, files=vocab)  # the same run
    with pytest.raises(ValueError, match="different settings"):
        C.start_run(tmp_path / "run", {**run, "seed": 1}, resume=True, writer=True)
    other = {"vocab.json": C.json_bytes(["[PAD]", "bad"])}
    with pytest.raises(ValueError, match=r"vocab\.json': --resume, but this run's vocab\.json"):
        C.start_run(tmp_path / "run", run, resume=True, writer=True, files=other)
    C.start_run(tmp_path / "fresh", run, resume=False, writer=False)  # not the writer: no files
    assert not (tmp_path / "fresh").exists()
