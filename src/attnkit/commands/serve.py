"""``attnkit serve``: an OpenAI-compatible HTTP server for a Llama model.

The bundled SmolLM2-135M-Instruct unless ``--model`` names a ``.gguf`` file or a Hugging Face
Llama directory. Requests are batched continuously over a paged KV cache with prefix caching
(``attnkit.serve``). Binds 127.0.0.1 unless ``--host`` says otherwise: a server reachable from
the network is a choice, not a default. SIGTERM (or Ctrl-C) stops accepting connections, lets
what runs finish for up to ``--shutdown-timeout`` seconds, cancels the rest, and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from attnkit.commands.train import PATH, THREADS


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a Llama model over an OpenAI-compatible HTTP API",
        description="Serve the bundled SmolLM2-135M-Instruct (or --model) at /v1/chat/completions "
        "and /v1/completions (streaming or not), /v1/models, /health and /metrics, with "
        "continuous batching, a paged KV cache and prefix caching. Point the openai client at "
        "http://HOST:PORT/v1.",
    )
    p.add_argument("--model", type=PATH, default=None, help="a .gguf file or a Llama directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: a free one)")
    p.add_argument("--max-batch", type=int, default=16, help="sequences decoded together")
    p.add_argument("--kv-blocks", type=int, default=512, help="KV cache blocks (default 512)")
    p.add_argument("--block-size", type=int, default=16, help="positions per KV block")
    p.add_argument("--max-waiting", type=int, default=64, help="queued requests before 429")
    p.add_argument(
        "--chunk-tokens",
        type=int,
        default=256,
        help="tokens computed per step (beside decoding streams, a prompt's "
        "later tokens count for more: their attention reads more keys)",
    )
    p.add_argument("--no-prefix-cache", action="store_true", help="do not share prompt prefixes")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to finish")
    p.add_argument("--threads", type=THREADS, default=None, help="threads of the model's steps")
    p.add_argument(
        "--kv-dtype",
        default="float16",
        help="how the KV cache stores keys and values: float16 (default), bfloat16 or float32 "
        "(twice the memory per position, and twice the bytes a step reads)",
    )
    p.add_argument(
        "--build-kernel",
        action="store_true",
        help="compile attnkit's C++ kernels before loading the model if no build is cached "
        "(about a minute, once per machine); without it the server uses a cached build or "
        "the slower reference paths",
    )
    p.set_defaults(func=run)


def build_kernel() -> str | None:
    """Compile the fused C++ module now if no verified build is cached (asked for by
    ``--build-kernel``): the quantised products, decode and paged attention then run compiled.
    Returns why it could not be built, or None."""
    from attnkit.backends.fused import jit

    try:
        jit.build()
    except jit.NotBuilt as reason:
        return str(reason)
    return None


def load_model(path: Path | None) -> Any:
    """The model to serve (tests replace this seam)."""
    from attnkit.models.llama import load_pretrained

    return load_pretrained(path)


MAX_POSITIONS = 2**24  # KV positions: far past any machine's memory for a real model


def check_pool_fits(args: argparse.Namespace, config: Any) -> None:
    """The KV pool --kv-blocks asks for, against this machine's memory, before it is allocated."""
    import torch

    itemsize = torch.empty(0, dtype=getattr(torch, args.kv_dtype)).element_size()
    per_position = 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize
    need = args.kv_blocks * args.block_size * per_position
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > memory:
        raise ValueError(
            f"--kv-blocks {args.kv_blocks} x --block-size {args.block_size} needs "
            f"{need / 2**30:.1f} GiB of KV cache ({per_position:,} bytes a position), more than "
            f"this machine's {memory / 2**30:.1f} GiB"
        )


