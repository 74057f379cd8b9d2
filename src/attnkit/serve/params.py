"""A completion request read and its parameters checked, and the OpenAI shapes the server
answers in: errors (``ApiError``) and log-probabilities (``Scores``, one choice's as its text
goes out).

Every check names the parameter it refuses (``param`` in the error), so a client sees which
part of its request to change; parameters the server does not implement are refused by name,
never ignored.
"""

import json
import math
from collections.abc import Mapping
from typing import Any

from attnkit._io import is_utf8
from attnkit.models.llama_generate import Sampling
from attnkit.serve.requests import Generation, Scoring

__all__ = [
    "MAX_BODY_BYTES",
    "ApiError",
    "Scores",
    "include_usage_of",
    "is_int",
    "json_object",
    "logprobs_json",
    "not_unicode",
    "sampling_of",
    "scoring_of",
    "stops_of",
]


class ApiError(Exception):
    """An error answered as OpenAI's JSON with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or {400: "invalid_request_error", 429: "rate_limit_exceeded"}.get(
            status, "server_error"
        )

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 and self.status != 429 else self.code
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# A request body's bytes, at most (413 beyond): a prompt that fills SmolLM2's context is about
# 40 KB of text, a logit_bias for every token about 0.8 MB; more is read and parsed for nothing.
MAX_BODY_BYTES = 8 * 2**20


async def json_object(request: Any) -> dict[str, Any]:
    """A request's body as a JSON object (a Starlette ``Request``): 413 past ``MAX_BODY_BYTES``
    (by its Content-Length before any byte is read, else as the bytes come), 400 for what is
    not a JSON object or holds text that is not valid Unicode."""
    too_large = ApiError(
        413,
        f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB",
        code="request_too_large",
    )
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}") from err
    except RecursionError:
        raise ApiError(400, "the request body nests arrays or objects too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    broken = not_unicode(body)
    if broken is not None:
        where = f" in {broken}" if broken else ""
        raise ApiError(
            400,
            "the request has text that is not valid Unicode (a lone surrogate such as "
            f"\\ud800){where}",
            broken or None,
        )
    return body


def include_usage_of(body: Mapping[str, Any]) -> bool:
    """``stream_options.include_usage``: whether a stream ends with a usage chunk."""
    options = body.get("stream_options")
    if options is None:
        return False
    include_usage = options.get("include_usage", False) if isinstance(options, dict) else None
    if not isinstance(include_usage, bool):
        raise ApiError(
            400,
            "stream_options must be an object whose include_usage is true or false, got "
            f"{options!r}",
            "stream_options",
        )
    return include_usage


def not_unicode(body: Mapping[str, Any]) -> str | None:
    """Where a parsed JSON body holds a string that is not valid Unicode, or None: the
    top-level key whose value holds it ("" for a key itself). JSON's escapes can spell a lone
    surrogate (``"\\ud800"``), which no tokenizer or UTF-8 answer can carry."""
    for name, value in body.items():
        if not is_utf8(name):
            return ""
        stack = [value]  # a walk, not recursion: JSON nests as deep as the parser allowed
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                if not is_utf8(item):
                    return name
            elif isinstance(item, dict):
                stack.extend(item.keys())
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)
    return None


def _real(x: object) -> bool:
    """A finite int or float (JSON's true and false are not numbers here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _number(
    body: Mapping[str, Any], name: str, default: float, low: float, high: float, open_low: bool
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _real(value) or value > high or value < low or (open_low and value == low):
        side = "(" if open_low else "["
        raise ApiError(400, f"{name} must be a number in {side}{low}, {high}], got {value!r}", name)
    return float(value)


def sampling_of(body: Mapping[str, Any]) -> Sampling:
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0, open_low=False)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, open_low=True)
    return Sampling(temperature, None, top_p if top_p < 1 else None)


