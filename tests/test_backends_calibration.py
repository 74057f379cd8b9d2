"""The calibration: measured once per profile, written where auto reads it, read back, and
invalidated when torch, the thread count or the fused build changes; the fit recovers known
constants; calls on another device never read CPU numbers.

The measuring runs a shortened list of configurations (``CONFIGS`` cut to small shapes), so
these tests take seconds; the full list is what ``attnkit kernels calibrate`` runs.
"""

from __future__ import annotations

import json

import pytest
import torch

from attnkit import scaled_dot_product_attention
from attnkit.backends import calibration, cost, explain, rates
from attnkit.backends.fused import jit
from attnkit.functional import make_call
from attnkit.registry import AttentionCall

SMALL = [
    (backend, (1, 2, min(i, 96), min(j, 96), 16), kind)
    for backend, (_, _, i, j, _), kind in calibration.CONFIGS
    if backend != "fused"
]


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """An empty cache, no fused kernel, nothing pinned, no background work."""
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(jit, "_MODULE", [None])
    monkeypatch.setattr(jit, "is_built", lambda: False)
    monkeypatch.setattr(calibration, "CONFIGS", SMALL)
    monkeypatch.setattr(calibration, "EVAL_SHAPE", (1, 2, 64, 64))
    with rates.pin(None):
        yield tmp_path


def test_written_once_read_back_and_used_by_auto(machine) -> None:
    q = torch.randn(1, 2, 64, 16)
    assert rates.table_for(q.device, "float32") is None
    assert explain(q, q, q).verdicts[0].estimate.basis == "priority"
    table = calibration.calibrate("float32", repeats=1)
    path = rates.calibration_path("float32")
    assert path == machine / "calibration" / f"cpu-float32-{torch.get_num_threads()}threads.json"
    data = json.loads(path.read_text())
    assert data["threads"] == torch.get_num_threads() and data["torch"] == torch.__version__
    assert data["fused"] is None and data["format"] == rates.FORMAT
    read = rates.table_for(q.device, "float32")
    assert read is not None and read.rows == table.rows and read.eval_s == table.eval_s
    assert "measured on this machine" in read.source
    assert {b for b, _ in read.rows} == {"torch", "tiled", "sparse", "math"}
    assert all(
        r.gflops > 0 and r.call >= 0 and r.tile >= 0 and r.pair >= 0 for r in read.rows.values()
    )
    e = explain(q, q, q)
    assert e.verdicts[0].estimate.basis == "measured"
    assert "measured on this machine" in str(e).splitlines()[1]
    assert rates.table_for(q.device, "bfloat16") is None  # each dtype is measured on its own


def test_a_calibration_starts_no_background_calibration(machine, monkeypatch) -> None:
    """The calls a calibration times find no table yet; they must not start another
    calibration beside it (two would time each other)."""
    monkeypatch.setenv("ATTNKIT_BACKGROUND", "1")
    monkeypatch.setattr(rates, "_STARTED", set())
    monkeypatch.setattr(rates.subprocess, "Popen", lambda *a, **k: pytest.fail("started one"))
    calibration.calibrate("float32", repeats=1)
    assert rates.table_for(torch.device("cpu"), "float32") is not None


def test_invalidated_by_another_torch_thread_count_or_fused_build(machine, monkeypatch) -> None:
    calibration.calibrate("float32", repeats=1)
    cpu = torch.device("cpu")
    assert rates.table_for(cpu, "float32") is not None
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert rates.table_for(cpu, "float32") is None  # another profile: not measured yet
    finally:
        torch.set_num_threads(threads)
    assert rates.table_for(cpu, "float32") is not None
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    rates.forget()
    assert rates._read("float32", threads) is None
    monkeypatch.undo()
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(machine))
    monkeypatch.setattr(jit, "is_built", lambda: True)  # the kernel was built since
    monkeypatch.setattr(jit, "_MODULE", [None])
    with rates.pin(None):
        assert rates.table_for(cpu, "float32") is None
    monkeypatch.setattr(jit, "is_built", lambda: False)
    path = rates.calibration_path("float32")
    path.write_text("{ damaged")
    rates.forget()
    assert rates._read("float32", threads) is None  # a damaged file is ignored, not an error


