"""`attnkit serve`: 127.0.0.1 unless told otherwise, bad numbers are one line and exit 2 before
the model loads, and SIGTERM lets the running stream finish, then exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from attnkit.cli import build_parser, main
from attnkit.commands import serve

requests = pytest.importorskip("requests")
pytest.importorskip("uvicorn")

from serve_oracles import free_port  # noqa: E402

TESTS = Path(__file__).resolve().parent


def test_the_default_address_is_localhost() -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.model) == ("127.0.0.1", 8000, None)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "70000"], "--port"),
        (["--kv-blocks", "0"], "--kv-blocks"),
        (["--max-batch", "32", "--chunk-tokens", "16"], "--chunk-tokens"),
        (["--max-waiting", "-1"], "--max-waiting"),
        (["--model", "no/such/model.gguf"], "does not exist"),
        (["--kv-dtype", "float64"], "--kv-dtype"),
    ],
)
def test_bad_arguments_are_one_line_before_the_model_loads(capsys, monkeypatch, argv, message):
    monkeypatch.setattr(serve, "load_model", lambda path: pytest.fail("the model loaded"))
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and err.startswith("attnkit serve: error")


def test_an_address_it_cannot_serve_at_is_one_line_before_the_model_loads(capsys, monkeypatch):
    """A port another server holds, and an address that is not this machine's: exit 2 with one
    line, before the model loads (uvicorn found out only after it loaded, and exited 1
    or 3 under a page of its log)."""
    import socket

    monkeypatch.setattr(serve, "load_model", lambda path: pytest.fail("the model loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert err.startswith(f"attnkit serve: error: cannot serve at 127.0.0.1:{port}: ")
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): documentation only, never a local address
    assert main(["serve", "--host", "192.0.2.1", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot serve at 192.0.2.1:0" in err


def test_a_kv_pool_past_the_machines_memory_is_refused_before_it_is_made(monkeypatch):
    """4 MiB of memory (1,024 pages of 4 KiB) holds one block of 16 positions, not 16 million."""
    import argparse

    from attnkit.commands import serve
    from serve_oracles import tiny_llm

    config = tiny_llm().model.config
    monkeypatch.setattr(serve.os, "sysconf", lambda name: 1024 if "PAGES" in name else 4096)
    big = argparse.Namespace(kv_blocks=16_000_000, block_size=16, kv_dtype="float16")
    with pytest.raises(ValueError, match=r"--kv-blocks 16000000 x --block-size 16 needs"):
        serve.check_pool_fits(big, config)
    serve.check_pool_fits(argparse.Namespace(kv_blocks=1, block_size=16, kv_dtype="float16"),
                          config)  # fmt: skip


def test_the_bound_socket_is_what_uvicorn_serves_on(monkeypatch, capsys):
    served: list = []
    monkeypatch.setattr(serve, "load_model", lambda path: tiny_llm_for_serve())

    import uvicorn

    def run(self, sockets=None):  # what uvicorn gets: the socket, bound where asked
        served.extend((sock, sock.getsockname()) for sock in sockets)

    monkeypatch.setattr(uvicorn.Server, "run", run)
    monkeypatch.setattr(serve.signal, "signal", lambda *args: None)
    import gc

    import torch

    before = torch.get_num_threads()
    try:
        assert serve.run(build_parser().parse_args(["serve", "--port", "0"])) == 0
    finally:
        gc.unfreeze()
        torch.set_num_threads(before)
    ((sock, (host, port)),) = served
    assert host == "127.0.0.1" and port > 0  # --port 0: a free port, named where to connect
    assert f" at http://127.0.0.1:{port}/v1 " in capsys.readouterr().err
    assert sock.fileno() == -1  # closed once the server is done


def tiny_llm_for_serve():
    from serve_oracles import tiny_llm

    return tiny_llm()


class _Loaded(Exception):
    """Raised by the test's model loader: the command got as far as loading the model."""


@pytest.mark.parametrize("flag", [True, False])
def test_build_kernel_compiles_before_the_model_loads_and_only_when_asked(monkeypatch, flag):
    order: list[str] = []
    monkeypatch.setattr(serve, "build_kernel", lambda: order.append("build"))

    def load_model(path):
        order.append("load")
        raise _Loaded

    monkeypatch.setattr(serve, "load_model", load_model)
    build = ["--build-kernel"] if flag else []
    args = build_parser().parse_args(["serve", "--port", "0", *build])
    with pytest.raises(_Loaded):
        serve.run(args)
    assert order == (["build", "load"] if flag else ["load"])


def test_a_kernel_that_cannot_be_built_is_said_in_one_line(capsys, monkeypatch) -> None:
    from attnkit.backends.fused import jit

    def fail(force: bool = False):
        raise jit.NotBuilt("no C++ compiler ('c++') is installed")

    monkeypatch.setattr(jit, "build", fail)
    assert serve.build_kernel() == "no C++ compiler ('c++') is installed"


