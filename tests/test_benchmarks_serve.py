"""benchmarks/serve.py: percentiles interpolate, the report gives each row's speed-up over one
client and the prefix cache's ratio, and says when llama.cpp was not measured; rounds
combine to the median speed and pooled percentiles."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import socketserver
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("requests")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serve.py"
spec = importlib.util.spec_from_file_location("bench_serve", SCRIPT)
bench = importlib.util.module_from_spec(spec)
sys.modules["bench_serve"] = bench
spec.loader.exec_module(bench)


def test_percentiles_interpolate_between_ranks() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert bench.percentile(xs, 50) == 2.5
    assert bench.percentile(xs, 0) == 1.0 and bench.percentile(xs, 100) == 4.0
    assert bench.percentile([7.0], 99) == 7.0


def test_rounds_combine_to_the_median_speed_and_pooled_percentiles() -> None:
    rounds = [
        {"clients": 8, "tokens_per_s": 300.0, "ttfts": [0.1, 0.3], "gaps": [0.01, 0.02]},
        {"clients": 8, "tokens_per_s": 360.0, "ttfts": [0.2], "gaps": [0.03]},
        {"clients": 8, "tokens_per_s": 320.0, "ttfts": [0.4], "gaps": [0.04, 0.05]},
    ]
    for r, decode, together in zip(
        rounds, (410.0, 390.0, 450.0), (500.0, float("nan"), 460.0), strict=True
    ):
        r["decode_per_s"], r["together_per_s"] = decode, together
    row = bench.combine(rounds)
    assert (row["clients"], row["tokens_per_s"], row["decode_per_s"]) == (8, 320.0, 410.0)
    assert row["together_per_s"] == 480.0  # the median of the rounds that had such a window
    assert (row["tokens_per_s_min"], row["tokens_per_s_max"]) == (300.0, 360.0)
    assert row["ttft_p50"] == pytest.approx(0.25) and row["itl_p50"] == pytest.approx(0.03)


def test_the_report_gives_speed_ups_and_the_prefix_cache_ratio() -> None:
    def row(clients, tps):
        return dict(
            clients=clients,
            tokens_per_s=tps,
            tokens_per_s_min=tps - 1,
            tokens_per_s_max=tps + 2,
            decode_per_s=2 * tps,
            together_per_s=3 * tps if clients == 1 else 3 * tps + 30,
            ttft_p50=0.1,
            ttft_p99=0.2,
            itl_p50=0.01,
            itl_p99=0.02,
        )

    serial = {**row(8, 10.0), "together_per_s": float("nan")}
    out = {
        "attnkit": [row(1, 10.0), row(8, 35.0)],
        "llama.cpp": [row(1, 10.0), serial],
        "prefix": {"cached": 0.05, "uncached": 0.5},
    }
    args = argparse.Namespace(
        new=128,
        prompt=64,
        threads=2,
        system=1000,
        rounds=5,
        repeats=3,
        kv_dtype="float32",
        section="serve",
        no_llama_cpp=False,
    )
    text = bench.report(out, args)
    assert text.startswith("## Serving: `attnkit serve` under load\n")
    assert "`python benchmarks/serve.py --write`" in text
    want = "| attnkit | 8 | 35.0 (34-37) | 3.50x | 70.0 | 3.50x | 135.0 | 4.50x | 100 | 200 |"
    assert want in text
    assert "| llama.cpp | 8 | 10.0 (9-12) | 1.00x | 20.0 | 1.00x | n/a | n/a | 100 |" in text
    assert "the median of 3 rounds" in text
    assert "50 ms cached, 500 ms uncached (10.0x)" in text
    assert "llama.cpp's server was not measured" not in text
    out["llama.cpp"] = []
    assert "llama.cpp's server was not measured" in bench.report(out, args)
    out["failed"] = {"llama.cpp": "its process ended with -11"}
    text = bench.report(out, args)
    said = "llama.cpp's server failed on its first request here (its process ended with -11)"
    assert said in text
    assert "was not measured" not in text
    del out["failed"]
    # A second CPU's table: its own section, a heading naming the CPU, the command that made it.
    args.section, args.no_llama_cpp = "serve-avx2", True
    text = bench.report(out, args)
    assert text.startswith(f"### `attnkit serve` under load on {bench.cpu()}\n")
    assert "`python benchmarks/serve.py --no-llama-cpp --section serve-avx2 --write`" in text
    assert "The load and the columns of the table above: 128 tokens after a 64-token" in text
    assert "*Any decoding*" not in text  # told once, above


def test_a_section_name_is_letters_digits_and_dashes() -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--section", "../x"])
    assert exc.value.code == 2


def test_decode_time_counts_overlapping_streams_once() -> None:
    """Two streams decoding at once over [1, 3] and [2, 4] (3 and 5 tokens after their first):
    8 tokens in 3 s; a third that starts after both end adds its own time; a stream of one
    token (no decoding) adds nothing."""

    def t(first, last, tokens):
        return bench.Timing(tokens=tokens, first=first, last=last)

    assert bench.decode_rate([t(1, 3, 4), t(2, 4, 6)]) == pytest.approx(8 / 3)
    assert bench.decode_rate([t(1, 3, 4), t(2, 4, 6), t(5, 7, 3)]) == pytest.approx(10 / 5)
    assert bench.decode_rate([t(1, 3, 4), t(9, 9, 1)]) == pytest.approx(3 / 2)
    # one request at a time (a server without batching): the single-stream rate, however many
    assert bench.decode_rate([t(k * 10, k * 10 + 4, 9) for k in range(8)]) == pytest.approx(2)


def test_the_all_decoding_window_runs_from_the_last_first_text_to_the_first_last_text() -> None:
    """Streams over [0, 4] (texts every 0.5 s) and [1, 5] (every 0.25 s): in (1, 4] the first
    brings 6 texts and the second 12, 18 in 3 s; alone, a stream's own rate; streams one after
    another (no window) give NaN."""

    def t(start, end, step):
        n = round((end - start) / step)
        times = [start + k * step for k in range(n + 1)]
        return bench.Timing(tokens=n + 1, first=start, last=end, times=times)

    assert bench.all_decoding_rate([t(0, 4, 0.5), t(1, 5, 0.25)]) == pytest.approx(18 / 3)
    assert bench.all_decoding_rate([t(1, 5, 0.25)]) == pytest.approx(16 / 4)
    assert bench.decode_rate([t(1, 5, 0.25)]) == pytest.approx(16 / 4)
    assert math.isnan(bench.all_decoding_rate([t(0, 1, 0.5), t(2, 3, 0.5)]))


class _Scripted(socketserver.ThreadingTCPServer):
    """A server that answers each ``/v1/completions`` request only once ``clients`` requests
    have arrived (so the clients must send together), with ``reply(body)``'s bytes."""

    daemon_threads = True

    def __init__(self, clients: int, reply) -> None:
        self.arrived = threading.Barrier(clients, timeout=10)
        self.reply = reply
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            head += self.rfile.read(1)
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        body = json.loads(self.rfile.read(length))
        self.server.arrived.wait()
        self.wfile.write(self.server.reply(body))


