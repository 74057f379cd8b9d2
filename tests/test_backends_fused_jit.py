"""The fused kernel's build: OpenMP threads, builds only when asked, a verified cache, locks
that die with their owner, and failures remembered.

Builds are simulated where a real compile is not the point (``_compile`` replaced by a copy of
the real library, built once for the module), so these tests take seconds, not minutes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import attnkit
from attnkit import scaled_dot_product_attention
from attnkit.backends import explain, rates
from attnkit.backends.fused import jit
from attnkit.masks import relative


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """The real kernel (built here once) and a copy of its verified build's folder (a copy:
    other processes may rebuild the shared cache meanwhile)."""
    try:
        module = jit.build()
    except jit.NotBuilt as reason:
        pytest.skip(f"the fused kernel cannot be built here: {reason}")
    name = f"attnkit_fused_{jit.build_key()}"
    copy = tmp_path_factory.mktemp("real") / name
    shutil.copytree(jit.cache_dir() / name, copy)
    return module, copy


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A process that has loaded nothing and an empty cache."""
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(jit, "_MODULE", [None])
    return tmp_path


def _fake_compile(real, calls: list):
    """A ``_compile`` that copies the real library into the build folder (no compiler)."""
    module, real_folder = real
    name = f"attnkit_fused_{jit.build_key()}"

    def compile_(module_name, folder):
        calls.append(folder)
        shutil.copy(real_folder / f"{name}.so", folder / f"{name}.so")
        return module

    return compile_


@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_runs_on_every_thread_torch_uses(real, threads) -> None:
    """Compiled with OpenMP: as many of torch's intra-op threads enter the forward's and the
    backward's parallel loops as torch.get_num_threads() says (64 query blocks x 8 heads of
    work: enough for every thread)."""
    module, _ = real
    if threads > (os.cpu_count() or 1):
        pytest.skip(f"this machine has fewer than {threads} cores")
    assert module.openmp()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v = (torch.randn(1, 8, 512, 64, requires_grad=True) for _ in range(3))
        out = scaled_dot_product_attention(q, k, v, backend="fused")
        assert module.threads_used() == threads == torch.get_num_threads()
        out.sum().backward()
        assert module.threads_used() == threads
    finally:
        torch.set_num_threads(before)


def test_auto_never_compiles_in_the_callers_thread(empty_cache, monkeypatch) -> None:
    """On an empty cache, default calls of every kind (bfloat16 with an ALiBi function, where
    the fused kernel would be fastest, included) run on another backend without compiling;
    explain says the kernel is not built yet and how to build it."""

    def compile_(*args):
        raise AssertionError("auto compiled the kernel")

    monkeypatch.setattr(jit, "_compile", compile_)
    slopes = torch.tensor([2.0 ** (-x) for x in range(1, 5)])
    alibi = relative(lambda b, h, i, j: -slopes[h] * (i - j).abs())
    q, k, v = (torch.randn(1, 4, 300, 32).bfloat16() for _ in range(3))
    for kw in ({}, {"is_causal": True}, {"bias": alibi}):
        out = scaled_dot_product_attention(q, k, v, **kw)
        assert out.shape == q.shape
        e = explain(q, k, v, **kw)
        assert e.backend != "fused"
        fused = next(x for x in e.verdicts if x.backend == "fused")
        assert fused.why_not.startswith("not built yet: `attnkit kernels build`")
    assert not jit.is_built()
    assert not list(empty_cache.glob("attnkit_fused_*"))  # no build folder was even made


def test_auto_starts_one_background_build_and_measurement(empty_cache, monkeypatch) -> None:
    """Unmeasured, auto starts one background process per profile (however many calls), with
    this interpreter and the profile's dtype and thread count, announced once on the logger."""
    started = []

    class FakeProcess:
        pid = 12345

        def __init__(self, command, **kw):
            started.append(command)
            assert kw["start_new_session"] and kw["stdin"] == subprocess.DEVNULL

        def wait(self):
            return 0

    monkeypatch.setenv("ATTNKIT_BACKGROUND", "1")
    monkeypatch.setattr(rates.subprocess, "Popen", FakeProcess)
    monkeypatch.setattr(rates, "_STARTED", set())
    q = torch.randn(1, 2, 64, 16)
    with rates.pin(None):
        for _ in range(3):
            scaled_dot_product_attention(q, q, q, is_causal=True)
        scaled_dot_product_attention(q.bfloat16(), q.bfloat16(), q.bfloat16())
    threads = str(torch.get_num_threads())
    assert started == [
        [sys.executable, "-m", "attnkit.backends.calibration", "float32", threads],
        [sys.executable, "-m", "attnkit.backends.calibration", "bfloat16", threads],
    ]
    monkeypatch.setenv("ATTNKIT_BACKGROUND", "0")
    monkeypatch.setattr(rates, "_STARTED", set())
    with rates.pin(None):
        scaled_dot_product_attention(q, q, q)
    assert len(started) == 2


