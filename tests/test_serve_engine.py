"""attnkit.serve.engine: a request gets the same greedy tokens alone or batched with others (and
with a prefix-cache hit, and after being preempted), a cached prefix skips prefill, cancelling
returns the blocks, and the pool is whole after many requests."""

from __future__ import annotations

import random
import threading

import pytest

from attnkit.models.llama_generate import Sampling
from attnkit.serve.engine import Engine, EngineStopped, QueueFull
from llama_oracles import bundled as bundled
from serve_oracles import one_thread as one_thread
from serve_oracles import tiny_model


def prompts_of(lengths, seed=0, vocab=97):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def whole(engine: Engine) -> None:
    assert not engine.running and not engine.waiting
    engine.cache.clear()
    engine.pool.check_whole()


def alone(model, prompt, max_tokens, **kwargs):
    engine = Engine(model, **kwargs)
    gen = engine.submit(prompt, max_tokens)
    engine.run_until_idle()
    return gen.result(0)[0]


LENGTHS = [1, 3, 5, 8, 9, 13, 17, 20, 24, 31, 33, 40, 47, 50, 63, 70]  # 16 requests


def test_sixteen_concurrent_requests_give_the_tokens_each_gives_alone() -> None:
    model = tiny_model()
    prompts = prompts_of(LENGTHS)
    budgets = [4 + n % 7 for n in range(16)]
    expected = [alone(model, p, k, block_size=4) for p, k in zip(prompts, budgets, strict=True)]
    # a small pool and budget: chunked prefill, evictions and preemptions all happen
    engine = Engine(model, num_blocks=48, block_size=4, max_batch=16, chunk_tokens=24).start()
    try:
        gens = [engine.submit(p, k) for p, k in zip(prompts, budgets, strict=True)]
        got = [g.result(60) for g in gens]
    finally:
        engine.stop()
    assert [tokens for tokens, _ in got] == expected
    assert all(reason == "length" for _, reason in got)
    assert engine.counters["steps"] < sum(budgets)  # batched, not one request at a time
    assert engine.counters["preemptions"] > 0
    whole(engine)


def test_a_prefix_hit_skips_the_cached_blocks_and_changes_no_token() -> None:
    model = tiny_model()
    system = prompts_of([37], seed=3)[0]
    a, b = (system + tail for tail in prompts_of([5, 9], seed=4))
    engine = Engine(model, num_blocks=64, block_size=8)
    first = engine.submit(a, 6)
    engine.run_until_idle()
    assert engine.counters["prefill_tokens"] == len(a) and engine.cache.hit_tokens == 0
    second = engine.submit(b, 6)
    engine.run_until_idle()
    cached = 32  # the four full blocks of the shared 37 tokens
    assert second.cached_tokens == cached == engine.cache.hit_tokens
    assert engine.counters["prefill_tokens"] == len(a) + len(b) - cached
    assert first.result(0)[0] == alone(model, a, 6, block_size=8)
    assert second.result(0)[0] == alone(model, b, 6, block_size=8, prefix_caching=False)
    whole(engine)


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode() -> None:
    model = tiny_model()
    short, long = prompts_of([3, 200], seed=5)
    engine = Engine(model, num_blocks=64, block_size=8, chunk_tokens=32)
    s = engine.submit(short, 12)
    engine.step()  # the short prompt is prefilled and starts decoding
    engine.submit(long, 2)
    for _ in range(6):
        before = len(s.generated)
        engine.step()
        assert len(s.generated) == before + 1  # a token every step, the long prompt beside it
    engine.run_until_idle()
    whole(engine)


def test_beside_decoding_streams_a_chunk_shrinks_as_its_context_grows() -> None:
    """A prompt token at position p costs 1 + p / keys_per_token tokens' worth of a step (its
    products, then its attention over p keys); beside a decoding stream a chunk takes about
    chunk_tokens of that, and alone it takes chunk_tokens tokens."""
    model = tiny_model()
    c = model.config
    hd, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    engine = Engine(model, num_blocks=160, block_size=8, chunk_tokens=64, prefix_caching=False)
    k = engine.keys_per_token
    assert k == (2 * c.embed_dim * hd + 2 * c.embed_dim * kv + 3 * c.embed_dim * c.ffn_dim) / (
        2 * hd
    )
    short, long = prompts_of([3, 500], seed=7)
    alone = engine.submit(long, 1)
    engine.step()
    assert alone.computed == 64  # nothing decodes: the whole budget, in tokens
    engine.cancel(alone)
    engine.step()
    engine.submit(short, 40)
    engine.step()  # the short one decodes from now on
    g = engine.submit(long, 1)
    chunks = []
    while g.computed < len(long):
        before = g.computed
        engine.step()
        chunks.append((before, g.computed - before))

    def work(start, n):  # what n tokens from start cost, in tokens at the start
        return n + (n * start + n * (n - 1) / 2) / k

    for start, n in chunks[:-1]:  # every chunk but the prompt's end: the most that fits
        assert work(start, n) <= 63 < work(start, n + 1)  # 63: the budget less the stream's token
    assert chunks[0][1] > chunks[-2][1]  # later chunks are shorter
    engine.run_until_idle()
    whole(engine)


