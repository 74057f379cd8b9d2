"""The registry: registering and looking up backends, ``auto`` weighing their costs within the
memory budget, refusals that say why, ``use(name)`` overriding what a call or module names, and
the ``AttentionCall`` it routes."""

from __future__ import annotations

import threading

import pytest
import torch

from attnkit import MultiHeadAttention, masks, registry, scaled_dot_product_attention
from attnkit.functional import attention_math, make_call
from attnkit.registry import (
    DEFAULT_MEMORY_BUDGET,
    Backend,
    BackendUnavailable,
    Estimate,
    available_backends,
    get_backend,
    get_memory_budget,
    memory_budget,
    register_backend,
    register_cost,
    select_backend,
    set_memory_budget,
    use,
    weigh,
)

F64 = torch.float64


@pytest.fixture
def fresh_registry():
    """The registry and its costs as they were before the test, whatever the test registers."""
    saved, costs = dict(registry._REGISTRY), dict(registry._COSTS)
    yield registry._REGISTRY
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)
    registry._COSTS.clear()
    registry._COSTS.update(costs)
    registry._RANKED.clear()


@pytest.fixture
def only_test_costs(fresh_registry, monkeypatch):
    """Auto weighs only the backends a test gives a cost (the real ones keep theirs after)."""
    monkeypatch.setattr(registry, "_COSTS", {})
    registry._RANKED.clear()
    return registry._COSTS


def _qkv(i: int = 5, j: int = 7, h: int = 4, h_kv: int = 2, b: int = 2):
    g = torch.Generator().manual_seed(i * 100 + j)
    return (
        torch.randn(b, h, i, 8, dtype=F64, generator=g),
        torch.randn(b, h_kv, j, 8, dtype=F64, generator=g),
        torch.randn(b, h_kv, j, 6, dtype=F64, generator=g),
    )


def _recording(
    name: str,
    log: list[str],
    reason: str | None = None,
    seconds: float | None = None,
    materialised: int = 0,
) -> Backend:
    """A backend that serves calls with the reference math and notes its name in ``log``;
    with ``seconds`` it has a cost (and auto weighs it)."""

    def run(call):
        log.append(name)
        return attention_math(call)

    def cost(call):
        log.append(f"cost {name}")
        return Estimate(seconds, materialised, f"{name} costs {seconds}")

    return register_backend(name, run, lambda call: reason, cost=None if seconds is None else cost)


def test_register_get_replace_and_list(fresh_registry) -> None:
    def run(call):
        return attention_math(call)

    first = register_backend("test.first", run, description="one")
    assert isinstance(first, Backend) and first.description == "one"
    assert get_backend("test.first") is first
    assert first.why_not(make_call(*_qkv())) is None  # no why_not: serves every call
    names = available_backends()
    assert "test.first" in names and names == sorted(names)
    assert {"math", "torch", "tiled", "sparse", "chunked"} <= set(names)

    replacement = register_backend("test.first", run, lambda call: "replaced")
    assert get_backend("test.first") is replacement is not first
    assert available_backends().count("test.first") == 1


@pytest.mark.parametrize("name", ["", "auto"])
def test_reserved_names_cannot_be_registered(fresh_registry, name: str) -> None:
    with pytest.raises(ValueError, match="non-empty string other than 'auto'"):
        register_backend(name, attention_math)
    assert name not in registry._REGISTRY


def test_unknown_names_are_named_in_the_error() -> None:
    with pytest.raises(ValueError, match=r"got 'no-such-backend'") as info:
        get_backend("no-such-backend")
    for known in ("auto", "math", "torch", "tiled"):
        assert known in str(info.value)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="no-such-backend"):
        scaled_dot_product_attention(q, k, v, backend="no-such-backend")
    with pytest.raises(ValueError, match="no-such-backend"):
        select_backend("no-such-backend", make_call(q, k, v))


def test_auto_takes_the_cheapest_backend_that_can_serve(only_test_costs) -> None:
    log: list[str] = []
    _recording("test.refuses", log, "it refuses", seconds=0.001)
    _recording("test.slow", log, seconds=0.5)
    _recording("test.fast", log, seconds=0.1)
    _recording("test.no-cost", log)  # serves everything, but has no cost: auto never takes it
    q, k, v = _qkv()
    call = make_call(q, k, v)
    assert select_backend("auto", call).name == "test.fast"
    assert "cost test.refuses" not in log  # a backend is costed only for calls it can serve
    log.clear()
    out = scaled_dot_product_attention(q, k, v)
    assert log[-1] == "test.fast" and "test.no-cost" not in log
    ref = scaled_dot_product_attention(q, k, v, backend="math")
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    verdicts = weigh(call)
    assert [v.backend for v in verdicts] == ["test.fast", "test.slow", "test.refuses"]
    assert [v.chosen for v in verdicts] == [True, False, False]
    assert verdicts[2].why_not == "it refuses" and verdicts[2].estimate is None
    assert verdicts[1].estimate == Estimate(0.5, 0, "test.slow costs 0.5")


