"""The package's shape, checked from its source text with ``ast`` (independent of import-linter).

Every ``import`` statement in ``src/attnkit`` counts: at module level, inside functions and
under ``if TYPE_CHECKING:``. Relative imports are resolved. ``from pkg import name`` is an
import of ``pkg/name.py`` (or ``pkg/name/``) when ``name`` is a submodule, else of
``pkg/__init__.py``. Importing ``a.b.c`` also runs ``a/__init__.py`` and ``a/b/__init__.py``,
but only the explicit edge to ``a.b.c`` is counted.

Layers (by path; the same rules as the import-linter contracts in ``pyproject.toml``), from the
bottom up:

    core       masks, functional, registry, _* (private helpers): import only core
    backends   backends/...: core and backends
    modules    attention, positional, blocks, debug, any other module file at the package top:
               core, backends, modules
    models     models/..., integrations/...: not viz, train, distributed, tasks, cli, commands
    apps       viz/... (imports core only), train/..., distributed/... (never imports train)
    tasks      tasks/... (the worked examples)
    cli        cli.py, commands/...

A layer imports only its own rank and those below it; train, distributed and tasks are
imported only from cli, commands and tasks (and from inside themselves).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = "attnkit"
MAX_LINES = 600


# --- the import graph ------------------------------------------------------------------------


@dataclass(frozen=True)
class Edge:
    importer: str  # dotted module name; a package is named by its __init__.py
    imported: str
    line: int
    names_root: bool  # `import attnkit`, `from attnkit import x`, `from .. import x` at the top
    relative: bool

    def where(self) -> str:
        return f"{_path(self.importer)}:{self.line}"


@cache
def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every .py file of the package."""
    found = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _path(module: str) -> str:
    return _modules()[module].relative_to(ROOT).as_posix()


def _is_package(module: str) -> bool:
    return _modules()[module].name == "__init__.py"


