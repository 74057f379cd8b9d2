"""The quantised Llama decoding step as one compiled call (``llama_step``, ``step.cpp``): the
same logits and caches as the module path (the reference), token for token, on random
quantised models (GQA, odd sizes, parts in several block types, tied and untied outputs,
left padding, bfloat16 caches) and on the bundled SmolLM2; when it is taken; its threads; its
checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnkit.models import llama_step
from attnkit.models.llama import LlamaModel
from quant_oracles import SMALL, random_quantised
from quant_oracles import kernel as kernel
from quant_oracles import quant_kernel as quant_kernel


def _module_path(monkeypatch) -> None:
    monkeypatch.setattr(llama_step, "why_not", lambda *args, **kwargs: "the module path")


def _steps(model, prompt: torch.Tensor, steps: int, monkeypatch, *, padding=None, kv_dtype=None):
    """Decode ``steps`` tokens greedily with the fused step and, on copies of its caches, with
    the module path; every step's logits and the caches must agree. Returns the largest logit
    difference, and with a 16-bit cache also the cache's own effect: the largest difference
    between the module path's logits with that cache and with a float32 one."""
    b, n = prompt.shape
    fused = model.new_caches(n + steps + 1, kv_dtype=kv_dtype)
    ref = model.new_caches(n + steps + 1, kv_dtype=kv_dtype)
    exact = None if kv_dtype is None else model.new_caches(n + steps + 1)
    with torch.no_grad():
        model(prompt, caches=fused, padding=padding)
        out = model(prompt, caches=ref, padding=padding, last_only=True)
        if exact is not None:
            with monkeypatch.context() as patch:
                _module_path(patch)
                model(prompt, caches=exact, padding=padding)
    token = out.logits[:, -1].argmax(-1, keepdim=True)  # (b, 1)
    worst = effect = 0.0
    for _ in range(steps):
        if padding is not None:
            padding = torch.cat([padding, padding.new_ones(b, 1)], dim=1)  # (b, j + 1)
        before = llama_step.calls
        with torch.no_grad():
            got = model(token, caches=fused, padding=padding).logits  # (b, 1, V)
        assert llama_step.calls == before + 1, "the fused step was not taken"
        with monkeypatch.context() as patch:
            _module_path(patch)
            with torch.no_grad():
                want = model(token, caches=ref, padding=padding).logits
                if exact is not None:
                    float32 = model(token, caches=exact, padding=padding).logits
                    effect = max(effect, (want - float32).abs().max().item())
        assert llama_step.calls == before + 1
        worst = max(worst, (got - want).abs().max().item())
        assert [c.length for c in fused] == [c.length for c in ref]
        token = want[:, -1].argmax(-1, keepdim=True)
    # float32: the summation orders' rounding, carried through the layers; bfloat16: a value
    # at a rounding boundary may round to the next one.
    rtol = 1e-4 if kv_dtype is None else 2**-7  # one bfloat16 step (float16's are smaller)
    for a, r in zip(fused, ref, strict=True):
        torch.testing.assert_close(a.key, r.key, atol=1e-4, rtol=rtol)
        torch.testing.assert_close(a.value, r.value, atol=1e-4, rtol=rtol)
    return worst if exact is None else (worst, effect)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("n", [1, 17, 300])
def test_step_equals_the_module_path_on_a_random_quantised_model(
    quant_kernel, monkeypatch, n: int, tie: bool
) -> None:
    model = random_quantised(dataclasses.replace(SMALL, tie_embeddings=tie), seed=n)
    prompt = torch.randint(0, SMALL.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
    assert _steps(model, prompt, 20, monkeypatch) <= 1e-4


def test_step_serves_left_padded_batches_and_bfloat16_caches(quant_kernel, monkeypatch) -> None:
    model = random_quantised(SMALL, seed=3)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, SMALL.vocab_size, (3, 23), generator=gen)
    padding = torch.ones(3, 23, dtype=torch.bool)
    padding[0, :9] = False
    padding[2, :22] = False  # a one-token prompt
    assert _steps(model, prompt, 12, monkeypatch, padding=padding) <= 1e-4
    for dtype in (torch.bfloat16, torch.float16):
        worst, effect = _steps(model, prompt, 12, monkeypatch, kv_dtype=dtype)
        assert worst <= max(1e-4, effect / 10), (dtype, worst, effect)


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 17, 300])
def test_step_equals_the_module_path_on_smollm2(quant_kernel, monkeypatch, n: int) -> None:
    from llama_oracles import _bundled_gguf

    model = _bundled_gguf()
    ids = model.encode("Once upon a time, in a small village by the sea, " * 40)[:n]
    # The two paths sum the products in other orders, through 30 layers, on logits of size 20
    # to 35: 2-3e-5 apart with AVX-512, 0.7-1.2e-4 with AVX2 (its interleaved rows sum each
    # output in one chain of up to 1,536 FMAs). The bound the bundled model's paths keep in the
    # serve step's test as well; the float32 path's is 1e-3.
    assert _steps(model.model, torch.tensor([ids]), 20, monkeypatch) <= 5e-4


