"""``backend="auto"`` against the fastest backend, cell by cell, and the cost model's calibration.

The grid: n = 512..8192 (b = 4 up to n = 1024, then fewer, 1 from n = 4096; h = 8, d = 64),
float32 and bfloat16, six kinds of call, forward and forward+backward:

    plain      no mask                      causal     is_causal=True
    alibi      ALiBi bias function, declared relative (``masks.relative``)
    relative   T5-style bucket bias function, declared relative
    window     causal sliding window of 256 keys (``masks.window_fn``: a declared band)
    document   causal attention within 8 packed documents: an undeclared mask function
               (document ids captured) plus is_causal=True

Each cell runs in a fresh subprocess: it builds the inputs once, then interleaves round by
round every backend that can serve the call (``backend=name``; functions are materialised
inside the timed call where the backend needs them) and ``backend="auto"``, and reports
medians. The machine is shared, so single cells move by 5-20 % between runs: read auto /
fastest together with the spread of its neighbours. After timing, auto's call runs once more
per pass with the peak resident set reset (``/proc/self/clear_refs``): its peak extra memory.

Before the grid, auto's own calibration runs for each dtype with the grid's thread count, in
a fresh process (``attnkit kernels calibrate``, building the fused kernel first when it is not
built), as a user's machine would do it; its time is reported. ``--threads 1`` measures the
one-thread profile (its own calibration), written to its own section.

    python benchmarks/auto.py --sizes 512 2048 --dtypes float32 --kinds alibi --modes fwd
    python benchmarks/auto.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _report, attention
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's attnkit

import _report
from _report import natural_int, positive_float, positive_int, thread_count, time_limit

HEADS, DIM, WINDOW, DOCUMENTS = 8, 64, 256, 8
SIZES = [512, 1024, 2048, 4096, 8192]
DTYPES = ["float32", "bfloat16"]
KINDS = ["plain", "causal", "alibi", "relative", "window", "document"]
MODES = ["fwd", "fwdbwd"]
# Bytes per (b, h, i, j) element at peak for routes that build n x n tensors (forward and
# backward); a backend whose cell would pass --max-dense-gb is not timed and says so.
DENSE_BYTES = {"math": 16.0, "chunked": 0.0}


MORE = "<!-- more -->\n\n"  # what comes after it is on the log page only


def batch_for(n: int) -> int:
    return max(1, min(4, 4096 // n))


def document_ids(n: int):
    """Document id per position: 8 documents with lengths drawn once per n (seeded)."""
    import torch

    g = torch.Generator().manual_seed(n)
    cuts = (torch.randperm(n - 1, generator=g)[: DOCUMENTS - 1] + 1).sort().values
    ids = torch.zeros(n, dtype=torch.long)
    for c in cuts.tolist():
        ids[c:] += 1
    return ids


def call_kwargs(kind: str, n: int) -> dict:
    """The keyword arguments of ``scaled_dot_product_attention`` for one kind of call."""
    import torch
    from attention import _alibi_fn, _relative_fn

    from attnkit import masks

    if kind == "plain":
        return {}
    if kind == "causal":
        return {"is_causal": True}
    if kind == "alibi":
        slopes = torch.tensor([2.0 ** (-8.0 * (x + 1) / HEADS) for x in range(HEADS)])
        return {"bias": _alibi_fn(slopes)}
    if kind == "relative":
        table = torch.randn(HEADS, 32, generator=torch.Generator().manual_seed(0))
        return {"bias": _relative_fn(table)}
    if kind == "window":
        return {"mask": masks.window_fn(WINDOW - 1, 0)}
    if kind == "document":
        ids = document_ids(n)

        def document(b, h, i, j):
            return ids[i] == ids[j]

        return {"mask": document, "is_causal": True}
    raise ValueError(f"unknown kind {kind!r}")


# Worker side: one cell in a fresh subprocess.


def cell(job: dict) -> dict:
    import torch

    import attnkit  # noqa: F401  (registers the backends and their costs)
    from attnkit import registry, scaled_dot_product_attention
    from attnkit.backends import explain

    torch.set_num_threads(job["threads"])
    torch.manual_seed(0)
    b, n, dtype = job["b"], job["n"], getattr(torch, job["dtype"])
    inputs = [torch.randn(b, HEADS, n, DIM, dtype=dtype, requires_grad=True) for _ in range(3)]
    q, k, v = inputs
    kw = call_kwargs(job["kind"], n)
    result: dict = {"skipped": {}, "auto": {}, "times": {}}
    names = []
    for verdict in explain(q, k, v, **kw).verdicts:
        name, estimate = verdict.backend, verdict.estimate
        if estimate is None or (job["backends"] and name not in job["backends"]):
            continue  # cannot serve the call, or not asked for
        dense = DENSE_BYTES.get(name, 0.0) * b * HEADS * n * n + estimate.materialised
        if dense > job["max_dense_bytes"]:
            result["skipped"][name] = "its n x n tensors exceed --max-dense-gb"
            continue
        names.append(name)
    for mode in job["modes"]:
        grad = mode == "fwdbwd"
        with torch.set_grad_enabled(grad):
            e = explain(q, k, v, **kw)
        chosen = e.verdicts[0]
        result["auto"][mode] = {
            "backend": e.backend,
            "materialised": chosen.estimate.materialised if chosen.estimate else None,
            "estimates": {v.backend: v.estimate.seconds for v in e.verdicts if v.estimate},
        }
    fns = {
        name: (lambda name=name: scaled_dot_product_attention(q, k, v, backend=name, **kw))
        for name in [*names, "auto"]
    }
    times: dict[str, list[float]] = {f"{m}|{mode}": [] for m in fns for mode in job["modes"]}
    for r in range(job["warmup"] + job["repeats"]):
        for name, fn in fns.items():
            for mode in job["modes"]:
                start = time.perf_counter()
                _report.grad_step(fn, mode, inputs)
                if r >= job["warmup"]:
                    times[f"{name}|{mode}"].append(time.perf_counter() - start)
    # A cell where auto's median is over 5 % above the fastest's gets more rounds of just
    # those two (and auto's own choice), interleaved: two medians of three that differ by
    # chance are measured again rather than reported as auto's cost.
    result["confirmed"] = {}
    for mode in job["modes"]:
        med = {name: statistics.median(times[f"{name}|{mode}"]) for name in fns}
        fastest = min((name for name in fns if name != "auto"), key=med.get)
        if med["auto"] <= 1.05 * med[fastest] or not job["confirm"]:
            continue
        again = dict.fromkeys([fastest, result["auto"][mode]["backend"], "auto"])
        again = [name for name in again if name in fns]
        for _ in range(job["confirm"]):
            for name in again:
                start = time.perf_counter()
                _report.grad_step(fns[name], mode, inputs)
                times[f"{name}|{mode}"].append(time.perf_counter() - start)
        result["confirmed"][mode] = again
    result["times"] = {key: statistics.median(ts) for key, ts in times.items()}
    if Path("/proc/self/clear_refs").exists():
        for mode in job["modes"]:
            before = _report.status_kib("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            _report.grad_step(fns["auto"], mode, inputs)
            result["auto"][mode]["peak_mb"] = (_report.status_kib("VmHWM") - before) / 1024
    registry_budget = registry.get_memory_budget()
    result["budget"] = registry_budget
    return result


def run_worker(job: dict, timeout: float) -> dict:
    return _report.run_worker(__file__, job, timeout)


def summarise(job: dict, result: dict) -> list[dict]:
    """One row per pass: the fastest backend, auto's choice and time, their ratio."""
    rows = []
    for mode in job["modes"]:
        mine = {
            name: t
            for key, t in result["times"].items()
            for name, m in [key.split("|")]
            if m == mode and name != "auto"
        }
        fastest = min(mine, key=mine.get)
        auto = result["auto"][mode]
        rows.append(
            {
                "n": job["n"],
                "b": job["b"],
                "dtype": job["dtype"],
                "kind": job["kind"],
                "mode": mode,
                "fastest": fastest,
                "fastest_s": mine[fastest],
                "auto": auto["backend"],
                "auto_s": result["times"][f"auto|{mode}"],
                "chosen_s": mine.get(auto["backend"]),
                "materialised": auto["materialised"],
                "peak_mb": auto.get("peak_mb"),
                "budget": result["budget"],
                "times": mine,
                "skipped": result["skipped"],
                "confirmed": result.get("confirmed", {}).get(mode, []),
            }
        )
    return rows