def _chunked(pieces: list[bytes]) -> bytes:
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    return head + b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"


def _events(body: dict, reason: str = "length") -> list[bytes]:
    texts = [{"choices": [{"text": f"t{k}", "finish_reason": None}]} for k in range(3)]
    done = {"choices": [{"text": "", "finish_reason": reason}]}
    return [b"data: " + json.dumps(e).encode() + b"\r\n\r\n" for e in [*texts, done]] + [
        b"data: [DONE]\r\n\r\n"
    ]


@pytest.fixture
def scripted():
    servers = []

    def start(clients: int, reply) -> str:
        server = _Scripted(clients, reply)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_the_clients_send_together_and_time_every_text_event(scripted) -> None:
    """Three clients; the server answers none until all three requests are in. Events split
    across chunks and several in one chunk are each timed once; the finish event and [DONE]
    are not texts."""

    def reply(body: dict) -> bytes:
        assert body["stream"] and body["max_tokens"] == 5 and body["ignore_eos"]
        whole = b"".join(_events(body))
        return _chunked([whole[:7], whole[7:50], whole[50:]])

    url = scripted(3, reply)
    timings = bench.streams(url, ["a", "b", "c"], 5, {"ignore_eos": True})
    assert len(timings) == 3
    for t in timings:
        assert t.tokens == 5 and len(t.times) == 3 and len(t.gaps) == 2
        assert t.ttft > 0 and t.first == t.times[0] and t.last == t.times[-1]
        assert t.gaps == pytest.approx(
            [b - a for a, b in zip(t.times[:-1], t.times[1:], strict=True)]
        )


