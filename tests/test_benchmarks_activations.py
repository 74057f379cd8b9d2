"""The activation-rounding benchmark rounds as it says: int8 blocks exactly as gguf's Q8_0
quantises and de-quantises, hooks that round every product's input and leave the model as it was,
and a section with its summary above the fold."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

gguf = pytest.importorskip("gguf")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "activations.py"
spec = importlib.util.spec_from_file_location("bench_activations", SCRIPT)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_int8_blocks_are_gguf_q8_0(dtype):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 96)) * rng.uniform(1e-3, 1e3, (3, 1))).astype(np.float32)
    x[1, 32:64] = 0.0  # an all-zero block stays zero (its scale is 0)
    q8 = gguf.GGMLQuantizationType.Q8_0
    expected = gguf.quants.dequantize(gguf.quants.quantize(x, q8), q8)
    got = bench.int8_blocks(torch.from_numpy(x).to(dtype))
    assert got.dtype == dtype and got.shape == (3, 96)
    np.testing.assert_array_equal(got.float().numpy(), expected)


def test_int8_blocks_by_hand():
    x = torch.tensor([127.0, -63.4, 0.5, -2.5] + [0.0] * 28, dtype=torch.float64)
    got = bench.int8_blocks(x)  # d = 127 / 127 = 1: the nearest integer, halves away from 0
    assert got[:4].tolist() == [127.0, -63.0, 1.0, -3.0] and not got[4:].any()


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3, bias=False, dtype=torch.float64)
        self.norm = nn.Identity()

    def forward(self, x):
        return self.norm(self.proj(x)) @ torch.ones(3, 2, dtype=torch.float64)


def test_rounded_rounds_each_product_input_and_then_lets_go():
    model = _Tiny()
    x = torch.tensor([[1.0 + 2**-12, 2.0, -3.0, 0.1]], dtype=torch.float64)
    plain = model(x)
    with bench.rounded(model, bench.bfloat16):
        inner = model(x)
    r = bench.bfloat16
    expected = r(r(x) @ model.proj.weight.T) @ torch.ones(3, 2, dtype=torch.float64)
    assert torch.equal(inner, expected) and not torch.equal(inner, plain)
    assert torch.equal(model(x), plain)  # the hooks are gone


def test_report_has_one_table_and_its_summary_first():
    rows = [
        {"variant": "attnkit (float32 activations)", "max_error": 7e-5, "argmax_moved": 0,
         "positions": 100},
        {"variant": "bfloat16 activations", "max_error": 0.4, "argmax_moved": 0, "positions": 100},
        {"variant": "int8 activations, per 32 (llama.cpp's Q8_0)", "max_error": 1.5,
         "argmax_moved": 3, "positions": 100},
    ]  # fmt: skip
    same = {rows[0]["variant"]: 20, rows[1]["variant"]: 18, rows[2]["variant"]: 5}
    text = bench.report(rows, same, 20, (1, 7))
    summary, rest = text.split("<!-- more -->")
    assert "7.0e-05" in summary and "20 of 20" in summary
    assert "int8 activations: 1.5, 5 of 20" in summary
    assert rest.count("|---|") == 1 and "| 3 of 100 | 5 of 20 |" in rest
