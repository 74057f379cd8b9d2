"""The fused module's quantised matrix products (quant.cpp): ``dequantize`` equal to
``gguf.quants.dequantize`` bit for bit on random blocks of every supported GGUF type,
``qmatmul`` within float32 rounding of the float64 product with the de-quantised weight on both
its paths (matrix-vector for m <= 8, and up to 256 for Q4 with AVX-512; tiles of W and a
float32 matmul above), ``embedding`` equal
to rows of ``dequantize``, bad operands refused in a sentence before any work, the
matrix-vector path on every intra-op thread, and the AVX2 and portable builds of the same file
against gguf (the native class is covered by the full module).

Random blocks are random bytes with the float16 scale fields overwritten by finite values, so
every nibble and 6-bit pattern occurs; plain F16 / BF16 / F32 rows are finite random values."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import torch

from attnkit.backends.fused import jit

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Kind  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

KINDS = [Kind.F32, Kind.F16, Kind.BF16, Kind.Q4_0, Kind.Q4_1, Kind.Q8_0, Kind.Q6_K]
SCALES = {Kind.Q4_0: (0,), Kind.Q4_1: (0, 2), Kind.Q8_0: (0,), Kind.Q6_K: (208,)}  # f16 fields


@pytest.fixture(scope="module")
def kernel():
    """The full fused module (built once; cached)."""
    try:
        return jit.build()
    except jit.NotBuilt as reason:
        pytest.skip(f"the fused kernel is unavailable here: {reason}")


def _block(kind: Kind) -> tuple[int, int]:
    """(values, bytes) of one block of ``kind``."""
    return gguf.GGML_QUANT_SIZES[kind]


def _blocks(kind: Kind, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """W (n, k) as random GGUF rows: uint8 (n, row_bytes)."""
    rng = np.random.default_rng(seed)
    if kind in (Kind.F32, Kind.F16, Kind.BF16):
        w = rng.standard_normal((n, k)).astype(np.float32)
        if kind == Kind.F16:
            w = w.astype(np.float16)
        elif kind == Kind.BF16:
            w = (w.view(np.uint32) >> 16).astype(np.uint16)  # the high half of each float32
        return torch.from_numpy(w.view(np.uint8).reshape(n, -1).copy())
    values, size = _block(kind)
    raw = rng.integers(0, 256, (n, k // values, size), dtype=np.uint8)
    for at in SCALES[kind]:
        scale = (rng.standard_normal((n, k // values, 1)) * 0.1).astype(np.float16)
        raw[..., at : at + 2] = scale.view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def _reference(w: torch.Tensor, kind: Kind, k: int) -> torch.Tensor:
    """gguf's numpy de-quantisation: float32 (n, k)."""
    return torch.from_numpy(
        np.ascontiguousarray(gguf_dequantize(w.numpy(), kind), dtype=np.float32).reshape(-1, k)
    )


def _ks(kind: Kind) -> list[int]:
    """Row lengths: odd multiples of the block (and of 32, the unit the kernel reads)."""
    return [256, 768] if kind == Kind.Q6_K else [32, 96, 288]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("n", [1, 7, 97])
def test_dequantize_equals_gguf_bit_for_bit(kernel, kind: Kind, n: int) -> None:
    for k in _ks(kind):
        w = _blocks(kind, n, k, seed=n * k)
        got = kernel.dequantize(w, int(kind), k)
        want = _reference(w, kind, k)
        assert got.dtype == torch.float32 and got.shape == (n, k)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"k = {k}"


def _assert_product(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """out = x @ w^T in float32: within a float32 rounding bound of the float64 product,
    proportional to sqrt(k) |x| |W| (both paths sum k products in a different order)."""
    x64, w64 = x.double(), w.double()
    want = x64 @ w64.T
    bound = 4e-7 * x.shape[1] ** 0.5 * (x64.abs() @ w64.abs().T) + 1e-30
    err = (out.double() - want).abs()
    assert (err <= bound).all(), f"worst error / bound: {(err / bound).max().item():.2f}"


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("m", [1, 2, 5, 8, 64, 200])
def test_qmatmul_is_x_times_the_dequantized_weight(kernel, kind: Kind, m: int) -> None:
    """m <= 8 takes the matrix-vector path (rows 4, 2, 1 at a time, and 8 for Q4_0 / Q4_1
    with AVX-512), larger m the tiles."""
    for n in (1, 7, 97):
        for k in _ks(kind)[-2:]:
            w = _blocks(kind, n, k, seed=n + k)
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m * n + k))
            out = torch.full((m, n), float("nan"))
            assert kernel.qmatmul(x, w, int(kind), out) is None
            _assert_product(out, x, _reference(w, kind, k))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_a_row_gets_the_same_bits_alone_or_among_others(kernel, kind: Kind) -> None:
    """The matrix-vector path takes x's rows 8, 4, 2 or 1 at a time, and each row's sums run
    the same chains whichever: a row's product is the same bits alone or in any batch (so a
    server's greedy request gives the same tokens alone or among others). Rows wider than
    768 values go 4 at a time, not 8 (AVX-512): both widths are checked."""
    for k in (_ks(kind)[-1], 1792):
        w = _blocks(kind, 97, k, seed=3)
        x = torch.randn(8, k, generator=torch.Generator().manual_seed(5))
        alone = torch.empty(8, 97)
        for r in range(8):
            kernel.qmatmul(x[r : r + 1].contiguous(), w, int(kind), alone[r : r + 1])
        for m in range(2, 9):
            together = torch.empty(m, 97)
            kernel.qmatmul(x[:m].contiguous(), w, int(kind), together)
            assert torch.equal(together, alone[:m]), f"k={k}: {m} rows together differ from alone"


