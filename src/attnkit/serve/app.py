"""The OpenAI-compatible HTTP API over an ``Engine``: chat and text completions, models, health,
Prometheus metrics.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed as server-sent
events with ``"stream": true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``. The
request and response bodies follow OpenAI's API reference, so the ``openai`` client works
unchanged (``base_url="http://127.0.0.1:8000/v1"``).

Errors are OpenAI's JSON, ``{"error": {"message", "type", "param", "code"}}``: 400 for a request
that can never succeed (unknown model, empty messages, ``max_tokens`` < 1 or past the context,
a prompt longer than the context, ``temperature`` outside 0..2, ``top_p`` outside (0, 1]),
413 for a body over 8 MiB (``params.MAX_BODY_BYTES``), 429 when the waiting queue is full, 503
while shutting down. A client's mistake is never a 500.

Each request's tokens come from the engine's thread as events, handed to the event loop a step
at a time (one ``call_soon_threadsafe`` after each engine step). When the client goes away (a
stream closed, a request dropped), its sequence is cancelled and its KV blocks return to the
pool at the engine's next step.

At start the application loads the compiled paged-attention kernel if a verified build is
cached (``attnkit kernels build`` makes one; nothing is compiled here), and the engine's steps
take it (``attnkit.serve.forward``); otherwise they take the reference and the log says why.
"""

# No ``from __future__ import annotations``: FastAPI reads the handlers' annotations at runtime,
# and ``Request`` is imported inside ``create_app`` (FastAPI is an optional dependency).
import asyncio
import collections
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
    Scores,
    include_usage_of,
    is_int,
    json_object,
    sampling_of,
    scoring_of,
    stops_of,
)
from attnkit.serve.text import TextStream, token_label

__all__ = ["ApiError", "create_app", "metrics_text"]

_log = logging.getLogger("attnkit")