def test_a_body_without_chunks_is_read_to_the_end(scripted) -> None:
    def reply(body: dict) -> bytes:
        return b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + b"".join(_events(body))

    t = bench.stream(scripted(1, reply), "a", 7, {})
    assert (t.tokens, len(t.times)) == (7, 3)


def test_an_error_status_an_early_stop_or_a_cut_off_stream_raises(scripted) -> None:
    def refuse(body: dict) -> bytes:
        error = b'{"error": {"message": "max_tokens is too large"}}'
        return b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n" + error

    with pytest.raises(RuntimeError, match=r"400 Bad Request.*max_tokens is too large"):
        bench.stream(scripted(1, refuse), "a", 5, {})
    with pytest.raises(RuntimeError, match="ended by 'stop'"):
        bench.stream(scripted(1, lambda body: _chunked(_events(body, "stop"))), "a", 5, {})
    with pytest.raises(RuntimeError, match="without a finish_reason"):  # cut off mid-stream
        bench.stream(scripted(1, lambda body: _chunked(_events(body)[:2])), "a", 5, {})


def test_a_peer_that_crashes_is_reported_and_attnkit_is_still_measured(monkeypatch) -> None:
    """llama.cpp's server dying on its first request (its build faulted on one CPU) ends its
    part of the run, not the run; attnkit failing still fails it."""

    class Proc:
        def __init__(self, argv):
            self.llama = "llama_cpp.server" in argv

        def poll(self):
            return -11 if self.llama else None

    stopped = []
    monkeypatch.setattr(bench, "llama_cpp_available", lambda: True)
    monkeypatch.setattr(bench, "start_server", lambda argv, url, env: Proc(argv))
    monkeypatch.setattr(bench, "stop_server", stopped.append)

    def load_round(url, clients, prompt, new, extra, seed):
        if url.endswith(":9001"):  # llama.cpp's port: its stream ends mid-chunk
            raise ValueError("invalid literal for int() with base 16: b''")
        return {"clients": clients, "tokens_per_s": 10.0 * clients, "decode_per_s": 1.0,
                "together_per_s": 1.0, "ttfts": [0.1], "gaps": [0.01]}  # fmt: skip

    monkeypatch.setattr(bench, "load_round", load_round)
    monkeypatch.setattr(bench, "prefix_cache", lambda *a: {"cached": 0.1, "uncached": 1.0})
    args = argparse.Namespace(
        port=9000, threads=2, clients=[1, 8], kv_blocks=64, kv_dtype="float16",
        no_llama_cpp=False, prompt=64, new=4, repeats=1, system=100, rounds=1,
    )  # fmt: skip
    out = bench.measure(args)
    assert [row["clients"] for row in out["attnkit"]] == [1, 8] and out["llama.cpp"] == []
    assert out["failed"] == {"llama.cpp": "its process ended with -11"}
    assert len(stopped) == 2 and all(isinstance(p, Proc) for p in stopped)

    def broken(url, *a, **k):
        raise ValueError("attnkit's stream broke")

    monkeypatch.setattr(bench, "load_round", broken)
    with pytest.raises(ValueError, match="attnkit's stream broke"):
        bench.measure(args)
