"""``attnkit serve`` under load: throughput, time to first token, inter-token latency, and the
prefix cache, beside llama.cpp's server when it is installed.

The server runs in its own process (``python -m attnkit.cli serve --build-kernel``, the bundled
SmolLM2-135M-Instruct kept quantised, ``--threads`` torch threads; the kernel is compiled first
if the cache has none); the clients are one asyncio loop of this process, one HTTP/1.1
connection each, that send their ``/v1/completions`` requests at the same moment, read the
server-sent events and time each one. It reports:

1. load: for 1, 4, 8 and 16 concurrent clients, each streaming ``--new`` tokens (128) after a
   prompt of ``--prompt`` tokens (64; the text of random token ids, a different prompt per
   request so that the prefix cache does not help), greedy, ``ignore_eos`` so every request
   runs to its length: aggregate tokens/s (all tokens over the wall time of a round; the
   median of ``--repeats`` (3) rounds, the loads interleaved round after round, new prompts in
   every round), aggregate decode tokens/s two ways (``decode_rate``: the tokens after each
   request's first over the time some request was decoding, so prompts computed in steps in
   which others already decode count against it; ``all_decoding_rate``: the texts in the
   window in which every request decodes, after all prompts and before any stream ends),
   time to first token and inter-token latency (p50 and p99 over every request and gap
   between two text events of those rounds: an event carries one token, or the few a
   character spans), and the speed-ups over one client;
2. prefix cache: time to first token (one new token) of a request whose ``--system`` (1,000)
   token system prompt is already cached, against the same request with a system prompt never
   seen (medians over ``--rounds`` requests);
3. llama.cpp: the same load grid against ``python -m llama_cpp.server`` on the same GGUF with
   the same threads, when ``llama_cpp.server`` imports (``make bench-peers`` installs it).
   It does not take ``ignore_eos``: a ``logit_bias`` of -100 on the end-of-sequence token does
   the same. It serves one request at a time (no batching across requests): with
   ``--interrupt_requests False`` the others wait their turn (by default a new request cuts
   off the stream that runs).

    PYTHONPATH=src python benchmarks/serve.py              # the tables, docs/benchmarks.md
    PYTHONPATH=src python benchmarks/serve.py --quick      # a tiny grid, print only
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _report, when run from anywhere
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's attnkit

import requests
from _report import (
    CHARTS,
    cpu,
    environment,
    port_number,
    positive_int,
    thread_count,
    write_chart,
    write_section,
)

EOS = 2  # SmolLM2's <|im_end|>


@dataclass
class Timing:
    """One streamed request: seconds to the first text and between texts (a text event holds
    one token, or a few when a character spans tokens), the tokens generated."""

    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    first: float = 0.0  # perf_counter() at the first and the last text
    last: float = 0.0
    times: list[float] = field(default_factory=list)  # perf_counter() at every text


def decode_rate(timings: Sequence[Timing]) -> float:
    """Aggregate decode tokens/s: every token after each request's first, over the time in
    which some request was decoding (the union of the intervals from a request's first text
    to its last). A server that decodes several streams at once packs more tokens into that
    time; one that serves one request at a time gets its single-stream rate however many
    clients wait (their waits are not decoding time)."""
    spans = sorted((t.first, t.last) for t in timings if t.last > t.first)
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    tokens = sum(t.tokens - 1 for t in timings if t.last > t.first)
    return tokens / busy if busy > 0 else float("nan")


def all_decoding_rate(timings: Sequence[Timing]) -> float:
    """Aggregate decode tokens/s while every stream decodes: the texts that arrive between the
    last stream's first text and the first stream's last text, over that window (every prompt
    has been computed by then, and no stream has ended yet). With one stream it is that
    stream's decode rate. A text is one token, or the few a character spans (then this counts
    one: a slight undercount). NaN when there is no such window: a server that serves one
    request at a time never decodes its streams together."""
    lo = max(t.first for t in timings)
    hi = min(t.last for t in timings)
    if hi <= lo:
        return float("nan")
    texts = sum(1 for t in timings for at in t.times if lo < at <= hi)
    return texts / (hi - lo)


@functools.cache
def _tokenizer():
    from attnkit.models.llama import bundled_model_path, load_pretrained

    return load_pretrained(bundled_model_path()).tokenizer


def text_of(rng: random.Random, n: int) -> str:
    """Text of exactly ``n`` SmolLM2 tokens, from random ids (llama.cpp's server takes prompts
    as text only, so both servers get the same text)."""
    tok = _tokenizer()
    while True:
        ids = tok.encode(tok.decode([rng.randrange(1_000, 20_000) for _ in range(n + 8)]))
        if len(ids) >= n:
            text = tok.decode(ids[:n])
            if len(tok.encode(text)) == n:
                return text


async def _stream(url: str, body: dict, connection: tuple) -> Timing:
    """Send one ``/v1/completions`` request on an open HTTP/1.1 connection and time each text
    event of its stream."""
    reader, writer = connection
    try:
        payload = json.dumps(body).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {urlsplit(url).netloc}\r\n"
            "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        )
        timing, start, last = Timing(), time.perf_counter(), None
        writer.write(head.encode() + payload)
        status = (await reader.readline()).decode("latin-1").strip()
        chunked = False
        while (header := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = header.decode("latin-1").partition(":")
            if name.strip().lower() == "transfer-encoding":
                chunked = "chunked" in value.lower()
        if status.split(" ")[1:2] != ["200"]:
            error = (await reader.read()).decode(errors="replace")[:500]
            raise RuntimeError(f"{url} answered {status!r}: {error}")
        pending = b""
        async for piece in _body(reader, chunked):
            pending += piece
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if not event.get("choices"):
                    continue
                reason = event["choices"][0].get("finish_reason")
                if reason is not None:
                    # Every request runs to its length (the end-of-sequence token is ignored or
                    # banned), so it generated max_tokens tokens.
                    if reason != "length":
                        raise RuntimeError(f"a request ended by {reason!r}, not by its length")
                    timing.tokens = body["max_tokens"]
                    continue
                now = time.perf_counter()
                timing.times.append(now)
                if last is None:
                    timing.ttft, timing.first = now - start, now
                else:
                    timing.gaps.append(now - last)
                last = timing.last = now
        if not timing.tokens:
            raise RuntimeError(f"{url}'s stream ended without a finish_reason")
        return timing
    finally:
        writer.close()


async def _body(reader: asyncio.StreamReader, chunked: bool):
    """The bytes of a response body: chunk by chunk (``Transfer-Encoding: chunked``), or as
    they come until the server closes the connection."""
    if not chunked:
        while piece := await reader.read(65536):
            yield piece
        return
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            return
        yield (await reader.readexactly(size + 2))[:-2]  # the data, then CRLF


async def _streams(url: str, bodies: Sequence[dict]) -> list[Timing]:
    where = urlsplit(url)
    # Every connection first; then each task sends its request before any waits for an
    # answer, so the requests leave together.
    opened = [asyncio.open_connection(where.hostname, where.port) for _ in bodies]
    connections = await asyncio.gather(*opened)
    runs = [_stream(url, b, c) for b, c in zip(bodies, connections, strict=True)]
    return list(await asyncio.gather(*runs))


def streams(url: str, prompts: Sequence[str], new: int, extra: dict) -> list[Timing]:
    """Stream one request per prompt, all sent at the same moment, each on its own connection.

    The clients are one asyncio loop of this process: threads that each build a request
    take CPU from the two cores the server computes on, so while the first request is being
    computed the others would trickle in over tens of milliseconds."""
    bodies = [
        {"prompt": p, "max_tokens": new, "temperature": 0, "stream": True, **extra} for p in prompts
    ]
    return asyncio.run(_streams(url, bodies))


def stream(url: str, prompt: str, new: int, extra: dict) -> Timing:
    return streams(url, [prompt], new, extra)[0]


def load_round(url: str, clients: int, prompt_len: int, new: int, extra: dict, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [text_of(rng, prompt_len) for _ in range(clients)]
    start = time.perf_counter()
    results = streams(url, prompts, new, extra)
    wall = time.perf_counter() - start
    return {
        "clients": clients,
        "tokens_per_s": sum(r.tokens for r in results) / wall,
        "decode_per_s": decode_rate(results),
        "together_per_s": all_decoding_rate(results),
        "ttfts": [r.ttft for r in results],
        "gaps": [g for r in results for g in r.gaps],
    }


def combine(rounds: Sequence[dict]) -> dict:
    """One row from the rounds of one load: the median of their tokens/s (and the range), the
    percentiles of every request's TTFT and every gap, all rounds pooled."""
    ttfts = [t for r in rounds for t in r["ttfts"]]
    gaps = [g for r in rounds for g in r["gaps"]]
    speeds = [r["tokens_per_s"] for r in rounds]
    return {
        "clients": rounds[0]["clients"],
        "tokens_per_s": statistics.median(speeds),
        "decode_per_s": _median_known([r["decode_per_s"] for r in rounds]),
        "together_per_s": _median_known([r["together_per_s"] for r in rounds]),
        "tokens_per_s_min": min(speeds),
        "tokens_per_s_max": max(speeds),
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "itl_p50": percentile(gaps, 50),
        "itl_p99": percentile(gaps, 99),
    }


