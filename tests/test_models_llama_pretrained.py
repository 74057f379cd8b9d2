"""The bundled SmolLM2-135M-Instruct against transformers' LlamaForCausalLM loaded from the same
GGUF: logits, greedy generation, tokenizer and chat template; and the model that keeps the GGUF
blocks (``load_pretrained()``'s default) against the float32 one. The models load once per test
session (``llama_oracles``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from llama_oracles import TEXTS
from llama_oracles import bundled as bundled
from llama_oracles import bundled_gguf as bundled_gguf
from llama_oracles import hf_bundled as hf_bundled
from llama_oracles import hf_tokenizer as hf_tokenizer

pytestmark = pytest.mark.slow  # loads two 135M-parameter models (about 20 s together)

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = (
    "The lighthouse keeper had not spoken to anyone in three winters. Each evening he climbed "
    "the one hundred and twelve steps, trimmed the wick, wound the clockwork that turned the "
    "great lens, and wrote a single line in the log: weather, ships, nothing else. "
)


def _prompt_of(model, n: int) -> torch.Tensor:
    ids = model.encode(STORY * 8)
    assert len(ids) >= n
    return torch.tensor([ids[:n]])


@pytest.mark.parametrize("n", [1, 2, 9, 64, 97, 200])
def test_logits_equal_transformers(bundled, hf_bundled, n: int) -> None:
    ids = _prompt_of(bundled, n)
    with torch.no_grad():
        ours = bundled.model(ids).logits
        theirs = hf_bundled(ids).logits
    error = (ours - theirs).abs().max().item()
    # The whole difference is RoPE's angles, float64 here and float32 there (the next test);
    # it grows with the position: about 1e-4 at 200 tokens, on logits of size 34.
    assert error <= 2e-4, error


def test_the_whole_difference_is_rope_angles_in_float32(bundled, hf_bundled, monkeypatch):
    """attnkit computes RoPE angles in float64; transformers in float32 (``inv_freq`` and
    ``position * inv_freq``). With transformers' float32 angles the logits are bit-identical:
    every other step computes the same thing in the same order."""
    from attnkit.positional import RotaryEmbedding

    def float32_angles(self, positions, *, device=None):
        d = self.head_dim
        inv_freq = 1.0 / self.base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
        angle = positions.float().unsqueeze(-1) * inv_freq  # (..., n, d/2), float32
        angle = torch.cat([angle, angle], dim=-1)
        return angle.cos().to(device), angle.sin().to(device)

    monkeypatch.setattr(RotaryEmbedding, "cos_sin_at", float32_angles)
    ids = _prompt_of(bundled, 150)
    with torch.no_grad():
        assert torch.equal(bundled.model(ids).logits, hf_bundled(ids).logits)


@pytest.mark.parametrize(
    "prompt",
    [
        FRANCE,
        "Once upon a time",
        [{"role": "user", "content": "Write a Python function that reverses a string."}],
    ],
    ids=["chat-france", "story", "chat-code"],
)
def test_greedy_64_tokens_equal_transformers_generate(bundled, hf_bundled, prompt) -> None:
    text = prompt if isinstance(prompt, str) else bundled.chat_prompt(prompt)
    ids = bundled.encode(text)
    ours = bundled.generate_ids(ids, 64)[0]
    with torch.no_grad():
        out = hf_bundled.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)
    assert ours == out[0, len(ids) :].tolist()


def test_chat_answers_the_capital_of_france(bundled) -> None:
    pieces: list[str] = []
    answer = bundled.chat(FRANCE, 32, on_text=pieces.append)
    assert answer == "The capital of France is Paris."
    assert "".join(pieces) == answer and len(pieces) > 1  # streamed, token by token
    assert bundled.generate(bundled.chat_prompt(FRANCE), 32, stop="Paris") == (
        "The capital of France is "
    )


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_equals_transformers(bundled, hf_tokenizer, text: str) -> None:
    ours = bundled.encode(text)
    assert ours == hf_tokenizer(text)["input_ids"]
    assert bundled.decode(ours) == hf_tokenizer.decode(ours, skip_special_tokens=True)


def test_chat_template_equals_transformers(bundled, hf_tokenizer) -> None:
    conversations = [
        FRANCE,
        [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Colour of the sky?"},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "And grass?"},
        ],
    ]
    for messages in conversations:
        for open_turn in (True, False):
            ours = bundled.tokenizer.apply_chat_template(messages, add_generation_prompt=open_turn)
            theirs = hf_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=open_turn
            )
            assert ours == theirs


def test_left_padded_batch_gives_the_tokens_of_each_prompt_alone(bundled) -> None:
    prompts = ["Once upon a time", bundled.chat_prompt(FRANCE), "1, 2, 3, 4,"]
    together = bundled.generate_ids(prompts, 12)
    alone = [bundled.generate_ids(p, 12)[0] for p in prompts]
    assert together == alone
    assert bundled.generate(prompts, 12)[1] == "The capital of France is Paris."


# --- the quantised model (the GGUF blocks kept) against the float32 one -----------------------


def test_the_gguf_model_keeps_its_weights_quantised(bundled_gguf) -> None:
    """Q4_1 projections and the Q8_0 embedding (also the tied output matrix) stay in their
    blocks: about 97 MB of parameters and buffers instead of 540 MB, and no float tensor above
    1 MB (the norms are 576 floats each)."""
    m = bundled_gguf.model
    tensors = {id(t): t for t in [*m.parameters(), *m.buffers()]}.values()  # shared once
    assert sum(t.numel() * t.element_size() for t in tensors) < 110e6
    big = [t.shape for t in tensors if t.is_floating_point() and t.numel() * 4 > 1e6]
    assert big == []
    assert m.embed.format.name == "Q8_0" and m.blocks[7].ffn.gate.format.name == "Q4_1"


@pytest.mark.parametrize("n", [1, 17, 300])
def test_gguf_logits_are_the_float32_logits(bundled, bundled_gguf, n: int) -> None:
    ids = _prompt_of(bundled, n)
    with torch.no_grad():
        error = (bundled_gguf.model(ids).logits - bundled.model(ids).logits).abs().max().item()
    assert error <= 1e-3, error


@pytest.fixture
def quant_kernel(monkeypatch):
    """The fused kernel's qmatmul where it can be built here (this build is an explicit
    request), else the reference path, which de-quantises every matrix at each step."""
    from attnkit.backends.fused import jit
    from attnkit.quant import linear

    if jit.prerequisites() is None:
        try:
            module = jit.build()
        except jit.NotBuilt:
            return None
        if hasattr(module, "qmatmul"):
            monkeypatch.setattr(linear, "_KERNEL", [module])
            return module
    return None


def test_gguf_greedy_tokens_are_the_float32_tokens(bundled, bundled_gguf, quant_kernel) -> None:
    # One left-padded batch: the three prompts share the steps.
    prompts = ["Once upon a time", bundled.chat_prompt(FRANCE), "def fibonacci(n):"]
    assert bundled_gguf.generate_ids(prompts, 16) == bundled.generate_ids(prompts, 16)
