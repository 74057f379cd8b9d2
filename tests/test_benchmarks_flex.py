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
