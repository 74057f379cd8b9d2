"""A tiny Iris run written by `attnkit train`, shared by the train and evaluate command tests.

A test file takes the ``run_dir`` fixture by re-exporting it (``from train_runs import run_dir as
run_dir``): pytest finds fixtures by name in the test module. The run is trained once per module.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from attnkit.cli import main

TINY = ["--epochs", "3", "--d-model", "16", "--heads", "2", "--layers", "1", "--quiet"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("iris")
    assert main(["train", "iris", "--seed", "1", "--out", str(out), *TINY]) == 0
    return out


def copy_run(run_dir: Path, tmp_path: Path) -> Path:
    """A copy of the run that a test may damage."""
    target = tmp_path / "copy"
    shutil.copytree(run_dir, target)
    return target
