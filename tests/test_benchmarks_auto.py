"""The auto benchmark's bookkeeping: each kind of call is what its name says, the fastest
backend and auto's ratio are read from the times, and the table counts the cells within 10 %."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from attnkit import masks, scaled_dot_product_attention

HERE = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(HERE))  # the script imports _report and attention from its folder
spec = importlib.util.spec_from_file_location("bench_auto", HERE / "auto.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_document_ids_cut_a_sequence_into_eight_increasing_documents() -> None:
    ids = bench.document_ids(1000)
    assert ids[0] == 0 and ids[-1] == bench.DOCUMENTS - 1
    steps = ids.diff()
    assert set(steps.tolist()) <= {0, 1} and int(steps.sum()) == bench.DOCUMENTS - 1


def test_each_kind_is_the_call_its_name_says() -> None:
    """Against dense float64 oracles: causal, the window of 256 keys (causal), documents
    (causal within a document) and the ALiBi bias written out by hand."""
    n, g = 300, torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, bench.HEADS, n, 16, dtype=torch.float64, generator=g) for _ in "qkv")
    i, j = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    ids = bench.document_ids(n)
    slopes = torch.tensor([2.0 ** (-8.0 * (x + 1) / bench.HEADS) for x in range(bench.HEADS)])
    dense = {
        "causal": {"mask": j <= i},
        "window": {"mask": (j <= i) & (j > i - bench.WINDOW)},
        "document": {"mask": (j <= i) & (ids.view(-1, 1) == ids.view(1, -1))},
        "alibi": {"bias": (-slopes.view(-1, 1, 1) * (i - j).abs()).double()},
    }
    for kind, want_kw in dense.items():
        got = scaled_dot_product_attention(q, k, v, backend="math", **bench.call_kwargs(kind, n))
        want = scaled_dot_product_attention(q, k, v, backend="math", **want_kw)
        torch.testing.assert_close(got, want, msg=kind)
    assert bench.call_kwargs("plain", n) == {}
    assert isinstance(bench.call_kwargs("window", n)["mask"], masks.StructuredFn)


def _result(times: dict[str, float], chosen: str) -> dict:
    return {
        "times": {f"{name}|fwd": t for name, t in times.items()},
        "auto": {"fwd": {"backend": chosen, "materialised": 0, "peak_mb": 3.0}},
        "skipped": {},
        "budget": 2**30,
    }


def test_summary_finds_the_fastest_backend_and_the_table_counts_cells_within_ten_percent() -> None:
    job = {"n": 512, "b": 4, "dtype": "float32", "kind": "plain", "modes": ["fwd"]}
    good = bench.summarise(job, _result({"torch": 0.010, "fused": 0.008, "auto": 0.0084}, "fused"))
    bad = bench.summarise(job, _result({"torch": 0.010, "tiled": 0.012, "auto": 0.0125}, "tiled"))
    assert good[0]["fastest"] == "fused" and good[0]["chosen_s"] == 0.008
    assert bad[0]["fastest"] == "torch" and bad[0]["auto_s"] / bad[0]["fastest_s"] == 1.25
    table = bench.render(good + bad, "`cmd`", 60.0, 3)
    assert "auto within 10 % of the fastest in 1 of 2 cells (worst 1.25x)" in table
    assert "| 512 | float32 | plain | fwd | torch | 10.0 | tiled |" in table
    assert table.startswith("## auto: the chosen route against the fastest, 2 threads\n")
    titled = bench.render(good, "`cmd`", 60.0, 3, threads=1, cpu_in_title=True)
    from _report import cpu

    assert titled.startswith(f"## auto on {bench.short_cpu(cpu())}, 1 thread\n")


def test_a_heading_names_the_cpu_without_trademarks() -> None:
    name = "Intel(R) Xeon(R) Processor (AVX-512 with avx512_bf16, with AMX)"
    assert bench.short_cpu(name) == "Intel Xeon (AVX-512 with avx512_bf16, with AMX)"
    assert bench.short_cpu("AMD EPYC 9R14 96-Core Processor (AVX2, no AVX-512, no AMX)") == (
        "AMD EPYC 9R14 96-Core (AVX2, no AVX-512, no AMX)"
    )


def test_a_section_of_its_own_is_named_with_letters_digits_and_dashes() -> None:
    assert bench.parse_args(["--section", "auto-amx"]).section == "auto-amx"
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(["--section", "../x"])
    assert stop.value.code == 2
