"""Building the fused kernel just in time, once per source version, CPU class and torch.

The C++ sources ship inside the package (``fused.h``, ``forward.cpp``, ``backward.cpp``,
``module.cpp``) and are compiled with ``torch.utils.cpp_extension`` (a C++ compiler, ninja and
OpenMP), never at install time, and only when asked:

* ``backend="fused"`` on a call, ``attnkit.backends.fused.build()`` or ``attnkit kernels
  build`` compile in the caller's thread (once; a cached build loads in milliseconds);
* ``backend="auto"`` never compiles in the caller's thread. It weighs the kernel only once a
  verified build is in the cache; until then it takes another backend, and the first time it
  has no measurements of this machine it builds the kernel and measures (``calibration``) in
  a background process (announced once on the ``"attnkit"`` logger; ``ATTNKIT_BACKGROUND=0``
  turns that off).

The build is cached under ``$XDG_CACHE_HOME/attnkit/torch_extensions`` (``~/.cache`` when
unset; ``ATTNKIT_CACHE_DIR`` overrides the whole path), in a folder named by a hash of the
sources, the compiler flags, the torch version and the sources' location. A build is compiled
in a folder of its own and moved into place only after it loaded; a record of its size and
SHA-256 is written beside it, and a cached library is loaded only when it matches that record
(a truncated or damaged file is rebuilt, or reported, never loaded). Builders take an
operating-system file lock on the build key, which the kernel releases when a builder dies:
a killed build leaves nothing that blocks the next one. A build that failed is recorded, with
the compiler's output kept in a log file, and is not retried until asked (``build(force=True)``,
``attnkit kernels build``).

Compiler flags: OpenMP (``-fopenmp`` when compiling and linking, as torch's own CPU build, so
``at::parallel_for`` runs on torch's intra-op threads), and ATen's vectorised types compiled for
the CPU class torch itself dispatches to on this machine
(``torch.backends.cpu.get_cpu_capability()``: AVX512, AVX2 or the portable default), never
``-march=native``: the class is part of the cache key, so a cache shared between machines of
different classes keeps one build per class. ``ATTNKIT_FUSED=0`` turns the backend off.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

__all__ = [
    "SOURCES",
    "NotBuilt",
    "build",
    "cache_dir",
    "file_lock",
    "flags",
    "is_built",
    "load",
    "loaded",
    "prerequisites",
    "unavailable",
]

HERE = Path(__file__).resolve().parent
_log = logging.getLogger("attnkit")
SOURCES = (
    "fused.h",
    "forward.cpp",
    "backward.cpp",
    "quant.h",
    "matvec.h",
    "interleaved.h",
    "kv_tiles.h",
    "quant.cpp",
    "decode.cpp",
    "paged.cpp",
    "step.cpp",
    "bindings.h",
    "module.cpp",
)
BUILD_WAIT = 900.0  # seconds an explicit build waits for another process building the same key
RECORD = "build.json"

_CAPABILITY_FLAGS = {
    "AVX512": [
        "-DCPU_CAPABILITY=AVX512",
        "-DCPU_CAPABILITY_AVX512",
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx2",
        "-mfma",
        "-mf16c",
    ],
    "AVX2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}
LINK_FLAGS = ("-fopenmp",)  # a tuple: torch's builder appends to the lists it is given


class NotBuilt(RuntimeError):
    """The kernel is not built (or not available) here; the message says why and what to do."""


def capability() -> str:
    """The CPU class the kernel is compiled for: torch's own dispatch level on this machine."""
    level = torch.backends.cpu.get_cpu_capability()
    if level.startswith("AVX512"):
        return "AVX512"
    return level if level in _CAPABILITY_FLAGS else "DEFAULT"


def flags() -> list[str]:
    """Compiler flags: optimisation, OpenMP and the CPU class's instruction sets."""
    return ["-O3", "-std=c++17", "-fopenmp", *_CAPABILITY_FLAGS.get(capability(), [])]


