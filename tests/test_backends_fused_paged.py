"""The paged attention kernel (``attnkit.backends.fused.paged``): against a dense float64
reference (its error at most twice that of the plain torch path, ``attnkit.serve.paged``, in
float32) for ragged batches of decode rows and prefill chunks read through scattered block
tables, float32, bfloat16 and float16 pools, keys past a sequence's length never read, the chunk
merge on two threads, every thread busy for one long sequence, argument checks that name the
shapes, and the server's greedy tokens unchanged when its steps take the kernel.
"""

from __future__ import annotations

import random

import pytest
import torch

from attnkit.backends.fused import jit
from attnkit.backends.fused import paged as fused_paged
from attnkit.backends.fused.paged import paged_attention, why_not
from attnkit.serve import forward as serve_forward
from attnkit.serve import paged as serve_paged
from attnkit.serve.engine import Engine
from llama_oracles import bundled_gguf as bundled_gguf
from serve_oracles import tiny_model

F64 = torch.float64


@pytest.fixture(scope="module")
def kernel():
    """Build (or load) the kernel once; without a compiler these tests cannot run here."""
    try:
        return jit.build()
    except jit.NotBuilt as reason:
        pytest.skip(f"the fused kernel is unavailable here: {reason}")


def _problem(lengths, query_lengths, h, h_kv, d, s, dtype, seed, garbage=0.0):
    """q (t, h, d) and a pool whose blocks are shuffled among the sequences, with two spare
    blocks; positions past every sequence's length hold ``garbage`` (NaN: must not be read)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-j // s) for j in lengths]
    n_blocks = sum(need) + 2
    order = torch.randperm(n_blocks, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(order[at : at + n])
        at += n
    m = max(need)
    padded = [t + [order[-1]] * (m - len(t)) for t in tables]  # a spare block: never read
    key_pool = torch.randn(n_blocks, s, h_kv, d, generator=g)  # (N, s, h_kv, d)
    value_pool = torch.randn(n_blocks, s, h_kv, d, generator=g)
    used = torch.zeros(n_blocks * s, dtype=torch.bool)
    for table, j in zip(tables, lengths, strict=True):
        used[serve_paged.slots_of(table, 0, j, s)] = True
    key_pool.view(-1, h_kv, d)[~used] = garbage
    value_pool.view(-1, h_kv, d)[~used] = garbage
    q = torch.randn(sum(query_lengths), h, d, generator=g)  # (t, h, d)
    return (
        q,
        key_pool.to(dtype),
        value_pool.to(dtype),
        torch.tensor(padded, dtype=torch.long),  # (b, m)
        torch.tensor(lengths, dtype=torch.long),  # (b,)
        list(query_lengths),
    )


def dense_reference(q, key_pool, value_pool, tables, lengths, query_lengths, scale=None):
    """Each sequence's keys gathered into a dense (j, h, d) tensor, float64, causal aligned
    bottom-right: query a of i new tokens sees keys 0 .. j - i + a."""
    h, d = q.shape[1:]
    r = h // key_pool.shape[2]
    scale = d**-0.5 if scale is None else scale
    out, start = [], 0
    for n, (j, i) in enumerate(zip(lengths.tolist(), query_lengths, strict=True)):
        k = key_pool[tables[n]].flatten(0, 1)[:j].to(F64).repeat_interleave(r, 1)  # (j, h, d)
        v = value_pool[tables[n]].flatten(0, 1)[:j].to(F64).repeat_interleave(r, 1)
        qn = q[start : start + i].to(F64)  # (i, h, d)
        scores = torch.einsum("ihd,jhd->hij", qn, k) * scale  # (h, i, j)
        visible = torch.arange(j)[None] <= (j - i + torch.arange(i))[:, None]  # (i, j)
        scores = scores.masked_fill(~visible, float("-inf"))
        out.append(torch.einsum("hij,jhd->ihd", scores.softmax(-1), v))  # (i, h, d)
        start += i
    return torch.cat(out)  # (t, h, d)


def _check_against_references(args, **kw):
    """The kernel's error against float64 at most twice the plain float32 path's (which reads
    the pool with its garbage zeroed: the reference gathers whole blocks)."""
    q, key_pool, value_pool, tables, lengths, query_lengths = args
    want = dense_reference(*args, **kw)
    got = paged_attention(*args, **kw)
    assert got.shape == q.shape and got.dtype == torch.float32
    plain = serve_paged.paged_attention(
        q, key_pool.nan_to_num(0.0).float(), value_pool.nan_to_num(0.0).float(), tables,
        lengths, query_lengths, **kw,
    )  # fmt: skip
    err = (got.to(F64) - want).abs().max().item()
    limit = (plain.to(F64) - want).abs().max().item()
    assert err <= 2 * limit + 1e-6, (err, limit)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("s", [1, 16, 24, 32])
@pytest.mark.parametrize(("h", "h_kv"), [(9, 3), (4, 1), (8, 8)])
def test_ragged_batches_equal_the_float64_reference(kernel, h, h_kv, s, dtype) -> None:
    """Random lengths 1..300: decode rows (one new token), prefill chunks (some new tokens after
    a cached prefix) and whole prompts in one batch; garbage (NaN) past every length."""
    rng = random.Random(h * 100 + s)
    lengths = [rng.randint(1, 300) for _ in range(6)] + [1, 97]
    query_lengths = [1, 1, rng.randint(1, 40), lengths[3], rng.randint(1, 70), 1, 1, 33]
    query_lengths = [min(i, j) for i, j in zip(query_lengths, lengths, strict=True)]
    d = 17 if h == 9 else 64
    args = _problem(lengths, query_lengths, h, h_kv, d, s, dtype, seed=s, garbage=float("nan"))
    _check_against_references(args)


def test_the_plain_reference_and_a_scale(kernel) -> None:
    """The serve reference itself (not only float64) agrees closely, with a given scale, and
    int32 tables and lengths are read as int64 ones."""
    args = _problem([5, 120, 257], [5, 1, 64], 6, 2, 80, 16, torch.float32, seed=3)
    got = paged_attention(*args, scale=0.3)
    want = serve_paged.paged_attention(*args, scale=0.3)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    q, kp, vp, tables, lengths, qls = args
    narrow = paged_attention(q, kp, vp, tables.int(), lengths.int(), qls, scale=0.3)
    assert torch.equal(narrow, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_long_sequences_split_into_chunks_and_merge(kernel, dtype) -> None:
    """On two threads, keys longer than a chunk are split and the chunks' states merged, for
    decode rows and for a prefill chunk after a long prefix (several query blocks)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        args = _problem([1500, 999, 2100], [1, 90, 1], 8, 2, 64, 16, dtype, seed=7)
        _check_against_references(args)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_one_long_sequence_runs_on_every_thread(kernel, threads) -> None:
    args = _problem([4096], [1], 8, 2, 64, 16, torch.float32, seed=1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        paged_attention(*args)
        assert kernel.threads_used() == threads == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_bad_arguments_are_named(kernel) -> None:
    q, kp, vp, tables, lengths, qls = _problem([10, 20], [2, 1], 4, 2, 8, 4, torch.float32, 0)
    with pytest.raises(ValueError, match=r"q must be \(t, h, d\)"):
        paged_attention(q[None], kp, vp, tables, lengths, qls)
    with pytest.raises(ValueError, match="of one shape"):
        paged_attention(q, kp, vp[:, :2], tables, lengths, qls)
    with pytest.raises(ValueError, match="h_kv dividing h"):
        paged_attention(q[:, :3], kp, vp, tables, lengths, qls)
    with pytest.raises(ValueError, match="b = 3 rows"):
        paged_attention(q, kp, vp, tables, lengths, [1, 1, 1])
    with pytest.raises(ValueError, match="sum to 4, but q has t = 3"):
        paged_attention(q, kp, vp, tables, lengths, [2, 2])
    with pytest.raises(ValueError, match="integer tensors"):
        paged_attention(q, kp, vp, tables.float(), lengths, qls)
    with pytest.raises(ValueError, match="sequence 1 has 1 new tokens and length 21"):
        paged_attention(q, kp, vp, tables, lengths + 1, qls)
    with pytest.raises(ValueError, match="sequence 0 has 2 new tokens and length 1"):
        paged_attention(q, kp, vp, tables, torch.tensor([1, 20]), qls)
    bad = tables.clone()
    bad[0, 1] = kp.shape[0]
    with pytest.raises(RuntimeError, match=r"block_tables\[0, 1\] = \d+ is not a block"):
        paged_attention(q, kp, vp, bad, lengths, qls)
    with pytest.raises(jit.NotBuilt, match="float32 queries"):
        paged_attention(q.double(), kp, vp, tables, lengths, qls)
    with pytest.raises(jit.NotBuilt, match="float32, bfloat16 or float16 pools"):
        paged_attention(q, kp.double(), vp.double(), tables, lengths, qls)
    with pytest.raises(jit.NotBuilt, match="float32, bfloat16 or float16 pools"):
        paged_attention(q, kp.half(), vp.bfloat16(), tables, lengths, qls)
    assert why_not(q, kp, vp) is None


def test_no_kernel_means_an_error_not_a_fallback(kernel, monkeypatch) -> None:
    args = _problem([10], [1], 4, 2, 8, 4, torch.float32, 0)
    monkeypatch.setenv("ATTNKIT_FUSED", "0")
    assert why_not(*args[:3], loaded_only=True) is not None
    with pytest.raises(jit.NotBuilt, match="not loaded"):
        paged_attention(*args)


def test_the_engine_gives_the_same_greedy_tokens_through_the_kernel(kernel, monkeypatch):
    """Chunked prefill and batched decoding through the kernel (the seam picks it once loaded)
    give the tokens of the reference path (the kernel turned off)."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(len(args[5]))
        return paged_attention(*args, **kwargs)

    def run():
        model = tiny_model()
        engine = Engine(model, num_blocks=64, block_size=4, max_batch=4, chunk_tokens=24)
        rng = random.Random(0)
        gens = [engine.submit([rng.randrange(97) for _ in range(n)], 6) for n in (3, 30, 17, 41)]
        engine.run_until_idle()
        return [g.result(0)[0] for g in gens]

    assert serve_forward.use_fused_kernel() is None
    monkeypatch.setattr(fused_paged, "paged_attention", counted)
    through_kernel = run()
    assert calls and max(calls) > 1  # batched steps of several sequences took the kernel
    monkeypatch.setenv("ATTNKIT_FUSED", "0")
    calls.clear()
    assert run() == through_kernel
    assert not calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_result_is_the_same_bits_however_its_queries_are_split(kernel, dtype, threads):
    """A sequence's 600 new tokens attended in one call, in pieces of any size (each piece a
    call whose earlier tokens are cached), one token at a time, or beside other sequences: every
    row the same bits (keys split at fixed positions; one way of summing scores for any rows)."""
    n, h, h_kv, d, s = 600, 9, 3, 64, 16
    g = torch.Generator().manual_seed(11)
    blocks = -(-n // s) + 8
    key_pool = torch.randn(blocks, s, h_kv, d, generator=g).to(dtype)
    value_pool = torch.randn(blocks, s, h_kv, d, generator=g).to(dtype)
    table = torch.randperm(blocks, generator=g)[: -(-n // s)]
    other = torch.randperm(blocks, generator=g)[:8]  # another sequence's table (70 keys)
    q = torch.randn(n, h, d, generator=g)
    q_other = torch.randn(1, h, d, generator=g)

    def attend(parts, company=False):
        out, at = [], 0
        for size in parts:
            rows = q[at : at + size]
            tables, lengths, counts = [table], [at + size], [size]
            if company:  # a decoding sequence first in the batch
                rows = torch.cat([q_other, rows])
                tables, lengths, counts = [other, table], [70, at + size], [1, size]
            m = max(len(t) for t in tables)
            padded = torch.stack([torch.cat([t, t.new_zeros(m - len(t))]) for t in tables])
            o = paged_attention(rows, key_pool, value_pool, padded, torch.tensor(lengths), counts)
            out.append(o[1:] if company else o)
            at += size
        return torch.cat(out)

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = attend([n])
        for parts, company in (([1] * 40 + [560], False), ([255, 1, 344], False),
                               ([37, 300, 263], True), ([200, 200, 200], True)):  # fmt: skip
            assert torch.equal(attend(parts, company), whole), (parts, company)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("dtype", "prompt", "filler", "new"),
    [
        (torch.float16, [2501, 2092, 1743, 1977, 1230, 4649, 4626, 3746, 4626, 817, 1962, 1398,
                         3551, 2107, 701, 1398, 6740, 1743, 1796, 1743, 811, 4319, 2092, 7042,
                         6740, 3252, 2988], 35, 2),
        (torch.bfloat16, [19945, 3551, 4319, 2477, 1977, 1977, 4626, 1463, 1796, 3746, 2107,
                          2342, 2299, 6740, 4626, 282], 33, 8),
    ],
)  # fmt: skip
def test_a_16_bit_cache_gives_the_same_greedy_tokens_alone_and_batched(
    kernel, bundled_gguf, dtype, prompt, filler, new
):
    """Near-ties of SmolLM2 where another request ahead of it changes how the prompt is split
    into chunks (chunk_tokens=48): a last-bit difference in a key, rounded to 16 bits, used to
    change the greedy token. The steps are now the same bits whatever the split."""
    kw = dict(num_blocks=64, block_size=16, max_batch=16, chunk_tokens=48, kv_dtype=dtype)
    engine = Engine(bundled_gguf.model, **kw)
    alone = engine.submit(prompt, new, ignore_eos=True)
    engine.run_until_idle()
    engine = Engine(bundled_gguf.model, **kw)
    engine.submit([1] * filler, 1, ignore_eos=True)
    batched = engine.submit(prompt, new, ignore_eos=True)
    engine.run_until_idle()
    assert batched.result(0)[0] == alone.result(0)[0]
