"""The numbers auto decides by: per-machine rates, measured here and kept in a data file.

A ``Table`` holds, for one device, dtype and thread count, each backend's ``Rates`` per pass
(the constants of ``cost.price``) and ``eval_s`` (seconds per element-op of a mask or bias
function). Tables come from ``attnkit.backends.calibration``, which times a few small calls on
this machine and writes one JSON file per (device, dtype, thread count) beside the fused
kernel's build (``cache_dir()/calibration``). A table is used only while it was measured with
this torch, this attnkit, this thread count and (where the fused kernel is built) that build;
otherwise auto falls back to its priority list (``cost.PRIORITY``) and, where it may, starts a
calibration in a background process (once per process and profile; ``ATTNKIT_BACKGROUND=0``
turns that off). CUDA and MPS calls have no tables: they always follow the priority list.

``reference_rates.json`` beside this file is a table measured on one machine (AMD EPYC,
AVX-512 with avx512_bf16, 2 threads): the format, and the numbers the tests pin (``pin``) so
that their expectations do not depend on the machine that runs them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from attnkit.backends.fused import jit
from attnkit.registry import forget_rankings

__all__ = [
    "FORMAT",
    "Rates",
    "Table",
    "calibration_path",
    "forget",
    "pin",
    "profile",
    "reference",
    "start_background",
    "table_for",
    "write_table",
]

_log = logging.getLogger("attnkit")
HERE = Path(__file__).resolve().parent
FORMAT = 1  # the table files' format version
PASSES = ("fwd", "fwdbwd")


@dataclass(frozen=True)
class Rates:
    """One backend's constants for one dtype and pass (see ``cost.price``)."""

    call: float  # seconds per call
    tile: float  # seconds per key tile visited
    gflops: float  # forward GFLOP/s of the whole pass (fwd+bwd: forward FLOPs / its time)
    pair: float  # seconds per (b, h, i, j) pair computed, elementwise work


@dataclass(frozen=True)
class Table:
    """Every measured backend's ``Rates`` for one profile, keyed ``(backend, pass)``."""

    rows: dict[tuple[str, str], Rates]
    eval_s: float
    source: str  # where the numbers come from, in words (for ``explain``)
    meta: dict

    def to_json(self) -> dict:
        rows = {f"{b}/{p}": asdict(r) for (b, p), r in sorted(self.rows.items())}
        return {**self.meta, "format": FORMAT, "eval_s": self.eval_s, "rates": rows}

    @classmethod
    def from_json(cls, data: dict, source: str) -> Table:
        rows = {}
        for key, r in data["rates"].items():
            backend, mode = key.split("/")
            rows[(backend, mode)] = Rates(
                **{f: float(r[f]) for f in ("call", "tile", "gflops", "pair")}
            )
        meta = {k: v for k, v in data.items() if k not in ("rates", "eval_s", "format")}
        return cls(rows, float(data["eval_s"]), source, meta)


def profile(row: str, threads: int | None = None) -> dict:
    """What a table must have been measured with to apply here and now."""
    return {
        "device": "cpu",
        "dtype": row,
        "threads": torch.get_num_threads() if threads is None else threads,
        "torch": torch.__version__,
        "attnkit": _version(),
        "capability": jit.capability(),
    }


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("attnkit")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def calibration_path(row: str, threads: int | None = None) -> Path:
    p = profile(row, threads)
    return jit.cache_dir() / "calibration" / f"cpu-{row}-{p['threads']}threads.json"


def write_table(table: Table, path: Path) -> None:
    """Write a table file atomically (a temporary file moved into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table.to_json(), indent=1))
    os.replace(tmp, path)
    forget()


_PINNED: list[dict[str, Table] | None] = [None]
_TABLES: dict[tuple[str, int], Table | None] = {}


@contextlib.contextmanager
def pin(tables: dict[str, Table] | None) -> Iterator[None]:
    """Use ``tables`` (keyed by dtype row, "float32" / "bfloat16") for every CPU call inside the
    block instead of this machine's measurements; ``None`` unpins."""
    previous = _PINNED[0]
    _PINNED[0] = tables
    forget()
    try:
        yield
    finally:
        _PINNED[0] = previous
        forget()


def reference() -> dict[str, Table]:
    """The shipped reference tables (``reference_rates.json``), keyed by dtype row."""
    data = json.loads((HERE / "reference_rates.json").read_text())
    source = f"the reference table ({data['machine']})"
    return {row: Table.from_json(t, source) for row, t in data["tables"].items()}


def forget() -> None:
    """Drop the tables read so far and auto's rankings (measurements changed)."""
    _TABLES.clear()
    forget_rankings()


def _read(row: str, threads: int) -> Table | None:
    path = calibration_path(row, threads)
    try:
        data = json.loads(path.read_text())
        table = Table.from_json(data, "")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    want = profile(row, threads)
    if data.get("format") != FORMAT or any(data.get(k) != v for k, v in want.items()):
        return None  # another torch, attnkit, thread count or CPU class: measure again
    if jit.is_built() and data.get("fused") != jit.build_key():
        return None  # the fused kernel was built (or rebuilt) since: measure it too
    source = (
        f"measured on this machine ({data.get('cpu', 'CPU')}, {threads} threads) by the "
        f"calibration of {data.get('when', '?')}, which took {data.get('seconds', 0):.0f} s"
    )
    return Table(table.rows, table.eval_s, source, table.meta)


def table_for(device: torch.device, row: str) -> Table | None:
    """The rates for calls on ``device`` in dtype row ``row`` with the current thread count, or
    None (auto then follows its priority list). Never reads CPU numbers for another device."""
    if device.type != "cpu":
        return None
    pinned = _PINNED[0]
    if pinned is not None:
        return pinned.get(row)
    threads = torch.get_num_threads()
    key = (row, threads)
    if key in _TABLES:
        return _TABLES[key]
    table = _TABLES[key] = _read(row, threads)
    if table is None:
        start_background(row, threads)
    return table


_STARTED: set[tuple[str, int]] = set()


def background_allowed() -> bool:
    """Whether auto may start work in a background process (``ATTNKIT_BACKGROUND=0``: never)."""
    return os.environ.get("ATTNKIT_BACKGROUND", "1") != "0"


def start_background(row: str, threads: int) -> bool:
    """Measure this profile (building the fused kernel first, where it can be built and is
    not) in a background process, once per process and profile; returns whether one started.
    The caller never waits for it; auto weighs its results once it has finished."""
    if (row, threads) in _STARTED or not background_allowed():
        return False
    _STARTED.add((row, threads))
    root = jit.cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
        log = (root / "background.log").open("ab")
    except OSError:
        return False
    command = [sys.executable, "-m", "attnkit.backends.calibration", row, str(threads)]
    with log:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
        )
    build = "" if jit.is_built() or jit.prerequisites() else "building the fused CPU kernel and "
    _log.warning(
        "attnkit: %smeasuring this machine for auto (%s, %d threads) in the background (process "
        "%d, log %s); until then auto follows its priority list. `attnkit kernels build` does "
        "it now; ATTNKIT_BACKGROUND=0 turns background work off",
        build,
        row,
        threads,
        process.pid,
        root / "background.log",
    )
    threading.Thread(target=_when_done, args=(process,), daemon=True).start()
    return True


def _when_done(process: subprocess.Popen) -> None:
    process.wait()
    forget()
