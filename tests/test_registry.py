"""The registry: registering and looking up backends, ``auto`` routing, refusals that say why,
``use(name)`` overriding what a call or module names, and the ``AttentionCall`` it routes."""

from __future__ import annotations

import threading

import pytest
import torch

from attnkit import MultiHeadAttention, masks, registry, scaled_dot_product_attention
from attnkit.functional import attention_math, make_call
from attnkit.registry import (
    AUTO_ORDER,
    Backend,
    BackendUnavailable,
    available_backends,
    get_backend,
    register_backend,
    select_backend,
    use,
)

F64 = torch.float64


@pytest.fixture
def fresh_registry():
    """The registry as it was before the test, whatever the test registers or replaces."""
    saved = dict(registry._REGISTRY)
    yield registry._REGISTRY
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


def _qkv(i: int = 5, j: int = 7, h: int = 4, h_kv: int = 2, b: int = 2):
    g = torch.Generator().manual_seed(i * 100 + j)
    return (
        torch.randn(b, h, i, 8, dtype=F64, generator=g),
        torch.randn(b, h_kv, j, 8, dtype=F64, generator=g),
        torch.randn(b, h_kv, j, 6, dtype=F64, generator=g),
    )


def _recording(name: str, log: list[str], reason: str | None = None) -> Backend:
    """A backend that serves calls with the reference math and notes its name in ``log``."""

    def run(call):
        log.append(name)
        return attention_math(call)

    return register_backend(name, run, lambda call: reason)


def test_register_get_replace_and_list(fresh_registry) -> None:
    def run(call):
        return attention_math(call)

    first = register_backend("test.first", run, description="one")
    assert isinstance(first, Backend) and first.description == "one"
    assert get_backend("test.first") is first
    assert first.why_not(make_call(*_qkv())) is None  # no why_not: serves every call
    names = available_backends()
    assert "test.first" in names and names == sorted(names)
    assert {"math", "torch", "tiled", "tiled-functions", "sparse", "chunked"} <= set(names)

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


def test_auto_takes_the_first_backend_in_order_that_can_serve(fresh_registry, monkeypatch) -> None:
    log: list[str] = []
    _recording("test.refuses", log, "it refuses")
    _recording("test.serves", log)
    _recording("test.also-serves", log)
    order = ["test.refuses", "test.not-registered", "test.serves", "test.also-serves"]
    monkeypatch.setattr(registry, "AUTO_ORDER", order)
    q, k, v = _qkv()
    assert select_backend("auto", make_call(q, k, v)).name == "test.serves"
    out = scaled_dot_product_attention(q, k, v)
    assert log == ["test.serves"]
    ref = scaled_dot_product_attention(q, k, v, backend="math")
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_auto_routes_with_the_real_order() -> None:
    assert AUTO_ORDER[-1] == "math"  # the math backend serves every call, so it comes last
    q, k, v = _qkv()

    def route(*args, **kw):
        return select_backend("auto", make_call(*args, **kw)).name

    assert route(q, k, v) == "torch"
    assert route(q, k, v, is_causal=True) == "torch"
    assert route(q, k, v, masks.causal_fn(2)) == "tiled-functions"
    assert route(q, k, v, return_weights=True) == "math"
    assert route(q, k, v, masks.causal_fn(2), return_weights=True) == "math"
    gen = torch.Generator().manual_seed(0)
    assert route(q, k, v, dropout_p=0.1, generator=gen) == "math"
    assert route(q[0, 0], k[0, 0], v[0, 0]) == "tiled"  # torch's kernel refuses (i, d) inputs
    _, weights = scaled_dot_product_attention(q, k, v, return_weights=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 5, dtype=F64))


def test_no_backend_lists_every_candidates_reason(fresh_registry, monkeypatch) -> None:
    log: list[str] = []
    _recording("test.a", log, "a is asleep")
    _recording("test.b", log, "b is busy")
    monkeypatch.setattr(registry, "AUTO_ORDER", ["test.a", "test.missing", "test.b"])
    q, k, v = _qkv()
    with pytest.raises(BackendUnavailable) as info:
        scaled_dot_product_attention(q, k, v)
    message = str(info.value)
    assert "test.a: a is asleep" in message and "test.b: b is busy" in message
    assert "test.missing" not in message  # unregistered names are skipped, not reasons
    assert isinstance(info.value, ValueError)
    assert log == []  # run is never called for a refused call


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
                assert chosen() == "torch"
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