def test_auto_leaves_out_routes_over_the_memory_budget(only_test_costs) -> None:
    log: list[str] = []
    _recording("test.builds", log, seconds=0.1, materialised=1000)
    _recording("test.tiles", log, seconds=0.3, materialised=0)
    q, k, v = _qkv()
    call = make_call(q, k, v)
    assert select_backend("auto", call).name == "test.builds"
    with memory_budget(1000):  # at the budget is within it
        assert select_backend("auto", call).name == "test.builds"
    with memory_budget(999):
        assert select_backend("auto", call).name == "test.tiles"
        verdict = weigh(call)[1]
        assert verdict.backend == "test.builds" and not verdict.chosen
        assert verdict.why_not == (
            "it would build 1000 bytes of masks and biases, over the memory budget of 999 bytes"
        )
        log.clear()
        scaled_dot_product_attention(q, k, v)
        assert log[-1] == "test.tiles"
    register_cost("test.tiles", None)  # without a cost auto cannot take it: nothing fits
    with memory_budget(999), pytest.raises(BackendUnavailable) as info:
        scaled_dot_product_attention(q, k, v)
    message = str(info.value)
    assert "test.builds: it would build 1000 bytes" in message
    assert "attnkit.backends.memory_budget(bytes)" in message


def test_auto_remembers_rankings_per_signature(only_test_costs) -> None:
    """A decoding step repeats the same call: its ranking is weighed once per signature (with
    the identity of its mask and bias functions)."""
    log: list[str] = []
    _recording("test.a", log, seconds=0.2)
    _recording("test.b", log, seconds=0.1, materialised=10)
    q, k, v = _qkv()
    for _ in range(3):
        assert select_backend("auto", make_call(q, k, v)).name == "test.b"
    assert log.count("cost test.a") == log.count("cost test.b") == 1
    with memory_budget(5):  # the budget is part of the signature
        assert select_backend("auto", make_call(q, k, v)).name == "test.a"
    assert select_backend("auto", make_call(q, k, v, is_causal=True)).name == "test.b"
    assert log.count("cost test.b") == 3  # each new signature is weighed afresh
    _recording("test.c", log, seconds=0.01)  # registering forgets every ranking
    assert select_backend("auto", make_call(q, k, v)).name == "test.c"
    for _ in range(2):  # the same mask function: weighed once
        select_backend("auto", make_call(q, k, v, _every))
    assert log.count("cost test.c") == 2
    for _ in range(2):  # a new function each call: weighed each time
        select_backend("auto", make_call(q, k, v, lambda b, h, i, j: _every(b, h, i, j)))
    assert log.count("cost test.c") == 4


def _every(b, h, i, j):
    return (i >= 0) & (j >= 0)


def test_auto_without_a_cost_model_takes_the_reference(fresh_registry, monkeypatch) -> None:
    monkeypatch.setattr(registry, "_COSTS", {})
    registry._RANKED.clear()
    assert select_backend("auto", make_call(*_qkv())).name == "math"


def test_auto_routes_with_the_real_cost_model() -> None:
    q, k, v = _qkv()

    def route(*args, **kw):
        return select_backend("auto", make_call(*args, **kw)).name

    assert route(q, k, v) == "torch"  # a few positions: torch's kernel costs least to call
    assert route(q, k, v, is_causal=True) == "torch"
    assert route(q, k, v, return_weights=True) == "math"
    assert route(q, k, v, masks.causal_fn(2), return_weights=True) == "math"
    gen = torch.Generator().manual_seed(0)
    assert route(q, k, v, dropout_p=0.1, generator=gen) == "math"
    assert route(q[0, 0], k[0, 0], v[0, 0]) != "torch"  # torch's kernel refuses (i, d) inputs
    _, weights = scaled_dot_product_attention(q, k, v, return_weights=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 5, dtype=F64))


