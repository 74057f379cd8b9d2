"""`attnkit show`, with a fake BERT injected through the `attnkit.commands.show.load_model` seam
(tests/fake_bert.py; the real model is exercised in the end-to-end test)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest
import torch

from attnkit.cli import main
from attnkit.commands import show
from attnkit.viz.explorer import ERROR_BOUND, page_weights
from fake_bert import N_HEADS, N_LAYERS, FakeBert
from fake_bert import fake as fake


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse() -> None:
        raise AssertionError("the model must not be loaded for an input error")

    monkeypatch.setattr(show, "load_model", refuse)


def _embedded_weights(page: str, shape: tuple[int, ...]) -> np.ndarray:
    weights, _ = page_weights(page)  # each within ERROR_BOUND (2**-13) of the weight shown
    assert weights.shape == shape
    return weights


def test_html_explorer_and_strongest_links(
    fake: FakeBert, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "a.html"
    assert main(["show", "The cat sat on the mat", "--out", str(out), "--top", "3"]) == 0
    assert fake.texts == ["The cat sat on the mat"]
    page = out.read_text(encoding="utf-8")
    tokens = ["[CLS]", "the", "cat", "sat", "on", "the", "mat", "[SEP]"]
    weights = _embedded_weights(page, (N_LAYERS, N_HEADS, 8, 8))
    np.testing.assert_allclose(weights, fake.attentions[:, 0].numpy(), rtol=0, atol=ERROR_BOUND)
    assert "The cat sat on the mat" in page
    # the page opens on what the summary below describes: the last layer, mean of its heads
    assert f'"layer":{N_LAYERS - 1},"head":null' in page

    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"wrote {out}"
    assert lines[1].startswith("Strongest links, layer 2, mean of 4 heads")
    # oracle: the strongest link between two different word pieces of the last layer's mean
    mean = fake.attentions[-1, 0].mean(0).double()
    best = max(((q, k) for q in range(1, 7) for k in range(1, 7) if q != k), key=lambda p: mean[p])
    first = lines[2].split()
    assert first[:5] == [str(best[0]), tokens[best[0]], "->", str(best[1]), tokens[best[1]]]
    assert float(first[5]) == pytest.approx(mean[best].item(), abs=5e-4)
    assert len(lines) == 5  # header + top 3


def test_strongest_links_of_one_head() -> None:
    att = torch.zeros(1, 2, 4, 4, dtype=torch.float64)
    att[0, 1, 1, 2] = 0.7  # "b" -> "c" in head 1
    att[0, 1, 2, 1] = 0.2
    att[0, 1, 1, 0] = 0.9  # towards [CLS]: left out
    att[0, 1, 1, 1] = 0.95  # to itself: left out
    text = show.strongest_links(att, ["[CLS]", "b", "c", "[SEP]"], layer=0, head=1, top=5)
    assert text.splitlines()[1:] == [
        "  1 b -> 2 c  0.700  " + "█" * 14,
        "  2 c -> 1 b  0.200  " + "█" * 4,
    ]
    one_word = show.strongest_links(att, ["[CLS]", "b", "[SEP]", "[PAD]"], top=5)
    assert "(none" in one_word


def test_png_of_one_head(fake: FakeBert, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "a.png"
    assert main(["show", "a b c", "--layer", "1", "--head", "2", "--out", str(out)]) == 0
    image = mpimg.imread(out)
    assert image.ndim == 3 and min(image.shape[:2]) >= 200
    assert f"wrote {out}" in capsys.readouterr().out


def test_pdf_like_save_figure(fake: FakeBert, tmp_path: Path) -> None:
    from attnkit.viz.heatmap import SAVE_FORMATS

    out = tmp_path / "a.pdf"
    assert main(["show", "a b c", "--out", str(out), "--layer", "0", "--head", "1"]) == 0
    assert out.read_bytes().startswith(b"%PDF-")
    for suffix in SAVE_FORMATS:  # every format save_figure writes is one show accepts
        assert main(["show", "a b", "--out", str(tmp_path / f"b{suffix}"), "--top", "0"]) == 0


@pytest.mark.parametrize("extra", [["--layer", "0"], []])
def test_svg_of_a_layer_or_everything(fake: FakeBert, tmp_path: Path, extra: list[str]) -> None:
    out = tmp_path / "a.svg"
    assert main(["show", "a b c", "--out", str(out), *extra]) == 0
    text = out.read_text(encoding="utf-8")
    assert "<svg" in text
    expected = "Layer 0, all heads" if extra else "All layers and heads"
    assert expected in text or expected.replace(" ", "") in text.replace(" ", "")


def _one_error_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("attnkit show: error: ")
    return err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["   "], "TEXT is empty"),
        ([""], "TEXT is empty"),
        (["a b", "--out", "{tmp}/missing/a.html"], "does not exist"),
        (["a b", "--out", "{tmp}"], "is a directory"),
        (["a b", "--out", "{tmp}/a.txt"], "use .html"),
        (["a b", "--head", "1", "--out", "{tmp}/a.png"], "--head needs --layer"),
        (["a b", "--top", "-1", "--out", "{tmp}/a.html"], "--top"),
    ],
)
def test_input_errors_exit_2_before_loading_the_model(
    no_model: None, tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str], message: str
) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["show", *argv]) == 2
    assert message in _one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--layer", "3"], "--layer 3 is out of range: the model has 3 layers, numbered 0 to 2"),
        (["--layer", "-1"], "--layer -1 is out of range"),
        (["--layer", "0", "--head", "4"], "--head 4 is out of range: the model has 4 heads"),
    ],
)
def test_bad_layer_or_head_exit_2_and_write_nothing(
    fake: FakeBert, tmp_path: Path, capsys: pytest.CaptureFixture, extra: list[str], message: str
) -> None:
    for name in ("a.html", "a.png"):
        assert main(["show", "a b", "--out", str(tmp_path / name), *extra]) == 2
        assert message in _one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_leaves_the_old_file_whole(
    fake: FakeBert, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    out = tmp_path / "a.html"
    out.write_text("old", encoding="utf-8")

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("attnkit._io.os.fsync", disk_full)
    assert main(["show", "a b", "--out", str(out)]) == 2  # the file system's answer, one line
    assert "No space left on device" in capsys.readouterr().err
    assert out.read_text(encoding="utf-8") == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.html"]  # no temporary left behind


def test_html_starts_at_the_requested_layer_and_head(fake: FakeBert, tmp_path: Path) -> None:
    out = tmp_path / "a.html"
    assert main(["show", "a b c", "--layer", "2", "--head", "3", "--out", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    assert '"layer":2,"head":3' in page


# ---- end to end: the bundled MiniLM through attnkit's BERT, Hugging Face as the oracle ----


@pytest.mark.slow
def test_end_to_end_with_the_bundled_minilm(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    transformers = pytest.importorskip("transformers", reason="the hf extra holds the oracle")
    from attnkit.models.bert_pretrained import bundled_model_path

    text = "The cat sat on the mat."
    out = tmp_path / "attention.html"
    assert main(["show", text, "--out", str(out), "--layer", "3", "--head", "7"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"wrote {out}"
    assert printed[1].startswith("Strongest links, layer 3, head 7")

    path = bundled_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    hf = transformers.BertModel.from_pretrained(str(path), attn_implementation="eager").eval()
    batch = tokenizer([text], return_tensors="pt")
    with torch.no_grad():
        expected = torch.stack(hf(**batch, output_attentions=True).attentions)[:, 0]  # (l,h,i,j)
    tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][0])

    page = out.read_text(encoding="utf-8")
    data = json.loads(re.search(r'class="ak-data">(.*?)</script>', page, flags=re.S).group(1))
    assert data["queryTokens"] == tokens and (data["layer"], data["head"]) == (3, 7)
    weights = _embedded_weights(page, (6, 12, len(tokens), len(tokens)))
    np.testing.assert_allclose(weights, expected.numpy(), atol=1e-5 + ERROR_BOUND)

    png = tmp_path / "heads.png"
    assert main(["show", text, "--out", str(png), "--layer", "5", "--top", "0"]) == 0
    assert mpimg.imread(png).ndim == 3
    assert capsys.readouterr().out == f"wrote {png}\n"


# ---- --model DIR: any Hugging Face model, through attnkit.integrations.transformers_maps ----


def test_a_model_directory_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A small random GPT-2 saved as a directory: the page holds transformers' eager weights
    for it, and the printed links leave out its tokenizer's special tokens."""
    transformers = pytest.importorskip("transformers", reason="the hf extra holds the oracle")
    from attnkit.models.bert_pretrained import bundled_model_path

    model_dir = tmp_path / "tiny-gpt2"
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(bundled_model_path()))
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=tokenizer.vocab_size, n_embd=32, n_layer=2, n_head=4, initializer_range=0.3
    )
    model = transformers.GPT2Model(config).eval()
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

    text = "The cat sat on the mat."
    out = tmp_path / "a.html"
    assert main(["show", text, "--model", str(model_dir), "--out", str(out), "--top", "2"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"wrote {out}"
    assert printed[1].startswith("Strongest links, layer 1, mean of 4 heads")
    assert len(printed) == 4 and not any("[CLS]" in line for line in printed[2:])

    batch = tokenizer([text], return_tensors="pt")
    model.set_attn_implementation("eager")
    with torch.no_grad():
        layers = model(input_ids=batch["input_ids"], output_attentions=True).attentions
    expected = torch.stack([a[0] for a in layers])  # (l, h, i, j)
    page = out.read_text(encoding="utf-8")
    assert "attnkit show: attention of tiny-gpt2" in page
    weights = _embedded_weights(page, tuple(expected.shape))
    np.testing.assert_allclose(weights, expected.numpy(), atol=1e-6 + ERROR_BOUND)


def test_a_directory_without_a_model_exits_2(
    no_model: None, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    pytest.importorskip("transformers", reason="--model needs the hf extra")
    out = tmp_path / "a.html"
    assert main(["show", "a b", "--model", str(tmp_path), "--out", str(out)]) == 2
    assert "has no config.json" in _one_error_line(capsys)
    assert not out.exists()


def test_a_damaged_model_directory_is_one_line(tmp_path: Path, capsys) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text("{", encoding="utf-8")
    assert main(["show", "Hi", "--model", str(tmp_path), "--out", str(tmp_path / "a.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert "could not be loaded" in err and len(err.splitlines()) == 1
