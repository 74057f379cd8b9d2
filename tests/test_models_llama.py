"""The Llama decoder on small random models: Hugging Face parity, KV cache, left padding,
llama.cpp's q/k row permutation, configuration checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnkit.models.llama import LlamaConfig, LlamaModel
from attnkit.models.llama_loading import expected_shapes, permute_qk, unpermute_qk

transformers = pytest.importorskip("transformers")

from llama_oracles import tiny_hf  # noqa: E402

SMALL = LlamaConfig(
    vocab_size=61, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=48
)


def _small(seed: int = 0, **changes) -> LlamaModel:
    torch.manual_seed(seed)
    model = LlamaModel(dataclasses.replace(SMALL, **changes)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_hf(tmp_path_factory.mktemp("tiny_llama"))


@pytest.mark.parametrize("n", [1, 13, 97])
def test_logits_equal_hugging_face_llama(tiny, n: int) -> None:
    hf, ours = tiny
    ids = torch.randint(0, 101, (2, n), generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)


def test_untied_output_and_plain_attention_equal_hugging_face(tmp_path) -> None:
    hf, ours = tiny_hf(tmp_path, seed=3, tie_word_embeddings=False, num_key_value_heads=6)
    assert ours.lm_head is not None and ours.config.num_kv_heads == 6
    ids = torch.randint(0, 101, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, rtol=0, atol=2e-5)


def test_left_padded_batch_matches_hugging_face_with_its_attention_mask(tiny) -> None:
    hf, ours = tiny
    ids = torch.randint(3, 101, (2, 9), generator=torch.Generator().manual_seed(1))
    padding = torch.ones(2, 9, dtype=torch.bool)
    padding[0, :4] = False  # row 0: 5 real tokens after 4 pads
    with torch.no_grad():
        expected = hf(ids, attention_mask=padding.long()).logits
        got = ours(ids, padding=padding).logits
    torch.testing.assert_close(got[padding], expected[padding], rtol=0, atol=2e-5)


def test_kv_cache_decoding_equals_full_forward_at_every_step() -> None:
    model = _small(seed=1).double()
    ids = torch.randint(0, 61, (2, 23), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits  # (b, n, V)
        caches = model.new_caches(23)
        steps = [model(ids[:, :5], caches=caches).logits]  # a prompt of 5, then one at a time
        steps += [model(ids[:, t : t + 1], caches=caches).logits for t in range(5, 23)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-12)
    assert caches[0].length == 23


def test_last_only_gives_the_last_position() -> None:
    model = _small()
    ids = torch.randint(0, 61, (3, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, last_only=True).logits, model(ids).logits[:, -1:])


def test_left_padded_batch_equals_each_prompt_alone_with_a_cache() -> None:
    model = _small(seed=4).double()
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 61, (n,), generator=gen) for n in (3, 8, 1, 8)]
    continuation = torch.randint(0, 61, (4, 6), generator=gen)
    n = 8
    ids = torch.zeros(4, n, dtype=torch.long)
    padding = torch.zeros(4, n, dtype=torch.bool)
    for row, p in enumerate(prompts):
        ids[row, n - len(p) :] = p
        padding[row, n - len(p) :] = True
    with torch.no_grad():
        caches = model.new_caches()
        batch = [model(ids, caches=caches, padding=padding).logits[:, -1]]
        for t in range(6):
            padding = torch.cat([padding, torch.ones(4, 1, dtype=torch.bool)], dim=1)
            step = model(continuation[:, t : t + 1], caches=caches, padding=padding)
            batch.append(step.logits[:, -1])
        for row, p in enumerate(prompts):
            alone = model(torch.cat([p, continuation[row]])[None]).logits[0]  # (n, V)
            expected = alone[len(p) - 1 :]  # the prompt's last position, then each new token
            got = torch.stack([b[row] for b in batch])
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_pad_queries_give_finite_outputs_and_weights_are_causal() -> None:
    model = _small()
    ids = torch.randint(0, 61, (2, 6))
    padding = torch.tensor([[False, False, True, True, True, True], [True] * 6])
    with torch.no_grad():
        out = model(ids, padding=padding, need_weights=True)
    assert torch.isfinite(out.logits).all()
    assert out.weights is not None and len(out.weights) == SMALL.num_layers
    w = out.weights[0]  # (b, h, i, j)
    assert w.shape == (2, 4, 6, 6)
    assert torch.all(w.triu(1) == 0)  # no query sees a later key
    assert torch.all(w[0, :, :, :2] == 0)  # nobody attends to the pads
    torch.testing.assert_close(w[0, :, 2:].sum(-1), torch.ones(4, 4))


def test_state_dict_names_and_shapes_are_what_loaders_expect() -> None:
    model = LlamaModel(SMALL)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == expected_shapes(SMALL)
    untied = dataclasses.replace(SMALL, tie_embeddings=False)
    assert "lm_head.weight" in expected_shapes(untied)
    assert sum(p.numel() for p in LlamaModel(untied).parameters()) > sum(
        p.numel() for p in model.parameters()
    )


# --- llama.cpp's q/k row permutation --------------------------------------------------------


def _llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py, LlamaModel.permute, written out independently."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _rope_interleaved(x: torch.Tensor, base: float) -> torch.Tensor:
    """llama.cpp's RoPE (normal mode): rotate adjacent pairs (x[2k], x[2k+1]) at position p by
    p * base^(-2k/d). ``x`` is (n, d)."""
    n, d = x.shape
    k = torch.arange(d // 2, dtype=x.dtype)
    angle = torch.arange(n, dtype=x.dtype)[:, None] * base ** (-2 * k / d)  # (n, d/2)
    even, odd = x[:, 0::2], x[:, 1::2]
    out = torch.empty_like(x)
    out[:, 0::2] = even * angle.cos() - odd * angle.sin()
    out[:, 1::2] = even * angle.sin() + odd * angle.cos()
    return out


def test_permutation_moves_each_half_pair_to_adjacent_rows() -> None:
    heads, d = 3, 8
    rows = torch.arange(heads * d, dtype=torch.float64)[:, None]  # row r holds the value r
    gguf = permute_qk(rows, heads)
    torch.testing.assert_close(gguf, _llama_cpp_permute(rows, heads))
    for h in range(heads):
        for s in range(2):
            for k in range(d // 2):
                # Hugging Face row s*d/2 + k of head h is GGUF row 2k + s of that head.
                assert gguf[h * d + 2 * k + s, 0] == h * d + s * (d // 2) + k
    torch.testing.assert_close(unpermute_qk(gguf, heads), rows)
    w = torch.randn(heads * d, 5)
    torch.testing.assert_close(unpermute_qk(_llama_cpp_permute(w, heads), heads), w)


def test_llama_cpp_rope_on_permuted_rows_equals_rotate_half_on_original_rows() -> None:
    from attnkit.positional import RotaryEmbedding

    heads, d, e, n, base = 2, 8, 12, 9, 100.0
    torch.manual_seed(0)
    w_hf = torch.randn(heads * d, e, dtype=torch.float64)
    x = torch.randn(n, e, dtype=torch.float64)
    rope = RotaryEmbedding(d, base=base)
    ours = rope.rotate((x @ w_hf.T).view(n, heads, d).transpose(0, 1))  # (h, n, d)
    gguf = (x @ _llama_cpp_permute(w_hf, heads).T).view(n, heads, d).transpose(0, 1)
    theirs = torch.stack([_rope_interleaved(gguf[h], base) for h in range(heads)])
    # The same vectors, the features of each head in the other order.
    torch.testing.assert_close(
        unpermute_qk(theirs.transpose(0, 1).reshape(n, -1).T, heads).T,
        ours.transpose(0, 1).reshape(n, -1),
        rtol=0,
        atol=1e-12,
    )
    # So every attention score is the same.
    torch.testing.assert_close(theirs @ theirs.transpose(1, 2), ours @ ours.transpose(1, 2))


# --- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"embed_dim": 30}, "divisible"),
        ({"num_kv_heads": 3}, "divide"),
        ({"num_layers": 0}, "num_layers"),
        ({"eps": 0.0}, "eps"),
        ({"eos_id": 61}, "outside the vocabulary"),
        ({"embed_dim": 40, "num_heads": 4, "num_kv_heads": 4}, None),
        ({"embed_dim": 12, "num_heads": 4, "num_kv_heads": 4}, "even"),
    ],
)
def test_config_is_checked(change, match) -> None:
    if match is None:
        dataclasses.replace(SMALL, **change)
        return
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(SMALL, **change)


def test_config_is_frozen_and_reads_hugging_face() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SMALL.embed_dim = 64  # type: ignore[misc]
    hf = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=1,
        intermediate_size=40,
        num_hidden_layers=3,
        rope_theta=1234.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=[7, 8],
    ).to_dict()
    config = LlamaConfig.from_hf(hf)
    assert (config.num_layers, config.num_kv_heads, config.rope_base) == (3, 1, 1234.0)
    assert (config.eps, config.tie_embeddings, config.eos_id) == (1e-6, False, 7)
    with pytest.raises(ValueError, match="model_type"):
        LlamaConfig.from_hf({**hf, "model_type": "mistral"})
    with pytest.raises(ValueError, match="rope scaling"):
        LlamaConfig.from_hf({**hf, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match="attention_bias"):
        LlamaConfig.from_hf({**hf, "attention_bias": True})


def test_ids_and_padding_are_checked() -> None:
    model = _small()
    with pytest.raises(ValueError, match="token ids"):
        model(torch.randn(1, 4))
    with pytest.raises(ValueError, match="padding"):
        model(torch.zeros(1, 4, dtype=torch.long), padding=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="one KVCache per layer"):
        model(torch.zeros(1, 4, dtype=torch.long), caches=model.new_caches()[:1])


def test_new_caches_keep_keys_and_values_in_kv_dtype() -> None:
    """``new_caches(kv_dtype=torch.bfloat16)``: every layer's cache stores bfloat16, and the
    logits stay within bfloat16's rounding of those of a float32 cache."""
    model = _small(seed=6)
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(7))
    logits = {}
    with torch.no_grad():
        for kv_dtype in (None, torch.bfloat16):
            caches = model.new_caches(12, kv_dtype=kv_dtype)
            steps = [model(ids[:, :4], caches=caches).logits]
            steps += [model(ids[:, t : t + 1], caches=caches).logits for t in range(4, 12)]
            logits[kv_dtype] = torch.cat(steps, dim=1)
            assert {c.key.dtype for c in caches} == {kv_dtype or torch.float32}
    difference = (logits[torch.bfloat16] - logits[None]).abs().max()
    assert 0 < difference < 1e-2