def _internal(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def _edges_of(module: str) -> Iterator[Edge]:
    tree = ast.parse(_modules()[module].read_text(encoding="utf-8"))
    package = module if _is_package(module) else module.rpartition(".")[0]
    for node in ast.walk(tree):  # every statement, at any depth
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _internal(alias.name):
                    yield Edge(module, alias.name, node.lineno, alias.name == PACKAGE, False)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base_parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not _internal(base):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if sub in _modules() else base
                yield Edge(module, target, node.lineno, base == PACKAGE, node.level > 0)


@cache
def _all_edges() -> tuple[Edge, ...]:
    return tuple(edge for module in _modules() for edge in _edges_of(module))


@cache
def _edges() -> tuple[Edge, ...]:
    """The edges between existing files (a name that is not a file is reported on its own)."""
    return tuple(edge for edge in _all_edges() if edge.imported in _modules())


# --- layers ----------------------------------------------------------------------------------

CORE = {"masks", "functional", "registry"}
PACKAGE_LAYERS = {
    "backends": "backends",
    "flex": "modules",
    "quant": "modules",
    "models": "models",
    "integrations": "models",
    "viz": "viz",
    "train": "train",
    "distributed": "distributed",
    "serve": "serve",
    "learn": "learn",
    "tasks": "tasks",
    "commands": "cli",
}
RANK = {
    "core": 0,
    "backends": 1,
    "modules": 2,
    "models": 3,
    "viz": 4,
    "train": 4,
    "distributed": 4,
    "serve": 4,
    "learn": 5,
    "tasks": 5,
    "cli": 6,
}
PROTECTED = {"train", "distributed", "tasks", "serve"}  # imported only by these importers:
PROTECTED_IMPORTERS = {"cli", "tasks"}


def _layer(module: str) -> str | None:
    """The layer of a module by its path; None for the package root and for a new subpackage
    that no layer claims yet."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    top = parts[1]
    if top in CORE or top.startswith("_"):
        return "core"
    if top == "cli":
        return "cli"
    if top in PACKAGE_LAYERS:
        return PACKAGE_LAYERS[top]
    if len(parts) == 2 and not _is_package(module):
        return "modules"
    return None


def _top(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _layer_violation(edge: Edge) -> str | None:
    """Why ``edge`` breaks a layer rule, or None."""
    src, dst = _layer(edge.importer), _layer(edge.imported)
    if edge.importer == PACKAGE and dst in PROTECTED:
        return f"only cli, commands and tasks may import {dst}, not the package root"
    if src is None or dst is None:
        return None  # the root is checked by test_nothing_imports_the_package_root
    if (
        dst in PROTECTED
        and src not in PROTECTED_IMPORTERS
        and _top(edge.importer) != _top(edge.imported)
    ):
        return f"only cli, commands and tasks may import {dst}"
    if src == "viz" and dst not in {"core", "viz"}:
        return "viz imports only core (masks, functional, registry, _*)"
    if src == "distributed" and dst == "train":
        return "distributed never imports train"
    if RANK[dst] > RANK[src]:
        return f"{src} (layer {RANK[src]}) may not import {dst} (layer {RANK[dst]})"
    return None


# --- the checks ------------------------------------------------------------------------------


def test_the_package_is_found() -> None:
    assert f"{PACKAGE}.functional" in _modules() and len(_edges()) > 50


def test_every_import_names_an_existing_module() -> None:
    bad = sorted(
        {
            f"{edge.where()}: {edge.imported} is neither a file nor a package"
            for edge in _all_edges()
            if edge.imported not in _modules()
        }
    )
    assert not bad, "imports of modules that do not exist:\n" + "\n".join(bad)


def test_every_subpackage_has_a_layer() -> None:
    unplaced = sorted({_top(m) for m in _modules() if m != PACKAGE and _layer(m) is None})
    assert not unplaced, (
        "these subpackages belong to no layer; add them to PACKAGE_LAYERS here and to the "
        f"import-linter contracts in pyproject.toml: {unplaced}"
    )


def _cycles() -> list[list[str]]:
    """One concrete cycle per strongly connected component of two or more files (Tarjan)."""
    graph: dict[str, set[str]] = {m: set() for m in _modules()}
    for edge in _edges():
        if edge.imported != edge.importer:
            graph[edge.importer].add(edge.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the number of files
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)

    cycles = []
    for component in components:
        start = min(component)
        # breadth-first from start back to start, inside the component: a shortest cycle
        parent: dict[str, str] = {}
        frontier, found = [start], None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & component):
                    if w == start:
                        found = v
                        break
                    if w not in parent:
                        parent[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        path = [found]
        while path[-1] != start:
            path.append(parent[path[-1]])
        cycles.append([*reversed(path), start])
    return cycles


def test_no_import_cycles() -> None:
    lines = {}
    for edge in _edges():
        lines.setdefault((edge.importer, edge.imported), edge.line)
    report = []
    for cycle in _cycles():
        steps = [f"{_path(a)}:{lines[a, b]} imports {b}" for a, b in pairwise(cycle)]
        report.append("cycle:\n    " + "\n    ".join(steps))
    assert not report, "import cycles between files:\n" + "\n".join(report)


def test_nothing_imports_the_package_root() -> None:
    """Inside the package, modules import each other by name, never through ``attnkit``
    itself; the root ``__init__`` imports its submodules by their full dotted names."""
    bad = []
    for edge in _edges():
        if edge.importer == PACKAGE:
            if edge.names_root or edge.relative:
                bad.append(
                    f"{edge.where()}: imports {edge.imported} through the root or relatively; "
                    f"write `import {edge.imported} as ...` or `from {edge.imported} import ...`"
                )
        elif edge.names_root:
            bad.append(
                f"{edge.where()}: imports the package root {PACKAGE!r}; "
                "import the module that defines the name"
            )
    assert not bad, "imports of the package root:\n" + "\n".join(dict.fromkeys(bad))


def test_layers() -> None:
    bad = []
    for edge in _edges():
        why = _layer_violation(edge)
        if why:
            bad.append(f"{edge.where()}: {edge.importer} imports {edge.imported}: {why}")
    assert not bad, "layer rules broken:\n" + "\n".join(sorted(set(bad)))


def _source_files() -> list[Path]:
    suffixes = {".py", ".js", ".css", ".html"}
    return sorted(p for p in (SRC / PACKAGE).rglob("*") if p.suffix in suffixes)


def test_files_are_read_in_one_sitting() -> None:
    long = []
    for path in _source_files():
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES:
            long.append(f"{path.relative_to(ROOT).as_posix()}: {n} lines")
    assert not long, f"source files over {MAX_LINES} lines:\n" + "\n".join(long)


def test_no_attribute_type_ignores() -> None:
    """``# type: ignore[attr-defined]`` hides attributes hung on functions; declare a type."""
    bad = []
    for path in _source_files():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if "type: ignore[attr-defined]" in line:
                bad.append(f"{path.relative_to(ROOT).as_posix()}:{n}: {line.strip()}")
    assert not bad, "`# type: ignore[attr-defined]` in src/:\n" + "\n".join(bad)


def test_no_structure_is_read_out_of_closures() -> None:
    """Structure is data (``masks.exact_structure``): no module recognises a function by its
    code object or reads numbers out of its closure."""
    pattern = re.compile(r"getclosurevars|__code__|__closure__|co_freevars|cell_contents")
    bad = []
    for path in _source_files():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line):
                bad.append(f"{path.relative_to(ROOT).as_posix()}:{n}: {line.strip()}")
    assert not bad, "closure decoding in src/:\n" + "\n".join(bad)