def _run_until_serving(monkeypatch, argv, *, load=None, on_engine=None, on_serve=None) -> None:
    """``attnkit serve ARGV`` with the tiny model (or ``load(path)``) up to the point where
    uvicorn would serve: ``on_engine(engine)`` once the engine is made, ``on_serve()`` in place
    of serving. Restores the garbage collector and torch's thread count afterwards."""
    import gc

    import torch
    import uvicorn

    import attnkit.serve.engine as engine_module
    from serve_oracles import tiny_llm

    class Recorded(engine_module.Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if on_engine is not None:
                on_engine(self)

    before = torch.get_num_threads()
    monkeypatch.setattr(serve, "load_model", load or (lambda path: tiny_llm()))
    monkeypatch.setattr(engine_module, "Engine", Recorded)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: on_serve and on_serve())
    monkeypatch.setattr(serve.signal, "signal", lambda *args: None)  # keep pytest's handlers
    try:
        assert serve.run(build_parser().parse_args(["serve", "--port", "0", *argv])) == 0
    finally:
        gc.unfreeze()
        torch.set_num_threads(before)


def test_what_loading_made_is_out_of_the_garbage_collectors_way_while_serving(monkeypatch):
    """A full collection walks every tracked object (about 200,000 after loading torch and
    SmolLM2: 60 ms, a pause in every stream); the server freezes them before it serves."""
    import gc

    seen: list[int] = []
    before = gc.get_freeze_count()
    _run_until_serving(
        monkeypatch, ["--threads", "1"], on_serve=lambda: seen.append(gc.get_freeze_count())
    )
    assert len(seen) == 1 and seen[0] > before + 10_000


@pytest.mark.parametrize(("flag", "want"), [(["--threads", "2"], 2), ([], None)])
def test_the_engine_gets_the_threads_and_this_thread_stays_at_one(monkeypatch, flag, want):
    """Two threads computing in parallel keep two OpenMP pools, more threads than cores, and
    then the steps' threads sleep between parallel regions: the model loads and the event loop
    runs on one thread; the engine's thread has the count asked for (torch's by default)."""
    import torch

    from serve_oracles import tiny_llm

    before = torch.get_num_threads()
    seen: dict[str, int] = {}

    def load_model(path):
        seen["loading"] = torch.get_num_threads()
        return tiny_llm()

    _run_until_serving(
        monkeypatch,
        flag,
        load=load_model,
        on_engine=lambda engine: seen.update(engine=engine.threads),
        on_serve=lambda: seen.update(serving=torch.get_num_threads()),
    )
    assert seen == {"loading": 1, "engine": want or before, "serving": 1}


@pytest.mark.parametrize(
    ("flag", "want"),
    [
        (["--kv-dtype", "bfloat16"], "bfloat16"),
        (["--kv-dtype", "float32"], "float32"),
        ([], "float16"),
    ],
)
def test_the_kv_dtype_reaches_the_pool(monkeypatch, flag, want) -> None:
    import torch

    pools: list[torch.dtype] = []
    _run_until_serving(
        monkeypatch, flag, on_engine=lambda engine: pools.append(engine.pool.keys[0].dtype)
    )
    assert pools == [getattr(torch, want)]


def test_the_server_runs_on_uvloop_and_httptools(monkeypatch) -> None:
    """The serve extra installs uvicorn's fast event loop and HTTP parser, and the command
    leaves uvicorn to take them (a quarter less of the event loop's time per streamed token)."""
    import asyncio

    import uvicorn

    configs: list[uvicorn.Config] = []

    class Recorded(uvicorn.Config):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            configs.append(self)

    monkeypatch.setattr(uvicorn, "Config", Recorded)
    _run_until_serving(monkeypatch, [])
    (config,) = configs
    config.load()
    assert config.http_protocol_class.__module__ == "uvicorn.protocols.http.httptools_impl"
    factory = config.get_loop_factory()
    loop = factory() if factory is not None else asyncio.new_event_loop()
    try:
        assert type(loop).__module__.startswith("uvloop")
    finally:
        loop.close()


# The command, with the tiny model of the tests in place of SmolLM2 (load_model is the seam).
_SERVE = """
import sys
sys.path.insert(0, {tests!r})
import serve_oracles
from attnkit.commands import serve
serve.load_model = lambda path: serve_oracles.tiny_llm()
from attnkit.cli import main
sys.exit(main(["serve", "--port", "{port}", "--shutdown-timeout", "20", "--threads", "1"]))
"""


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_finishes_the_running_stream_and_exits_zero(stop) -> None:
    """SIGTERM, or SIGINT (Ctrl-C)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    code = _SERVE.format(tests=str(TESTS), port=port)
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if requests.get(url + "/health", timeout=1).ok:
                    break
            except requests.ConnectionError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        events: list[dict] = []
        started = threading.Event()

        def stream() -> None:
            body = {
                "prompt": "Count:",
                "max_tokens": 200,
                "stream_options": {"include_usage": True},
                "temperature": 0,
                "stream": True,
            }
            with requests.post(url + "/v1/completions", json=body, stream=True, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith(b"data: {"):
                        events.append(json.loads(line[6:]))
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(60)
        proc.send_signal(stop)
        reader.join(60)
        assert proc.wait(60) == 0, proc.stderr.read().decode()
        assert events[-2]["choices"][0]["finish_reason"] == "length"  # it ran to its end
        assert events[-1]["usage"]["completion_tokens"] == 200
        with pytest.raises(requests.ConnectionError):
            requests.get(url + "/health", timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