def test_cancelling_returns_every_block() -> None:
    model = tiny_model()
    engine = Engine(model, num_blocks=32, block_size=4, prefix_caching=False)
    running = engine.submit(prompts_of([30])[0], 100)
    waiting = [engine.submit(p, 5) for p in prompts_of([100, 100], seed=1)]  # no room yet
    engine.step()
    engine.step()
    assert engine.pool.num_free < 32 and len(engine.waiting) == 2
    for gen in [running, *waiting]:
        engine.cancel(gen)
    engine.step()
    assert [g.result(0)[1] for g in (running, *waiting)] == ["cancelled"] * 3
    assert engine.counters["cancelled"] == 3
    whole(engine)


def test_a_sequence_longer_than_the_whole_pool_ends_with_length() -> None:
    engine = Engine(tiny_model(), num_blocks=4, block_size=4)  # 16 positions in all
    gen = engine.submit(prompts_of([10])[0], 100)
    engine.run_until_idle()
    tokens, reason = gen.result(0)
    assert reason == "length" and len(tokens) == 16 + 1 - 10  # keys for 16 positions, +1 sampled
    whole(engine)


def test_a_failing_step_ends_every_request_with_an_error(monkeypatch) -> None:
    engine = Engine(tiny_model()).start()
    monkeypatch.setattr(engine, "_plan", lambda: 1 / 0)
    gens = [engine.submit([1, 2], 3) for _ in range(3)]
    assert [g.result(30)[1] for g in gens] == ["error"] * 3
    assert engine.counters["errors"] >= 1
    engine.stop()
    whole(engine)


def test_the_pool_is_whole_after_a_thousand_requests() -> None:
    model = tiny_model(embed_dim=12, num_heads=2, num_kv_heads=1, ffn_dim=8, num_layers=1)
    rng = random.Random(7)
    engine = Engine(
        model, num_blocks=40, block_size=2, max_batch=8, chunk_tokens=16, eos_id=5, max_waiting=1000
    )
    gens = []
    for n in range(1000):
        prompt = prompts_of([rng.randint(1, 12)], seed=n % 50)[0]  # repeats: prefix hits
        gens.append(engine.submit(prompt, rng.randint(1, 6)))
        if rng.random() < 0.1:
            engine.cancel(gens[-1])
        if n % 8 == 7:
            engine.step()
    engine.run_until_idle()
    assert all(g.finish_reason in ("stop", "length", "cancelled") for g in gens)
    assert engine.cache.hit_tokens > 0
    whole(engine)


def test_sampling_with_a_seed_repeats_and_greedy_stops_at_the_end_token() -> None:
    model = tiny_model()
    prompt = prompts_of([6])[0]
    sampled = [alone(model, prompt, 8) for _ in range(2)]  # greedy
    engine = Engine(model)
    a = engine.submit(prompt, 8, Sampling(1.0, None, 0.9), seed=3)
    b = engine.submit(prompt, 8, Sampling(1.0, None, 0.9), seed=3)
    engine.run_until_idle()
    assert a.result(0)[0] == b.result(0)[0]
    eos = sampled[0][2]
    engine = Engine(model, eos_id=eos)
    gen = engine.submit(prompt, 8)
    engine.run_until_idle()
    assert gen.result(0) == (sampled[0][: sampled[0].index(eos) + 1], "stop")


def test_the_seeds_at_either_end_of_torchs_range_sample() -> None:
    engine = Engine(tiny_model())
    gens = [engine.submit([1, 2], 3, Sampling(1.0), seed=s) for s in (-(2**63), 2**64 - 1)]
    engine.run_until_idle()
    assert [len(g.result(0)[0]) for g in gens] == [3, 3]


