"""The OpenAI-compatible HTTP API over an ``Engine``: chat and text completions, models, health,
Prometheus metrics.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed as server-sent
events with ``"stream": true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``. The
request and response bodies follow OpenAI's API reference, so the ``openai`` client works
unchanged (``base_url="http://127.0.0.1:8000/v1"``).

Errors are OpenAI's JSON, ``{"error": {"message", "type", "param", "code"}}``: 400 for a request
that can never succeed (unknown model, empty messages, ``max_tokens`` < 1 or past the context,
a prompt longer than the context, ``temperature`` outside 0..2, ``top_p`` outside (0, 1]),
429 when the waiting queue is full, 503 while shutting down. A client's mistake is never a 500.

Each request's tokens come from the engine's thread as events, handed to the event loop with
``call_soon_threadsafe``. When the client goes away (a stream closed, a request dropped), its
sequence is cancelled and its KV blocks return to the pool at the engine's next step.

At start the application loads the compiled paged-attention kernel if a verified build is
cached (``attnkit kernels build`` makes one; nothing is compiled here), and the engine's steps
take it (``attnkit.serve.forward``); otherwise they take the reference and the log says why.
"""

# No ``from __future__ import annotations``: FastAPI reads the handlers' annotations at runtime,
# and ``Request`` is imported inside ``create_app`` (FastAPI is an optional dependency).
import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from attnkit.serve.engine import Engine, EngineStopped, Generation, QueueFull
from attnkit.serve.forward import use_fused_kernel
from attnkit.serve.params import (
    ApiError,
    is_int,
    logprobs_json,
    sampling_of,
    scoring_of,
    stops_of,
)
from attnkit.serve.text import TextStream, token_bytes, token_label

__all__ = ["ApiError", "create_app", "metrics_text"]

_log = logging.getLogger("attnkit")


# The chat roles, as the chat template spells them: OpenAI's "developer" messages are what its
# older API called "system" (the instructions), and templates know only the older name.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
TOOLS = ("tool", "function")


