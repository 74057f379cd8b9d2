"""Every benchmark script refuses a bad number on its command line before any work: exit status
2 and one line naming the argument, the value and what was expected (its ``parse_args`` alone
runs here, so nothing is built, loaded or started)."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest

HERE = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(HERE))  # the scripts import _report (and each other) from their folder
import _report  # noqa: E402


@cache
def script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_arguments_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as missing:  # an optional dependency (requests, ...)
        del sys.modules[spec.name]
        pytest.skip(f"benchmarks/{name}.py needs {missing.name}")
    return module


BAD = [  # script, argv, what the error line says
    ("activations", ["--threads", "0"], "argument --threads: '0' is not a whole number from 1"),
    ("attention", ["--timeout", "nan"], "argument --timeout: 'nan' is not a finite number above 0"),
    ("attention", ["--sizes", "512", "0"], "argument --sizes: '0' is not a whole number"),
    ("auto", ["--confirm", "-1"], "argument --confirm: '-1' is not a whole number of at least 0"),
    ("bert", ["--batch-size", "0"], "argument --batch-size: '0' is not a whole number"),
    ("configs", ["--text-epochs", "0"], "argument --text-epochs: '0' is not a whole number"),
    ("explorer", ["--repeats", "-1"], "argument --repeats: '-1' is not a whole number"),
    ("flex", ["--max-dense-gb", "inf"], "argument --max-dense-gb: 'inf' is not a finite number"),
    ("flex", ["--n"], "argument --n: expected at least one length"),
    ("generate", ["--threads", "2", "0"], "argument --threads: '0' is not a whole number"),
    ("generate", ["--threads"], "argument --threads: expected at least one thread count"),
    ("hf_models", ["--max-eager-gib", "-1"], "argument --max-eager-gib: '-1' is not a finite"),
    ("iris_recipes", ["--workers", "0"], "argument --workers: '0' is not a whole number"),
    ("learn", ["--seeds", "0", "-1"], "argument --seeds: '-1' is not a whole number"),
    ("modern", ["--n", "128", "0"], "argument --n: '0' is not a whole number"),
    ("quant_matmul", ["--threads", "2000"], "argument --threads: '2000' is not a whole number"),
    ("ring", ["--dim", "0"], "argument --dim: '0' is not a whole number"),
    ("ring", ["--worlds", "1", "2"], "argument --worlds: 1 is too few"),
    ("serve", ["--clients", "0"], "argument --clients: '0' is not a whole number"),
    ("serve", ["--port", "70000"], "argument --port: '70000' is not a whole number from 1"),
    ("startup", ["--rounds", "0"], "argument --rounds: '0' is not a whole number"),
    ("variants_training", ["--steps", "1.5"], "argument --steps: '1.5' is not a whole number"),
]


@pytest.mark.parametrize(
    ("name", "argv", "said"), BAD, ids=[f"{n} {' '.join(a)}" for n, a, _ in BAD]
)
def test_a_bad_number_is_refused_in_one_line(name, argv, said, capsys) -> None:
    bench = script(name)
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and errors[0] == err.splitlines()[-1], err
    assert said in errors[0], err


@pytest.mark.parametrize("name", sorted({name for name, _, _ in BAD}))
def test_the_defaults_pass_their_own_checks(name) -> None:
    assert isinstance(script(name).parse_args([]), argparse.Namespace)


def test_no_script_takes_an_unchecked_number() -> None:
    for path in sorted(HERE.glob("*.py")):
        found = re.findall(r"type=(?:int|float)\b", path.read_text(encoding="utf-8"))
        assert not found, f"{path.name}: use a checking type from _report, not {found[0]}"


@pytest.mark.parametrize(
    ("check", "text", "value"),
    [
        (_report.positive_int, "3", 3),
        (_report.natural_int, "0", 0),
        (_report.thread_count, "1024", 1024),
        (_report.port_number, "8317", 8317),
        (_report.positive_float, "0.5", 0.5),
        (_report.natural_float, "0", 0.0),
        (_report.time_limit, "3600", 3600.0),
    ],
)
def test_good_numbers_pass(check, text, value) -> None:
    assert check(text) == value


@pytest.mark.parametrize(
    ("check", "text"),
    [
        (_report.positive_int, "0"),
        (_report.positive_int, "1.0"),
        (_report.positive_int, "nan"),
        (_report.positive_int, True),
        (_report.natural_int, "-1"),
        (_report.thread_count, "1025"),
        (_report.port_number, "65535"),
        (_report.positive_float, "0"),
        (_report.positive_float, "nan"),
        (_report.positive_float, "-inf"),
        (_report.positive_float, True),
        (_report.natural_float, "-0.1"),
        (_report.natural_float, "inf"),
        (_report.time_limit, "1e300"),
    ],
)
def test_bad_numbers_name_the_value(check, text) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(text))):
        check(text)