def test_bad_requests_are_refused_before_they_queue() -> None:
    engine = Engine(tiny_model(), num_blocks=4, block_size=4, max_waiting=1)
    for args, match in [
        (([], 4), "empty"),
        (([1], 0), "max_tokens"),
        (([1] * 500, 13), "context of 512"),
        (([1] * 20, 4), "does not fit"),
        (([97], 4), "outside"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.submit(*args)
    for seed in (2**64, -(2**63) - 1, 1.5, True):  # torch.Generator takes -2**63..2**64 - 1
        with pytest.raises(ValueError, match=r"seed must be an int in -2\*\*63\.\.2\*\*64 - 1"):
            engine.submit([1], 2, Sampling(1.0), seed=seed)
    for args, kwargs, match in [
        (([True, False], 2), {}, "token ids must be ints, got True"),
        (([1.0], 2), {}, "token ids must be ints, got 1.0"),
        ((None, 2), {}, "prompt must be a sequence of token ids, got NoneType"),
        (("hello", 2), {}, "prompt must be a sequence of token ids, got str"),
        (([1], 2, 0.7), {}, "sampling must be a Sampling or None, got 0.7"),
        (([1], 2), {"scoring": {"logit_bias": {}}}, "scoring must be a Scoring or None"),
        (([1], 2), {"on_event": 5}, "on_event must be a function"),
    ]:
        with pytest.raises(TypeError, match=match):
            engine.submit(*args, **kwargs)
    numpy = pytest.importorskip("numpy")
    engine.submit(numpy.array([1, 2]), 2)  # numpy's ints are ints
    assert engine.waiting[-1].tokens == [1, 2] and type(engine.waiting[-1].tokens[0]) is int
    with pytest.raises(QueueFull):
        engine.submit([1], 2)
    engine.stop()
    with pytest.raises(EngineStopped):
        engine.submit([1], 2)
    whole(engine)


def test_a_callback_that_fails_ends_only_its_own_request() -> None:
    engine = Engine(tiny_model(), num_blocks=16, block_size=4)

    def failing(token, reason):
        if token is not None:
            raise RuntimeError("the client's own bug")

    good = [engine.submit([1, 2, 3 + n], 4) for n in range(3)]
    bad = engine.submit([5, 6], 4, on_event=failing)
    engine.run_until_idle()
    assert [g.result(0)[1] for g in good] == ["length"] * 3
    assert all(len(g.generated) == 4 for g in good)
    assert bad.finish_reason == "error" and engine.counters["errors"] == 1
    whole(engine)


def test_stop_finishes_what_runs_then_ends_the_thread() -> None:
    engine = Engine(tiny_model()).start()
    gen = engine.submit([1, 2, 3], 5)
    engine.stop(timeout=30)
    assert gen.result(0)[1] == "length" and not engine.started
    assert not any(t.name == "attnkit-serve-engine" for t in threading.enumerate())


def test_the_engines_thread_computes_with_its_own_thread_count(one_thread) -> None:
    """Steps run with ``threads`` intra-op threads on the engine's thread, whatever the thread
    that made the engine has (``attnkit serve`` keeps that one at one thread)."""
    import torch

    seen: list[int] = []
    engine = Engine(tiny_model(), threads=2).start()
    engine.submit([1, 2, 3], 3, on_event=lambda *event: seen.append(torch.get_num_threads()))
    engine.stop(timeout=30)
    assert len(seen) >= 3 and set(seen) == {2}
    assert torch.get_num_threads() == 1
    assert Engine(tiny_model()).threads == 1  # by default the count of the thread making it
    with pytest.raises(ValueError, match="threads must be a positive int, got 0"):
        Engine(tiny_model(), threads=0)


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_a_16_bit_pool_keeps_batched_equal_to_alone(name) -> None:
    """``kv_dtype=torch.bfloat16`` or ``torch.float16`` stores the cache in half the bytes; a
    request still gets the same tokens alone or among others (each key is rounded once,
    whatever the batch)."""
    import torch

    dtype = getattr(torch, name)
    model = tiny_model()
    prompts = prompts_of(LENGTHS[::2], seed=4)
    kw = {"block_size": 4, "kv_dtype": dtype}
    expected = [alone(model, p, 6, **kw) for p in prompts]
    engine = Engine(model, num_blocks=64, max_batch=8, chunk_tokens=16, **kw)
    assert {t.dtype for t in engine.pool.keys + engine.pool.values} == {dtype}
    gens = [engine.submit(p, 6) for p in prompts]
    engine.run_until_idle()
    assert [g.result(0)[0] for g in gens] == expected
    whole(engine)
    assert Engine(model).pool.keys[0].dtype == torch.float32  # the model's dtype by default
    with pytest.raises(ValueError, match=r"kv_dtype must be torch\.float32, torch\.bfloat16 or"):
        Engine(model, kv_dtype=torch.float64)


def test_batched_equals_alone_with_smollm2(bundled) -> None:
    texts = ["The capital of France is", "1, 2, 3, 4,", "Hello"]
    prompts = [bundled.encode(t) for t in texts]
    expected = [bundled.generate_ids(p, 6)[0] for p in prompts]
    engine = Engine(bundled.model, num_blocks=16, block_size=8, eos_id=bundled.eos_id)
    gens = [engine.submit(p, 6, Sampling()) for p in prompts]
    engine.run_until_idle()
    assert [g.result(0)[0] for g in gens] == expected
    whole(engine)


pytestmark = pytest.mark.usefixtures("one_thread")