def cache_dir() -> Path:
    """Where builds are kept (one folder per build key)."""
    override = os.environ.get("ATTNKIT_CACHE_DIR")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "attnkit" / "torch_extensions"


def build_key() -> str:
    """A hash of the sources, the flags, the CPU class, the torch version and where the sources
    are (the build files name them by path: two installs sharing a cache would otherwise
    rebuild each other's build in turn)."""
    digest = hashlib.sha256(str(HERE).encode())
    for name in SOURCES:
        digest.update(name.encode())
        digest.update((HERE / name).read_bytes())
    digest.update(" ".join([*flags(), *LINK_FLAGS]).encode())
    digest.update(torch.__version__.encode())
    return digest.hexdigest()[:16]


def _name() -> str:
    return f"attnkit_fused_{build_key()}"


def _where() -> Path:
    return cache_dir() / _name()


def _compiler() -> str | None:
    """The C++ compiler torch's extension builder will call, if it exists."""
    return shutil.which(os.environ.get("CXX", "c++"))


def _ninja_on_path() -> bool:
    """torch's builder runs ``ninja`` from PATH; the pip package's binary counts too."""
    if shutil.which("ninja"):
        return True
    try:
        import ninja  # the PyPI package (the `fused` extra)
    except ImportError:
        return False
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    return shutil.which("ninja") is not None


def prerequisites() -> str | None:
    """Why the kernel cannot be built here at all, or None."""
    if os.environ.get("ATTNKIT_FUSED", "1") == "0":
        return "the fused kernel is turned off (ATTNKIT_FUSED=0)"
    if _compiler() is None:
        cxx = os.environ.get("CXX", "c++")
        return f"no C++ compiler ({cxx!r}) is installed: the fused kernel cannot be built"
    if not _ninja_on_path():
        return "ninja is not installed (pip install ninja): the fused kernel cannot be built"
    return None


