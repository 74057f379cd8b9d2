"""`attnkit train vit|translate|forecast` (the course's worked examples) end to end on tiny
settings: the files each writes, the metrics.json keys beside their baselines, a resume that
equals the uninterrupted run, `attnkit evaluate` reading the checkpoint back, and bad options
refused before anything is written. The targets themselves (97 % digits, 99 % dates, beating
both CO2 baselines) are reached by the default recipes, measured once and reported in
docs/learn, not here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnkit.cli import main
from attnkit.tasks.registry import evaluate_checkpoint

pytestmark = pytest.mark.slow  # trains tiny models and draws their pictures

TINY = ["--epochs", "2", "--d-model", "16", "--heads", "2", "--layers", "1", "--quiet"]
TASKS = {
    "vit": (
        ["vit"],
        {"test_accuracy", "val_accuracy", "train_accuracy", "test_errors"},
        ["attention.png"],
    ),
    "translate": (
        ["translate", "--limit-train", "200"],
        {"exact_match", "val_token_accuracy", "wrong", "decoding"},
        ["alignment.png", "alignment_heads.png", "examples.json"],
    ),
    "forecast": (
        ["forecast"],
        {"mae", "mae_week_52", "val_mae", "weeks_interpolated", "yearly_attention"},
        ["forecast.png"],
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for task, (argv, _, _) in TASKS.items():
        out[task] = tmp_path_factory.mktemp(task) / "run"
        assert main(["train", *argv, "--out", str(out[task]), *TINY]) == 0
    return out


@pytest.mark.parametrize("task", list(TASKS))
def test_writes_checkpoint_metrics_baseline_and_pictures(runs, task: str) -> None:
    _, keys, pictures = TASKS[task]
    run = runs[task]
    names = {p.name for p in run.iterdir()}
    assert {"config.json", "model.safetensors", "metrics.json", "trainer_state.json"} <= names
    for picture in pictures:
        assert picture in names
        if picture.endswith(".png"):
            assert (run / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics = json.loads((run / "metrics.json").read_text())
    assert keys <= set(metrics) and metrics["task"] == task and metrics["epochs_run"] == 2
    assert metrics["baseline"] is not None
    if task == "vit":
        assert 0.9 < metrics["baseline"]["test_accuracy"] <= 1  # logistic regression, same split
    if task == "forecast":
        base = metrics["baseline"]
        assert base["linear_trend_seasonal"]["mae"] < base["seasonal_naive"]["mae"]
        assert metrics["weeks_interpolated"] == 59


@pytest.mark.parametrize("task", list(TASKS))
def test_evaluate_reads_the_checkpoint_back_to_the_same_figures(runs, task: str) -> None:
    metrics = json.loads((runs[task] / "metrics.json").read_text())
    again = evaluate_checkpoint(runs[task], write=False)
    key = {"vit": "test_accuracy", "translate": "exact_match", "forecast": "mae"}[task]
    assert again[key] == metrics[key]


def test_resume_of_a_finished_run_changes_nothing(runs, tmp_path: Path) -> None:
    import shutil

    again = tmp_path / "again"
    shutil.copytree(runs["forecast"], again, symlinks=True)
    before = (again / "model.safetensors").read_bytes()
    assert main(["train", "forecast", "--out", str(again), "--resume", *TINY]) == 0
    assert (again / "model.safetensors").read_bytes() == before


def test_resume_after_one_epoch_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    """A vit run stopped after its first epoch (``FitOptions.stop_after``), then resumed, holds
    the same weights, byte for byte, as the run that was never stopped (shifts included: they
    draw from the saved RNG)."""
    from dataclasses import replace

    import attnkit.tasks.vit as vit
    from attnkit.tasks.vit import VIT_TRAIN, VitConfig, VitRun, train_vit

    run = VitRun(
        0, VitConfig(embed_dim=16, num_heads=2, num_layers=1), replace(VIT_TRAIN, epochs=2)
    )
    stopped = tmp_path / "stopped"
    original = vit.FitOptions
    vit.FitOptions = lambda **kw: original(**kw, stop_after=1)  # type: ignore[assignment]
    try:
        train_vit(run, out=stopped, progress=False, baseline=False)
    finally:
        vit.FitOptions = original  # type: ignore[assignment]
    resumed = train_vit(run, out=stopped, resume=True, progress=False, baseline=False)
    straight = train_vit(run, out=tmp_path / "straight", progress=False, baseline=False)
    assert resumed["epochs_run"] == straight["epochs_run"] == 2
    assert (stopped / "model.safetensors").read_bytes() == (
        tmp_path / "straight" / "model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        ("vit --variant pretrained", "--variant pretrained is for the text task; vit has one"),
        ("forecast --max-len 10", "--max-len: only the text task reads this; forecast does not"),
        ("vit --limit-train 10", "--limit-train: only the text task reads this; vit does not"),
        ("translate --freeze-layers 1", "--freeze-layers: only the text task reads this"),
        ("vit --heads 5", "--heads 5 must divide the embedding width --d-model 64"),
        ("forecast --d-model 30 --heads 4", "--heads 4 must divide the embedding width"),
        ("translate --epochs 0", "argument --epochs"),
        ("forecast --lr nan", "argument --lr"),
        ("translate --resume", "--resume: there is no run at 'runs/translate-seed0'"),
        ("vit --out a_file", "--out 'a_file' is a file; give a directory for the run"),
        ("forecast --positional learned", "--positional is for the vit task; forecast does not"),
        ("vit --d-model 18 --heads 2", "--d-model 18: the 2-D sinusoidal positions give rows"),
        ("vit --positional rope", "argument --positional: invalid choice: 'rope'"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_creates_nothing(
    tmp_path, monkeypatch, capsys, argv, words
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("not a run")
    with pytest.raises(SystemExit) as exit_info:
        code = main(["train", *argv.split()])
        raise SystemExit(code)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("attnkit train: error: ") and words in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
