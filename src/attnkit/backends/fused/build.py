"""Building the fused kernel just in time, once per source version, CPU class and torch.

The C++ sources ship inside the package (``fused.h``, ``forward.cpp``, ``backward.cpp``,
``module.cpp``) and are compiled on first use with ``torch.utils.cpp_extension.load`` (a C++
compiler and ninja), never at install time. The result is cached under
``$XDG_CACHE_HOME/attnkit/torch_extensions`` (``~/.cache`` when unset; ``ATTNKIT_CACHE_DIR``
overrides the whole path), in a folder named by a hash of the sources, the compiler flags, the
torch version and the sources' location, so a changed source, another torch or another install
builds anew and a cached build loads in about a second.

Compiler flags: ATen's vectorised types (``at::vec::Vectorized``) are compiled for the CPU class
torch itself dispatches to on this machine (``torch.backends.cpu.get_cpu_capability()``:
AVX512, AVX2 or the portable default), with that class's instruction-set flags, never
``-march=native``: the class is part of the cache key, so a cache shared between machines of
different classes keeps one build per class.

The first use on a machine logs one warning (logger ``"attnkit"``) while it compiles; that
first use may be ``backend="auto"`` weighing the kernel, which it does on any CPU call.
``ATTNKIT_FUSED=0`` turns the backend off (it then says so in ``why_not``, and auto weighs the
others).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["SOURCES", "cache_dir", "flags", "load", "unavailable"]

HERE = Path(__file__).resolve().parent
_log = logging.getLogger("attnkit")
SOURCES = ("fused.h", "forward.cpp", "backward.cpp", "module.cpp")

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


def capability() -> str:
    """The CPU class the kernel is compiled for: torch's own dispatch level on this machine."""
    level = torch.backends.cpu.get_cpu_capability()
    if level.startswith("AVX512"):
        return "AVX512"
    return level if level in _CAPABILITY_FLAGS else "DEFAULT"


def flags() -> list[str]:
    """Compiler flags: optimisation and the CPU class's instruction sets."""
    return ["-O3", "-std=c++17", *_CAPABILITY_FLAGS.get(capability(), [])]


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
    digest.update(" ".join(flags()).encode())
    digest.update(torch.__version__.encode())
    return digest.hexdigest()[:16]


def _compiler() -> str | None:
    """The C++ compiler torch's extension builder will call, if it exists."""
    return shutil.which(os.environ.get("CXX", "c++"))


def _ninja_on_path() -> bool:
    """torch's builder runs ``ninja`` from PATH; the pip package's binary counts too."""
    if shutil.which("ninja"):
        return True
    try:
        import ninja  # the PyPI package (pinned in the dev and test extras)
    except ImportError:
        return False
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    return shutil.which("ninja") is not None


@functools.cache
def _load() -> tuple[ModuleType | None, str | None]:
    if os.environ.get("ATTNKIT_FUSED", "1") == "0":
        return None, "the fused kernel is turned off (ATTNKIT_FUSED=0)"
    if _compiler() is None:
        cxx = os.environ.get("CXX", "c++")
        return None, f"no C++ compiler ({cxx!r}) is installed: the fused kernel cannot be built"
    if not _ninja_on_path():
        return None, "ninja is not installed (pip install ninja): the fused kernel cannot be built"
    from torch.utils import cpp_extension

    name = f"attnkit_fused_{build_key()}"
    where = cache_dir() / name
    if not (where / f"{name}.so").exists():  # a cached build loads in about a second
        _log.warning(
            "attnkit: building the fused CPU kernel in %s (once per machine and torch version; "
            "about a minute; ATTNKIT_FUSED=0 turns it off)",
            where,
        )
    try:
        where.mkdir(parents=True, exist_ok=True)
        module = cpp_extension.load(
            name=name,
            sources=[str(HERE / s) for s in SOURCES if s.endswith(".cpp")],
            extra_cflags=flags(),
            extra_include_paths=[str(HERE)],
            build_directory=str(where),
            verbose=False,
        )
    except Exception as error:  # a compiler error, a missing header, a read-only cache
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return None, f"building the fused kernel failed ({first}); see the build in {where}"
    return module, None


def load() -> ModuleType:
    """The compiled kernel (built on the first call); raises RuntimeError saying why not."""
    module, reason = _load()
    if module is None:
        raise RuntimeError(reason)
    return module


def unavailable() -> str | None:
    """Why the kernel cannot be used here (building it first if needed), or None."""
    return _load()[1]