@pytest.mark.slow
def test_greedy_tokens_equal_the_module_paths_on_smollm2(quant_kernel, monkeypatch) -> None:
    from llama_oracles import _bundled_gguf

    model = _bundled_gguf()
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    before = llama_step.calls
    fused = [model.generate_ids(p, 24) for p in prompts]
    assert llama_step.calls - before >= 3 * 20
    _module_path(monkeypatch)
    assert fused == [model.generate_ids(p, 24) for p in prompts]


def test_step_is_taken_only_for_quantised_weights_with_the_kernel_loaded(
    quant_kernel, monkeypatch
) -> None:
    model = random_quantised(SMALL)
    prompt = torch.tensor([[5, 7, 11, 2]])

    def decode(m) -> int:
        before = llama_step.calls
        caches = m.new_caches(12)
        with torch.no_grad():
            m(prompt, caches=caches)
            for t in range(6):
                m(torch.tensor([[t]]), caches=caches)
        return llama_step.calls - before

    assert decode(model) == 6
    caches = model.new_caches(12)
    with torch.no_grad():
        model(prompt, caches=caches)
        assert llama_step.why_not(model, prompt[:, :1], caches, need_weights=True) is not None
    torch.manual_seed(0)
    plain = LlamaModel(SMALL).eval()  # float32 weights: the module path
    assert decode(plain) == 0
    with torch.no_grad():
        why = llama_step.why_not(plain, prompt[:, :1], plain.new_caches(4))
    assert why is not None and "float32" in why
    monkeypatch.setenv("ATTNKIT_FUSED", "0")
    assert decode(model) == 0


def test_a_replaced_projection_is_seen_before_the_next_step(quant_kernel) -> None:
    """The packed weights follow the model's modules: a projection swapped for a float32 one
    (or another quantised one) after steps ran is what the next step reads, or refuses."""
    model = random_quantised(SMALL)
    prompt = torch.tensor([[5, 7, 11, 2]])
    caches = model.new_caches(12)
    with torch.no_grad():
        model(prompt, caches=caches)
    token = prompt[:, :1]
    other = random_quantised(SMALL, seed=1)
    with torch.no_grad():
        assert llama_step.why_not(model, token, caches) is None
        model.blocks[1].ffn.down = other.blocks[1].ffn.down  # another quantised matrix
        assert llama_step.why_not(model, token, caches) is None
        assert _packed_from(model, other.blocks[1].ffn.down.raw)
        down = model.blocks[1].ffn.down
        model.blocks[1].ffn.down = torch.nn.Linear(down.in_features, down.out_features, False)
        why = llama_step.why_not(model, token, caches)
    assert why is not None and "layer 1" in why and "not quantised" in why


def _packed_from(model, raw: torch.Tensor) -> bool:
    """Whether the packed weights hold ``raw`` itself, or its interleaved copy."""
    packed = model._llama_step
    return any(w is raw for w in packed.weights) or any(s is raw for s, _ in packed.sources)


def test_weights_changed_in_place_are_seen_before_the_next_step(quant_kernel, monkeypatch):
    """A copy the step keeps (rows interleaved) is made again when its module's weight is
    written in place: the next step computes with the new values."""
    model = random_quantised(SMALL, seed=4)
    other = random_quantised(SMALL, seed=5)
    prompt = torch.tensor([[5, 7, 11, 2]])
    with torch.no_grad():
        for block, theirs in zip(model.blocks, other.blocks, strict=True):
            block.ffn.up.raw.copy_(theirs.ffn.up.raw)
    # The module path after the change against the step after the change.
    assert _steps(model, prompt, 3, monkeypatch) <= 1e-4
    with torch.no_grad():
        model.blocks[0].ffn.up.raw.copy_(model.blocks[1].ffn.up.raw)
    assert _steps(model, prompt, 3, monkeypatch) <= 1e-4


def test_a_model_made_under_inference_mode_takes_the_step(quant_kernel, monkeypatch) -> None:
    """Its weights keep no count of in-place writes; packing them still works."""
    with torch.inference_mode():
        model = random_quantised(SMALL, seed=6)
    assert model.blocks[0].ffn.up.raw.is_inference()
    with torch.inference_mode():
        assert _steps(model, torch.tensor([[5, 7, 11]]), 3, monkeypatch) <= 1e-4


