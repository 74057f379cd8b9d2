"""The decode step over a KV cache (``attnkit.backends.fused.decode``): the compiled
flash-decoding kernel against a float64 reference (its error at most twice that of the plain
torch path in float32), float32 and bfloat16 caches read in place, key padding with fully
masked rows, NaN where the reference puts it, every thread busy for one sequence, and argument
checks that name the shapes.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from attnkit.backends.fused import jit
from attnkit.backends.fused.decode import decode_attention, decode_reference, why_not

F64 = torch.float64


@pytest.fixture(scope="module")
def kernel():
    """Build (or load) the kernel once; without a compiler these tests cannot run here."""
    try:
        return jit.build()
    except jit.NotBuilt as reason:
        pytest.skip(f"the fused kernel is unavailable here: {reason}")


def _cache(b, h_kv, length, d, dtype, seed, spare=5):
    """q (b, h, 1, d) is made by the caller; key and value as a cache's storage: room for
    ``spare`` more positions than are filled (garbage there, never read)."""
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(b, h_kv, length + spare, d, generator=g).to(dtype)
    value = torch.randn(b, h_kv, length + spare, d, generator=g).to(dtype)
    key[:, :, length:] = float("nan")  # positions past length must not be read
    value[:, :, length:] = float("nan")
    return key, value


def _errors(q, key, value, length, **kw):
    """The kernel's and the plain float32 path's largest error against float64."""
    want = decode_reference(q.to(F64), key.to(F64), value.to(F64), length, **kw)
    got = decode_attention(q, key, value, length, **kw)
    plain = decode_reference(q, key.float(), value.float(), length, **kw)
    assert got.shape == want.shape == q.shape and got.dtype == torch.float32
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN in other places"
    finite = ~torch.isnan(want)
    err = (got.to(F64) - want)[finite].abs().max().item() if finite.any() else 0.0
    limit = (plain.to(F64) - want)[finite].abs().max().item() if finite.any() else 0.0
    return err, limit


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("length", [1, 7, 97, 1000, 4096])
@pytest.mark.parametrize("d", [64, 80, 17])
@pytest.mark.parametrize(("h", "h_kv"), [(9, 3), (8, 8), (4, 1), (12, 2)])
def test_equals_the_float64_reference(kernel, h, h_kv, d, length, kv_dtype) -> None:
    """Error against float64 (on the cache's own values) at most twice the plain path's (groups
    of 1, 3, 4 and 6 query heads per key/value head)."""
    seed = h * 100_000 + d * 10_000 + length
    b = (1, 3)[seed % 2]
    key, value = _cache(b, h_kv, length, d, kv_dtype, seed)
    q = torch.randn(b, h, 1, d, generator=torch.Generator().manual_seed(seed + 1))
    err, limit = _errors(q, key, value, length)
    assert err <= 2 * limit + 1e-7, f"error {err:.2e} > 2x the plain path's ({limit:.2e})"


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("length", [7, 97, 4096])
def test_key_padding_with_fully_masked_rows(kernel, length, kv_dtype) -> None:
    """Left padding of different lengths per row, one row with no key at all (zeros)."""
    b, h, h_kv, d = 3, 9, 3, 64
    key, value = _cache(b, h_kv, length, d, kv_dtype, length)
    q = torch.randn(b, h, 1, d, generator=torch.Generator().manual_seed(length))
    key_mask = torch.ones(b, length, dtype=torch.bool)
    key_mask[0] = False  # no key: the row gives zeros
    key_mask[1, : length // 2] = False  # left padding
    key_mask[2, ::3] = False  # holes, across chunk boundaries
    err, limit = _errors(q, key, value, length, key_mask=key_mask)
    assert err <= 2 * limit + 1e-7
    out = decode_attention(q, key, value, length, key_mask=key_mask)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("where", [0, 700, 4095])
def test_a_nan_key_makes_its_groups_rows_nan_and_a_masked_one_does_not(
    kernel, where: int, threads: int
) -> None:
    """A NaN in one key row (in any chunk) makes the rows of the query heads that see it NaN,
    as the reference does; masked out, it changes nothing. NaN values past ``length`` are
    never read (``_cache`` puts them there)."""
    if threads > (os.cpu_count() or 1):
        pytest.skip(f"this machine has fewer than {threads} cores")
    b, h, h_kv, d, length = 2, 9, 3, 64, 4096
    key, value = _cache(b, h_kv, length, d, torch.float32, where)
    q = torch.randn(b, h, 1, d, generator=torch.Generator().manual_seed(where))
    key[1, 2, where, 5] = float("nan")
    value[0, 1, where, 7] = float("nan")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = decode_attention(q, key, value, length)
        want = decode_reference(q.to(F64), key.to(F64), value.to(F64), length)
        assert torch.equal(torch.isnan(out), torch.isnan(want))
        assert torch.isnan(out[1, 6:]).all() and torch.isnan(out[0, 3:6, :, 7]).all()
        key_mask = torch.ones(b, length, dtype=torch.bool)
        key_mask[:, where] = False
        masked = decode_attention(q, key, value, length, key_mask=key_mask)
        assert not torch.isnan(masked).any()
        want = decode_reference(q.to(F64), key.to(F64), value.to(F64), length, key_mask=key_mask)
        torch.testing.assert_close(masked.to(F64), want, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_one_sequence_with_three_key_heads_uses_every_thread(kernel, threads) -> None:
    """Flash-decoding: b = 1 and h_kv = 3 give only three (batch, key head) pairs; the keys
    are split into chunks so that every one of torch's threads takes part."""
    if threads > (os.cpu_count() or 1):
        pytest.skip(f"this machine has fewer than {threads} cores")
    key, value = _cache(1, 3, 4096, 64, torch.float32, 0)
    q = torch.randn(1, 9, 1, 64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        decode_attention(q, key, value, 4096)
        assert kernel.threads_used() == threads == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_reads_a_cache_view_and_takes_a_scale(kernel) -> None:
    """A ``[:, :, :length]`` view of the storage gives what the storage and ``length`` give;
    ``scale`` multiplies the scores as in the reference."""
    key, value = _cache(3, 3, 97, 64, torch.bfloat16, 3)
    q = torch.randn(3, 9, 1, 64)
    whole = decode_attention(q, key, value, 97, scale=0.3)
    view = decode_attention(q, key[:, :, :97], value[:, :, :97], 97, scale=0.3)
    assert torch.equal(whole, view)
    want = decode_reference(q.to(F64), key.to(F64), value.to(F64), 97, scale=0.3)
    torch.testing.assert_close(whole.to(F64), want, atol=1e-5, rtol=1e-5)
    default = decode_attention(q, key, value, 97)
    torch.testing.assert_close(
        default, decode_attention(q, key, value, 97, scale=1 / math.sqrt(64)), atol=0, rtol=0
    )


def test_what_the_kernel_does_not_serve_falls_back_in_a_sentence(kernel) -> None:
    """float64 queries, a float16 cache and a query that requires grad take the reference (and
    why_not says why); the result is the reference's."""
    key, value = _cache(1, 1, 7, 8, F64, 0)
    q = torch.randn(1, 2, 1, 8, dtype=F64)
    assert "float32 queries" in why_not(q, key, value)
    torch.testing.assert_close(
        decode_attention(q, key, value, 7), decode_reference(q, key, value, 7), atol=0, rtol=0
    )
    assert "float32, bfloat16 or float16 caches" in why_not(q.float(), key.double(), value.double())
    assert "float32, bfloat16 or float16 caches" in why_not(q.float(), key.half(), value.bfloat16())
    grad_q = q.float().requires_grad_()
    assert "requires grad" in why_not(grad_q, key.float(), value.float())
    out = decode_attention(grad_q, key.float(), value.float(), 7)
    assert out.requires_grad
    assert why_not(q.float(), key.float(), value.float()) is None
    strided = torch.randn(1, 2, 1, 16)[..., ::2]  # q not contiguous in d: the reference
    assert "contiguous in d" in why_not(strided, key.float(), value.float())
    torch.testing.assert_close(
        decode_attention(strided, key.float(), value.float(), 7),
        decode_reference(strided, key.float(), value.float(), 7),
    )


@pytest.mark.parametrize(
    ("q_shape", "k_shape", "length", "mask_shape", "words"),
    [
        ((1, 4, 2, 8), (1, 2, 9, 8), 9, None, r"q must be \(b, h, 1, d\)"),
        ((1, 4, 1, 8), (1, 3, 9, 8), 9, None, "h_kv dividing h = 4"),
        ((1, 4, 1, 8), (2, 2, 9, 8), 9, None, r"b = 1, d = 8"),
        ((1, 4, 1, 8), (1, 2, 9, 8), 10, None, r"length must be an int in \[0, L = 9\]"),
        ((1, 4, 1, 8), (1, 2, 9, 8), 5, (1, 9), r"key_mask must be a bool \(b, length\) = \(1, 5"),
    ],
)
def test_bad_arguments_name_the_shapes(q_shape, k_shape, length, mask_shape, words) -> None:
    q, key = torch.randn(q_shape), torch.randn(k_shape)
    mask = None if mask_shape is None else torch.ones(mask_shape, dtype=torch.bool)
    with pytest.raises(ValueError, match=words):
        decode_attention(q, key, key, length, key_mask=mask)


def test_the_kernel_checks_its_operands_before_any_work(kernel) -> None:
    """Called directly, the compiled function takes q and out as (b, h, d) or (b, h, 1, d) and
    refuses bad layouts with a sentence."""
    q, out = torch.randn(1, 4, 8), torch.empty(1, 4, 8)
    key = torch.randn(1, 2, 9, 8)
    out4 = torch.empty(1, 4, 1, 8)
    kernel.decode(q[:, :, None], key, key, 9, 1.0, None, out4)
    kernel.decode(q, key, key, 9, 1.0, None, out)
    assert torch.equal(out4[:, :, 0], out)
    with pytest.raises(RuntimeError, match=r"q must be float32 \(b, h, d\) or \(b, h, 1, d\)"):
        kernel.decode(torch.randn(1, 4, 2, 8), key, key, 9, 1.0, None, out)
    with pytest.raises(RuntimeError, match="key and value must both be float32, both bfloat16"):
        kernel.decode(q, key, key.bfloat16(), 9, 1.0, None, out)
    with pytest.raises(RuntimeError, match="contiguous in d"):
        kernel.decode(q, key.mT.contiguous().mT, key, 9, 1.0, None, out)
    with pytest.raises(RuntimeError, match="length must be in"):
        kernel.decode(q, key, key, 10, 1.0, None, out)
    with pytest.raises(RuntimeError, match="key_mask must be bool"):
        kernel.decode(q, key, key, 9, 1.0, torch.ones(1, 8, dtype=torch.bool), out)


def test_the_per_token_question_reads_no_file(kernel, monkeypatch) -> None:
    """``loaded_only``: before this process has loaded the kernel the answer is a sentence and
    no file is read (the layer asks per token); the full question loads a verified build."""
    key, value = _cache(1, 1, 7, 8, torch.float32, 0)
    q = torch.randn(1, 2, 1, 8)
    monkeypatch.setattr(jit, "_MODULE", [None])
    real = jit.unavailable
    monkeypatch.setattr(jit, "unavailable", lambda: pytest.fail("a file was read"))
    assert why_not(q, key, value, loaded_only=True) == (
        "the fused kernel is not loaded in this process (it loads once built)"
    )
    monkeypatch.setattr(jit, "unavailable", real)
    assert why_not(q, key, value) is None and jit.loaded() is not None
    assert why_not(q, key, value, loaded_only=True) is None
    monkeypatch.setenv("ATTNKIT_FUSED", "0")
    assert jit.loaded() is None and "turned off" in why_not(q, key, value)