# --- wording ---------------------------------------------------------------------------------

# Words about how the project was made, not about what it does.
PROVENANCE = [
    (re.compile(r"\bthe brief\b|\bbrief's\b", re.I), "refers to the brief"),
    (re.compile(r"\bthe issue\b|\bissue #?\d+\b", re.I), "refers to an issue"),
    (re.compile(r"\bT[1-5] (met|missed)\b"), "target code"),
    (re.compile(r"\bsessions?\b", re.I), "refers to a session"),
    (re.compile(r"\bthis stop\b", re.I), "refers to a stop"),
]
# Bare target codes used as labels ("T1:", "**T2**", "targets T1, T2"); "T5" the model
# (T5-style relative buckets, Raffel et al. 2020) is a name, not a code.
TARGET_CODE = re.compile(r"\bT[1-5]\b(?!-style)")
# A commit named next to the word, or any hex token of 7-40 with a letter and a digit.
COMMIT_HASH = re.compile(
    r"\bcommits?\W+[0-9a-f]{7,40}\b|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", re.I
)


def _text_files() -> list[Path]:
    suffixes = {".py", ".md", ".js", ".html"}
    files = [p for top in ("src", "docs", "benchmarks") for p in (ROOT / top).rglob("*")]
    files.append(ROOT / "README.md")
    return sorted(
        p for p in files if p.is_file() and p.suffix in suffixes and "egg-info" not in p.as_posix()
    )


def test_no_words_about_how_the_project_was_made() -> None:
    bad = []
    for path in _text_files():
        rel = path.relative_to(ROOT).as_posix()
        in_src = rel.startswith("src/")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            found = [why for pattern, why in PROVENANCE if pattern.search(line)]
            if not in_src and TARGET_CODE.search(line):
                found.append("target code")
            if rel == "docs/benchmarks.md" and COMMIT_HASH.search(line):
                found.append("commit hash")
            for why in dict.fromkeys(found):
                bad.append(f"{rel}:{n}: {why}: {line.strip()[:100]}")
    assert not bad, (
        "say what a reader needs (the target itself, the source of the example), not how the "
        "project was made:\n" + "\n".join(bad)
    )
