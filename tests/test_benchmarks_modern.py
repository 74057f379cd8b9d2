"""The modern benchmark's routes compute the same thing (outputs and gradients, float64, small
sizes), and its table reports the ratios the issue's targets name."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "modern.py"
spec = importlib.util.spec_from_file_location("bench_modern", SCRIPT)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

SMALL_MLA = dict(embed_dim=32, num_heads=4, kv_rank=12, q_rank=16, nope_dim=8, rope_dim=4,
                 v_dim=6)  # fmt: skip


def _outputs_and_grads(fn, leaves):
    out = fn()
    grads = torch.autograd.grad(out.sum(), leaves) if leaves else ()
    return out.detach(), grads


def test_delta_routes_agree():
    """To float32's precision: transformers' rule computes in float32 whatever its inputs."""
    sizes = dict(h=2, h_v=4, d=8)
    results = [
        _outputs_and_grads(*bench.delta_call(route, 70, torch.float64, sizes=sizes))
        for route in bench.EXPERIMENTS["delta"][0]
    ]
    (o1, g1), (o2, g2) = results
    assert (o1.transpose(1, 2) - o2).abs().max() < 1e-5  # transformers' layout is (b, n, h, d)
    for a, b in zip(g1, g2, strict=True):
        assert (a - b).abs().max() < 1e-4


def test_decode_routes_agree():
    outs = [
        bench.decode_call(route, 20, torch.float64, sizes=SMALL_MLA)[0]()
        for route in bench.EXPERIMENTS["decode"][0]
    ]
    assert (outs[0] - outs[1]).abs().max() < 1e-10


def test_dsa_equals_dense_when_top_k_covers_every_key():
    indexer = dict(num_heads=4, head_dim=8, top_k=64)
    results = [
        _outputs_and_grads(
            *bench.dsa_call(route, 40, torch.float64, sizes=SMALL_MLA, indexer=indexer)
        )
        for route in bench.EXPERIMENTS["dsa"][0]
    ]
    (o1, g1), (o2, g2) = results
    assert (o1 - o2).abs().max() < 1e-10
    assert (g1[0] - g2[0]).abs().max() < 1e-10


def test_table_reports_time_and_memory_ratios():
    key = ("delta", 4096, "float32")
    rows = [
        {"key": key, "route": "attnkit chunked", "times": {"fwd": 1.0, "fwdbwd": 2.0},
         "mem": {"fwd": 10.0, "fwdbwd": 20.0}},
        {"key": key, "route": "transformers chunked", "times": {"fwd": 3.0, "fwdbwd": 8.0},
         "mem": {"fwd": 10.0, "fwdbwd": 40.0}},
    ]  # fmt: skip
    text = bench.table(rows, ["fwd", "fwdbwd"])
    assert "| 0.25 (fwdbwd) | 0.500 |" in text
    assert "576" not in text and "1152 bytes per token" in bench.cache_bytes()


def test_dsa_verdicts_name_every_figure_and_the_target():
    key = ("dsa", 8192, "bfloat16")
    rows = [
        {"key": key, "route": "dsa sparse", "times": {"fwd": 1.0, "fwdbwd": 4.0},
         "mem": {"fwd": 100.0, "fwdbwd": 300.0}},
        {"key": key, "route": "dense torch", "times": {"fwd": 2.0, "fwdbwd": 3.0},
         "mem": {"fwd": 1000.0, "fwdbwd": 3200.0}},
    ]  # fmt: skip
    fwd, fwdbwd = bench.verdicts(rows)
    assert "bfloat16, fwd: time 1.00 s against 2.00 s = 0.500x (met" in fwd
    assert "100 MB against 1000 MB = 0.100x (met" in fwd
    assert "= 1.333x (MISSED" in fwdbwd and "= 0.094x (met" in fwdbwd
    assert bench.verdicts([{**rows[0], "key": ("dsa", 4096, "bfloat16")}]) == []