@pytest.mark.parametrize("kind", [Kind.F32, Kind.F16, Kind.BF16], ids=lambda k: k.name)
@pytest.mark.parametrize("m", [1, 3, 9])
def test_plain_rows_of_any_length(kernel, kind: Kind, m: int) -> None:
    """Plain rows need not be whole units of 32: the last values are read one by one."""
    for k in (1, 37, 97):
        w = _blocks(kind, 7, k, seed=k)
        want = _reference(w, kind, k)
        assert torch.equal(kernel.dequantize(w, int(kind), k), want)
        x = torch.randn(m, k)
        out = torch.empty(m, 7)
        kernel.qmatmul(x, w, int(kind), out)
        _assert_product(out, x, want)


def test_qmatmul_on_wide_matrices_spreads_tiles_over_rows_of_x(kernel) -> None:
    """Few rows of W and many of x: the tiles split x's rows too (every tile is written)."""
    w = _blocks(Kind.Q4_1, 17, 96)
    x = torch.randn(333, 96)
    out = torch.full((333, 17), float("nan"))
    kernel.qmatmul(x, w, int(Kind.Q4_1), out)
    _assert_product(out, x, _reference(w, Kind.Q4_1, 96))


@pytest.mark.parametrize("kind", [Kind.Q8_0, Kind.Q6_K], ids=lambda k: k.name)
def test_embedding_is_rows_of_dequantize(kernel, kind: Kind) -> None:
    k = _ks(kind)[-1]
    w = _blocks(kind, 97, k)
    ids = torch.tensor([5, 0, 96, 5, 42])
    assert torch.equal(kernel.embedding(ids, w, int(kind), k), _reference(w, kind, k)[ids])
    assert kernel.embedding(ids[:0], w, int(kind), k).shape == (0, k)


_W = _blocks(Kind.Q4_1, 7, 64)  # rows of 40 bytes
_X, _OUT, Q41 = torch.randn(3, 64), torch.empty(3, 7), int(Kind.Q4_1)
BAD = [
    ("qmatmul: kind = 5 is not a supported GGUF type", "qmatmul", (_X, _W, 5, _OUT)),
    ("dequantize: kind = 99 is not", "dequantize", (_W, 99, 64)),
    ("w must be a uint8 (n, row_bytes)", "qmatmul", (_X, _W.float(), Q41, _OUT)),
    ("w of shape [7, 40] must be contiguous", "qmatmul",
     (_X, torch.cat([_W, _W], 1)[:, :40], Q41, _OUT)),
    ("w of shape [7, 40] has rows of 40 bytes; Q4_1 with k = 96 needs 60", "dequantize",
     (_W, Q41, 96)),
    ("k = 48 must be a positive multiple of Q4_1's block of 32", "dequantize", (_W, Q41, 48)),
    ("rows of 40 bytes, not a whole number of Q8_0 blocks of 34", "qmatmul", (_X, _W, 8, _OUT)),
    ("x must be a float32 (m, k) tensor, got Double", "qmatmul", (_X.double(), _W, Q41, _OUT)),
    ("x of shape [3, 32] does not match: expected (m, k) with columns = 64", "qmatmul",
     (_X[:, :32].contiguous(), _W, Q41, _OUT)),
    ("x of shape [3, 64] must be contiguous", "qmatmul", (_X.t().contiguous().t(), _W, Q41, _OUT)),
    ("out of shape [3, 8] does not match: expected (m, n) with rows = 3, columns = 7", "qmatmul",
     (_X, _W, Q41, torch.empty(3, 8))),
    ("out must be a float32 (m, n) tensor, got Half", "qmatmul", (_X, _W, Q41, _OUT.half())),
    ("embedding: ids[1] = 7 is out of range for w with 7 rows", "embedding",
     (torch.tensor([0, 7]), _W, Q41, 64)),
    ("ids must be a 1-D int64 tensor", "embedding", (torch.tensor([0.0]), _W, Q41, 64)),
]  # fmt: skip


