"""attnkit.serve.text: streamed text equals the decoded whole, stop strings never leak, and an
unfinished UTF-8 character waits for the token that completes it."""

from __future__ import annotations

import pytest

from attnkit.serve.text import TextStream


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