def test_no_backend_lists_every_candidates_reason(only_test_costs) -> None:
    log: list[str] = []
    _recording("test.a", log, "a is asleep", seconds=1.0)
    _recording("test.b", log, "b is busy", seconds=1.0)
    q, k, v = _qkv()
    with pytest.raises(BackendUnavailable) as info:
        scaled_dot_product_attention(q, k, v)
    message = str(info.value)
    assert "test.a: a is asleep" in message and "test.b: b is busy" in message
    assert "memory_budget" not in message  # no backend was over the budget
    assert isinstance(info.value, ValueError)
    assert log == []  # run (and cost) are never called for a refused call


def test_memory_budget_default_setting_and_blocks() -> None:
    assert get_memory_budget() == DEFAULT_MEMORY_BUDGET == 1 << 30
    previous = set_memory_budget(123)
    try:
        assert previous == DEFAULT_MEMORY_BUDGET and get_memory_budget() == 123
        with memory_budget(7):
            assert get_memory_budget() == 7
            with memory_budget(0):
                assert get_memory_budget() == 0
            assert get_memory_budget() == 7
            with pytest.raises(RuntimeError, match="boom"), memory_budget(9):
                raise RuntimeError("boom")
            assert get_memory_budget() == 7
        assert get_memory_budget() == 123
    finally:
        set_memory_budget(previous)
    assert get_memory_budget() == DEFAULT_MEMORY_BUDGET


def test_memory_budget_block_is_local_to_its_thread() -> None:
    seen: dict[str, int] = {}
    inside, release = threading.Event(), threading.Event()

    def other_thread() -> None:
        inside.wait(5)
        seen["other"] = get_memory_budget()
        release.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with memory_budget(5):
        inside.set()
        assert release.wait(5)
        seen["here"] = get_memory_budget()
    worker.join(5)
    assert seen == {"here": 5, "other": DEFAULT_MEMORY_BUDGET}


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (-1, ValueError, "must be >= 0 bytes, got -1"),
        (1.5, TypeError, "whole number of bytes \\(int\\), got float 1.5"),
        ("1GB", TypeError, "got str '1GB'"),
        (True, TypeError, "got bool True"),
        (None, TypeError, "got NoneType None"),
    ],
)
def test_memory_budget_rejects_bad_values_by_name(value, error, match) -> None:
    ran = []
    with pytest.raises(error, match=match), memory_budget(value):
        ran.append(True)
    with pytest.raises(error, match=match):
        set_memory_budget(value)
    assert ran == [] and get_memory_budget() == DEFAULT_MEMORY_BUDGET


def test_register_cost_checks_its_arguments(fresh_registry) -> None:
    with pytest.raises(TypeError, match="cost must be a function of an AttentionCall, got int"):
        register_cost("math", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="other than 'auto'"):
        register_cost("auto", lambda call: Estimate(0.0))


def test_a_named_backend_that_refuses_says_why(fresh_registry) -> None:
    log: list[str] = []
    _recording("test.refuses", log, "the moon is full")
    q, k, v = _qkv()
    match = "backend 'test.refuses' cannot serve this call: the moon is full"
    with pytest.raises(BackendUnavailable, match=match):
        scaled_dot_product_attention(q, k, v, backend="test.refuses")
    with pytest.raises(BackendUnavailable, match="does not return the attention weights"):
        scaled_dot_product_attention(q, k, v, backend="torch", return_weights=True)
    assert log == []


def test_use_overrides_the_backend_a_call_or_module_names(fresh_registry) -> None:
    log: list[str] = []
    _recording("test.forced", log)
    q, k, v = _qkv()
    ref = scaled_dot_product_attention(q, k, v, backend="math")
    mha = MultiHeadAttention(16, 4, backend="math").double()
    x = torch.randn(2, 5, 16, dtype=F64)
    with use("test.forced"):
        assert select_backend("torch", make_call(q, k, v)).name == "test.forced"
        out = scaled_dot_product_attention(q, k, v, backend="tiled")
        assert log == ["test.forced"]
        mha(x)
        assert log == ["test.forced"] * 2
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    scaled_dot_product_attention(q, k, v, backend="math")
    mha(x)
    assert log == ["test.forced"] * 2  # nothing forced after the block


def test_use_nests_and_restores_on_exit_and_on_exception(fresh_registry) -> None:
    log: list[str] = []
    _recording("test.outer", log)
    _recording("test.inner", log)
    call = make_call(*_qkv())

    def chosen() -> str:
        return select_backend("math", call).name

    assert chosen() == "math"
    with use("test.outer"):
        assert chosen() == "test.outer"
        with use("test.inner"):
            assert chosen() == "test.inner"
            with use("auto"):  # auto inside: routing as usual, whatever the call names
                assert chosen() == "torch"  # a few positions: torch's kernel costs least
        assert chosen() == "test.outer"
        with pytest.raises(RuntimeError, match="boom"), use("test.inner"):
            assert chosen() == "test.inner"
            raise RuntimeError("boom")
        assert chosen() == "test.outer"
    assert chosen() == "math"


