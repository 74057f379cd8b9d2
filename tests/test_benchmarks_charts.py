"""The benchmark charts: the recorded tables parse back into the rows their scripts produce, and
the charts at the top of docs/benchmarks.md are drawn from them."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_charts", ROOT / "benchmarks" / "charts.py")
charts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(charts)
report = importlib.import_module("_report")  # the helper charts.py put on the path
PNG = b"\x89PNG\r\n\x1a\n"


def test_markdown_tables_parse() -> None:
    text = "Intro\n\n| a | b |\n|---|--:|\n| 1 | x y |\n| 2 |  |\n\nafter\n| c |\n|---|\n| 3 |\n"
    assert charts.tables(text) == [[{"a": "1", "b": "x y"}, {"a": "2", "b": ""}], [{"c": "3"}]]
    assert charts.number("1,234") == 1234.0 and charts.number("0.52 (1.0)") == 0.52
    assert charts.number("3.2x") == 3.2 and charts.number("-0") == 0.0
    assert charts.number("—") is None and charts.number("not run") is None
    assert charts.number("") is None


def test_attention_table_round_trips() -> None:
    bench = charts.attention_bench
    rows = [
        {"n": 2048, "b": 2, "method": "torch", "skipped": False, "fwd_s": 0.098,
         "fwdbwd_s": 0.354, "fwd_mb": 10.4, "fwdbwd_mb": 42.0},
        {"n": 2048, "b": 2, "method": "tiled", "skipped": False, "fwd_s": 1.5,
         "fwdbwd_s": 4.25, "fwd_mb": None, "fwdbwd_mb": 1234.0},
        {"n": 16384, "b": 1, "method": "math", "skipped": True},
    ]  # fmt: skip
    args = argparse.Namespace(repeats=3, max_dense_gb=6.0, sizes=[2048, 16384])
    md = bench.render(rows, args, 60.0, {}, "python benchmarks/attention.py", 60.0)
    (table,) = charts.tables(md)
    back = charts.attention_rows(table)
    assert [(r["n"], r["b"], r["method"], r["skipped"]) for r in back] == [
        (2048, 2, "torch", False), (2048, 2, "tiled", False), (16384, 1, "math", True)
    ]  # fmt: skip
    # The table keeps whole milliseconds and megabytes.
    assert back[0]["fwd_s"] == 0.098 and back[0]["fwdbwd_s"] == 0.354 and back[0]["fwd_mb"] == 10
    assert back[1]["fwd_s"] == 1.5 and back[1]["fwdbwd_mb"] == 1234 and back[1]["fwd_mb"] is None
    assert back[2]["fwd_s"] is None and back[2]["fwdbwd_mb"] is None


def test_flex_table_round_trips() -> None:
    key = ("window + ALiBi", 4096, "bfloat16")
    rows = [
        {"key": key, "route": "flex", "times": {"fwd": 0.058, "fwdbwd": 0.155},
         "mem": {"fwd": 32.0, "fwdbwd": 70.0}},
        {"key": key, "route": "dense", "times": {"fwd": 0.904, "fwdbwd": 1.254},
         "mem": {"fwd": 1055.0, "fwdbwd": 1056.0}},
    ]  # fmt: skip
    (table,) = charts.tables(charts.flex_bench.table(rows, ["fwd", "fwdbwd"]))
    back = charts.flex_rows(table)
    for mine, theirs in zip(back, rows, strict=True):
        assert mine["key"] == theirs["key"] and mine["route"] == theirs["route"]
        assert mine["times"] == theirs["times"] and mine["mem"] == theirs["mem"]


def test_generate_table_round_trips() -> None:
    rows = [
        {"n": n, "threads": 2, "library": lib, "prefill_tok_s": p, "decode_tok_s": d}
        for n, lib, p, d in [(16, "attnkit quantised", 127.0, 62.4), (16, "llama.cpp", 40.0, 9.3),
                             (64, "attnkit quantised", 484.0, 22.1), (64, "llama.cpp", 546.0, 24.8)]
    ]  # fmt: skip
    (table,) = charts.tables("\n".join(charts.generate_bench.speed_table(rows)))
    assert sorted(charts.generate_rows(table), key=str) == sorted(rows, key=str)


def test_hf_models_table_round_trips(tmp_path: Path) -> None:
    cell = {"seconds": 1.25, "cpu_seconds": 2.5, "peak_mib": 300.0}
    rows = [
        {
            "model": "llama",
            "n": 2048,
            "load": 1.0,
            "attnkit": cell,
            "sdpa": cell,
            "eager": cell,
            "floor": {"seconds": None, "cpu_seconds": None, "peak_mib": 100.0},
        },
        {"model": "mistral", "n": 16384, "load": 1.0, "attnkit": cell, "sdpa": cell},
    ]
    args = argparse.Namespace(repeats=1, max_eager_gib=6.0)
    (table,) = charts.tables(charts.hf_bench.markdown(rows, args, 1.0))
    back = charts.hf_rows(table)
    assert back[0] == {k: v for k, v in rows[0].items() if k != "load"}
    assert "eager" not in back[1] and back[1]["attnkit"] == cell  # "not run"
    assert charts.hf_bench.chart(back, tmp_path).read_bytes()[:8] == PNG


def test_write_chart_draws_what_was_measured(tmp_path: Path) -> None:
    rows = [
        {"series": "ours", "n": 512, "s": 1.0},
        {"series": "ours", "n": 1024, "s": None},  # not measured: left out of the line
        {"series": "theirs", "n": 512, "s": 2.0},
        {"series": "theirs", "n": 1024, "s": 0.0},  # nothing to draw on a log axis
    ]
    path = report.write_chart("x", rows, panels=[("s", "time", "s")], title="t", out_dir=tmp_path)
    assert path == tmp_path / "x.png" and path.read_bytes()[:8] == PNG
    assert [p.name for p in tmp_path.iterdir()] == ["x.png"]  # written atomically, nothing else
    with pytest.raises(ValueError, match="needs rows"):
        report.write_chart("y", [], panels=[("s", "time", "s")], title="t", out_dir=tmp_path)


def test_a_long_chart_title_is_wrapped_inside_the_picture() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, _ = plt.subplots(1, 2, figsize=(8.4, 4.0))
    title = "transformers models with attn_implementation = attnkit, sdpa, eager " * 2
    renderer = fig.canvas.get_renderer()
    one_line = fig.text(0.5, 0.5, title, fontsize=11).get_window_extent(renderer)
    assert one_line.width > fig.bbox.width  # on one line it would be cut off
    text = report.fit_title(fig, title, fontsize=11)
    box = text.get_window_extent(renderer)
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height
    assert text.get_text().replace("\n", " ") == title.strip()  # the words, all of them
    short = report.fit_title(fig, "short", fontsize=11)
    assert short.get_text() == "short"
    plt.close(fig)


def test_recorded_tables_read_back(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# B\n\n<!-- begin:x -->\nhello\n<!-- end:x -->\n")
    assert report.read_section("x", doc) == "hello\n"
    assert report.read_section("missing", doc) is None
    report.write_section("x", "bye", doc)
    assert report.read_section("x", doc) == "bye\n"


@pytest.mark.slow
def test_the_charts_shown_are_drawn_from_the_recorded_tables(tmp_path: Path) -> None:
    said: list[str] = []
    made = charts.draw_all(charts.DOC, tmp_path, say=said.append)
    names = {p.name for p in made}
    assert {"attention.png", "attention-all-methods.png", "generate.png"} <= names
    assert {p.name for p in tmp_path.iterdir()} == names
    for path in made:
        assert path.read_bytes()[:8] == PNG
        assert 5_000 < path.stat().st_size < 100_000, f"{path.name}: {path.stat().st_size} bytes"
    committed = {p.name for p in charts.CHARTS.iterdir()}
    assert committed == names, "docs/images/benchmarks/ is out of date: run benchmarks/charts.py"
    page = charts.DOC.read_text("utf-8")
    shown = set(re.findall(r"\]\(images/benchmarks/([\w.-]+\.png)\)", page))
    assert shown == names, f"charts drawn but not shown, or shown but not drawn: {shown ^ names}"
    lead = page[: page.index("<!-- begin:")]
    assert all(f"images/benchmarks/{name}" in lead for name in names), "charts lead the page"
