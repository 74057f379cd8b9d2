"""`attnkit generate`: streams a continuation or a chat answer; bad prompts, numbers and files are
one line on stderr and exit code 2, before the model loads."""

from __future__ import annotations

import html
import re

import pytest
import torch

from attnkit.cli import main
from attnkit.commands import generate

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from llama_oracles import _bundled, gguf_tiny_config, write_gguf  # noqa: E402


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(gguf_tiny_config()).eval()
    return write_gguf(tmp_path_factory.mktemp("cli") / "tiny.gguf", hf)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_help_describes_the_attention_view(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    description = capsys.readouterr().out.split("positional arguments")[0]
    assert "--show-attention" in description and "explorer" in description


@pytest.mark.slow
def test_chat_streams_the_bundled_answer(capsys, monkeypatch) -> None:
    monkeypatch.setattr(
        generate, "load_model", lambda path, weights=None: _bundled()
    )  # loaded once per run
    assert main(["generate", "--chat", "What is the capital of France?"]) == 0
    assert capsys.readouterr().out == "The capital of France is Paris.\n"


def test_continuation_is_printed_after_the_prompt(tiny_gguf, capsys) -> None:
    args = ["generate", "Once", "--max-new-tokens", "6", "--model", str(tiny_gguf)]
    assert main(args) == 0
    out = capsys.readouterr().out
    from attnkit.models.llama import load_pretrained

    assert out == "Once" + load_pretrained(tiny_gguf).generate("Once", 6) + "\n"
    assert main([*args, "--temperature", "0.8", "--top-k", "5", "--seed", "3"]) == 0


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["  "], "prompt is empty"),
        (["hi", "--max-new-tokens", "-1"], "--max-new-tokens must be >= 0"),
        (["hi", "--temperature", "-0.5"], "temperature"),
        (["hi", "--top-p", "2"], "top_p"),
        (["hi", "--top-k", "0"], "top_k"),
        (["hi", "--stop", ""], "--stop"),
        (["hi", "--system", "be brief"], "--system needs --chat"),
        (["hi", "--model", "/nonexistent/model.gguf"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_loading(extra, match, capsys, monkeypatch):
    def no_load(path, weights=None):
        raise AssertionError("the model loaded before the arguments were checked")

    monkeypatch.setattr(generate, "load_model", no_load)
    assert main(["generate", *extra]) == 2
    assert match in _one_line(capsys)


def test_weights_choose_the_blocks_or_float32(tiny_gguf, tmp_path, capsys, monkeypatch) -> None:
    outputs = []
    for weights in ("gguf", "float32"):
        assert main(["generate", "Once", "--max-new-tokens", "6", "--model", str(tiny_gguf),
                     "--weights", weights]) == 0  # fmt: skip
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]

    def no_load(path, weights=None):
        raise AssertionError("the model loaded before the arguments were checked")

    monkeypatch.setattr(generate, "load_model", no_load)
    assert main(["generate", "hi", "--model", str(tmp_path), "--weights", "gguf"]) == 2
    assert "--weights gguf keeps a GGUF file's blocks" in _one_line(capsys)


def test_foreign_and_truncated_files_are_one_line_and_exit_2(tiny_gguf, tmp_path, capsys):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:-100])
    assert main(["generate", "hi", "--model", str(cut)]) == 2
    assert "truncated" in _one_line(capsys)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(gguf_tiny_config()).eval()
    other = write_gguf(tmp_path / "other.gguf", hf, arch="qwen2")
    assert main(["generate", "hi", "--model", str(other)]) == 2
    assert "'qwen2' model" in _one_line(capsys)


def test_a_token_budget_whose_cache_cannot_fit_is_one_line_and_exit_2(tiny_gguf, capsys):
    args = ["generate", "Once", "--max-new-tokens", str(10**12), "--model", str(tiny_gguf)]
    assert main(args) == 2
    line = _one_line(capsys)
    assert "max_new_tokens=1,000,000,000,000: the KV cache for 1 x 1,000,000,000,0" in line


def test_show_attention_writes_the_generation_view(tiny_gguf, tmp_path, capsys) -> None:
    out = tmp_path / "gen.html"
    args = ["generate", "Once", "--max-new-tokens", "5", "--model", str(tiny_gguf)]
    assert main([*args, "--show-attention", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    assert '"nq": 5' in page or '"nq":5' in page  # one row per generated token
    assert "each new token" in page
    printed = capsys.readouterr()
    assert printed.err.strip() == f"wrote {out}"
    generated = html.escape(printed.out.rstrip("\n").removeprefix("Once"))
    # The prompt and the answer under their own labels; the rows are the decoder's
    # self-attention over its own sequence, not cross-attention, though the map is not square.
    assert '<p class="ak-text"><bdi>Prompt</bdi>: <q><bdi>Once</bdi></q></p>' in page
    assert f'<p class="ak-text"><bdi>Generated</bdi>: <q><bdi>{generated}</bdi></q></p>' in page
    assert "Input:" not in page and "cross-attention" not in page
    assert re.search(r"5 queries × \d+ keys \(causal self-attention", page)
    assert main([*args, "--show-attention", str(tmp_path / "x.png")]) == 2
    assert ".html" in _one_line(capsys)
    assert main([*args, "--show-attention", str(tmp_path / "no" / "x.html")]) == 2
    assert "does not exist" in _one_line(capsys)