def check(args: argparse.Namespace) -> None:
    """Every argument, before the model loads."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    for name in ("max_batch", "kv_blocks", "block_size", "chunk_tokens", "threads"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number, got {value}")
    if args.max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if args.chunk_tokens < args.max_batch:
        raise ValueError(
            f"--chunk-tokens ({args.chunk_tokens}) must be at least --max-batch "
            f"({args.max_batch}): each running sequence decodes one token per step"
        )
    if args.kv_dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"--kv-dtype must be float32, float16 or bfloat16, got {args.kv_dtype!r}")
    if not 0 <= args.shutdown_timeout <= 86400:  # NaN fails too
        raise ValueError(
            f"--shutdown-timeout must be 0 to 86400 seconds, got {args.shutdown_timeout}"
        )
    if args.kv_blocks * args.block_size > MAX_POSITIONS:
        raise ValueError(
            f"--kv-blocks x --block-size = {args.kv_blocks * args.block_size:,} positions; at most "
            f"{MAX_POSITIONS:,}"
        )
    if args.model is not None and not args.model.exists():
        raise FileNotFoundError(f"model {str(args.model)!r} does not exist")


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not yet listening): an address that does not resolve,
    is not this machine's or is taken fails here, in one line, before the model loads."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as err:  # UnicodeError: not a valid host name
        reason = err.strerror if isinstance(err, socket.gaierror) else "not a valid host name"
        message = f"--host {host!r} does not resolve to an address: {reason}"
        raise ValueError(message) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise ValueError(f"cannot serve at {host}:{port}: {err.strerror}") from None
    return sock


def run(args: argparse.Namespace) -> int:
    check(args)
    sock = bind(args.host, args.port)
    try:
        return _serve(args, sock)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, sock: socket.socket) -> int:
    import torch
    import uvicorn

    # The engine's thread computes with the threads asked for; this thread (the event loop)
    # stays at one, before anything here computes: two threads that compute in parallel keep
    # two pools of OpenMP threads, more than the cores, and then the steps' threads sleep
    # between the step's parallel regions instead of waiting awake.
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(1)
    from attnkit.serve.app import create_app
    from attnkit.serve.engine import Engine

    if args.build_kernel:
        reason = build_kernel()  # before the model: its quantised layers look the kernel up
        if reason is not None:
            print(f"attnkit serve: the C++ kernel was not built ({reason}); serving on the "
                  "reference paths", file=sys.stderr)  # fmt: skip
    llm = load_model(args.model)
    check_pool_fits(args, llm.model.config)
    engine = Engine(
        llm.model,
        num_blocks=args.kv_blocks,
        block_size=args.block_size,
        max_batch=args.max_batch,
        max_waiting=args.max_waiting,
        chunk_tokens=args.chunk_tokens,
        prefix_caching=not args.no_prefix_cache,
        eos_id=llm.eos_id,
        threads=threads,
        kv_dtype=getattr(torch, args.kv_dtype),
    )
    name = Path(llm.path).stem if getattr(llm, "path", None) else "attnkit"
    app = create_app(llm, engine, model_name=name, shutdown_timeout=args.shutdown_timeout)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="info",
        timeout_graceful_shutdown=max(1, round(args.shutdown_timeout)),
    )
    # uvicorn handles SIGTERM and SIGINT (Ctrl-C: stop accepting, drain, shut the application
    # down) and then raises the signal again under the handler that was there before: a quiet
    # one, so the process ends with 0 after a clean shutdown instead of dying by the signal
    # (or, for Ctrl-C, reporting an interruption). Set only now: Ctrl-C while the model loads
    # still interrupts.
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, lambda signum, frame: None)
    # What loading made (torch, the model, the tokenizer, the application: about 200,000
    # objects) lives as long as the server: the cyclic garbage collector leaves it alone from
    # now on, so its collections during serving walk the requests' objects only.
    gc.freeze()
    host, port = sock.getsockname()[:2]
    where = f"[{host}]" if ":" in host else host
    print(f"attnkit serve: {name} at http://{where}:{port}/v1 (Ctrl-C or SIGTERM stops it)",
          file=sys.stderr)  # fmt: skip
    uvicorn.Server(config).run(sockets=[sock])
    return 0
