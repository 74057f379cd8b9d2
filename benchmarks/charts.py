"""Redraw the charts at the top of docs/benchmarks.md from the tables recorded below them.

Each benchmark script draws its charts from its own rows when it writes its section. This
script parses the markdown tables already recorded in ``docs/benchmarks.md`` back into the rows
those scripts produce and calls the same chart functions, so the charts show exactly the
measured tables without hours of measuring again:

    attention.png              benchmarks/attention.py, the first (latest) table of its section
    attention-all-methods.png  the same section's table with the most methods
    flex-float32.png, flex-bfloat16.png
                               benchmarks/flex.py, one chart per dtype
    generate.png               benchmarks/generate.py
    serve.png                  benchmarks/serve.py
    hf_models.png              benchmarks/hf_models.py (once its section is recorded)

A section or table that is not recorded draws nothing (and says so).

    python benchmarks/charts.py              # writes docs/images/benchmarks/*.png
    python benchmarks/charts.py --out DIR    # somewhere else
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _report and the scripts
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's attnkit

import attention as attention_bench
import flex as flex_bench
import generate as generate_bench
import hf_models as hf_bench
import serve as serve_bench
from _report import CHARTS, DOC, read_section

Table = list[dict[str, str]]  # one dict per body row: header -> cell text


def tables(markdown: str) -> list[Table]:
    """The pipe tables of ``markdown``, in order; a cell keeps its text, stripped."""
    found: list[Table] = []
    lines = markdown.splitlines()
    for at in range(len(lines) - 1):
        if not (_is_row(lines[at]) and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[at + 1])):
            continue
        if at and _is_row(lines[at - 1]):
            continue  # the separator of a table already read
        header = _cells(lines[at])
        body = []
        for line in lines[at + 2 :]:
            if not _is_row(line):
                break
            body.append(dict(zip(header, _cells(line), strict=False)))
        found.append(body)
    return found


def _is_row(line: str) -> bool:
    return line.startswith("|") and line.rstrip().endswith("|")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip()[1:-1].split("|")]


def number(cell: str | None) -> float | None:
    """``"1,234"`` -> 1234.0, ``"0.52 (1.0)"`` -> 0.52, ``"3.2x"`` -> 3.2; not a number
    (``"—"``, ``""``, ``"not run"``) -> None."""
    found = re.match(r"-?[\d,]*\.?\d+", (cell or "").strip())
    return None if found is None else float(found.group(0).replace(",", ""))


def _has(table: Table, *columns: str) -> bool:
    return bool(table) and all(c in table[0] for c in columns)


# Each parser gives back the rows of the script that wrote the table.


def attention_rows(table: Table) -> list[dict]:
    rows = []
    for cell in table:
        skipped = cell["fwd ms"].startswith("skipped")
        ms = {mode: None if skipped else number(cell[f"{label} ms"])
              for mode, label in (("fwd", "fwd"), ("fwdbwd", "fwd+bwd"))}  # fmt: skip
        mb = {mode: None if skipped else number(cell[f"{label} MB"])
              for mode, label in (("fwd", "fwd"), ("fwdbwd", "fwd+bwd"))}  # fmt: skip
        rows.append({
            "n": int(number(cell["n"]) or 0), "b": int(number(cell["b"]) or 0),
            "method": cell["method"], "skipped": skipped,
            **{f"{m}_s": None if t is None else t / 1e3 for m, t in ms.items()},
            **{f"{m}_mb": v for m, v in mb.items()},
        })  # fmt: skip
    return rows


def flex_rows(table: Table) -> list[dict]:
    rows = []
    for cell in table:
        skipped = cell.get("fwd s", "").startswith("skipped")
        key = (cell["scenario"], int(number(cell["n"]) or 0), cell["dtype"])
        times = {m: number(cell.get(f"{m} s")) for m in ("fwd", "fwdbwd")}
        mem = {m: number(cell.get(f"{m} MB")) for m in ("fwd", "fwdbwd")}
        rows.append({
            "key": key, "route": cell["route"], "skipped": skipped,
            "times": {m: t for m, t in times.items() if t is not None and not skipped},
            "mem": {m: v for m, v in mem.items() if v is not None and not skipped},
        })  # fmt: skip
    return rows


def generate_rows(table: Table) -> list[dict]:
    """The rows of a generate speed table; the libraries are read from its columns, the thread
    count from its ``threads`` column (2 in tables recorded before it had one)."""
    head = "prefill tok/s "
    libraries = [k.removeprefix(head) for k in table[0] if k.startswith(head)]
    return [
        {
            "n": int(number(cell["prompt tokens"]) or 0),
            "threads": int(number(cell.get("threads", "2")) or 2),
            "library": library,
            "prefill_tok_s": number(cell[f"prefill tok/s {library}"]),
            "decode_tok_s": number(cell[f"decode tok/s {library}"]),
        }
        for cell in table
        for library in libraries
    ]


def serve_rows(table: Table) -> dict[str, list[dict]]:
    """A serve load table as ``benchmarks/serve.py`` measures it: rows per server."""
    out: dict[str, list[dict]] = {"attnkit": [], "llama.cpp": []}
    for cell in table:
        out.setdefault(cell["server"], []).append(
            {
                "clients": int(number(cell["clients"]) or 0),
                "tokens_per_s": number(cell["tokens/s"]),
                "itl_p50": (number(cell["ITL p50 (ms)"]) or 0.0) / 1e3,
            }
        )
    return out


def hf_rows(table: Table) -> list[dict]:
    rows = []
    for cell in table:
        row: dict = {"model": cell["model"], "n": int(number(cell["n"]) or 0)}
        for impl in hf_bench.IMPLEMENTATIONS:
            seconds = number(cell[f"{impl} (s)"])
            if seconds is None:
                continue  # "not run"
            cpu = re.search(r"\(([\d.]+)\)", cell[f"{impl} (s)"])
            row[impl] = {
                "seconds": seconds,
                "cpu_seconds": float(cpu.group(1)) if cpu else None,
                "peak_mib": number(cell[f"{impl} peak (MiB)"]),
            }
        floor = number(cell.get("floor (MiB)", "not run"))
        if floor is not None:
            row[hf_bench.FLOOR] = {"seconds": None, "cpu_seconds": None, "peak_mib": floor}
        rows.append(row)
    return rows


def _section_tables(name: str, doc: Path, *columns: str) -> list[Table]:
    markdown = read_section(name, doc)
    return [] if markdown is None else [t for t in tables(markdown) if _has(t, *columns)]


def draw_all(
    doc: Path = DOC, out: Path = CHARTS, say: Callable[[str], object] = print
) -> list[Path]:
    """Every chart the recorded tables of ``doc`` allow, written to ``out``."""
    made: list[Path] = []
    found = [attention_rows(t) for t in _section_tables("attention", doc, "method", "fwd ms")]
    if found:
        chosen = attention_bench.CHART_METHODS["attention"]
        made.append(attention_bench.chart(found[0], "attention", chosen, out))
        widest = max(found, key=lambda rows: len({r["method"] for r in rows}))
        made.append(attention_bench.chart(widest, "attention-all-methods", None, out))
    flex = [r for t in _section_tables("flex", doc, "scenario", "route") for r in flex_rows(t)]
    for dtype in dict.fromkeys(r["key"][2] for r in flex):
        made.append(flex_bench.chart(flex, dtype, out))
    generate = _section_tables("generate", doc, "prompt tokens")
    if generate:
        made.append(generate_bench.chart([r for t in generate for r in generate_rows(t)], out))
    hf = _section_tables("hf_models", doc, "model", "attnkit (s)")
    if hf:
        made.append(hf_bench.chart(hf_rows(hf[0]), out))
    serve = _section_tables("serve", doc, "server", "clients", "tokens/s")
    if serve:
        made.append(serve_bench.chart(serve_rows(serve[0]), out))
    recorded = {
        "attention": found,
        "flex": flex,
        "generate": generate,
        "hf_models": hf,
        "serve": serve,
    }
    for name, rows in recorded.items():
        if not rows:
            say(f"{doc.name}: no recorded {name} table, no chart")
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doc", type=Path, default=DOC, help="the page whose tables to draw")
    parser.add_argument("--out", type=Path, default=CHARTS, help="folder for the PNGs")
    args = parser.parse_args(argv)
    for path in draw_all(args.doc, args.out):
        print(f"wrote {path} ({path.stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