def test_the_fit_recovers_known_constants() -> None:
    """Times made by the model's own formula from the reference row scaled by known factors
    (fixed costs x 3, throughput x 0.5) are fitted back to that row, also with one call slowed
    fivefold by other work; a backend without a reference row is fitted on all four constants."""
    ref = rates.Rates(call=2e-4, tile=5e-5, gflops=120.0, pair=3e-9)
    true = rates.Rates(call=6e-4, tile=1.5e-4, gflops=240.0, pair=1.5e-9)
    found = []
    for x, (tiles, pairs, extra) in enumerate(
        [(1, 256, 0), (16, 1e6, 0), (64, 8e6, 0), (40, 4e6, 4e6), (8, 2e5, 2e5), (100, 3e7, 0)]
    ):
        terms = cost.Terms(tiles=tiles, pairs=pairs, extra=extra, ops=1e5 * x)
        seconds = true.call + true.tile * tiles + pairs * 256 / (true.gflops * 1e9)
        seconds += true.pair * extra + 1e-9 * terms.ops
        for backend in ("b", "new"):
            found.append(
                {"backend": backend, "mode": "fwd", "terms": terms, "d": 64, "seconds": seconds}
            )
    got = calibration.fit(found, 1e-9, {("b", "fwd"): ref})
    slowed = dict(found[-2], seconds=found[-2]["seconds"] * 5, backend="b")  # one busy round
    busy = calibration.fit([*found, slowed], 1e-9, {("b", "fwd"): ref})[("b", "fwd")]
    for name in ("call", "tile", "gflops", "pair"):
        assert getattr(busy, name) == pytest.approx(getattr(true, name), rel=1e-6), name
    for name in ("call", "tile", "gflops", "pair"):
        for backend in ("b", "new"):
            want = getattr(true, name)
            assert getattr(got[(backend, "fwd")], name) == pytest.approx(want, rel=1e-6), name


def test_calls_on_another_device_never_read_cpu_numbers(monkeypatch) -> None:
    """A CUDA-like call (tensors on the meta device stand in for one) is priced by the
    priority list even while CPU tables are pinned; no table file is read for it."""
    monkeypatch.setattr(rates, "_read", lambda *a: pytest.fail("read CPU rates"))
    q = torch.empty(1, 8, 512, 64, device="meta")
    call = AttentionCall(q, q, q, None, None, True, 0.125, 0.0, None, False)
    assert rates.table_for(q.device, "float32") is None
    for name in ("torch", "tiled", "math"):
        estimate = cost.estimate(name, call)
        assert estimate.basis == "priority", name
    assert cost.estimate("torch", call).seconds < cost.estimate("tiled", call).seconds
    assert cost.source(call).startswith("no rates for meta calls: auto follows its priority")


def test_without_measurements_auto_follows_the_priority_list(machine) -> None:
    """torch's kernel wherever it serves without building an n x n tensor, the tile loops for
    functions (sparse for a declared window, tiled for others), never a slow route."""
    from attnkit import masks

    q = torch.randn(1, 2, 256, 16)
    slopes = torch.tensor([0.5, 0.25])
    alibi = masks.relative(lambda b, h, i, j: -slopes[h] * (i - j).abs())
    cases = {
        "torch": {"is_causal": True},
        "sparse": {"mask": masks.window_fn(31)},
        "tiled": {"bias": alibi},
    }
    for want, kw in cases.items():
        e = explain(q, q, q, **kw)
        assert e.backend == want, (want, str(e))
        assert "priority list" in str(e).splitlines()[1]
        out = scaled_dot_product_attention(q, q, q, **kw)
        ref = scaled_dot_product_attention(q.double(), q.double(), q.double(), backend="math", **kw)
        assert (out.double() - ref).abs().max() < 1e-5
    call = make_call(q, q, q, mask=torch.ones(256, 256, dtype=torch.bool))
    assert cost.estimate("torch", call).seconds == 1.0  # a mask tensor is read as it is


@pytest.mark.parametrize("pair_factor", [0.1, 0.5, 3.0, 0.0])
def test_the_fit_finds_the_per_pair_cost_apart_from_the_matmuls(pair_factor: float) -> None:
    """Elementwise work per pair need not scale with the matmuls from one CPU class to another
    (a window's cut tiles cost far less, relative to the matmuls, on Intel Xeon than on AMD
    EPYC): with the pairs pair_factor x the reference's and the matmuls twice as fast, each
    constant is fitted back, also with a call slowed fivefold by other work."""
    ref = rates.Rates(call=2e-4, tile=5e-5, gflops=120.0, pair=3e-9)
    true = rates.Rates(call=6e-4, tile=1.5e-4, gflops=240.0, pair=3e-9 * pair_factor)
    found = []
    # Calls without per-pair work in the majority, as in the calibration's configs.
    shapes = [(1, 256, 0), (16, 1e6, 0), (64, 8e6, 0), (40, 4e6, 4e6), (8, 2e5, 2e5)]
    shapes += [(100, 3e7, 0), (30, 6e6, 6e6), (50, 2e7, 0), (20, 4e6, 0)]
    for tiles, pairs, extra in shapes:
        terms = cost.Terms(tiles=tiles, pairs=pairs, extra=extra, ops=0)
        seconds = true.call + true.tile * tiles + pairs * 256 / (true.gflops * 1e9)
        seconds += true.pair * extra
        found.append({"backend": "b", "mode": "fwd", "terms": terms, "d": 64, "seconds": seconds})
    slowed = dict(found[2], seconds=found[2]["seconds"] * 5)
    for calls in (found, [*found, slowed]):
        got = calibration.fit(calls, 1e-9, {("b", "fwd"): ref})[("b", "fwd")]
        for name in ("call", "tile", "gflops"):
            assert getattr(got, name) == pytest.approx(getattr(true, name), rel=1e-6), name
        assert got.pair == pytest.approx(true.pair, rel=1e-6, abs=1e-15)
