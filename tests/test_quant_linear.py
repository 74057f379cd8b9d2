"""``QuantizedLinear``, ``QuantizedEmbedding`` and ``ConcatLinear`` against torch's layers on the
de-quantised weights: the reference path exactly, the fused kernel's ``qmatmul`` (built on
request here) within float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnkit.quant import ConcatLinear, QuantizedEmbedding, QuantizedLinear, dequantize
from attnkit.quant import linear as qlinear

pytest.importorskip("gguf")
from test_quant_formats import random_rows

KINDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q6_K": 14, "BF16": 30}


@pytest.fixture
def reference(monkeypatch):
    """Force the reference path (de-quantise, then F.linear) whether or not a kernel is built."""
    monkeypatch.setattr(qlinear, "_KERNEL", [None])


@pytest.fixture
def kernel(monkeypatch):
    """The fused kernel's qmatmul, built now if needed (an explicit request), or a skip."""
    from attnkit.backends.fused import jit

    reason = jit.prerequisites()
    if reason is not None:
        pytest.skip(f"the fused kernel is unavailable here: {reason}")
    try:
        module = jit.build()
    except jit.NotBuilt as error:
        pytest.skip(f"the fused kernel is unavailable here: {error}")
    if not hasattr(module, "qmatmul"):
        pytest.skip("this build of the fused kernel binds no qmatmul")
    monkeypatch.setattr(qlinear, "_KERNEL", [module])


def _layer(name: str, n: int, blocks: int, seed: int = 0) -> QuantizedLinear:
    raw, k = random_rows(name, n, blocks, seed)
    return QuantizedLinear(k, n, KINDS[name], raw=torch.from_numpy(raw))


@pytest.mark.parametrize("name", list(KINDS))
@pytest.mark.parametrize("shape", [(1, 1), (2, 7), (3, 1, 5)])
def test_reference_path_equals_f_linear_exactly(reference, name, shape) -> None:
    layer = _layer(name, 37, 3)
    x = torch.randn(*shape, layer.in_features, generator=torch.Generator().manual_seed(1))
    got = layer(x)
    assert tuple(got.shape) == (*shape, 37)
    assert torch.equal(got, F.linear(x, layer.weight))


@pytest.mark.parametrize("name", list(KINDS))
@pytest.mark.parametrize("m", [1, 5, 97])
def test_kernel_path_equals_f_linear_within_float32_rounding(kernel, name, m) -> None:
    layer = _layer(name, 37, 3)
    x = torch.randn(m, layer.in_features, generator=torch.Generator().manual_seed(m))
    want = F.linear(x.double(), layer.weight.double())  # float64 reference of the same weights
    error = (layer(x).double() - want).abs().max()
    plain = (F.linear(x, layer.weight).double() - want).abs().max()  # torch's own float32 error
    assert error <= 2 * plain + 1e-6, (float(error), float(plain))


def test_bias_weight_and_repr(reference) -> None:
    raw, k = random_rows("Q8_0", 5, 2, seed=4)
    bias = torch.randn(5)
    layer = QuantizedLinear(k, 5, 8, raw=torch.from_numpy(raw), bias=bias)
    x = torch.randn(3, k)
    assert torch.equal(layer(x), F.linear(x, layer.weight, bias))
    assert torch.equal(layer.weight, dequantize(torch.from_numpy(raw), 8, k))
    assert "kind=Q8_0" in repr(layer) and "out_features=5" in repr(layer)
    assert [name for name, _ in layer.named_buffers()] == ["raw"]


def test_embedding_equals_f_embedding_and_its_linear_the_tied_projection(reference) -> None:
    raw, e = random_rows("Q8_0", 23, 2, seed=5)
    table = QuantizedEmbedding(23, e, 8, raw=torch.from_numpy(raw))
    weight = dequantize(torch.from_numpy(raw), 8, e)  # (V, e)
    ids = torch.tensor([[3, 0, 22], [7, 7, 1]])
    assert torch.equal(table(ids), F.embedding(ids, weight))
    x = torch.randn(2, 3, e)
    assert torch.equal(table.linear(x), F.linear(x, weight))
    assert "kind=Q8_0" in repr(table)


def test_concat_linear_stacks_its_parts_rows(reference) -> None:
    parts = [_layer("Q4_1", 8, 2, 1), _layer("Q4_0", 4, 2, 3)]  # k = 64 both
    plain = nn.Linear(64, 3, bias=False)
    layer = ConcatLinear([*parts, plain])
    x = torch.randn(2, 64)
    assert layer.out_features == 15
    weight = torch.cat([parts[0].weight, parts[1].weight, plain.weight.detach()])
    torch.testing.assert_close(layer(x), F.linear(x, weight), rtol=0, atol=1e-5)


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match=r"raw must be \(4, 40\) bytes"):
        QuantizedLinear(64, 4, 3, raw=torch.zeros(4, 36, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        QuantizedLinear(64, 4, 3, raw=torch.zeros(4, 40))
    with pytest.raises(ValueError, match="whole blocks of 32"):
        QuantizedLinear(48, 4, 3)
    with pytest.raises(ValueError, match="in_features=64"):
        QuantizedLinear(64, 4, 3)(torch.zeros(2, 63))
    assert np.array_equal(QuantizedLinear(64, 4, 3).raw.numpy(), np.zeros((4, 40), np.uint8))


@pytest.mark.parametrize("background", ["1", "0"])
def test_a_missing_kernel_is_built_in_the_background_and_said_once(
    monkeypatch, caplog, background
) -> None:
    """Loading a quantised model calls prepare_kernel: without a kernel it starts the build
    through rates.start_background (unless ATTNKIT_BACKGROUND=0) and says so once per process."""
    from attnkit.quant import prepare_kernel

    monkeypatch.setattr(qlinear, "_KERNEL", [None])
    monkeypatch.setattr(qlinear, "_ANNOUNCED", [])
    monkeypatch.setattr(qlinear.jit, "is_built", lambda: False)
    monkeypatch.setattr(qlinear.jit, "prerequisites", lambda: None)
    monkeypatch.setattr(qlinear.jit, "unavailable", lambda: "not built yet")
    monkeypatch.setenv("ATTNKIT_BACKGROUND", background)
    started = []
    monkeypatch.setattr(qlinear.rates, "start_background", lambda *a: started.append(a) or True)
    with caplog.at_level("WARNING", logger="attnkit"):
        for _ in range(3):
            assert prepare_kernel() == "the fused kernel is unavailable: not built yet"
    assert len(started) == (background == "1")
    said = [r.getMessage() for r in caplog.records if "reference path" in r.getMessage()]
    assert len(said) == 1
    assert ("has started in the background" in said[0]) == (background == "1")