def _median_known(xs: Sequence[float]) -> float:
    """The median of the values that are not NaN (NaN if none is)."""
    known = [x for x in xs if not math.isnan(x)]
    return statistics.median(known) if known else float("nan")


def percentile(xs: Sequence[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def prefix_cache(url: str, system: int, rounds: int, extra: dict) -> dict:
    """Median TTFT of one new token after a cached and after a never-seen system prompt."""
    rng = random.Random(1)
    cached_system = text_of(rng, system)
    stream(url, cached_system + text_of(rng, 8), 1, extra)  # fills the cache
    cached, uncached = [], []
    for _ in range(rounds):  # alternate, so a change of load hits both
        cached.append(stream(url, cached_system + text_of(rng, 8), 1, extra).ttft)
        uncached.append(stream(url, text_of(rng, system) + text_of(rng, 8), 1, extra).ttft)
    return {"cached": statistics.median(cached), "uncached": statistics.median(uncached)}


def start_server(argv: list[str], url: str, env: dict) -> subprocess.Popen:
    # The server's log goes to a file: a pipe nobody reads fills up (llama.cpp logs tens of
    # kilobytes while loading) and blocks the server before it answers.
    fd, log = tempfile.mkstemp(prefix="server-", suffix=".log")
    with os.fdopen(fd, "wb") as sink:  # the server holds its own copy of the descriptor
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=sink)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = Path(log).read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{argv[2]} stopped (log {log}): {tail}")
        try:
            if requests.get(url + "/v1/models", timeout=1).ok:
                return proc
        except requests.ConnectionError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{argv[2]} did not start in 300 s (log {log})")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def llama_cpp_available() -> bool:
    """``llama_cpp.server`` with its own dependencies (an import in a fresh process)."""
    probe = [sys.executable, "-c", "import llama_cpp.server.app"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def measure(args: argparse.Namespace) -> dict:
    from attnkit.models.llama import bundled_model_path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    gguf = str(bundled_model_path())
    port = args.port
    out: dict = {"attnkit": [], "llama.cpp": [], "prefix": None, "failed": {}}
    servers = {
        "attnkit": (
            [
                *(sys.executable, "-m", "attnkit.cli", "serve", "--build-kernel"),
                *("--port", str(port)),
                *("--threads", str(args.threads), "--max-batch", str(max(args.clients))),
                *("--kv-blocks", str(args.kv_blocks), "--kv-dtype", args.kv_dtype),
            ],
            {"ignore_eos": True},
        ),
    }
    if not args.no_llama_cpp and llama_cpp_available():
        servers["llama.cpp"] = (
            [
                *(sys.executable, "-m", "llama_cpp.server", "--model", gguf),
                *("--port", str(port + 1), "--n_threads", str(args.threads), "--n_ctx", "8192"),
                # One request at a time, the others queued: by default a new request ends the
                # stream that runs (its clients see the response cut off).
                *("--interrupt_requests", "False"),
            ],
            {"logit_bias": {str(EOS): -100}},
        )
    for name, (argv, extra) in servers.items():
        url = f"http://127.0.0.1:{port if name == 'attnkit' else port + 1}"
        proc = None
        try:
            proc = start_server(argv, url, env)
            load_round(url, 1, args.prompt, 4, extra, seed=0)  # warm-up
        except (RuntimeError, ValueError, OSError, asyncio.IncompleteReadError) as err:
            code = None if proc is None else proc.poll()  # a crash: the signal, negated
            if proc is not None:
                stop_server(proc)
            if name == "attnkit":
                raise
            # a peer that cannot serve here: the report says so, attnkit's figures stand
            out["failed"][name] = str(err) if code is None else f"its process ended with {code}"
            continue
        try:
            # The loads interleaved, round after round (a drift of the machine's speed hits
            # every load alike); new prompts every round, so the prefix cache never helps.
            rounds: dict[int, list[dict]] = {clients: [] for clients in args.clients}
            for r in range(args.repeats):
                for clients in args.clients:
                    seed = 1000 * (r + 1) + clients
                    one = load_round(url, clients, args.prompt, args.new, extra, seed=seed)
                    said = {"round": r, "clients": clients, "tokens_per_s": one["tokens_per_s"]}
                    print(json.dumps({name: said}), flush=True)
                    rounds[clients].append(one)
            out[name] = [combine(rounds[clients]) for clients in args.clients]
            if name == "attnkit":
                out["prefix"] = prefix_cache(url, args.system, args.rounds, extra)
        finally:
            stop_server(proc)
    return out


def report(out: dict, args: argparse.Namespace) -> str:
    if args.section == "serve":
        heading = "## Serving: `attnkit serve` under load"
        intro = (
            f"Each client streams {args.new} tokens after a {args.prompt}-token prompt (greedy, "
            f"to its length), the clients' requests sent at the same moment; {args.threads} "
            f"threads; attnkit's KV cache in {args.kv_dtype}. "
            "Tokens/s: every token over a round's wall "
            f"time, the median of {args.repeats} rounds, the loads interleaved (range in "
            "brackets). Decode tokens/s, the median of the rounds, two ways. *Any decoding*: "
            "every token after each request's first, over the time in which some request was "
            "decoding (from a request's first text to its last, overlaps counted once; prefill "
            "and queueing before a first token left out, but prompts computed in steps in which "
            "others already decode count against it). *All decoding*: the texts in the window "
            "in which every request decodes (from the last request's first text to the first "
            "request's last), over its length: the batch's decoding speed with every prompt "
            "computed; n/a where the streams never decode together. TTFT and ITL percentiles "
            "over every request and gap of those rounds."
        )
    else:  # a second CPU's table, below the main one: the columns are told there
        heading = f"### `attnkit serve` under load on {cpu()}"
        intro = (
            f"The load and the columns of the table above: {args.new} tokens after a "
            f"{args.prompt}-token prompt per client, {args.threads} threads, the KV cache in "
            f"{args.kv_dtype}, medians of {args.repeats} rounds."
        )
    lines = [
        heading,
        "",
        intro,
        "",
        "| server | clients | tokens/s | vs 1 client | decode tokens/s, any decoding "
        "| vs 1 client | decode tokens/s, all decoding | vs 1 client "
        "| TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def rate(value: float, base: float) -> str:
        if math.isnan(value):
            return "n/a | n/a"
        return f"{value:.1f} | {value / base:.2f}x"

    for name in ("attnkit", "llama.cpp"):
        rows = out[name]
        for row in rows:
            first = rows[0]
            lines.append(
                f"| {name} | {row['clients']} | {row['tokens_per_s']:.1f} "
                f"({row['tokens_per_s_min']:.0f}-{row['tokens_per_s_max']:.0f}) | "
                f"{row['tokens_per_s'] / first['tokens_per_s']:.2f}x | "
                f"{rate(row['decode_per_s'], first['decode_per_s'])} | "
                f"{rate(row['together_per_s'], first['together_per_s'])} | "
                f"{row['ttft_p50'] * 1e3:.0f} | "
                f"{row['ttft_p99'] * 1e3:.0f} | {row['itl_p50'] * 1e3:.1f} | "
                f"{row['itl_p99'] * 1e3:.1f} |"
            )
    failed = out.get("failed", {}).get("llama.cpp")
    if failed:
        lines += ["", f"llama.cpp's server failed on its first request here ({failed})."]
    elif not out["llama.cpp"]:
        lines += ["", "llama.cpp's server was not measured (`llama_cpp.server` does not import)."]
    p = out["prefix"]
    if p:
        lines += [
            "",
            f"Time to first token after a {args.system}-token system prompt: "
            f"{p['cached'] * 1e3:.0f} ms cached, {p['uncached'] * 1e3:.0f} ms uncached "
            f"({p['uncached'] / p['cached']:.1f}x), medians of {args.rounds}.",
        ]
    lines += [
        "",
        f"CPU {cpu()}, load average {os.getloadavg()[0]:.1f} at the end. `{command(args)}`.",
        "",
        environment(),
    ]
    return "\n".join(lines)


def command(args: argparse.Namespace) -> str:
    """The command line that writes this table."""
    words = ["python benchmarks/serve.py"]
    if args.no_llama_cpp:
        words.append("--no-llama-cpp")
    if args.section != "serve":
        words.append(f"--section {args.section}")
    return " ".join([*words, "--write"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=positive_int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--prompt", type=positive_int, default=64, help="prompt tokens (64)")
    parser.add_argument("--new", type=positive_int, default=128, help="tokens per request (128)")
    parser.add_argument(
        "--system", type=positive_int, default=1000, help="cached system prompt (1,000)"
    )
    parser.add_argument("--rounds", type=positive_int, default=5, help="prefix-cache requests (5)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="rounds of each load (3)")
    parser.add_argument(
        "--threads", type=thread_count, default=2, help="threads of each server (2)"
    )
    parser.add_argument(
        "--kv-blocks", type=positive_int, default=1024, help="attnkit's KV blocks (1,024)"
    )
    parser.add_argument(
        "--kv-dtype",
        default="float16",
        help="attnkit's KV cache: float16 (the server's default), bfloat16 or float32",
    )
    parser.add_argument(
        "--port", type=port_number, default=8317, help="attnkit's port; llama.cpp +1"
    )
    parser.add_argument("--no-llama-cpp", action="store_true", help="attnkit only")
    parser.add_argument("--quick", action="store_true", help="1 and 2 clients, tiny; print only")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument(
        "--section",
        default="serve",
        help="the section of docs/benchmarks.md to write: serve (default; with the chart), or "
        "another name for a second CPU's table (serve-avx2: an AVX2-only CPU's)",
    )
    args = parser.parse_args(argv)
    if not args.section.replace("-", "").isalnum():
        parser.error(f"--section must be letters, digits and '-', got {args.section!r}")
    if args.quick:
        args.clients, args.prompt, args.new, args.system, args.rounds = [1, 2], 8, 8, 64, 2
        args.kv_blocks, args.repeats = 64, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = measure(args)
    markdown = report(out, args)
    print(markdown)
    if args.write and not args.quick:
        print(f"wrote {write_section(args.section, markdown)}")
        if args.section == "serve":  # the page's chart (benchmarks/charts.py draws it from here)
            print(f"wrote {chart(out)}")
    return 0


def chart(out: dict, out_dir: Path = CHARTS) -> Path:
    """Draw ``serve.png``: aggregate tokens/s and inter-token latency (p50) of each server
    against the number of clients."""
    rows = [
        {**row, "series": name, "itl_p50_ms": row["itl_p50"] * 1e3}
        for name in ("attnkit", "llama.cpp")
        for row in out[name]
    ]
    return write_chart(
        "serve",
        rows,
        panels=[
            ("tokens_per_s", "aggregate throughput", "tokens/s"),
            ("itl_p50_ms", "inter-token latency, p50", "ms"),
        ],
        title="SmolLM2-135M-Instruct served on CPU, streaming clients; dashed: llama.cpp",
        x="clients",
        x_label="concurrent clients",
        baselines=["llama.cpp"],
        log_y=True,
        out_dir=out_dir,
    )


if __name__ == "__main__":
    sys.exit(main())
