"""Generation on a small random Llama read from a GGUF file: sampling rules, the cached decoding
loop against full forwards, left padding, streaming text, stop strings and argument checks."""

from __future__ import annotations

import pytest
import torch

from attnkit.models.llama import PretrainedLlama, load_pretrained
from attnkit.models.llama_generate import Sampling, argmax, left_pad, text_pieces

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from llama_oracles import gguf_tiny_config, write_gguf  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> PretrainedLlama:
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(gguf_tiny_config(max_position_embeddings=512)).eval()
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(40)  # confident logits: few near-ties
    path = write_gguf(tmp_path_factory.mktemp("gen") / "tiny.gguf", hf)
    return load_pretrained(path, dtype=torch.float64)


# --- sampling -------------------------------------------------------------------------------


def test_greedy_is_the_argmax_and_ignores_top_k_and_top_p() -> None:
    logits = torch.randn(4, 50)
    expected = logits.argmax(-1)
    assert torch.equal(Sampling().next_token(logits), expected)
    assert torch.equal(Sampling(0.0, top_k=5, top_p=0.5).next_token(logits), expected)
    one = Sampling(1.5, top_k=1)  # sampling from a single candidate
    assert torch.equal(one.next_token(logits, torch.Generator().manual_seed(0)), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_argmax_is_torchs_with_ties_nans_and_infinities(dtype) -> None:
    """The first largest index of each row, a NaN taken as the largest, as torch.argmax."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (64, 97), generator=g).to(dtype)  # many ties
    logits[1, 5] = logits[1, 9] = float("nan")
    logits[2] = float("-inf")
    logits[3, [4, 60]] = float("inf")
    logits[4, 7], logits[4, 8] = float("inf"), float("nan")
    wide = torch.randn(3, 49_152, generator=g).to(dtype)
    # strided and single rows too, and one row without its batch dimension
    for x in (logits, logits[:, ::2], logits[5:6], wide, logits[4], wide[0]):
        got = argmax(x)
        assert got.dtype == torch.long and got.shape == x.shape[:-1]
        assert torch.equal(got, x.argmax(dim=-1))
    assert argmax(logits)[1:5].tolist() == [5, 0, 4, 8]


def test_top_k_and_top_p_keep_the_documented_sets() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    gen = torch.Generator().manual_seed(0)

    def seen(sampling: Sampling) -> set[int]:
        return {int(sampling.next_token(logits, gen)) for _ in range(400)}

    assert seen(Sampling(1.0, top_k=2)) == {1, 3}
    # Nucleus: the most likely tokens until their probability reaches top_p (0.5 + 0.3 = 0.8).
    assert seen(Sampling(1.0, top_p=0.8)) == {1, 3}
    assert seen(Sampling(1.0, top_p=0.81)) == {1, 2, 3}
    assert seen(Sampling(1.0, top_p=0.1)) == {1}
    assert seen(Sampling(1.0)) == {0, 1, 2, 3}


def test_sampling_frequencies_follow_the_temperature() -> None:
    logits = torch.tensor([[0.0, 1.0]])
    gen = torch.Generator().manual_seed(1)
    draws = torch.stack([Sampling(2.0).next_token(logits, gen) for _ in range(4000)])
    p1 = torch.sigmoid(torch.tensor(0.5)).item()  # softmax([0, 1] / 2)[1]
    assert abs(draws.float().mean().item() - p1) < 0.03


@pytest.mark.parametrize("temperature", [1e-45, 1e-300, 5e-324])
@pytest.mark.parametrize("limits", [{}, {"top_k": 3}, {"top_p": 0.9}])
def test_a_tiny_temperature_samples_the_best_tokens(temperature: float, limits: dict) -> None:
    """Any finite temperature > 0 passes the checks, so it must sample: as it goes to 0 the
    distribution is uniform over the best logits (30 at tokens 1 and 3; 60 / 5 = 12 by hand),
    never inf - inf = NaN in the softmax."""
    logits = torch.tensor([[1.0, 30.0, 2.0, 30.0, 29.0]] * 2000)  # (b, V)
    draws = Sampling(temperature, **limits).next_token(logits, torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == {1, 3}
    assert abs((draws == 1).float().mean().item() - 0.5) < 0.05


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_sampling_arguments_are_checked(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        Sampling(**kwargs)


# --- the decoding loop ----------------------------------------------------------------------


def test_left_pad_aligns_prompts_on_the_right() -> None:
    ids, padding = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert padding is not None and padding.tolist() == [[True] * 3, [False, False, True]]
    assert left_pad([[1, 2], [3, 4]], pad_id=0)[1] is None  # equal lengths need no mask


def test_each_cached_step_equals_a_full_forward(tiny) -> None:
    prompt = tiny.encode("Hello")
    new = tiny.generate_ids(prompt, 40)[0]
    assert 0 < len(new) <= 40
    full = torch.tensor([prompt + new])
    with torch.no_grad():
        logits = tiny.model(full).logits[0]  # (n, V)
    # The token chosen at each step is the argmax of the full forward at the position before it.
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == new


def test_a_batch_gives_the_tokens_of_each_prompt_alone(tiny) -> None:
    prompts = ["a", "Hello there, general", "xyz 123", "?"]
    together = tiny.generate_ids(prompts, 25)
    assert together == [tiny.generate_ids(p, 25)[0] for p in prompts]
    sampled = tiny.generate_ids(prompts, 10, temperature=1.0, seed=7)
    assert sampled == tiny.generate_ids(prompts, 10, temperature=1.0, seed=7)


def test_prompt_forms_agree(tiny) -> None:
    ids = tiny.encode("Once")
    text = tiny.generate("Once", 12)
    assert tiny.generate(ids, 12) == text
    assert tiny.generate(torch.tensor(ids), 12) == text
    assert tiny.generate(torch.tensor([ids, ids]), 12) == [text, text]
    assert tiny.generate([ids], 12) == [text]
    assert tiny.generate("Once", 0) == ""


def test_generation_stops_at_the_end_of_sequence_token(tiny, monkeypatch) -> None:
    prompt = tiny.encode("Hi")
    free = tiny.generate_ids(prompt, 20)[0]
    # Declare the third generated token the end of sequence: generation must stop right there.
    monkeypatch.setattr(type(tiny), "eos_id", property(lambda self: free[2]))
    stopped = tiny.generate_ids(prompt, 20)[0]
    assert stopped == free[: free.index(free[2]) + 1]


# --- text -----------------------------------------------------------------------------------


def test_stream_holds_back_unfinished_characters_and_stop_prefixes(tiny) -> None:
    text = "aé🙂 b STOP after"
    ids = tiny.encode(text)  # one token per byte: é and 🙂 span several tokens
    pieces = list(text_pieces(tiny.tokenizer, iter(ids), None, ()))
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert len(pieces) < len(ids)
    stopped = list(text_pieces(tiny.tokenizer, iter(ids), None, ("STOP",)))
    assert "".join(stopped) == "aé🙂 b "
    assert all("S" not in p for p in stopped)
    cut = list(text_pieces(tiny.tokenizer, iter(tiny.encode("a STO")), None, ("STOP",)))
    assert "".join(cut) == "a STO"  # a stop prefix at the end is text after all


def test_stream_equals_generate_and_feeds_on_text(tiny) -> None:
    pieces: list[str] = []
    text = tiny.generate("Hello", 30, on_text=pieces.append)
    assert "".join(pieces) == text == "".join(tiny.stream("Hello", 30))


def test_chat_renders_the_template(tiny) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert tiny.chat_prompt(messages) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tiny.chat(messages, 5) == tiny.generate(tiny.chat_prompt(messages), 5)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda m: m.generate("", 5), ValueError, "prompt 0 is empty"),
        (lambda m: m.generate([], 5), ValueError, "prompt is empty"),
        (lambda m: m.generate(["ok", ""], 5), ValueError, "prompt 1 is empty"),
        (lambda m: m.generate("hi", -1), ValueError, "max_new_tokens"),
        (lambda m: m.generate("hi", 2.5), ValueError, "max_new_tokens"),
        (
            lambda m: m.generate("hi", 10**12),
            ValueError,
            r"max_new_tokens=1,000,000,000,000: "
            r"the KV cache for 1 x 1,000,000,000,00\d positions \(2 layers.* more than the",
        ),
        (lambda m: m.generate(["a", "bc"], 10**12), ValueError, r"cache for 2 x 1,000,000,000,00"),
        (lambda m: m.generate("hi", 5, temperature=-1), ValueError, "temperature"),
        (lambda m: m.generate("hi", 5, seed="x"), ValueError, "seed"),
        (lambda m: m.generate("hi", 5, stop=""), ValueError, "stop"),
        (lambda m: m.generate([5, 10_000], 5), ValueError, "outside"),
        (lambda m: m.generate(torch.ones(3), 5), ValueError, "integer token ids"),
        (lambda m: m.generate(3.5, 5), TypeError, "prompt must be"),
        (lambda m: m.generate(["a", "b"], 5, on_text=print), ValueError, "on_text"),
        (lambda m: m.stream(["a", "b"], 5), ValueError, "one prompt"),
        (lambda m: m.chat([], 5), ValueError, "messages is empty"),
        (lambda m: m.chat([{"role": "user"}], 5), ValueError, "content"),
        (lambda m: m.chat("hello", 5), TypeError, "list of"),
    ],
)
def test_bad_arguments_fail_before_any_work(tiny, monkeypatch, call, error, match) -> None:
    def no_forward(*args, **kwargs):
        raise AssertionError("the model ran before the arguments were checked")

    monkeypatch.setattr(tiny.model, "forward", no_forward)
    with pytest.raises(error, match=match):
        call(tiny)


def test_attention_rows_are_what_each_cached_step_computed(tiny) -> None:
    ids = tiny.encode("Hello there")
    full = tiny.attention(ids).double()  # (l, h, n, n), float32 for the explorer
    caches = tiny.model.new_caches()
    with torch.no_grad():
        first = tiny.model(torch.tensor([ids[:4]]), caches=caches, need_weights=True)
        steps = [tiny.model(torch.tensor([[t]]), caches=caches, need_weights=True) for t in ids[4:]]
    prefill = torch.stack([w[0] for w in first.weights])
    torch.testing.assert_close(prefill, full[:, :, :4, :4], atol=1e-6, rtol=0)
    for k, step in enumerate(steps):
        row = 4 + k
        cached = torch.stack([w[0, :, 0] for w in step.weights])  # (l, h, row + 1)
        torch.testing.assert_close(cached, full[:, :, row, : row + 1], atol=1e-6, rtol=0)


def test_a_batch_shows_a_bar_only_on_a_terminal(tiny, monkeypatch) -> None:
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stderr, bar in ((io.StringIO(), False), (Terminal(), True)):
        monkeypatch.setattr(sys, "stderr", stderr)
        assert tiny.generate(["a", "bc"], 6) == [tiny.generate("a", 6), tiny.generate("bc", 6)]
        assert ("generating:" in stderr.getvalue()) is bar, stderr.getvalue()
