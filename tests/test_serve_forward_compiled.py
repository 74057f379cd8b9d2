"""The compiled paged step (``llama_step.paged_step``, ``step.cpp``'s ``llama_paged_step``):
``paged_forward`` of a quantised model as one call gives the module loop's logits and writes
the same keys and values into the pool, for ragged prefill chunks and decode steps of a few or
many sequences (the products' row kernels), a chunk of more than 256 tokens (the tile path);
when it is taken; its checks, made before any pool is written."""

from __future__ import annotations

import random
import sys
import threading
import time

import pytest
import torch

from attnkit.models import llama_step
from attnkit.serve import forward as serve_forward
from attnkit.serve.forward import PagedBatch, paged_forward
from attnkit.serve.paged import BlockPool, paged_attention
from llama_oracles import bundled_gguf as bundled_gguf
from quant_oracles import SMALL, random_quantised
from quant_oracles import kernel as kernel
from quant_oracles import quant_kernel as quant_kernel
from serve_oracles import one_thread as one_thread
from serve_oracles import tiny_model


def _pool(model, dtype=torch.float32, blocks: int = 96, size: int = 8) -> BlockPool:
    c = model.config
    return BlockPool(
        blocks,
        size,
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        dtype=dtype,
    )


def _run(
    model, prompts, cut: int, steps: int, dtype=torch.float32, size: int = 8, effect=None,
    pools: bool = True,
):  # fmt: skip
    """Prefill the prompts in two chunks (``cut`` tokens, then the rest), then decode ``steps``
    greedy tokens for all of them: compiled into one pool, the module loop (reference
    attention) into another with the same tables. Every step's logits and, at the end, the
    pools must agree; returns the largest logit difference. ``effect``, a list: the module
    loop runs a third time into a float32 pool, and the list gets the largest difference the
    pool's dtype makes to its logits."""
    room = max(map(len, prompts)) + steps
    blocks = len(prompts) * -(-room // size) + 5
    compiled, reference = (_pool(model, dtype, blocks, size) for _ in range(2))
    exact = _pool(model, torch.float32, blocks, size) if effect is not None else None
    free = list(range(blocks))
    random.Random(len(prompts)).shuffle(free)
    tables = [[free.pop() for _ in range(-(-room // size))] for _ in prompts]
    tokens = [list(p) for p in prompts]
    done = [0] * len(prompts)
    worst = 0.0
    plan = [min(cut, len(p)) for p in prompts]
    while True:
        rows = [n for n in range(len(tokens)) if done[n] < len(tokens[n])]
        if not rows:
            break
        new = [tokens[n][done[n] : done[n] + (plan[n] or len(tokens[n]))] for n in rows]
        batch = PagedBatch.build(new, [done[n] for n in rows], [tables[n] for n in rows], size)
        before = llama_step.calls
        pieces = -(-batch.ids.shape[0] // 256)  # a step of more tokens: pieces of 256
        with torch.no_grad():
            got = paged_forward(model, batch, compiled)
            assert llama_step.calls == before + pieces, "the compiled step was not taken"
            want = paged_forward(model, batch, reference, attention=paged_attention)
            if exact is not None:
                float32 = paged_forward(model, batch, exact, attention=paged_attention)
                effect.append(max([*effect, (want - float32).abs().max().item()]))
            assert llama_step.calls == before + pieces
        worst = max(worst, (got - want).abs().max().item())
        for row, n in enumerate(rows):
            done[n] += len(new[row])
            plan[n] = 0
            if done[n] == len(tokens[n]) and len(tokens[n]) < len(prompts[n]) + steps:
                tokens[n].append(int(want[row].argmax()))
    # A 16-bit pool: a step at a rounding boundary (2^-8 relative for bfloat16, 2^-11 for
    # float16). In a deep model the layers after such a step see other inputs, and their keys
    # drift further apart: ``pools=False`` leaves the pools unchecked.
    if not pools:
        return worst
    # Within a 16-bit pool the later layers' keys and values drift by a few of the dtype's steps
    # (float16 pools: 2 of 12,032 values about 15 steps apart, 1e-3 on values of about 0.08):
    # there the bound is one bfloat16 step of the pool's largest value.
    rtol = 1e-4 if dtype == torch.float32 else 2**-7
    for a, r in zip(
        compiled.keys + compiled.values, reference.keys + reference.values, strict=True
    ):
        scale = r.abs().max().item()
        atol = 1e-4 if dtype == torch.float32 else max(1e-4, 2**-8 * scale)
        torch.testing.assert_close(a, r, atol=atol, rtol=rtol)
    return worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ragged_prefill_chunks_and_decoding_equal_the_module_loop(quant_kernel, dtype) -> None:
    model = random_quantised(SMALL, seed=1)
    rng = random.Random(2)
    prompts = [[rng.randrange(SMALL.vocab_size) for _ in range(n)] for n in (1, 7, 13, 29, 40, 3)]
    # First step: 1 + 7 + 13 + 13 + 13 + 3 rows; then ragged rests; then six sequences
    # decoding together. The two paths sum the products in different orders (the module loop
    # multiplies chunks of more than 8 tokens by gemm); in a 16-bit pool a key or value on a
    # rounding boundary then lands one step (2^-8 relative in bfloat16, 2^-11 in float16)
    # apart. Those steps move the logits far less than storing every key and value in 16 bits
    # does (the reference's own difference from a float32 pool, about 0.15 here in bfloat16):
    # the bound is a tenth of that.
    effect: list[float] = []
    worst = _run(model, prompts, cut=13, steps=12, dtype=dtype, effect=effect)
    bound = 1e-4 if dtype == torch.float32 else effect[-1] / 10
    assert worst <= bound


def test_many_sequences_decoding_together_equal_the_module_loop(quant_kernel) -> None:
    model = random_quantised(SMALL, seed=4)
    rng = random.Random(5)
    prompts = [
        [rng.randrange(SMALL.vocab_size) for _ in range(rng.randrange(1, 30))] for _ in range(11)
    ]
    # Eleven one-token rows a step: the row kernels take them 4, 4, 2 and 1 at a time.
    assert _run(model, prompts, cut=64, steps=8, size=4) <= 1e-4


def test_a_step_of_more_than_256_tokens_runs_in_pieces(quant_kernel) -> None:
    model = random_quantised(SMALL, seed=6)
    rng = random.Random(7)
    prompts = [[rng.randrange(SMALL.vocab_size) for _ in range(n)] for n in (290, 5)]
    assert _run(model, prompts, cut=300, steps=3, size=16) <= 1e-4  # 295 rows, then 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_logits_are_the_same_bits_however_a_prompt_is_split_and_whatever_shares_it(
    quant_kernel, dtype
) -> None:
    """A 600-token prompt prefilled in one step (three pieces of at most 256), in chunks of any
    size, token by token at first, or beside another sequence that decodes: the logits of its
    last token, and every key and value it wrote, are the same bits. (A 16-bit pool rounds each
    key once: a last-bit difference would become a whole step there.)"""
    model = random_quantised(SMALL, seed=8)
    rng = random.Random(9)
    prompt = [rng.randrange(SMALL.vocab_size) for _ in range(600)]
    other = [rng.randrange(SMALL.vocab_size) for _ in range(40)]
    size = 16
    table, other_table = list(range(0, 40)), list(range(40, 50))

    def prefill(parts, company):
        pool = _pool(model, dtype, blocks=50, size=size)
        with torch.no_grad():
            if company:
                paged_forward(model, PagedBatch.build([other[:30]], [0], [other_table], size), pool)
            at, done = 0, 30
            for n in parts:
                new, starts, tables = [prompt[at : at + n]], [at], [table]
                if company:  # the other sequence decodes a token in the same step
                    new, starts, tables = [[other[done]], *new], [done, at], [other_table, table]
                    done += 1
                logits = paged_forward(model, PagedBatch.build(new, starts, tables, size), pool)
                at += n
        rows = [b * size + p for b in table for p in range(size)][:600]
        return logits[-1], [x.view(-1, *x.shape[2:])[rows] for x in pool.keys + pool.values]

    whole, written = prefill([600], company=False)
    for parts, company in (([1] * 10 + [590], False), ([255, 2, 343], True), ([100] * 6, True)):
        logits, kv = prefill(parts, company)
        assert torch.equal(logits, whole), (parts, company)
        assert all(torch.equal(a, b) for a, b in zip(kv, written, strict=True))


def test_the_bundled_smollm2_equals_the_module_loop(quant_kernel, bundled_gguf) -> None:
    model = bundled_gguf.model
    prompts = [
        bundled_gguf.encode(t)
        for t in ("Once upon a time", "What is 2 + 2? Think step by step.", "Hi", "The capital of")
    ]
    # The module loop multiplies chunks of more than 8 tokens by the tile path (gemm), the step
    # by the row kernels: another summation order, carried through 30 layers (logits of about
    # 20 in size). The bound against the float32 model is 1e-3.
    assert _run(model, prompts, cut=5, steps=10, size=16) <= 5e-4


def test_a_float16_pool_moves_the_bundled_models_logits_far_less_than_bfloat16(
    quant_kernel, bundled_gguf
) -> None:
    """The server's default cache (float16) against bfloat16: each one's difference from a
    float32 pool in the module loop's logits, along the same greedy tokens (docs/serve.md)."""
    model = bundled_gguf.model
    prompts = [bundled_gguf.encode(t) for t in ("Once upon a time", "def fibonacci(n):")]
    effects = {}
    for dtype in (torch.float16, torch.bfloat16):
        effect: list[float] = []
        worst = _run(model, prompts, 64, 6, dtype, size=16, effect=effect, pools=False)
        # The step against the module loop, both in this dtype: a key or value computed in
        # another order can land on the other side of a 16-bit rounding and 30 layers carry
        # that on, but the two stay closer than storing in this dtype moves the logits at all
        # (bfloat16: 0.04-0.06 against 0.08-0.09; float16: 0.005-0.007 against 0.010-0.012).
        assert worst < effect[-1], (dtype, worst, effect[-1])
        effects[dtype] = effect[-1]
    assert 0 < effects[torch.float16] < 0.1
    assert effects[torch.float16] < effects[torch.bfloat16] / 3, effects


def test_an_engine_packs_the_weights_for_the_step_when_it_is_made(quant_kernel) -> None:
    """The first request does not wait for the packing (on AVX2 it copies the matrices)."""
    from attnkit.serve.engine import Engine

    model = random_quantised(SMALL, seed=8)
    assert getattr(model, "_llama_step", None) is None
    Engine(model, num_blocks=8, block_size=4, threads=1)
    packed = model._llama_step
    assert packed.why is None and packed.weights
    assert any(k >= 256 for k in packed.kinds) == quant_kernel.interleaves()


def test_the_module_loop_runs_where_the_step_cannot(quant_kernel, monkeypatch) -> None:
    model = random_quantised(SMALL, seed=0)
    pool = _pool(model)
    batch = PagedBatch.build([[1, 2, 3]], [0], [[0]], 8)
    plain = tiny_model()  # float32 weights
    plain_pool = _pool(plain)
    before = llama_step.calls
    with torch.no_grad():
        why = llama_step.why_not_paged(plain, plain_pool.keys, plain_pool.values)
        assert "not kept quantised" in why
        paged_forward(plain, batch, plain_pool)
        assert "per layer" in llama_step.why_not_paged(model, pool.keys[:1], pool.values[:1])
        paged_forward(model, batch, pool, attention=paged_attention)  # a chosen attention
        with monkeypatch.context() as patch:  # a kernel plugged into the seam
            patch.setattr(serve_forward, "ATTENTION", lambda *args: paged_attention(*args))
            paged_forward(model, batch, pool)
        with monkeypatch.context() as patch:
            patch.setattr(llama_step.jit, "loaded", lambda: None)
            assert "not loaded" in llama_step.why_not_paged(model, pool.keys, pool.values)
    with torch.enable_grad():
        assert "grad" in llama_step.why_not_paged(model, pool.keys, pool.values)
        paged_forward(model, batch, pool)
    assert llama_step.calls == before
    with torch.no_grad():
        paged_forward(model, batch, pool)
    assert llama_step.calls == before + 1


def _arguments(model, pool: BlockPool) -> dict:
    """A valid ``paged_step`` call: two sequences, 3 and 1 new tokens, after 0 and 4 cached."""
    with torch.no_grad():
        assert llama_step.why_not_paged(model, pool.keys, pool.values) is None
    return dict(
        ids=torch.tensor([5, 6, 7, 8]),
        positions=torch.tensor([0, 1, 2, 4]),
        slots=torch.tensor([0, 1, 2, 12]),
        block_tables=torch.tensor([[0, 2], [1, 3]]),
        lengths=torch.tensor([3, 5]),
        starts=torch.tensor([0, 3, 4]),
        out_rows=torch.tensor([2, 3]),
        key_pools=pool.keys,
        value_pools=pool.values,
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(slots=torch.tensor([0, 1, 2, 99_999])), "slots[3] = 99999 is outside the pool"),
        (dict(slots=torch.tensor([0, 1, 2])), "one pool slot per row"),
        (dict(ids=torch.tensor([5, 6, 7, 101])), "outside the vocabulary"),
        (dict(positions=torch.tensor([0, 1, 2, 10**7])), "outside the RoPE tables"),
        (dict(block_tables=torch.tensor([[0, 2], [500, 3]])), "is not a block of the pool"),
        (dict(lengths=torch.tensor([3, 500])), "length 500"),
        (dict(starts=torch.tensor([0, 4, 4])), "has 4 new tokens and length 3"),
        (dict(out_rows=torch.tensor([2, 4])), "out_rows[1] = 4 is not a row"),
        (dict(block_tables=torch.tensor([[0, 2], [1, 3]], dtype=torch.int32)), "block_tables"),
    ],
)
def test_bad_input_is_refused_before_any_pool_is_written(quant_kernel, change, message) -> None:
    model = random_quantised(SMALL, seed=0)
    pool = _pool(model)
    args = {**_arguments(model, pool), **change}
    with torch.no_grad(), pytest.raises(RuntimeError, match=message.replace("[", r"\[")):
        llama_step.paged_step(model, **args)
    assert all(not t.any() for t in pool.keys + pool.values), "a pool was written"
    with torch.no_grad():  # the valid call works and writes
        llama_step.paged_step(model, **_arguments(model, pool))
    assert all(t.any() for t in pool.keys + pool.values)


pytestmark = pytest.mark.usefixtures("one_thread")


def test_other_python_threads_run_during_a_step(quant_kernel) -> None:
    """The kernel releases the GIL while it computes: a server's event loop keeps sending the
    tokens of the step before. With a switch interval of a minute, a second thread can only
    run while this one waits outside Python; the call is the kernel's alone (its arguments
    are made before)."""
    model = random_quantised(SMALL, seed=8)
    pool = _pool(model, blocks=64, size=8)
    t = 400  # a chunk long enough to last milliseconds
    batch = PagedBatch.build([[n % SMALL.vocab_size for n in range(t)]], [0], [list(range(50))], 8)
    with torch.no_grad():
        assert llama_step.why_not_paged(model, pool.keys, pool.values) is None
        packed = model._llama_step
        cos, sin = llama_step._tables(model, packed, model.config.max_len)
    args = (
        batch.ids, batch.positions, batch.slots, batch.block_tables, batch.lengths,
        torch.tensor([0, t]), torch.tensor([t - 1]), *packed.model_args, pool.keys,
        pool.values, cos, sin, packed.sizes, packed.numbers, torch.empty(1, SMALL.vocab_size),
    )  # fmt: skip
    ticks, stop = [0], threading.Event()

    def count() -> None:
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0)  # hands the GIL back at once

    interval = sys.getswitchinterval()
    thread = threading.Thread(target=count)
    sys.setswitchinterval(60.0)
    try:
        thread.start()
        time.sleep(0.05)  # the counter runs while this thread sleeps
        # Steps for at least 0.2 s: on a busy machine (another worker on the other core) one
        # step of a few milliseconds can end before the counter's thread is scheduled at all.
        # Between the steps this thread keeps the GIL (the switch interval is a minute), so
        # every tick counted is one made while a step ran.
        before, start = ticks[0], time.perf_counter()
        while time.perf_counter() - start < 0.2:
            quant_kernel.llama_paged_step(*args)
        during = ticks[0] - before
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        thread.join()
    assert during > 0, "no other Python thread ran during the step: the GIL was held"