def test_an_explicit_fused_call_builds_once_and_records_the_library(
    real, empty_cache, monkeypatch
) -> None:
    calls: list = []
    monkeypatch.setattr(jit, "_compile", _fake_compile(real, calls))
    q = torch.randn(1, 2, 40, 8, dtype=torch.float64)
    out = scaled_dot_product_attention(q, q, q, backend="fused")
    ref = scaled_dot_product_attention(q, q, q, backend="math")
    assert (out - ref).abs().max() < 1e-12
    scaled_dot_product_attention(q, q, q, backend="fused")
    assert len(calls) == 1 and jit.is_built()
    where = empty_cache / f"attnkit_fused_{jit.build_key()}"
    record = json.loads((where / jit.RECORD).read_text())
    library = where / f"attnkit_fused_{jit.build_key()}.so"
    assert record["size"] == library.stat().st_size and record["sha256"] == jit._sha256(library)
    assert not list(empty_cache.glob("*.building-*"))  # moved into place


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "no record"])
def test_a_damaged_cached_build_is_never_loaded(real, empty_cache, monkeypatch, damage) -> None:
    """A cached library that does not match its record is not loaded (it could crash the
    process): auto reports the kernel as not built, an explicit build replaces it."""
    name = f"attnkit_fused_{jit.build_key()}"
    where = empty_cache / name
    shutil.copytree(real[1], where)
    library = where / f"{name}.so"
    if damage == "truncated":
        os.truncate(library, library.stat().st_size // 2)
    elif damage == "flipped byte":
        data = bytearray(library.read_bytes())
        data[len(data) // 2] ^= 0xFF
        library.write_bytes(bytes(data))
    else:
        (where / jit.RECORD).unlink()
    monkeypatch.setattr(jit, "_import", lambda *a: pytest.fail("a damaged library was loaded"))
    assert not jit.is_built()
    assert jit.unavailable().startswith("not built yet")
    monkeypatch.undo()
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(empty_cache))
    monkeypatch.setattr(jit, "_MODULE", [None])
    calls: list = []
    monkeypatch.setattr(jit, "_compile", _fake_compile(real, calls))
    jit.build()
    assert len(calls) == 1 and jit._verified(where, name) is not None


def test_a_killed_builder_leaves_no_lock_behind(tmp_path) -> None:
    """The build lock is an operating-system lock: when its holder is killed (SIGKILL, as in a
    kill during the first build) the next builder takes it at once instead of waiting."""
    lock = tmp_path / "k.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from pathlib import Path
            from attnkit.backends.fused import jit
            with jit.file_lock(Path({str(lock)!r}), 0.0) as held:
                print(held, flush=True)
                time.sleep(600)
        """)],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "True"
        with jit.file_lock(lock, 0.0) as held:
            assert not held  # held by a live process: not ours
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        with jit.file_lock(lock, 0.0) as held:
            assert held
    finally:
        holder.kill()


def test_a_killed_build_folder_is_cleared_by_the_next_build(real, empty_cache, monkeypatch) -> None:
    name = f"attnkit_fused_{jit.build_key()}"
    stale = empty_cache / f"{name}.building-999999"
    stale.mkdir()
    (stale / "lock").write_text("")  # torch's own lock file, left by a killed build
    calls: list = []
    monkeypatch.setattr(jit, "_compile", _fake_compile(real, calls))
    jit.build()
    assert not stale.exists() and len(calls) == 1


def test_a_failed_build_is_remembered_until_asked_again(empty_cache, monkeypatch) -> None:
    calls = []

    def failing(name, folder):
        calls.append(folder)
        raise RuntimeError("ninja: build stopped\nforward.cpp:12:3: error: 'x' was not declared")

    monkeypatch.setattr(jit, "_compile", failing)
    with pytest.raises(jit.NotBuilt, match=r"error: 'x' was not declared.*log: "):
        jit.build()
    log = empty_cache / f"attnkit_fused_{jit.build_key()}.log"
    assert "ninja: build stopped" in log.read_text()
    reason = jit.unavailable()
    assert "building the fused kernel failed" in reason and "tries again" in reason
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(attnkit.backends.BackendUnavailable, match="failed"):
        scaled_dot_product_attention(q, q, q, backend="fused")
    assert len(calls) == 1  # neither unavailable() nor the explicit call tried again
    with pytest.raises(jit.NotBuilt):
        jit.build(force=True)
    assert len(calls) == 2


def test_kernels_command(real, capsys) -> None:
    from attnkit.cli import main

    assert main(["kernels", "status"]) == 0
    out = capsys.readouterr().out
    assert "fused kernel: built" in out
    assert f"auto, float32, {torch.get_num_threads()} threads:" in out
    assert main(["kernels", "build"]) == 0
    assert "fused kernel: built" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["kernels", "calibrate", "--threads", "0"])
    assert exit_.value.code == 2
    assert "--threads: '0' is not a whole number from 1 to 1024" in capsys.readouterr().err


def test_building_leaves_the_build_key_as_it_was(empty_cache, monkeypatch) -> None:
    """torch's builder appends its own link flags to the list it is given; handed the module's
    own list, the next build_key() in the same process named another build, so a calibration
    made right after a build recorded a key no later process matched."""
    from torch.utils import cpp_extension

    seen = []

    def load(**kw):
        kw["extra_ldflags"].append("-ltorch_cpu")  # as torch's _prepare_ldflags does
        kw["extra_cflags"].append("-DTORCH_EXTENSION_NAME=x")
        seen.append(kw["name"])
        raise RuntimeError("stop here")

    monkeypatch.setattr(cpp_extension, "load", load)
    key = jit.build_key()
    with pytest.raises(jit.NotBuilt):
        jit.build()
    assert seen and jit.build_key() == key