MAX_CHOICES = 16  # n: choices per request, at most


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

    # The engine's events wait in ``outbox`` and reach the requests' queues on the event loop,
    # a step's worth at a time: the engine wakes the loop once after each step (``flush``), or
    # at once for a request's last event. Waking the loop for every token had it take the GIL
    # back and forth with the engine's thread eight times a step with eight clients.
    outbox: collections.deque = collections.deque()  # (queue, (token, reason)), in order
    loop: asyncio.AbstractEventLoop | None = None
    pending = False  # a ``deliver`` is scheduled and has not begun

    def deliver() -> None:  # on the event loop
        nonlocal pending
        pending = False
        while outbox:
            events, item = outbox.popleft()
            events.put_nowait(item)

    def flush() -> None:  # any thread
        nonlocal pending
        if outbox and loop is not None and not pending:
            pending = True
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody listens
                loop.call_soon_threadsafe(deliver)

    def attach() -> None:  # on the event loop: at start, or at the first request without one
        nonlocal loop
        if loop is None:
            loop = asyncio.get_running_loop()
            engine.after_step.append(flush)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        nonlocal loop
        attach()
        reason = await asyncio.to_thread(use_fused_kernel)  # the cached build only
        if reason is not None:
            _log.info("attnkit serve: paged attention takes the reference: %s", reason)
        if not engine.started:
            engine.start()
        yield
        await asyncio.to_thread(engine.stop, shutdown_timeout)
        engine.after_step.remove(flush)
        loop = None

    app = FastAPI(title="attnkit serve", lifespan=lifespan)
    created = int(time.time())
    rejected = {"queue_full": 0, "shutting_down": 0, "bad_request": 0}
    spelled: dict[int, tuple[str, list[int]]] = {}

    def token_of(token_id: int) -> tuple[str, list[int]]:
        """A token's label and its bytes (for log-probabilities), looked up once."""
        if token_id not in spelled:
            raw = llm.tokenizer.token_bytes(token_id)
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
        body = await json_object(request)
        model = body.get("model")
        if model is not None and model != model_name:
            raise ApiError(
                400,
                f"unknown model {model!r}: this server runs {model_name!r}",
                "model",
                "model_not_found",
            )
        n = body.get("n", 1)
        if n is not None and (not is_int(n) or not 1 <= n <= MAX_CHOICES):
            raise ApiError(400, f"n must be an int in 1..{MAX_CHOICES}, got {n!r}", "n")
        return body

    def start(
        prompt: list[int], body: Mapping[str, Any], default_max: int | None
    ) -> list[tuple[Generation, asyncio.Queue]]:
        """The request's ``n`` choices submitted, each with the queue its events come to (all
        or none: a choice the engine refuses cancels the ones before it)."""
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
        if seed is not None and (not is_int(seed) or not -(2**63) <= seed < 2**63):
            raise ApiError(
                400, f"seed must be a 64-bit integer (-2**63 to 2**63 - 1), got {seed!r}", "seed"
            )
        ignore_eos = body.get("ignore_eos", False)  # vLLM's extension, for benchmarks
        if not isinstance(ignore_eos, bool):
            raise ApiError(
                400, f"ignore_eos must be true or false, got {ignore_eos!r}", "ignore_eos"
            )
        attach()
        choices: list[tuple[Generation, asyncio.Queue]] = []

        def listener(events: asyncio.Queue) -> Any:
            def on_event(token: int | None, reason: str | None) -> None:
                outbox.append((events, (token, reason)))
                if reason is not None:  # the last event: it may come outside a step
                    flush()

            return on_event

        try:
            for i in range(body.get("n") or 1):
                events: asyncio.Queue = asyncio.Queue()
                gen = engine.submit(
                    prompt,
                    max_tokens,
                    sampling,
                    seed=None if seed is None else seed + i,  # choice i: its own draws
                    ignore_eos=ignore_eos,
                    on_event=listener(events),
                    scoring=scoring,
                )
                choices.append((gen, events))
        except (QueueFull, EngineStopped, ValueError) as err:
            for gen, _ in choices:
                engine.cancel(gen)
            if isinstance(err, QueueFull):
                rejected["queue_full"] += 1
                raise ApiError(429, f"the server is busy: {err}; retry later") from err
            if isinstance(err, EngineStopped):
                rejected["shutting_down"] += 1
                raise ApiError(503, str(err), code="service_unavailable") from err
            raise ApiError(400, str(err)) from err
        return choices

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

    def usage(gens: list[Generation]) -> dict[str, int]:
        """The prompt once, the tokens of every choice."""
        n = sum(len(gen.generated) for gen in gens)
        prompt = gens[0].prompt_len
        return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}

    async def respond(
        request: Request,
        body: dict[str, Any],
        prompt: list[int],
        chat: bool,
        default_max: int | None,
        echo: str = "",
    ) -> Any:
        """``echo``: text each choice's answer begins with (text completions' ``echo``)."""
        stops = stops_of(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, f"stream must be true or false, got {stream!r}", "stream")
        include_usage = include_usage_of(body)
        choices = start(prompt, body, default_max)
        gens = [gen for gen, _ in choices]
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": ident, "created": int(time.time()), "model": model_name}
        kind = "chat.completion" if chat else "text_completion"
        scores = [Scores(gen, chat, token_of) for gen in gens]

        if not stream:

            async def whole(index: int) -> dict[str, Any]:
                gen, events = choices[index]
                parts, reason, covered = [], None, 0
                async for piece, finish, covered in pieces(gen, events, stops, request):
                    scores[index].reach(covered, sum(map(len, parts)))
                    parts.append(piece)
                    reason = finish or reason
                text = "".join(parts)
                logprobs = scores[index].take(covered, len(text))
                text = echo + text
                if chat:
                    message = {"role": "assistant", "content": text}
                    return {"index": index, "message": message, "logprobs": logprobs,
                            "finish_reason": reason}  # fmt: skip
                return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

            tasks = [asyncio.create_task(whole(i)) for i in range(len(choices))]
            try:
                answers = await asyncio.gather(*tasks)
            finally:  # one choice failed, or the client went away: every choice ends
                for task in tasks:
                    task.cancel()
                for gen in gens:
                    if not gen.finish_reason:
                        engine.cancel(gen)
            return {**head, "object": kind, "choices": answers, "usage": usage(gens)}

        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(index: int, piece: str, reason: str | None, covered: int = 0,
                  first: bool = False) -> str:  # fmt: skip
            # a chunk without tokens of its own (the first, the last) carries none
            logprobs = None if first else scores[index].streamed(covered, len(piece))
            if chat:
                delta = (
                    {"role": "assistant", "content": piece}
                    if first
                    else ({"content": piece} if piece or reason is None else {})
                )
                choice = {"index": index, "delta": delta, "logprobs": logprobs,
                          "finish_reason": reason}  # fmt: skip
            else:
                choice = {"index": index, "text": piece, "logprobs": logprobs,
                          "finish_reason": reason}  # fmt: skip
            return f"data: {json.dumps({**head, 'object': kind, 'choices': [choice]})}\n\n"

        async def one() -> AsyncIterator[str]:
            """The single choice's chunks, straight out."""
            gen, events = choices[0]
            async for piece, reason, covered in pieces(gen, events, stops, None):
                yield chunk(0, piece, reason, covered)

        async def many() -> AsyncIterator[str]:
            """Every choice's chunks through one queue, in the order their events come."""
            out: asyncio.Queue = asyncio.Queue()

            async def feed(index: int) -> None:
                gen, events = choices[index]
                try:
                    async for piece, reason, covered in pieces(gen, events, stops, None):
                        out.put_nowait(chunk(index, piece, reason, covered))
                except ApiError as err:
                    out.put_nowait(err)
                out.put_nowait(None)

            feeders = [asyncio.create_task(feed(i)) for i in range(len(choices))]
            try:
                running = len(feeders)
                while running:
                    item = await out.get()
                    if isinstance(item, ApiError):
                        raise item
                    if item is None:
                        running -= 1
                    else:
                        yield item
            finally:
                for task in feeders:
                    task.cancel()

        async def events_out() -> AsyncIterator[str]:
            if chat or echo:  # chat: the role first; echo: the prompt's text first
                for index in range(len(choices)):
                    yield chunk(index, echo, None, first=True)
            try:
                async for line in one() if len(choices) == 1 else many():
                    yield line
                if include_usage:
                    last = {**head, "object": kind, "choices": [], "usage": usage(gens)}
                    yield f"data: {json.dumps(last)}\n\n"
                yield "data: [DONE]\n\n"
            except ApiError as err:
                yield f"data: {json.dumps(err.body())}\n\n"
            finally:  # the client gone (or an error): every choice stops
                for gen in gens:
                    if not gen.finish_reason:
                        engine.cancel(gen)

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
        # Rendering and tokenising take a thread: on the event loop a long text would stall
        # every stream for as long as it takes.
        prompt = await asyncio.to_thread(lambda: llm.encode(llm.chat_prompt(clean)))
        return await respond(request, body, prompt, chat=True, default_max=None)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await body_of(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = await asyncio.to_thread(llm.encode, prompt)  # off the event loop, as in chat
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
        echo = ""  # the prompt's text before the answer, if asked for
        if body.get("echo"):
            echo = prompt if isinstance(prompt, str) else llm.decode(ids)
        # max_tokens: OpenAI's default of 16
        return await respond(request, body, ids, chat=False, default_max=16, echo=echo)

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