# The cached build: verified against its record before it is loaded.


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file moved into place)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _verified(where: Path, name: str) -> Path | None:
    """The built library in ``where`` when it matches its record (size and SHA-256), else None."""
    library = where / f"{name}.so"
    try:
        record = json.loads((where / RECORD).read_text())
        if library.stat().st_size != record["size"]:
            return None
        return library if _sha256(library) == record["sha256"] else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _import(library: Path, name: str) -> ModuleType:
    """Load a built extension module from its file (torch is imported: its symbols resolve)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


_MODULE: list[ModuleType | None] = [None]
_GUARD = threading.Lock()  # one build or load at a time in this process


def _failure(name: str) -> str | None:
    """The recorded reason the last build of this key failed, or None."""
    try:
        return json.loads((cache_dir() / f"{name}.failed").read_text())["reason"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _cached() -> ModuleType | None:
    """The kernel if it is loaded or a verified build is cached (loaded now), else None."""
    if _MODULE[0] is not None:
        return _MODULE[0]
    name = _name()
    library = _verified(cache_dir() / name, name)
    if library is None:
        return None
    with _GUARD:
        if _MODULE[0] is None:
            _MODULE[0] = _import(library, name)
    return _MODULE[0]


def loaded() -> ModuleType | None:
    """The kernel if this process has already loaded it, else None: reads no file and hashes
    nothing, so a per-token decision can ask it (``ATTNKIT_FUSED=0`` gives None). A verified
    build is loaded by the first ``is_built``, ``unavailable`` or ``load``, e.g. when auto
    first weighs the kernel."""
    if os.environ.get("ATTNKIT_FUSED", "1") == "0":
        return None
    return _MODULE[0]


def is_built() -> bool:
    """Whether a verified build of this kernel is loaded or in the cache (nothing is compiled)."""
    return prerequisites() is None and _cached() is not None


def unavailable() -> str | None:
    """Why auto cannot use the kernel now, or None; never compiles. An unbuilt kernel gives a
    sentence saying how to build it. Once the kernel is loaded this reads no file and looks up
    no program: auto asks it on every call."""
    if loaded() is not None:
        return None
    reason = prerequisites()
    if reason is not None:
        return reason
    if _cached() is not None:
        return None
    failed = _failure(_name())
    if failed is not None:
        return f"{failed}; `attnkit kernels build` tries again"
    return (
        "not built yet: `attnkit kernels build` (or attnkit.backends.fused.build(), or "
        "backend='fused' on a call) compiles it, about a minute, once per machine"
    )


# Building.


@contextlib.contextmanager
def file_lock(path: Path, wait: float) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``path`` (released by the kernel if this process dies);
    yields False when another process holds it for longer than ``wait`` seconds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.2)
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _compile(name: str, folder: Path) -> ModuleType:
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name=name,
        sources=[str(HERE / s) for s in SOURCES if s.endswith(".cpp")],
        extra_cflags=flags(),
        extra_ldflags=list(LINK_FLAGS),  # a copy: the builder appends its own flags to it
        extra_include_paths=[str(HERE)],
        build_directory=str(folder),
        verbose=False,
    )


def _buildfile_lock(name: str, where: Path) -> ModuleType:
    """Compile into a fresh folder, record the library's size and hash, move it into place."""
    root = where.parent
    for stale in root.glob(f"{name}.building-*"):  # left by a killed build: we hold the lock
        shutil.rmtree(stale, ignore_errors=True)
    folder = root / f"{name}.building-{os.getpid()}"
    folder.mkdir(parents=True)
    log = root / f"{name}.log"
    try:
        module = _compile(name, folder)
    except Exception as error:  # a compiler error, a missing header, a read-only cache
        text = str(error).strip() or type(error).__name__
        with contextlib.suppress(OSError):
            log.write_text(text + "\n")
        lines = [x for x in text.splitlines() if "error" in x.lower()] or text.splitlines()
        reason = f"building the fused kernel failed ({lines[0].strip()[:300]}); log: {log}"
        with contextlib.suppress(OSError):
            _write_json(root / f"{name}.failed", {"reason": reason, "log": str(log)})
        shutil.rmtree(folder, ignore_errors=True)
        raise NotBuilt(reason) from error
    library = folder / f"{name}.so"
    _write_json(folder / RECORD, {
        "key": name, "size": library.stat().st_size, "sha256": _sha256(library),
        "torch": torch.__version__, "flags": [*flags(), *LINK_FLAGS],
    })  # fmt: skip
    if where.exists():  # a damaged or unverified earlier build
        trash = root / f"{name}.old-{os.getpid()}"
        os.replace(where, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(folder, where)
    with contextlib.suppress(OSError):
        (root / f"{name}.failed").unlink()
    sys.modules[name] = module  # as _import registers a cached build
    return module


def build(force: bool = False) -> ModuleType:
    """Build the kernel now, in this thread (or load the verified cached build), and return it.

    ``force``: try again after a recorded failure. Raises ``NotBuilt`` saying why it cannot be
    built here. Waits up to ``BUILD_WAIT`` seconds for another process building the same key.
    """
    reason = prerequisites()
    if reason is not None:
        raise NotBuilt(reason)
    module = _cached()
    if module is not None:
        return module
    name, where = _name(), _where()
    failed = _failure(name)
    if failed is not None and not force:
        raise NotBuilt(f"{failed}; `attnkit kernels build` tries again")
    with _GUARD, file_lock(cache_dir() / f"{name}.lock", BUILD_WAIT) as held:
        if not held:
            raise NotBuilt(
                f"another process has been building the fused kernel in {cache_dir()} for "
                f"{BUILD_WAIT:.0f} s; try again later"
            )
        library = _verified(where, name)  # built by another process while we waited
        if library is not None:
            _MODULE[0] = _import(library, name)
            return _MODULE[0]
        _log.warning(
            "attnkit: building the fused CPU kernel in %s (once per machine and torch version; "
            "about a minute; ATTNKIT_FUSED=0 turns it off)",
            where,
        )
        _MODULE[0] = _buildfile_lock(name, where)
        return _MODULE[0]


def load() -> ModuleType:
    """The compiled kernel, built now if needed (an explicit request); raises ``NotBuilt``."""
    return _MODULE[0] or build()
