"""Tokens to text one at a time, for a stream: hold back what is not certain yet.

Two things make the text of a token uncertain when it arrives: it may end in the middle of a
UTF-8 character (the byte-level tokenizer decodes the fragment as U+FFFD), and it may be the
start of a ``stop`` string, which must not be sent if the string completes. ``TextStream`` is
the push form of ``attnkit.models.llama``'s generator over a token iterator (the server receives
tokens as events, it does not pull them), with the same rule: take the text of everything so
far, send what is new and certain.

Decoding every token so far at each push costs time in proportion to the length (SmolLM2's
tokenizer: 15 us at 128 tokens, 230 us at 2,000), paid per token per stream on the server's
event loop. So only the recent tokens are decoded again: the text of the tokens up to the last
whole character is kept, and the tokens after it are decoded together with the one or few
before them (the context a tokenizer may need, such as the space a word-start marker stands
for), the context's own text taken off. Where decoding is not that local (the window's text
does not begin with its context's), the whole is decoded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["TextStream", "token_label"]


def token_label(raw: bytes) -> str:
    """A token's text for an API answer: its bytes as UTF-8, or ``bytes:\\xe2\\x80`` where
    they end or begin inside a character (OpenAI's spelling)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextStream:
    """``push(token) -> (text, stopped)``; ``flush()`` gives what was held back at the end.

    ``stopped`` is True when a stop string appeared (it and what follows are never sent) or the
    end-of-sequence token came; push nothing after that.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str] = (), eos_id: int | None = None):
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.eos_id = eos_id
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already given out
        # The text of ids[:done] (it ends with a whole character); ids[context:done] is decoded
        # again with the tokens after done, as their context.
        self.head = ""
        self.context = self.done = 0
        self.stopped = False
        self.stop_string = False  # stopped by a stop string (not the end-of-sequence token)

    def push(self, token: int) -> tuple[str, bool]:
        if self.stopped:
            raise ValueError("the stream has stopped: push nothing after a stop")
        if token == self.eos_id:
            self.stopped = True
            return self.flush(), True
        self.ids.append(token)
        text = self._text()
        found = [
            k for k in (text.find(s, max(0, self.sent - len(s))) for s in self.stops) if k >= 0
        ]
        if found:
            self.stopped = self.stop_string = True
            end = min(found)
            piece = text[self.sent : end] if end > self.sent else ""
            self.sent = max(self.sent, end)
            return piece, True
        safe = len(text.rstrip("\ufffd"))
        for s in self.stops:  # a tail that could begin a stop string waits
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    safe = min(safe, len(text) - k)
                    break
        if safe <= self.sent:
            return "", False
        piece, self.sent = text[self.sent : safe], safe
        return piece, False

    def _text(self) -> str:
        """The text of every token so far (``tokenizer.decode(self.ids)``), decoding only the
        tokens after the last whole character and their context (module doc)."""
        decode = self.tokenizer.decode
        before = decode(self.ids[self.context : self.done]) if self.done > self.context else ""
        window = decode(self.ids[self.context :])
        if not window.startswith(before):  # not local here: the whole, and start again
            text = decode(self.ids)
            self.head, self.context, self.done = "", 0, 0
            if not text.endswith("\ufffd"):
                self.head, self.done = text, len(self.ids)
            return text
        text = self.head + window[len(before) :]
        if not window.endswith("\ufffd"):  # a whole character last: keep it
            self.head, self.context, self.done = text, self.done, len(self.ids)
        return text

    def flush(self) -> str:
        """The held-back tail (an unfinished character or a stop string's beginning that never
        completed), once the generation has ended without a stop string."""
        if self.stop_string:
            return ""
        text = self._text() if self.ids else ""
        piece, self.sent = text[self.sent :], max(self.sent, len(text))
        return piece