def assert_refused(kernel, expected: str, function: str, args: tuple) -> None:
    """``kernel.function(*args)`` raises, and its sentence holds ``expected``."""
    with pytest.raises(RuntimeError) as raised:
        getattr(kernel, function)(*args)
    assert expected in str(raised.value), f"{expected!r} not in {raised.value}"


@pytest.mark.parametrize(("expected", "function", "args"), BAD, ids=[b[0][:40] for b in BAD])
def test_bad_operands_are_refused_in_a_sentence(kernel, expected, function, args) -> None:
    """Each error names the argument, its shape and what was expected."""
    assert_refused(kernel, expected, function, args)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_matvec_runs_on_every_thread_torch_uses(kernel, threads: int) -> None:
    """A decoding step (m = 1) splits W's 1,536 rows over all of torch's intra-op threads."""
    if threads > (os.cpu_count() or 1):
        pytest.skip(f"this machine has fewer than {threads} cores")
    assert kernel.openmp()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w, x, out = _blocks(Kind.Q4_1, 1536, 576), torch.randn(1, 576), torch.empty(1, 1536)
        kernel.qmatmul(x, w, int(Kind.Q4_1), out)
        assert kernel.threads_used() == threads == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


# The other CPU classes: quant.cpp alone, with a generated module that binds it.

WRAPPER = """#include "bindings.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { attnkit_fused::bind_quant(m); }
"""


def _standalone(cpu_class: str):
    """quant.cpp compiled for ``cpu_class`` ("AVX2" or "DEFAULT": no vector flags), cached in
    the kernel cache under a hash of the sources and flags."""
    from torch.utils import cpp_extension

    flags = ["-O3", "-std=c++17", "-fopenmp", *jit._CAPABILITY_FLAGS.get(cpu_class, [])]
    digest = hashlib.sha256(" ".join([*flags, torch.__version__]).encode())
    for name in ("fused.h", "quant.h", "matvec.h", "interleaved.h", "quant.cpp", "bindings.h"):
        digest.update((jit.HERE / name).read_bytes())
    digest.update(WRAPPER.encode())
    name = f"attnkit_quant_{cpu_class.lower()}_{digest.hexdigest()[:12]}"
    folder = jit.cache_dir() / name
    folder.mkdir(parents=True, exist_ok=True)
    wrapper = folder / "module.cpp"
    if not wrapper.exists():
        wrapper.write_text(WRAPPER)
    with jit.file_lock(jit.cache_dir() / f"{name}.lock", jit.BUILD_WAIT):
        # We hold the build lock, so a baton torch's builder left in the folder is stale (a
        # killed build): without this, the builder would wait for it forever.
        (folder / "lock").unlink(missing_ok=True)
        return cpp_extension.load(
            name=name,
            sources=[str(wrapper), str(jit.HERE / "quant.cpp")],
            extra_cflags=flags,
            extra_ldflags=list(jit.LINK_FLAGS),
            extra_include_paths=[str(jit.HERE)],
            build_directory=str(folder),
            verbose=False,
        )


@pytest.mark.slow
@pytest.mark.parametrize("cpu_class", ["AVX2", "DEFAULT"])
def test_every_cpu_class_agrees_with_gguf(kernel, cpu_class: str) -> None:
    """The AVX2 build and the portable build (scalar twins), on every kind and both paths."""
    if cpu_class == "AVX2" and jit.capability() == "DEFAULT":
        pytest.skip("this CPU does not run AVX2 code")
    if cpu_class == jit.capability():
        pytest.skip(f"this machine's kernel is the {cpu_class} build: every test here runs it")
    if jit.prerequisites() is not None:
        pytest.skip(jit.prerequisites())
    module = _standalone(cpu_class)
    for kind in KINDS:
        k = _ks(kind)[-1]
        w = _blocks(kind, 7, k, seed=int(kind))
        want = _reference(w, kind, k)
        got = module.dequantize(w, int(kind), k)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), kind.name
        for m in (1, 5, 64):
            x = torch.randn(m, k)
            out = torch.empty(m, 7)
            module.qmatmul(x, w, int(kind), out)
            _assert_product(out, x, want)
        assert torch.equal(module.embedding(torch.tensor([6, 1]), w, int(kind), k), want[[6, 1]])