def short_cpu(name: str) -> str:
    """A CPU's name without trademarks and filler, for a heading: "Intel Xeon (..., with AMX)"."""
    return re.sub(r"\s+", " ", re.sub(r"\((R|TM)\)| Processor| CPU", "", name)).strip()


def render(
    rows: list[dict],
    command: str,
    elapsed: float,
    repeats: int,
    threads: int = 2,
    cpu_in_title: bool = False,
) -> str:
    from _report import cpu, environment

    ratios = [r["auto_s"] / r["fastest_s"] for r in rows]
    within = sum(x <= 1.10 for x in ratios)
    chosen_within = sum(
        r["chosen_s"] is not None and r["chosen_s"] <= 1.10 * r["fastest_s"] for r in rows
    )
    over = [r for r in rows if r["materialised"] and r["materialised"] > r["budget"]]
    confirmed = sum(bool(r.get("confirmed")) for r in rows)
    lines = [
        (
            f"## auto on {short_cpu(cpu())}, {threads} thread"
            if cpu_in_title
            else f"## auto: the chosen route against the fastest, {threads} thread"
        )
        + ("s" if threads > 1 else ""),
        "",
        f"auto within 10 % of the fastest in {within} of {len(rows)} cells (worst "
        f"{max(ratios):.2f}x); the backend it chose within 10 % of the fastest, in the same "
        f"rounds, in {chosen_within} of {len(rows)}; auto's built masks and biases above the "
        f"1 GiB budget in {len(over)} cells.",
        "",
        "<!-- more -->",  # the page shows the lines above; the grid is on the log page
        "",
        f"Command: {command} ({elapsed / 60:.1f} min). {environment()}; "
        "h=8, d=64; b = 4 up to n = 1024, 2 at 2048, 1 "
        f"from 4096. Each cell is a fresh process that interleaves, round by round, every "
        f'backend able to serve the call and `backend="auto"`; times are medians of {repeats} '
        "rounds. Where auto's median came out over 5 % above the fastest's, the cell ran "
        f"more rounds of just those two and auto's choice, interleaved ({confirmed} of "
        f"{len(rows)} cells, marked *), and the medians are over all rounds. Single cells "
        "move by 5-20 % between runs on this machine; auto's time "
        "includes its dispatch and is measured in the same rounds "
        "as the backend it picks (`chosen ms`), so auto / fastest above 1 with auto on the "
        "fastest backend is noise between two runs of the same code.",
        "",
        "| n | dtype | call | pass | fastest | fastest ms | auto takes | chosen ms | auto ms "
        "| auto / fastest | auto builds MiB | auto peak MiB | others (ms) |",
        "|---:|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        others = ", ".join(
            f"{name} {t * 1e3:,.0f}" for name, t in sorted(r["times"].items(), key=lambda x: x[1])
        )
        if r["skipped"]:
            others += "; not timed: " + ", ".join(r["skipped"])
        chosen = "—" if r["chosen_s"] is None else f"{r['chosen_s'] * 1e3:,.1f}"
        peak = "—" if r["peak_mb"] is None else f"{r['peak_mb']:,.0f}"
        built = (r["materialised"] or 0) / 2**20
        lines.append(
            f"| {r['n']} | {r['dtype']} | {r['kind']} | {r['mode']} | {r['fastest']} | "
            f"{r['fastest_s'] * 1e3:,.1f} | {r['auto']} | {chosen} | {r['auto_s'] * 1e3:,.1f} | "
            f"{r['auto_s'] / r['fastest_s']:.2f}{'*' if r.get('confirmed') else ''} | "
            f"{built:,.0f} | {peak} | {others} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=positive_int, nargs="+", default=SIZES)
    parser.add_argument("--dtypes", nargs="+", default=DTYPES, choices=DTYPES)
    parser.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS)
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--backends", nargs="+", default=[], help="time only these (and auto)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed rounds (median)")
    parser.add_argument("--warmup", type=natural_int, default=1, help="untimed rounds first")
    parser.add_argument(
        "--confirm",
        type=natural_int,
        default=6,
        help="more rounds of auto and the fastest where auto's median is over 5 %% above it",
    )
    parser.add_argument("--threads", type=thread_count, default=2)
    parser.add_argument(
        "--max-dense-gb", type=positive_float, default=6.0, help="skip bigger dense routes"
    )
    parser.add_argument(
        "--no-calibrate", action="store_true", help="keep auto's measurements as they are"
    )
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument(
        "--tables", nargs="+", metavar="JSON", help="render rows saved by --json runs, no timing"
    )
    parser.add_argument("--no-write", action="store_true", help="do not write docs/benchmarks.md")
    parser.add_argument(
        "--section",
        help="the section of docs/benchmarks.md to write (default: auto, or auto-N-thread for "
        "--threads N); another name titles it with the CPU, e.g. auto-amx for one CPU class",
    )
    parser.add_argument("--timeout", type=time_limit, default=1800, help="seconds per subprocess")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.section is not None and not args.section.replace("-", "").isalnum():
        parser.error(f"--section must be letters, digits and '-', got {args.section!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(cell(json.loads(args.worker))))
        return 0
    command = shlex.join(
        ["python", "benchmarks/auto.py", *(argv if argv is not None else sys.argv[1:])]
    )
    import torch

    torch.set_num_threads(args.threads)  # the environment line names the grid's thread count
    rows: list[dict] = []
    started = time.time()
    default = "auto" if args.threads == 2 else f"auto-{args.threads}-thread"
    section = args.section or default
    titled = section != default  # another section: its title names the CPU
    calibrated = "" if args.no_calibrate or args.tables else calibrate(args.threads, args.dtypes)
    if args.tables:
        saved = [json.loads(Path(f).read_text()) for f in args.tables]
        rows = [r for part in saved for r in part["rows"]]
        command = " and ".join(f"`{part['command']}`" for part in saved)
        calibrated = " ".join(part.get("calibrated", "") for part in saved)
        elapsed = sum(part["elapsed"] for part in saved)
        md = render(rows, command, elapsed, args.repeats, args.threads, titled)
        md = md.replace(MORE, f"{MORE}{calibrated}\n\n", 1) if calibrated else md
        print(md)
        if not args.no_write:
            from _report import write_section

            print(f"wrote {write_section(section, md)}", file=sys.stderr)
        return 0
    for n in args.sizes:
        for dtype in args.dtypes:
            for kind in args.kinds:
                job = {
                    "n": n,
                    "b": batch_for(n),
                    "dtype": dtype,
                    "kind": kind,
                    "modes": args.modes,
                    "backends": args.backends,
                    "repeats": args.repeats,
                    "warmup": args.warmup,
                    "confirm": args.confirm,
                    "threads": args.threads,
                    "max_dense_bytes": args.max_dense_gb * 1e9,
                }
                new = summarise(job, run_worker(job, args.timeout))
                rows += new
                for r in new:
                    print(
                        f"n={n} {dtype} {kind} {r['mode']}: fastest {r['fastest']} "
                        f"{r['fastest_s'] * 1e3:.1f} ms, auto {r['auto']} "
                        f"{r['auto_s'] * 1e3:.1f} ms ({r['auto_s'] / r['fastest_s']:.2f}x) "
                        f"[{time.time() - started:.0f} s]",
                        file=sys.stderr,
                        flush=True,
                    )
    elapsed = time.time() - started
    if args.json:
        saved = {"command": command, "elapsed": elapsed, "rows": rows, "calibrated": calibrated}
        Path(args.json).write_text(json.dumps(saved, indent=1))
    md = render(rows, f"`{command}`", elapsed, args.repeats, args.threads, titled)
    md = md.replace(MORE, f"{MORE}{calibrated}\n\n", 1) if calibrated else md
    print(md)
    if not args.no_write:
        from _report import write_section

        print(f"wrote {write_section(section, md)}", file=sys.stderr)
    return 0


def calibrate(threads: int, dtypes: list[str]) -> str:
    """auto's own calibration for this thread count, in a fresh process, as a user gets it
    (``attnkit kernels calibrate``); returns a sentence with its times."""
    import subprocess

    command = [sys.executable, "-m", "attnkit.cli", "kernels", "calibrate"]
    command += ["--threads", str(threads), "--dtypes", *dtypes]
    start = time.time()
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    print(out, file=sys.stderr, end="")
    took = [line.split("measured in ")[1] for line in out.splitlines() if "measured in" in line]
    return (
        f"auto's calibration on this profile ({threads} thread{'s' if threads > 1 else ''}): "
        f"{', '.join(f'{d} {t}' for d, t in zip(dtypes, took, strict=False))} "
        f"({time.time() - start:.0f} s with process start and any kernel build)."
    )


if __name__ == "__main__":
    sys.exit(main())