def test_the_step_multiplies_rows_in_the_layout_its_build_prefers(quant_kernel) -> None:
    """AVX2 without AVX-512 (``interleaves``): Q4_0, Q4_1 and Q8_0 matrices whose rows come
    in eights go to the step with their rows interleaved (kind 256 + the GGUF type), others as
    they are (SMALL's tied output has 101 rows); elsewhere every matrix as it is."""
    model = random_quantised(SMALL)
    caches = model.new_caches(8)
    with torch.no_grad():
        model(torch.tensor([[5, 7]]), caches=caches)
        assert llama_step.why_not(model, torch.tensor([[3]]), caches) is None
    packed = model._llama_step
    pairs = zip(packed.weights, packed.kinds, strict=True)
    layouts = [(kind, w.shape[0] % 8 == 0) for w, kind in pairs]
    if quant_kernel.interleaves():
        assert {kind for kind, _ in layouts} == {258, 259, 264, 8}
        assert all(whole for kind, whole in layouts if kind >= 256)
        assert all(not whole for kind, whole in layouts if kind < 256)
        assert len(packed.sources) == sum(kind >= 256 for kind, _ in layouts)
    else:
        assert all(kind < 256 for kind, _ in layouts) and packed.sources == ()


@pytest.mark.parametrize("threads", [1, 2])
def test_step_runs_on_every_intra_op_thread(quant_kernel, threads: int) -> None:
    model = random_quantised(SMALL)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        caches = model.new_caches(8)
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]), caches=caches)
            calls = llama_step.calls
            model(torch.tensor([[4]]), caches=caches)
        assert llama_step.calls == calls + 1
        assert quant_kernel.threads_used() == threads == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def _arguments(model: LlamaModel) -> dict:
    """A valid ``llama_step`` call (after a 3-token prefill), as keyword arguments."""
    caches = model.new_caches(8)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), caches=caches)
    packed = llama_step._packed(model)
    cos, sin = llama_step._tables(model, packed, 8)
    return {
        "ids": torch.tensor([4]),
        "positions": [3],
        "embed": packed.embed,
        "embed_kind": packed.embed_kind,
        "weights": list(packed.weights),
        "kinds": list(packed.kinds),
        "parts": list(packed.parts),
        "norms": list(packed.norms),
        "keys": [c._key for c in caches],
        "values": [c._value for c in caches],
        "cos": cos,
        "sin": sin,
        "key_mask": None,
        "sizes": dict(packed.sizes, length=3),
        "numbers": dict(packed.numbers),
        "logits": torch.empty(1, SMALL.vocab_size),
    }


BAD = [
    ("sizes", lambda a: a["sizes"].pop("h_kv"), "sizes has no 'h_kv'"),
    ("numbers", lambda a: a["numbers"].pop("eps"), "numbers has no 'eps'"),
    ("ids", lambda a: a.update(ids=torch.tensor([4.0])), "ids must be a contiguous int64"),
    ("ids", lambda a: a.update(ids=torch.tensor([101])), r"ids\[0\] = 101 is outside"),
    ("weights", lambda a: a["weights"].__setitem__(0, a["weights"][0].float()), "weights\\[0\\]"),
    ("weights", lambda a: a["weights"].__setitem__(1, a["weights"][1][:, :-2]), "weights\\[1\\]"),
    ("parts", lambda a: a["parts"].__setitem__(0, 2), "parts of matrix 0"),
    ("kinds", lambda a: a["kinds"].__setitem__(0, 99), "kinds\\[0\\] = 99"),
    ("keys", lambda a: a["keys"].__setitem__(1, a["keys"][1][:, :1]), "cache of layer 1"),
    ("positions", lambda a: a.update(positions=[3, 4]), "one RoPE position per row"),
    ("logits", lambda a: a.update(logits=torch.empty(1, 7)), "logits must be"),
    ("key_mask", lambda a: a.update(key_mask=torch.ones(1, 3, dtype=torch.bool)), "key_mask"),
]


@pytest.mark.parametrize(("what", "change", "match"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_before_any_work(quant_kernel, what, change, match) -> None:
    args = _arguments(random_quantised(SMALL))
    keys = [k.clone() for k in args["keys"]]
    change(args)
    with pytest.raises(RuntimeError, match=match):
        quant_kernel.llama_step(**args)
    # Layer 0's cache is written first: its position 3 (the new token's) is as it was.
    written = args["keys"][0][:, :, 3]
    assert torch.equal(keys[0][:, :, 3].view(torch.int32), written.view(torch.int32))
