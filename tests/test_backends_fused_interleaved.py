"""Rows of W interleaved by eight (interleaved.h), the layout the decoding step multiplies Q4_0,
Q4_1 and Q8_0 weights in on AVX2: ``interleave`` rearranges the same bytes, ``dequantize`` of
the interleaved rows equals gguf's de-quantisation of the original ones bit for bit (the
kernel's own de-quantised values, exact), ``qmatmul`` on them is x times those values within
float32 rounding on both paths, a row's product is the same bits alone, in any batch and on
any thread count, the portable build computes the same bits, bad operands are refused in a
sentence, and the build says whether its step takes this layout."""

from __future__ import annotations

import pytest
import torch

from attnkit.backends.fused import jit
from test_backends_fused_quant import (
    WRAPPER,
    Kind,
    _assert_product,
    _blocks,
    _reference,
    assert_refused,
)
from test_backends_fused_quant import _standalone as standalone
from test_backends_fused_quant import kernel as kernel

INTERLEAVED = 256
KINDS = [Kind.Q4_0, Kind.Q4_1, Kind.Q8_0]


def _interleaved(kernel, kind: Kind, n: int, k: int, seed: int = 0):
    """(GGUF rows, the same rows interleaved, gguf's float32 values) of a random W (n, k)."""
    w = _blocks(kind, n, k, seed=seed)
    return w, kernel.interleave(w, int(kind)), _reference(w, kind, k)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("n", [8, 24, 32, 40, 104])
def test_interleaving_keeps_every_byte_and_value(kernel, kind: Kind, n: int) -> None:
    """n = 24 and 40: a last set of fewer than four groups."""
    for k in (32, 96, 288):
        w, packed, want = _interleaved(kernel, kind, n, k, seed=n + k)
        assert packed.shape == w.shape and packed.dtype == torch.uint8
        assert not torch.equal(packed, w)
        assert torch.equal(packed.flatten().sort().values, w.flatten().sort().values)
        got = kernel.dequantize(packed, INTERLEAVED + int(kind), k)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"k = {k}"


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 64, 300])
def test_qmatmul_on_interleaved_rows_is_x_times_the_values(kernel, kind: Kind, m: int) -> None:
    """Up to 256 rows of x the row kernels (4, 2, 1 rows at a time), beyond them the tiles."""
    for n in (8, 40, 96):
        for k in (96, 288):
            _, packed, want = _interleaved(kernel, kind, n, k, seed=m + n + k)
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m * n + k))
            out = torch.full((m, n), float("nan"))
            kernel.qmatmul(x, packed, INTERLEAVED + int(kind), out)
            _assert_product(out, x, want)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_gets_the_same_bits_alone_or_in_any_batch(kernel, kind: Kind, threads) -> None:
    """Each output is one chain of FMAs in a fixed order, however many rows of x or groups of W
    a call takes at once and however the rows of W are split over threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _, packed, _ = _interleaved(kernel, kind, 104, 288, seed=3)
        code = INTERLEAVED + int(kind)
        x = torch.randn(19, 288, generator=torch.Generator().manual_seed(5))
        alone = torch.empty(19, 104)
        for r in range(19):
            kernel.qmatmul(x[r : r + 1].contiguous(), packed, code, alone[r : r + 1])
        for m in (2, 3, 4, 7, 8, 9, 12, 19):
            together = torch.empty(m, 104)
            kernel.qmatmul(x[:m].contiguous(), packed, code, together)
            assert torch.equal(together, alone[:m]), f"{m} rows together differ from alone"
    finally:
        torch.set_num_threads(before)


def test_the_build_says_whether_its_step_takes_interleaved_rows(kernel) -> None:
    """AVX2 without AVX-512: the step's products are faster on interleaved rows; elsewhere the
    row kernels of GGUF's own layout are kept."""
    assert kernel.interleaves() == (jit.capability() == "AVX2")


@pytest.mark.slow
def test_the_portable_build_computes_the_same_bits(kernel) -> None:
    """Without AVX2 the same chains run on 8 floats with std::fma: the same bits as this
    machine's vector code, on both paths."""
    if jit.capability() not in ("AVX2", "AVX512"):
        pytest.skip("this machine's kernel has no vector code to compare with")
    if jit.prerequisites() is not None:
        pytest.skip(jit.prerequisites())
    assert "bindings.h" in WRAPPER
    portable = standalone("DEFAULT")
    assert not portable.interleaves()
    for kind in KINDS:
        w, packed, want = _interleaved(kernel, kind, 40, 288, seed=int(kind))
        assert torch.equal(portable.interleave(w, int(kind)), packed)
        got = portable.dequantize(packed, INTERLEAVED + int(kind), 288)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        for m in (1, 5, 8, 300):
            x = torch.randn(m, 288)
            ours, theirs = torch.empty(m, 40), torch.empty(m, 40)
            kernel.qmatmul(x, packed, INTERLEAVED + int(kind), ours)
            portable.qmatmul(x, packed, INTERLEAVED + int(kind), theirs)
            if m <= 256:
                assert torch.equal(ours, theirs), f"{kind.name}, m = {m}"
            _assert_product(theirs, x, want)


_W = _blocks(Kind.Q4_1, 16, 64)
_W12 = _blocks(Kind.Q4_1, 12, 64)
_X, _OUT = torch.randn(3, 64), torch.empty(3, 16)
BAD = [
    ("interleave: kind = 14 (Q6_K) cannot be interleaved (expected Q4_0 = 2, Q4_1 = 3 or Q8_0 = 8)",
     "interleave", (_blocks(Kind.Q6_K, 8, 256), 14)),
    ("interleave: w of shape [12, 40] has 12 rows, not a multiple of 8", "interleave", (_W12, 3)),
    ("interleave: kind = 99 is not a supported GGUF type", "interleave", (_W, 99)),
    ("interleave: w must be a uint8 (n, row_bytes)", "interleave", (_W.float(), 3)),
    ("rows of 40 bytes, not a whole number of Q8_0 blocks of 34", "interleave", (_W, 8)),
    ("qmatmul: kind = 270 is not a supported GGUF type", "qmatmul", (_X, _W, 270, _OUT)),
    ("or 256 + Q4_0, Q4_1 or Q8_0 for rows interleaved by 8", "qmatmul", (_X, _W, 270, _OUT)),
    ("qmatmul: w of shape [12, 40] is interleaved by 8 rows (kind = 259) but has 12 rows",
     "qmatmul", (_X, _W12, 259, torch.empty(3, 12))),
    ("dequantize: w of shape [12, 40] is interleaved by 8 rows", "dequantize", (_W12, 259, 64)),
    ("embedding: kind = 259 is not a supported GGUF type", "embedding",
     (torch.tensor([0]), _W, 259, 64)),
]  # fmt: skip


@pytest.mark.parametrize(("expected", "function", "args"), BAD, ids=[b[0][:40] for b in BAD])
def test_bad_operands_are_refused_in_a_sentence(kernel, expected, function, args) -> None:
    assert_refused(kernel, expected, function, args)
