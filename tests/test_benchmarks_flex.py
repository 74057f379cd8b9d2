"""The flex benchmark's routes compute the same attention (and gradients), and its bookkeeping."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "flex.py"
spec = importlib.util.spec_from_file_location("bench_flex", SCRIPT)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


@pytest.mark.parametrize("name", bench.SCENARIOS)
def test_flex_and_dense_routes_agree(name: str) -> None:
    """What the table compares is the same computation: outputs and every gradient (the learned
    table's included) of the flex route equal the dense route's, in float64."""
    results = []
    for route in ("flex", "dense"):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, bench.HEADS, 200, 16, dtype=torch.float64, generator=g)
                   for _ in "qkv")  # fmt: skip
        for t in (q, k, v):
            t.requires_grad_()
        fn, leaves, _ = bench.make_call(route, name, q, k, v)
        out = fn()
        out.sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad, *(t.grad for t in leaves)))
    for ours, dense in zip(*results, strict=True):
        assert (ours - dense).abs().max() <= 1e-10


def test_table_reports_speed_up_and_memory_ratio() -> None:
    key = ("document", 4096, "float32")
    rows = [
        {"key": key, "route": "flex", "times": {"fwd": 1.0, "fwdbwd": 2.0},
         "mem": {"fwd": 10.0, "fwdbwd": 20.0}},
        {"key": key, "route": "dense", "times": {"fwd": 3.0, "fwdbwd": 5.0},
         "mem": {"fwd": 100.0, "fwdbwd": 400.0}},
    ]  # fmt: skip
    md = bench.table(rows, ["fwd", "fwdbwd"])
    assert "| document | 4096 | float32 | flex | 1.000 | 2.000 | 10 | 20 | 2.5x | 0.050 |" in md
    assert bench.dense_gb(16384, "float32") > 6.0 > bench.dense_gb(4096, "float32")


def test_skipped_dense_cell_says_what_it_needs() -> None:
    key = ("document", 16384, "bfloat16")
    rows = [
        {"key": key, "route": "flex", "times": {"fwd": 1.0, "fwdbwd": 2.0},
         "mem": {"fwd": 10.0, "fwdbwd": 20.0}},
        {"key": key, "route": "dense", "times": {}, "mem": {}, "skipped": True,
         "needs_gb": bench.dense_gb(16384, "bfloat16") * 1e9 / 2**30},
    ]  # fmt: skip
    md = bench.table(rows, ["fwd", "fwdbwd"])
    assert "| document | 16384 | bfloat16 | dense | not run (needs 20 GiB) |" in md


def test_compiled_table_ratio_and_failure_line() -> None:
    """The compiled comparison divides torch's compiled forward by attnkit's, and a case that
    failed to compile keeps its row with the error on one line."""
    a, b = ("document", 4096, "float32"), ("learned table", 4096, "bfloat16")
    rows = [
        {"key": a, "route": "flex", "times": {"fwd": 0.5}, "mem": {}},
        {"key": a, "route": "torch compiled", "times": {"fwd": 0.25}, "mem": {}, "build_s": 7.0},
        {"key": b, "route": "flex", "times": {"fwd": 1.0}, "mem": {}},
        {"key": b, "route": "torch compiled", "times": {}, "mem": {},
         "error": "BackendCompilerFailed: a | b"},
    ]  # fmt: skip
    md = bench.compiled_table(rows).splitlines()
    assert "| document | 4096 | float32 | 7.0 | 0.500 | 0.250 | 0.50 |" in md
    assert (
        "| learned table | 4096 | bfloat16 | failed | 1.000 | BackendCompilerFailed: a / b |  |"
        in md
    )
    assert len(md) == 4


def test_inference_scenarios_capture_nothing_that_needs_grad() -> None:
    """torch's CPU flex refuses tensors that require grad, so its route gets none."""
    _, score_mod, leaves = bench.scenario("learned table", 64, grad=False)
    assert leaves == ()
    idx = torch.arange(4)
    assert not score_mod(torch.zeros(4), 0, 0, idx, idx).requires_grad
    assert bench.scenario("learned table", 64)[2][0].requires_grad
