"""attnkit.serve.text: streamed text equals the decoded whole, stop strings never leak, and an
unfinished UTF-8 character waits for the token that completes it."""

from __future__ import annotations

import random

import pytest

from attnkit.serve.text import TextStream
from serve_oracles import _tokenizer


class Bytes:
    """A byte-level tokenizer: token ``t`` is byte ``t`` (a character may take several)."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def run(text: str, stops=(), eos_id=None, extra=()):
    stream = TextStream(Bytes(), stops, eos_id)
    pieces, stopped = [], False
    for token in [*text.encode("utf-8"), *extra]:
        piece, stopped = stream.push(token)
        pieces.append(piece)
        if stopped:
            break
    if not stopped:
        pieces.append(stream.flush())
    return pieces, stopped


def test_the_pieces_make_the_whole_text_and_no_piece_splits_a_character() -> None:
    text = "Zürich, 東京 🙂!"
    pieces, stopped = run(text)
    assert "".join(pieces) == text and not stopped
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("Hello world. Bye", ["."], "Hello world"),
        ("abc<|end|>def", ["<|end|>", "zz"], "abc"),
        ("a<|en", ["<|end|>"], "a<|en"),  # a stop that never completes is sent at the end
        ("no stop here", ["STOP"], "no stop here"),
    ],
)
def test_stop_strings_end_the_text_and_are_never_sent(text, stops, expected) -> None:
    pieces, _ = run(text, stops)
    assert "".join(pieces) == expected


def test_the_end_of_sequence_token_stops_and_flushes() -> None:
    pieces, stopped = run("ok", eos_id=255, extra=[255, 65])
    assert stopped and "".join(pieces) == "ok"


class WordStart:
    """A tokenizer whose pieces mark a word's start with "▁" and whose decode drops the space it
    stands for at the very start of the text (as SentencePiece's do): the text of some tokens
    depends on what comes before them."""

    pieces = ("▁a", "b", "▁cd", "e", "▁", "!", "▁x")

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids).replace("▁", " ").removeprefix(" ")


def _stream(tokenizer, ids) -> str:
    stream = TextStream(tokenizer)
    return "".join(stream.push(t)[0] for t in ids) + stream.flush()


@pytest.mark.parametrize("seed", range(5))
def test_streamed_text_equals_decoding_the_whole_with_context_dependent_tokens(seed) -> None:

    rng = random.Random(seed)
    ids = [rng.randrange(len(WordStart.pieces)) for _ in range(60)]
    assert _stream(WordStart(), ids) == WordStart().decode(ids)


def test_streamed_text_equals_decoding_the_whole_with_smollm2s_tokenizer() -> None:
    """Random ids over SmolLM2's whole vocabulary (byte tokens that split characters among
    them), and the text of a multilingual string: the pieces add up to the decoded whole."""
    _, tokenizer = _tokenizer()
    rng = random.Random(0)
    for _ in range(5):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(300)]
        assert _stream(tokenizer, ids) == tokenizer.decode(ids)
    ids = tokenizer.encode("Zürich, 東京 🙂 naïve — ok! " * 20)
    assert _stream(tokenizer, ids) == tokenizer.decode(ids)