def create_app(llm: Any, engine: Engine, *, model_name: str, shutdown_timeout: float = 30.0) -> Any:
    """The FastAPI application. ``llm`` gives ``encode``, ``decode``, ``chat_prompt``,
    ``tokenizer`` and ``eos_id`` (a ``PretrainedLlama``); ``engine`` runs its model. The
    engine's thread starts with the application and stops with it (finishing what runs for up
    to ``shutdown_timeout`` seconds)."""
    try:
        from fastapi import FastAPI, Request
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
        from starlette.exceptions import HTTPException
    except ImportError as err:
        raise ImportError(
            "attnkit serve needs FastAPI and uvicorn: pip install 'attnkit[serve]'", name=err.name
        ) from err

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        reason = await asyncio.to_thread(use_fused_kernel)  # the cached build only
        if reason is not None:
            _log.info("attnkit serve: paged attention takes the reference: %s", reason)
        if not engine.started:
            engine.start()
        yield
        await asyncio.to_thread(engine.stop, shutdown_timeout)

    app = FastAPI(title="attnkit serve", lifespan=lifespan)
    created = int(time.time())
    rejected = {"queue_full": 0, "shutting_down": 0, "bad_request": 0}
    spelled: dict[int, tuple[str, list[int]]] = {}

    def token_of(token_id: int) -> tuple[str, list[int]]:
        """A token's label and its bytes (for log-probabilities), looked up once."""
        if token_id not in spelled:
            raw = token_bytes(llm.tokenizer, token_id)
            spelled[token_id] = (token_label(raw), list(raw))
        return spelled[token_id]

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Any:
        if exc.status == 400:
            rejected["bad_request"] += 1
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Any:
        """A path or method the server does not serve, in OpenAI's error shape too (FastAPI
        answers ``{"detail": ...}``, which OpenAI clients show as an unexplained body)."""
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message, code = f"no such endpoint: {where} (see GET /v1/models)", "not_found"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"{where}: the method is not allowed here (allowed: {allowed})"
            code = "method_not_allowed"
        else:
            message, code = f"{where}: {exc.detail}", ""
        error = ApiError(exc.status_code, message, code=code)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Any:
        return await api_error(request, ApiError(400, f"invalid request: {exc.errors()[:3]}"))

    @app.get("/health")
    async def health() -> Any:
        if not engine.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> Any:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "attnkit"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Any:
        return PlainTextResponse(
            metrics_text(engine, rejected), media_type="text/plain; version=0.0.4"
        )

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as err:
            raise ApiError(400, f"the request body is not valid JSON: {err}") from err
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != model_name:
            raise ApiError(
                400,
                f"unknown model {model!r}: this server runs {model_name!r}",
                "model",
                "model_not_found",
            )
        if body.get("n", 1) != 1:
            raise ApiError(400, "n must be 1: one choice per request", "n")
        return body

    def start(
        prompt: list[int], body: Mapping[str, Any], default_max: int | None
    ) -> tuple[Generation, asyncio.Queue]:
        room = engine.max_len - len(prompt)
        if room < 1:
            raise ApiError(
                400,
                f"the prompt has {len(prompt)} tokens; the model's context is {engine.max_len}",
                "messages" if "messages" in body else "prompt",
                "context_length_exceeded",
            )
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = min(default_max or room, room) if max_tokens is None else max_tokens
        if not is_int(max_tokens) or not 1 <= max_tokens <= room:
            raise ApiError(
                400,
                f"max_tokens must be an int in 1..{room} (the context of {engine.max_len} less "
                f"the prompt's {len(prompt)} tokens), got {max_tokens!r}",
                "max_tokens",
            )
        sampling = sampling_of(body)
        scoring = scoring_of(body, engine.model.config.vocab_size, chat="messages" in body)
        seed = body.get("seed")
        if seed is not None and not is_int(seed):
            raise ApiError(400, f"seed must be an integer, got {seed!r}", "seed")
        ignore_eos = body.get("ignore_eos", False)  # vLLM's extension, for benchmarks
        if not isinstance(ignore_eos, bool):
            raise ApiError(
                400, f"ignore_eos must be true or false, got {ignore_eos!r}", "ignore_eos"
            )
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def on_event(token: int | None, reason: str | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody listens
                loop.call_soon_threadsafe(events.put_nowait, (token, reason))

        try:
            gen = engine.submit(
                prompt,
                max_tokens,
                sampling,
                seed=seed,
                ignore_eos=ignore_eos,
                on_event=on_event,
                scoring=scoring,
            )
        except QueueFull as err:
            rejected["queue_full"] += 1
            raise ApiError(429, f"the server is busy: {err}; retry later") from err
        except EngineStopped as err:
            rejected["shutting_down"] += 1
            raise ApiError(503, str(err), code="service_unavailable") from err
        except ValueError as err:
            raise ApiError(400, str(err)) from err
        return gen, events

    async def pieces(
        gen: Generation, events: asyncio.Queue, stops: list[str], request: Request | None
    ) -> AsyncIterator[tuple[str, str | None, int]]:
        """``(text, None, n)`` as it comes, then ``("", finish_reason, n)``; ``n``: how many of
        the generated tokens the text so far covers (every one but an end-of-sequence token:
        the tokens whose log-probabilities go with it). Cancels ``gen`` if the consumer stops
        early (a client gone) or a stop string ends it."""
        eos = None if gen.ignore_eos else llm.eos_id
        text = TextStream(llm.tokenizer, stops, eos)
        covered = 0
        done, loop = False, asyncio.get_running_loop()
        checked = loop.time()
        try:
            while True:
                if request is None:  # a stream: a client that leaves ends the generator
                    token, reason = await events.get()
                else:
                    try:
                        token, reason = await asyncio.wait_for(events.get(), 1.0)
                    except TimeoutError:
                        token = reason = None
                # A request answered at the end has no stream to fail on: ask, once a second,
                # whether its client is still there.
                if request is not None and loop.time() - checked >= 1.0:
                    checked = loop.time()
                    if await request.is_disconnected():
                        return
                if token is None and reason is None:
                    continue
                if token is not None:
                    covered += token != eos
                    piece, stopped = text.push(token)
                    if piece:
                        yield piece, None, covered
                    if stopped:
                        done = True
                        yield "", "stop", covered
                        return
                    continue
                done = True
                if reason == "error":
                    raise ApiError(500, "the generation failed on the server")
                tail = text.flush()
                if tail:
                    yield tail, None, covered
                yield "", reason, covered
                return
        finally:
            if not done or not gen.finish_reason:
                engine.cancel(gen)

    def usage(gen: Generation) -> dict[str, int]:
        n = len(gen.generated)
        return {
            "prompt_tokens": gen.prompt_len,
            "completion_tokens": n,
            "total_tokens": gen.prompt_len + n,
        }

    async def respond(
        request: Request,
        body: dict[str, Any],
        prompt: list[int],
        chat: bool,
        default_max: int | None,
    ) -> Any:
        stops = stops_of(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, f"stream must be true or false, got {stream!r}", "stream")
        options = body.get("stream_options") or {}
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        gen, events = start(prompt, body, default_max)
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": ident, "created": int(time.time()), "model": model_name}
        # Log-probabilities, when asked for: of the tokens [start, end) of the generation.
        offsets: list[int] = []  # each covered token's place in the text (legacy completions)
        sent = [0, 0]  # tokens given out, characters given out

        def logprobs(end: int, text_before: int) -> dict[str, Any] | None:
            if gen.scoring.logprobs is None:
                return None
            start = sent[0]
            while len(offsets) < end:  # the tokens of this piece begin where the text was
                offsets.append(text_before)
            sent[0] = end
            return logprobs_json(gen, start, end, chat, offsets, token_of)

        if not stream:
            parts, reason, covered = [], None, 0
            async for piece, finish, covered in pieces(gen, events, stops, request):
                while len(offsets) < covered:
                    offsets.append(sum(map(len, parts)))
                parts.append(piece)
                reason = finish or reason
            text = "".join(parts)
            scores = logprobs(covered, len(text))
            if chat:
                choice = {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": scores,
                    "finish_reason": reason,
                }
            else:
                choice = {"index": 0, "text": text, "logprobs": scores, "finish_reason": reason}
            kind = "chat.completion" if chat else "text_completion"
            return {**head, "object": kind, "choices": [choice], "usage": usage(gen)}

        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(piece: str, reason: str | None, covered: int = 0, first: bool = False) -> str:
            # a chunk without tokens of its own (the first, the last) carries none
            scores = None if first or covered == sent[0] else logprobs(covered, sent[1])
            sent[1] += len(piece)
            if chat:
                delta = (
                    {"role": "assistant", "content": piece}
                    if first
                    else ({"content": piece} if piece or reason is None else {})
                )
                choice = {"index": 0, "delta": delta, "logprobs": scores, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": piece, "logprobs": scores, "finish_reason": reason}
            return f"data: {json.dumps({**head, 'object': kind, 'choices': [choice]})}\n\n"

        async def events_out() -> AsyncIterator[str]:
            if chat:
                yield chunk("", None, first=True)
            try:
                async for piece, reason, covered in pieces(gen, events, stops, None):
                    yield chunk(piece, reason, covered)
            except ApiError as err:
                yield f"data: {json.dumps(err.body())}\n\n"
                return
            if include_usage:
                last = {**head, "object": kind, "choices": [], "usage": usage(gen)}
                yield f"data: {json.dumps(last)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events_out(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await body_of(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(
                400, "messages must be a non-empty list of {role, content} objects", "messages"
            )
        clean = []
        for k, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # content parts: only text is understood
                if not all(
                    isinstance(p, dict)
                    and p.get("type") == "text"
                    and isinstance(p.get("text"), str)
                    for p in content
                ):
                    raise ApiError(
                        400, f"messages[{k}].content: only text parts are supported", "messages"
                    )
                content = "".join(p["text"] for p in content)
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(content, str)
            ):
                raise ApiError(
                    400,
                    f"messages[{k}] must be an object with a string role and content",
                    "messages",
                )
            role = ROLES.get(m["role"])
            if role is None:
                raise ApiError(
                    400,
                    f"messages[{k}].role must be system, developer, user or assistant, got "
                    f"{m['role']!r}" + (" (tools are not supported)" if m["role"] in TOOLS else ""),
                    "messages",
                )
            clean.append({"role": role, "content": content})
        prompt = llm.encode(llm.chat_prompt(clean))
        return await respond(request, body, prompt, chat=True, default_max=None)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await body_of(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = llm.encode(prompt)
        elif isinstance(prompt, list) and all(is_int(t) for t in prompt):
            ids = list(prompt)
        else:
            raise ApiError(
                400,
                "prompt must be a string or a list of token ids (one prompt per request)",
                "prompt",
            )
        if not ids:
            raise ApiError(400, "the prompt is empty: give at least one token of text", "prompt")
        return await respond(request, body, ids, chat=False, default_max=16)  # OpenAI's default

    return app


def metrics_text(engine: Engine, rejected: Mapping[str, int]) -> str:
    """The engine's counters and gauges in Prometheus' text exposition format."""
    c, g = engine.counters, engine.gauges
    rows = [
        ("requests_total", "counter", "requests accepted", c["requests"]),
        (
            "prompt_tokens_total",
            "counter",
            "prompt tokens of accepted requests",
            c["prompt_tokens"],
        ),
        ("generation_tokens_total", "counter", "tokens generated", c["generated_tokens"]),
        (
            "prefill_tokens_total",
            "counter",
            "prompt tokens computed (prefix-cache hits excluded)",
            c["prefill_tokens"],
        ),
        (
            "prefix_cache_hit_tokens_total",
            "counter",
            "prompt tokens taken from the prefix cache",
            g["prefix_hit_tokens"],
        ),
        ("prefix_cache_evictions_total", "counter", "cached blocks evicted", g["prefix_evictions"]),
        ("preemptions_total", "counter", "sequences preempted for KV blocks", c["preemptions"]),
        (
            "cancelled_total",
            "counter",
            "sequences cancelled (client gone, shutdown)",
            c["cancelled"],
        ),
        ("engine_errors_total", "counter", "engine steps that failed", c["errors"]),
        ("queue_length", "gauge", "requests waiting", g["waiting"]),
        ("running_sequences", "gauge", "sequences in the running batch", g["running"]),
        ("kv_blocks_total", "gauge", "KV blocks in the pool", engine.pool.num_blocks),
        ("kv_blocks_used", "gauge", "KV blocks held by sequences", g["blocks_used"]),
        ("kv_blocks_free", "gauge", "KV blocks on the free list", g["blocks_free"]),
        (
            "kv_blocks_cached",
            "gauge",
            "KV blocks held only by the prefix cache",
            g["blocks_cached"],
        ),
    ]
    lines = []
    for name, kind, text, value in rows:
        lines += [
            f"# HELP attnkit_{name} {text}",
            f"# TYPE attnkit_{name} {kind}",
            f"attnkit_{name} {value}",
        ]
    lines += [
        "# HELP attnkit_requests_rejected_total requests refused",
        "# TYPE attnkit_requests_rejected_total counter",
    ]
    lines += [f'attnkit_requests_rejected_total{{reason="{k}"}} {v}' for k, v in rejected.items()]
    return "\n".join(lines) + "\n"