def test_use_rejects_unknown_names_before_the_block_runs() -> None:
    ran = []
    with pytest.raises(ValueError, match=r"got 'test\.nowhere'"), use("test.nowhere"):
        ran.append(True)
    with pytest.raises(TypeError, match="must be a string"), use(3):  # type: ignore[arg-type]
        ran.append(True)
    assert ran == []
    assert select_backend("math", make_call(*_qkv())).name == "math"


def test_use_is_local_to_its_thread(fresh_registry) -> None:
    log: list[str] = []
    _recording("test.here", log)
    call = make_call(*_qkv())
    seen: dict[str, str] = {}
    inside = threading.Event()
    release = threading.Event()

    def other_thread() -> None:
        inside.wait(5)
        seen["other"] = select_backend("math", call).name
        release.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with use("test.here"):
        inside.set()
        assert release.wait(5)
        seen["here"] = select_backend("math", call).name
    worker.join(5)
    assert seen == {"here": "test.here", "other": "math"}


def test_call_groups_and_score_shape() -> None:
    q, k, v = _qkv(5, 7, h=4, h_kv=2)
    call = make_call(q, k, v)
    assert (call.n_queries, call.n_keys, call.groups) == (5, 7, 2)
    assert call.score_shape == (2, 4, 5, 7)
    assert make_call(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)).groups == 1
    assert make_call(q, k[:, :1], v[:, :1]).groups == 4  # multi-query
    three = make_call(q[:, 0], k[:, 0], v[:, 0])  # (b, i, d): no head axis
    assert three.groups == 1 and three.score_shape == (2, 5, 7)
    five = make_call(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))
    assert five.groups == 2 and five.score_shape == (1, 2, 4, 5, 7)


def test_call_dense_mask_is_bottom_right_causal_and_combines() -> None:
    q, k, v = _qkv(2, 5)
    assert make_call(q, k, v).dense_mask() is None
    causal = make_call(q, k, v, is_causal=True).dense_mask()
    want = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)  # docstring picture
    assert torch.equal(causal, want)
    pad = masks.padding_mask(torch.tensor([5, 2]), 5)  # (b, 1, 1, j)
    both = make_call(q, k, v, pad, is_causal=True).dense_mask()
    assert torch.equal(both, pad & want)
    assert torch.equal(both[1, 0], torch.tensor([[1, 1, 0, 0, 0]] * 2, dtype=torch.bool))
    fn = lambda b, h, i, j: (i + j + h + b) % 3 == 0  # noqa: E731
    from_fn = make_call(q, k, v, fn, is_causal=True).dense_mask()
    assert from_fn.shape == (2, 4, 2, 5)
    for b, h, i, j in torch.cartesian_prod(*(torch.arange(n) for n in (2, 4, 2, 5))).tolist():
        assert bool(from_fn[b, h, i, j]) == ((i + j + h + b) % 3 == 0 and j <= i + 3)


def test_call_dense_bias_from_a_function_and_a_tensor() -> None:
    q, k, v = _qkv(3, 4)
    assert make_call(q, k, v).dense_bias(F64) is None
    bias = make_call(q, k, v, bias=lambda b, h, i, j: 0.5 * h + (j - i)).dense_bias(torch.float32)
    assert bias.dtype == torch.float32 and bias.shape == (1, 4, 3, 4)
    for h in range(4):
        for i in range(3):
            for j in range(4):
                assert float(bias[0, h, i, j]) == 0.5 * h + (j - i)
    tensor = torch.randn(4, 3, 4, dtype=F64)
    assert torch.equal(make_call(q, k, v, bias=tensor).dense_bias(F64), tensor)
    assert make_call(q, k, v, bias=tensor).dense_bias(torch.float16).dtype == torch.float16


def test_register_backend_wants_functions() -> None:
    with pytest.raises(TypeError, match="register_backend's run must be a function, got 3"):
        registry.register_backend("not-a-function", 3)
    with pytest.raises(TypeError, match="register_backend's why_not must be a function"):
        registry.register_backend("not-a-function", attention_math, why_not="no")
    assert "not-a-function" not in registry.available_backends()