def scoring_of(body: Mapping[str, Any], vocab: int, chat: bool) -> Scoring:
    """``logit_bias``, the penalties and ``logprobs`` (``top_logprobs`` for chat), checked; the
    OpenAI parameters this server does not implement are refused by name rather than ignored
    (an answer that silently skipped ``logit_bias`` or a JSON format would look right and be
    wrong)."""
    _refuse_unsupported(body, chat)
    bias = body.get("logit_bias")
    pairs: list[tuple[int, float]] = []
    if bias is not None:
        if not isinstance(bias, dict):
            message = f"logit_bias must map token ids to numbers, got {bias!r}"
            raise ApiError(400, message, "logit_bias")
        for key, value in bias.items():
            token = int(key) if isinstance(key, str) and key.strip().isdigit() else None
            if token is None or token >= vocab:
                raise ApiError(
                    400, f"logit_bias: {key!r} is not a token id in 0..{vocab - 1}", "logit_bias"
                )
            if not _real(value) or not -100 <= value <= 100:
                raise ApiError(
                    400, f"logit_bias: the bias of {key} must be in [-100, 100], got {value!r}",
                    "logit_bias",
                )  # fmt: skip
            pairs.append((token, float(value)))
    presence = _number(body, "presence_penalty", 0.0, -2.0, 2.0, open_low=False)
    frequency = _number(body, "frequency_penalty", 0.0, -2.0, 2.0, open_low=False)
    if chat:
        wanted, top = body.get("logprobs"), body.get("top_logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise ApiError(400, f"logprobs must be true or false, got {wanted!r}", "logprobs")
        if top is not None and (not is_int(top) or not 0 <= top <= 20):
            message = f"top_logprobs must be an int in 0..20, got {top!r}"
            raise ApiError(400, message, "top_logprobs")
        if top is not None and not wanted:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        count = (top or 0) if wanted else None
    else:
        count = body.get("logprobs")
        if count is not None and (not is_int(count) or not 0 <= count <= 5):
            raise ApiError(400, f"logprobs must be an int in 0..5, got {count!r}", "logprobs")
    return Scoring(tuple(pairs), presence, frequency, count)


def _refuse_unsupported(body: Mapping[str, Any], chat: bool) -> None:
    def refuse(param: str, what: str) -> None:
        raise ApiError(400, f"{param}: {what} is not supported by this server", param)

    if body.get("best_of") not in (None, 1):
        refuse("best_of", "more than one candidate per request")
    if not chat:
        echo = body.get("echo", False)
        if echo is not None and not isinstance(echo, bool):
            raise ApiError(400, f"echo must be true or false, got {echo!r}", "echo")
        if echo and body.get("logprobs") is not None:
            refuse("echo", "echo with logprobs (the prompt's own log-probabilities)")
        if body.get("suffix"):
            refuse("suffix", "a suffix (insertion)")
        return
    for param in ("tools", "functions"):
        if body.get(param):
            refuse(param, "calling tools")
    if body.get("tool_choice") not in (None, "none", "auto"):
        refuse("tool_choice", "calling tools")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        refuse("response_format", f"constraining the answer to {fmt!r}")


def logprobs_json(
    gen: Generation,
    start: int,
    end: int,
    chat: bool,
    offsets: list[int],
    token_of: Any,
) -> dict[str, Any]:
    """The log-probabilities of generated tokens [start, end) in OpenAI's shape: chat's
    ``{"content": [{token, logprob, bytes, top_logprobs}]}`` or the legacy completions'
    ``{tokens, token_logprobs, top_logprobs, text_offset}``."""
    generated = gen.generated
    rows = [(generated[i], *gen.logprobs[i]) for i in range(start, end)]
    if chat:
        content = []
        for token, logprob, top in rows:
            label, raw = token_of(token)
            alternatives = []
            for other, value in top:
                other_label, other_raw = token_of(other)
                alternatives.append({"token": other_label, "logprob": value, "bytes": other_raw})
            content.append(
                {"token": label, "logprob": logprob, "bytes": raw, "top_logprobs": alternatives}
            )
        return {"content": content, "refusal": None}
    return {
        "tokens": [token_of(token)[0] for token, _, _ in rows],
        "token_logprobs": [logprob for _, logprob, _ in rows],
        "top_logprobs": [{token_of(o)[0]: v for o, v in top} for _, _, top in rows],
        "text_offset": offsets[start:end],
    }


def stops_of(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if (
        not isinstance(stops, list)
        or len(stops) > 4
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise ApiError(
            400, f"stop must be a non-empty string or a list of up to 4, got {stop!r}", "stop"
        )
    return stops


class Scores:
    """One choice's log-probabilities as its text goes out: the tokens given out so far and
    where each one's text begins (legacy completions' ``text_offset``)."""

    def __init__(self, gen: Generation, chat: bool, token_of: Any) -> None:
        self.gen, self.chat, self.token_of = gen, chat, token_of
        self.offsets: list[int] = []
        self.tokens = self.chars = 0  # tokens and characters given out

    def reach(self, covered: int, text_before: int) -> None:
        """The tokens up to ``covered`` begin where the text was ``text_before`` long."""
        while len(self.offsets) < covered:
            self.offsets.append(text_before)

    def take(self, covered: int, text_before: int) -> dict[str, Any] | None:
        """The log-probabilities of the tokens not given out yet, up to ``covered``."""
        if self.gen.scoring.logprobs is None:
            return None
        self.reach(covered, text_before)
        start, self.tokens = self.tokens, covered
        return logprobs_json(self.gen, start, covered, self.chat, self.offsets, self.token_of)

    def streamed(self, covered: int, piece_chars: int) -> dict[str, Any] | None:
        """``take`` for a streamed piece of ``piece_chars`` characters (None: no new token)."""
        before = self.chars
        self.chars += piece_chars
        return None if covered == self.tokens else self.take(covered, before)
