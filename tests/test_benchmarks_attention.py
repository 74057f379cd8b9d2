"""The attention benchmark's bookkeeping: FLOP counts and the five targets' verdicts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "attention.py"
spec = importlib.util.spec_from_file_location("bench_attention", SCRIPT)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def _row(method, n, fwd, fb, fwd_mb=None, fb_mb=None):
    return {"n": n, "b": 1, "method": method, "skipped": False, "fwd_s": fwd, "fwdbwd_s": fb,
            "fwd_mb": fwd_mb, "fwdbwd_mb": fb_mb}  # fmt: skip


def test_flops() -> None:
    assert bench.flops("torch", 2, 1024, "fwd") == 4 * 2 * 8 * 1024 * 1024 * 64
    assert bench.flops("tiled causal", 1, 1024, "fwd") == 2 * 8 * 1024 * 1024 * 64
    assert bench.flops("tiled", 1, 1024, "fwdbwd") == 3.5 * 4 * 8 * 1024 * 1024 * 64
    assert bench.flops("sparse window 256", 1, 4096, "fwd") == 4 * 8 * 4096 * 256 * 64
    assert bench.flops("linear", 1, 4096, "fwd") is None


def test_quick_is_a_short_smoke_run_that_writes_nothing() -> None:
    args = bench.parse_args(["--quick"])
    assert args.sizes == [512, 1024] and args.repeats == 2
    assert args.no_memory and args.no_write  # no fresh process per cell, no docs rewritten
    full = bench.parse_args([])
    assert max(full.sizes) == 16384 and not full.no_memory and not full.no_write


def test_targets_met_and_missed() -> None:
    rows = [
        _row("torch", 8192, 1.0, 3.0, 10, 100),
        _row("tiled", 8192, 1.2, 3.5, 20, 140),  # 0.83x, 0.86x: speed met; memory 1.4x: met
        _row("torch causal", 8192, 1.0, 3.0),
        _row("tiled causal", 8192, 1.5, 3.0),  # 0.67x forward: speed missed
        _row("torch + ALiBi tensor", 8192, 2.0, 6.0, 1000, 4000),
        _row("tiled + ALiBi fn", 8192, 1.5, 5.0, 20, 600),  # faster, but 0.15 memory: missed
        _row("torch + relative tensor", 8192, 2.0, 6.0, 1000, 4000),
        _row("tiled + relative fn", 8192, 1.5, 5.5, 20, 400),  # 1.09x, 0.1 memory: met
        _row("tiled + relative fn, undeclared", 8192, 3.0, 12.0),  # 0.5x: reported, no target
        _row("torch", 16384, 4.0, 12.0),
        _row("linear", 16384, 0.1, 0.5),  # 40x, 24x: met
        _row("torch + window mask", 16384, 8.0, 24.0),
        _row("sparse window 256", 16384, 0.6, 1.0),  # 13x, 24x: missed
    ]
    t = bench.evaluate_targets(rows, ["fwd", "fwdbwd"])
    assert t[("tiled", 8192)][0].startswith("speed >= 0.75x torch: met")
    assert t[("tiled", 8192)][1].startswith("memory <= 1.5x torch: met")
    assert t[("tiled causal", 8192)][0].startswith("speed >= 0.75x torch: missed")
    assert t[("tiled + ALiBi fn", 8192)][0].startswith("speed >= dense bias: missed")
    assert t[("tiled + relative fn", 8192)][0].startswith(
        "speed >= dense bias: met (1.09x speed, memory 0.100"
    )
    assert t[("tiled + relative fn, undeclared", 8192)] == ["for comparison: 0.50x speed"]
    assert t[("linear", 16384)][0].startswith("speed >= 20x torch: met")
    assert t[("sparse window 256", 16384)][0].startswith("speed >= 15x dense window: missed")
    assert bench.fits("math", 1, 4096, 6.0) and not bench.fits("math", 1, 16384, 6.0)


def test_relative_bucket_function() -> None:
    import torch

    table = torch.arange(2 * 32, dtype=torch.float32).view(2, 32)  # bias = bucket + 32 * head
    fn = bench._relative_fn(table)
    i = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    j = torch.tensor([0, 3, 7, 8, 15, 16, 127, 128, 5000, -1, -8, -16, -5000]).view(1, 1, 1, -1)
    h = torch.tensor([0, 1]).view(1, 2, 1, 1)
    got = fn(i, h, i, j)  # (1, 2, 1, 13)
    # below 8: the distance; then 8 + floor(8 * log(a / 8) / log(16)), capped at 15; keys after
    # the query (j > i) use the upper 16 buckets
    want = torch.tensor([0, 19, 23, 24, 25, 26, 31, 31, 31, 1, 8, 10, 15], dtype=torch.float32)
    torch.testing.assert_close(got[0, 0, 0], want)
    torch.testing.assert_close(got[0, 1, 0], want + 32)
