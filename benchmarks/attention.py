"""Efficient attention on CPU: speed and peak extra memory of every attnkit algorithm vs torch.

For each sequence length ``n`` (b batch, h=8 heads, d=64, float32, 2 threads) it measures the
median forward and forward+backward time and the peak extra memory of:

    math                   attnkit's reference (explicit n x n scores)
    torch / torch causal   torch's fused F.scaled_dot_product_attention
    torch + ALiBi tensor   the fused kernel given the ALiBi bias as a dense (1, h, n, n) tensor,
                           built inside the timed call (a user must build it)
    torch + window mask    the fused kernel given a dense sliding-window mask (256 keys)
    tiled / tiled causal   attnkit's tiled backend (FlashAttention in PyTorch)
    tiled + ALiBi fn       the tiled backend given ALiBi as a bias *function* (never n x n),
                           declared relative (``masks.relative``): evaluated once per pass
    torch + relative tensor / tiled + relative fn
                           the same pair for a T5-style relative-position bucket bias (a
                           learned-looking table per head, log-spaced buckets: never underflows),
                           also declared relative; the dense tensor is built from the same
                           function with ``masks.materialize``
    sparse window 256      the sparse backend, causal sliding window of 256 keys
    chunked                query-chunked exact attention (checkpointed in backward)
    linear / linear causal kernelised linear attention (a different attention, for scale)
    fused, fused causal, fused + ALiBi fn, fused + relative fn (not in the default grid)
                           the fused C++ kernel of the tiled algorithm (backend "fused"),
                           built on first use; ``--dtype bfloat16`` runs every route in bfloat16

and a float32 matmul's GFLOP/s in the same processes, as the machine's ceiling.

Method: timings of one ``n`` run in one fresh subprocess that builds the inputs once and then
interleaves the candidates round by round (median over rounds), so load changes hit all of them.
Peak extra memory runs each (method, n, mode) in its own fresh subprocess: on Linux it resets
the peak RSS (``echo 5 > /proc/self/clear_refs``), runs the call once, and reports ``VmHWM``
minus the RSS before the call (inputs already allocated; gradients count as extra).
Dense routes whose n x n tensors would exceed ``--max-dense-gb`` are skipped and say so.

FLOPs: forward ``4 b h n^2 d`` (half for causal, ``4 b h n w d`` for a window of ``w``),
forward+backward 3.5x the forward (FlashAttention's convention: backward = 2.5 forwards).

    python benchmarks/attention.py                # the full table (30-40 min, quiet machine)
    python benchmarks/attention.py --quick        # a smoke run: n = 512, 1024, 2 rounds, time
                                                  # only, docs/benchmarks.md left as it is
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _report, when run from anywhere
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's attnkit
import _report
from _report import natural_int, positive_float, positive_int, thread_count, time_limit

from attnkit._progress import progress  # a bar when stderr is a terminal

HEADS, DIM, WINDOW = 8, 64, 256

METHODS = [
    "math",
    "torch",
    "torch causal",
    "torch + ALiBi tensor",
    "torch + window mask",
    "tiled",
    "tiled causal",
    "tiled + ALiBi fn",
    "torch + relative tensor",
    "tiled + relative fn",
    "sparse window 256",
    "chunked",
    "linear",
    "linear causal",
]
# Not in the default grid: the same bias functions without the ``relative`` declaration, so the
# tiled backend evaluates them per tile (what an arbitrary bias function costs).
EXTRA_METHODS = [
    "tiled + ALiBi fn, undeclared",
    "tiled + relative fn, undeclared",
    "fused",
    "fused causal",
    "fused + ALiBi fn",
    "fused + relative fn",
]
# Methods that build n x n tensors, with bytes per (b * h * n * n) element at peak, estimated
# for forward+backward (the cap below skips them where they would not fit).
DENSE_BYTES = {
    "math": 16.0,
    "chunked": 0.0,
    "torch + ALiBi tensor": 8.0,
    "torch + relative tensor": 8.0,
    "torch + window mask": 0.5,
}


def batch_for(n: int) -> int:
    """b = 4 up to n = 1024, then fewer so each size costs about the same: b = 1 from 4096."""
    return max(1, min(4, 4096 // n))


def flops(method: str, b: int, n: int, mode: str) -> float | None:
    if method.startswith("linear"):
        return None  # a different computation: GFLOP/s would not compare
    fwd = 4.0 * b * HEADS * n * n * DIM
    if "causal" in method:
        fwd /= 2
    if "window" in method:
        fwd = 4.0 * b * HEADS * n * min(WINDOW, n) * DIM
    return fwd if mode == "fwd" else 3.5 * fwd


# Worker side: runs inside a fresh subprocess.


def _alibi_fn(slopes):
    from attnkit.masks import relative

    def alibi(b, h, i, j):  # ALiBi (Press et al. 2022), symmetric: -slope_h * |i - j|
        return -slopes[h] * (i - j).abs()

    return relative(alibi)  # depends on j - i only: tiled evaluates it once per call


def _relative_fn(table):
    """T5-style buckets (Raffel et al. 2020): 8 exact distances, then log-spaced up to 128, per
    direction; ``table`` ``(h, 32)`` holds one bias per head and bucket."""
    import math

    import torch

    def relative(b, h, i, j):
        d = j - i
        a = d.abs()
        far = 8 + (torch.log(a.clamp(min=1).float() / 8) / math.log(16) * 8).long().clamp(max=7)
        return table[h, torch.where(a < 8, a, far) + (d > 0).long() * 16]

    from attnkit.masks import declare

    return declare(relative, relative=True)  # depends on j - i only


def make_call(method: str, q, k, v):
    """A zero-argument function computing the attention output for ``method``."""
    import torch
    import torch.nn.functional as F

    import attnkit.backends.fused  # noqa: F401  (registers "fused")
    from attnkit import masks, scaled_dot_product_attention
    from attnkit.backends.linear import linear_attention

    n = q.shape[2]
    slopes = torch.tensor([2.0 ** (-8.0 * (x + 1) / HEADS) for x in range(HEADS)])
    alibi = _alibi_fn(slopes)
    relative = _relative_fn(torch.randn(HEADS, 32, generator=torch.Generator().manual_seed(0)))
    window = masks.window_fn(WINDOW - 1, 0)
    calls = {
        "math": lambda: scaled_dot_product_attention(q, k, v, backend="math"),
        "torch": lambda: F.scaled_dot_product_attention(q, k, v),
        "torch causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "torch + ALiBi tensor": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=masks.materialize(alibi, (1, HEADS, n, n)).to(q.dtype)
        ),
        "torch + window mask": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=masks.sliding_window_mask(n, left=WINDOW - 1)
        ),
        "tiled": lambda: scaled_dot_product_attention(q, k, v, backend="tiled"),
        "tiled causal": lambda: scaled_dot_product_attention(
            q, k, v, is_causal=True, backend="tiled"
        ),
        "tiled + ALiBi fn": lambda: scaled_dot_product_attention(
            q, k, v, bias=alibi, backend="tiled"
        ),
        "torch + relative tensor": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=masks.materialize(relative, (1, HEADS, n, n)).to(q.dtype)
        ),
        "tiled + relative fn": lambda: scaled_dot_product_attention(
            q, k, v, bias=relative, backend="tiled"
        ),
        "tiled + ALiBi fn, undeclared": lambda: scaled_dot_product_attention(
            q, k, v, bias=lambda b, h, i, j: alibi(b, h, i, j), backend="tiled"
        ),
        "tiled + relative fn, undeclared": lambda: scaled_dot_product_attention(
            q, k, v, bias=lambda b, h, i, j: relative(b, h, i, j), backend="tiled"
        ),
        "sparse window 256": lambda: scaled_dot_product_attention(
            q, k, v, window, backend="sparse"
        ),
        "chunked": lambda: scaled_dot_product_attention(q, k, v, backend="chunked"),
        "fused": lambda: scaled_dot_product_attention(q, k, v, backend="fused"),
        "fused causal": lambda: scaled_dot_product_attention(
            q, k, v, is_causal=True, backend="fused"
        ),
        "fused + ALiBi fn": lambda: scaled_dot_product_attention(
            q, k, v, bias=alibi, backend="fused"
        ),
        "fused + relative fn": lambda: scaled_dot_product_attention(
            q, k, v, bias=relative, backend="fused"
        ),
        "linear": lambda: linear_attention(q, k, v),
        "linear causal": lambda: linear_attention(q, k, v, is_causal=True),
    }
    return calls[method]


def _step(fn, mode: str, inputs) -> None:
    out = fn()
    if mode == "fwdbwd":
        out.sum().backward()
        for t in inputs:
            t.grad = None


def worker(job: dict) -> dict:
    import torch

    torch.set_num_threads(job["threads"])
    torch.manual_seed(0)
    b, n = job["b"], job["n"]
    dtype = getattr(torch, job.get("dtype", "float32"))
    inputs = [torch.randn(b, HEADS, n, DIM, dtype=dtype, requires_grad=True) for _ in range(3)]
    q, k, v = inputs
    if job["kind"] == "memory":
        # Page in the code this method runs (kernels, thread pools) on tiny inputs first, so
        # the measurement counts tensors, not shared libraries touched for the first time.
        tiny = [torch.randn(1, HEADS, 64, DIM, dtype=dtype, requires_grad=True) for _ in range(3)]
        _step(make_call(job["method"], *tiny), job["mode"], tiny)
        del tiny
        fn = make_call(job["method"], q, k, v)
        before = _report.status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        if job["mode"] == "fwd":
            with torch.no_grad():
                _step(fn, "fwd", inputs)
        else:
            _step(fn, "fwdbwd", inputs)
        return {"extra_mb": (_report.status_kib("VmHWM") - before) / 1024}
    # Timing: interleave all methods round by round; a matmul ceiling each round.
    a = torch.randn(2048, 2048)
    fns = {m: make_call(m, q, k, v) for m in job["methods"]}
    times: dict[str, list[float]] = {f"{m}|{mode}": [] for m in fns for mode in job["modes"]}
    times["matmul"] = []
    for r in range(job["warmup"] + job["repeats"]):
        start = time.perf_counter()
        a @ a
        if r >= job["warmup"]:
            times["matmul"].append(time.perf_counter() - start)
        for m, fn in fns.items():
            for mode in job["modes"]:
                start = time.perf_counter()
                if mode == "fwd":
                    with torch.no_grad():
                        _step(fn, mode, inputs)
                else:
                    _step(fn, mode, inputs)
                if r >= job["warmup"]:
                    times[f"{m}|{mode}"].append(time.perf_counter() - start)
    return {key: statistics.median(ts) for key, ts in times.items()}


# Driver side.


def run_worker(job: dict, timeout: float) -> dict:
    return _report.run_worker(__file__, job, timeout)


def fits(method: str, b: int, n: int, max_dense_gb: float) -> bool:
    per = DENSE_BYTES.get(method, 0.0)
    return per * b * HEADS * n * n / 1e9 <= max_dense_gb


QUICK_SIZES = [512, 1024]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes", type=positive_int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384]
    )
    parser.add_argument(
        "--batch", type=positive_int, default=None, help="b for every n (default: 4..1)"
    )
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed rounds (median)")
    parser.add_argument("--warmup", type=natural_int, default=1, help="untimed rounds first")
    parser.add_argument("--threads", type=thread_count, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--methods", nargs="+", default=METHODS, choices=METHODS + EXTRA_METHODS, metavar="M"
    )
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    parser.add_argument("--no-memory", action="store_true", help="skip peak-memory runs")
    parser.add_argument(
        "--max-dense-gb", type=positive_float, default=6.0, help="skip bigger dense routes"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: n = 512, 1024; 2 rounds; no peak-memory runs (a fresh process each); "
        "never writes docs/benchmarks.md",
    )
    parser.add_argument("--no-write", action="store_true", help="do not write docs/benchmarks.md")
    parser.add_argument("--timeout", type=time_limit, default=3600, help="seconds per subprocess")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:  # its table is no measurement to keep: it never replaces the recorded one
        args.sizes, args.repeats, args.no_memory, args.no_write = QUICK_SIZES, 2, True, True
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    if not Path("/proc/self/clear_refs").exists():
        print("peak memory needs Linux /proc; measuring time only", file=sys.stderr)
        args.no_memory = True

    command = shlex.join(
        ["python", "benchmarks/attention.py", *(argv if argv is not None else sys.argv[1:])]
    )
    rows: list[dict] = []
    ceiling: list[float] = []
    started = time.time()
    for n in progress(args.sizes, desc="sizes", unit="n"):
        b = args.batch or batch_for(n)
        methods = [m for m in args.methods if fits(m, b, n, args.max_dense_gb)]
        skipped = [m for m in args.methods if m not in methods]
        job = {
            "kind": "time",
            "n": n,
            "b": b,
            "threads": args.threads,
            "methods": methods,
            "modes": args.modes,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "dtype": args.dtype,
        }
        times = run_worker(job, args.timeout)
        ceiling.append(2 * 2048**3 / times["matmul"] / 1e9)
        for m in args.methods:
            row = {"n": n, "b": b, "method": m, "skipped": m in skipped}
            for mode in args.modes:
                t = times.get(f"{m}|{mode}")
                row[f"{mode}_s"] = t
                row[f"{mode}_mb"] = None
                if t is not None and not args.no_memory:
                    mem_job = {**job, "kind": "memory", "method": m, "mode": mode}
                    row[f"{mode}_mb"] = run_worker(mem_job, args.timeout)["extra_mb"]
            rows.append(row)
        print(f"n={n} done ({time.time() - started:.0f} s)", file=sys.stderr, flush=True)
    elapsed = time.time() - started
    import torch

    torch.set_num_threads(args.threads)  # so environment() reports what the workers used
    matmul = statistics.median(ceiling)
    targets = evaluate_targets(rows, args.modes)
    md = render(rows, args, matmul, targets, command, elapsed)
    print(md)
    if not args.no_write:
        from _report import write_section

        print(f"wrote {write_section('attention', md)}", file=sys.stderr)
        for name, methods in CHART_METHODS.items():
            print(f"wrote {chart(rows, name, methods, dtype=args.dtype)}", file=sys.stderr)
    return 0


# The charts at the top of docs/benchmarks.md: the routes compared by the targets, and every
# method (None) of a run.
CHART_METHODS = {
    "attention": [m for m in METHODS if m.startswith(("torch", "tiled")) and "window" not in m],
    "attention-all-methods": None,
}


def chart(
    rows: list[dict], name: str, methods: list[str] | None = None, out_dir=None, dtype="float32"
):
    """Draw chart ``name`` from the rows ``main`` measured: forward+backward time and peak extra
    memory of one sequence (the call's figures divided by b) against n, one line per method."""
    from _report import CHARTS as folder
    from _report import write_chart

    kept = [r for r in rows if not r["skipped"] and (methods is None or r["method"] in methods)]
    per_sequence = [
        {
            "series": r["method"],
            "n": r["n"],
            **{
                key: None if r.get(key) is None else r[key] * scale / r["b"]
                for key, scale in (("fwdbwd_s", 1e3), ("fwdbwd_mb", 1.0))
            },
        }
        for r in kept
    ]
    batches = sorted({r["b"] for r in kept})
    return write_chart(
        name,
        per_sequence,
        panels=[
            ("fwdbwd_s", "time, forward + backward", "ms per sequence"),
            ("fwdbwd_mb", "peak extra memory, forward + backward", "MB per sequence"),
        ],
        title=f"Attention on CPU, h = {HEADS}, d = {DIM}, {dtype}, b = "
        f"{', '.join(map(str, batches))} (figures per sequence); dashed: torch",
        baselines=[r["method"] for r in kept if r["method"].startswith("torch")],
        group=_pair,
        out_dir=out_dir or folder,
    )


def _find(rows: list[dict], method: str, n: int) -> dict | None:
    for r in rows:
        if r["method"] == method and r["n"] == n and not r["skipped"]:
            return r
    return None


def evaluate_targets(rows: list[dict], modes: list[str]) -> dict[tuple[str, int], list[str]]:
    """The five targets' verdicts, per (method, n) row: a list of 'TARGET: met/missed (figures)'
    (the targets are listed under the table, see ``render``)."""
    notes: dict[tuple[str, int], list[str]] = {}

    def note(method: str, n: int, text: str) -> None:
        notes.setdefault((method, n), []).append(text)

    def ratio(base: dict | None, mine: dict | None, mode: str) -> float | None:
        if base is None or mine is None or base.get(f"{mode}_s") is None:
            return None
        if mine.get(f"{mode}_s") is None:
            return None
        return base[f"{mode}_s"] / mine[f"{mode}_s"]  # > 1: mine is faster

    def verdict(label: str, ok: bool | None, detail: str) -> str:
        state = "n/a" if ok is None else ("met" if ok else "missed")
        return f"{label} {state} ({detail})"

    ns = sorted({r["n"] for r in rows})
    for n in ns:
        # Tiled plain and causal >= 0.75x torch's throughput at n >= 2048, fwd and fwd+bwd.
        if n >= 2048:
            for mine, base in (("tiled", "torch"), ("tiled causal", "torch causal")):
                rs = [ratio(_find(rows, base, n), _find(rows, mine, n), m) for m in modes]
                if _find(rows, mine, n):
                    ok = None if None in rs else all(x >= 0.75 for x in rs)
                    note(
                        mine,
                        n,
                        verdict(
                            "speed >= 0.75x torch:", ok, " / ".join(_x(x) for x in rs) + " of torch"
                        ),
                    )
        # Tiled + a bias fn (ALiBi, relative buckets) fwd+bwd at least as fast as torch given
        # the same bias as a tensor; memory <= 1/8 of it at n = 8192.
        for kind in ("ALiBi", "relative"):
            mine = _find(rows, f"tiled + {kind} fn", n)
            base = _find(rows, f"torch + {kind} tensor", n)
            if mine is None:
                continue
            r = ratio(base, mine, "fwdbwd")
            ok = None if r is None else r >= 1.0
            detail = f"{_x(r)} speed"
            if n == 8192:
                mm, bm = mine.get("fwdbwd_mb"), base.get("fwdbwd_mb") if base else None
                if mm is not None and bm:
                    detail += f", memory {mm / bm:.3f} of torch's"
                    ok = None if ok is None else ok and mm <= bm / 8
                else:
                    ok = None
            note(f"tiled + {kind} fn", n, verdict("speed >= dense bias:", ok, detail))
            plain = _find(rows, f"tiled + {kind} fn, undeclared", n)
            if plain is not None:
                r = ratio(base, plain, "fwdbwd")
                note(f"tiled + {kind} fn, undeclared", n, f"for comparison: {_x(r)} speed")
        # Tiled fwd+bwd at n = 8192: peak extra memory <= 1.5x torch's.
        if n == 8192:
            mine, base = _find(rows, "tiled", n), _find(rows, "torch", n)
            mm = mine.get("fwdbwd_mb") if mine else None
            bm = base.get("fwdbwd_mb") if base else None
            ok = None if mm is None or not bm else mm <= 1.5 * bm
            detail = "memory not measured" if ok is None else f"{mm / bm:.2f}x torch's memory"
            note("tiled", n, verdict("memory <= 1.5x torch:", ok, detail))
        # Sparse window 256 at n = 16384 >= 15x faster than torch + window mask, both modes.
        if n == 16384:
            mine, base = _find(rows, "sparse window 256", n), _find(rows, "torch + window mask", n)
            rs = [ratio(base, mine, m) for m in modes]
            ok = None if None in rs else all(x >= 15 for x in rs)
            note(
                "sparse window 256",
                n,
                verdict("speed >= 15x dense window:", ok, " / ".join(_x(x) for x in rs)),
            )
            # Linear at n = 16384 >= 20x faster than torch's fused kernel.
            mine, base = _find(rows, "linear", n), _find(rows, "torch", n)
            rs = [ratio(base, mine, m) for m in modes]
            ok = None if None in rs else all(x >= 20 for x in rs)
            note("linear", n, verdict("speed >= 20x torch:", ok, " / ".join(_x(x) for x in rs)))
    return notes


def _x(r: float | None) -> str:
    return "?" if r is None else f"{r:.2f}x"


def _ms(t: float | None) -> str:
    return "—" if t is None else f"{t * 1e3:,.0f}"


def _mb(m: float | None) -> str:
    return "—" if m is None else f"{m:,.0f}"


def render(rows, args, matmul: float, targets, command: str, elapsed: float) -> str:
    from _report import environment

    lines = [
        "## Efficient attention on CPU (`benchmarks/attention.py`)",
        "",
        f"Command: `{command}` ({elapsed / 60:.1f} min). {environment()}; "
        f"h={HEADS}, d={DIM}, {getattr(args, 'dtype', 'float32')}; b as listed (4 up to n=1024, "
        "then fewer, 1 from n=4096, to keep runtime and memory sane). Times are medians of "
        f"{args.repeats} interleaved rounds; GFLOP/s counts forward 4bhn²d (half causal, "
        "4bhnwd for the window), forward+backward 3.5x that. Peak extra memory: VmHWM minus "
        "RSS before the call, in a fresh process per cell (gradients count). "
        f"float32 matmul ceiling measured in the same runs: {matmul:.0f} GFLOP/s.",
        "",
        "| n | b | method | fwd ms | fwd GFLOP/s | fwd MB | fwd+bwd ms | fwd+bwd GFLOP/s "
        "| fwd+bwd MB | target |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r["skipped"]:
            lines.append(
                f"| {r['n']} | {r['b']} | {r['method']} | skipped: its n x n tensors exceed "
                f"--max-dense-gb {args.max_dense_gb} |||||| |"
            )
            continue
        cells = []
        for mode in ("fwd", "fwdbwd"):
            t = r.get(f"{mode}_s")
            f = flops(r["method"], r["b"], r["n"], mode)
            gf = "—" if t is None or f is None else f"{f / t / 1e9:.0f}"
            cells += [_ms(t), gf, _mb(r.get(f"{mode}_mb"))]
        target = "; ".join(targets.get((r["method"], r["n"]), []))
        lines.append(
            f"| {r['n']} | {r['b']} | {r['method']} | " + " | ".join(cells) + f" | {target} |"
        )
    lines += [
        "",
        "Targets (ratios are torch's time over ours, >1 means faster):",
        "- speed >= 0.75x torch: tiled plain and causal at n >= 2048 reach 0.75x torch's fused "
        "throughput, fwd and fwd+bwd;",
        "- speed >= dense bias: tiled with an ALiBi or relative-position bias function, fwd+bwd, "
        "at least as fast as torch given the same bias as a dense tensor (built in the timed "
        "call), with at most 1/8 of its memory at n=8192;",
        "- memory <= 1.5x torch: tiled fwd+bwd at n=8192 uses at most 1.5x torch's peak extra "
        "memory;",
        "- speed >= 15x dense window: sparse window 256 at n=16384 is 15x faster than torch with "
        "the dense window mask;",
        "- speed >= 20x torch: linear at n=16384 is 20x faster than torch's fused kernel "
        "(fwd / fwd+bwd).",
    ]
    missing = [
        name
        for name, n in (
            ("speed >= 0.75x torch", 2048),
            ("memory <= 1.5x torch", 8192),
            ("speed >= 15x dense window", 16384),
            ("speed >= 20x torch", 16384),
        )
        if n not in args.sizes
    ]
    if missing:
        lines.append(f"- Not evaluated in this run (sizes not measured): {', '.join(missing)}.")
    return "\n".join(lines) + "\n"


def _pair(method: str) -> str:
    """torch's route and attnkit's for the same attention share a colour in the charts."""
    for prefix in ("torch", "tiled"):
        if method.startswith(prefix):
            return method.removeprefix(prefix).replace(" tensor", "").replace(" fn", "")
    return method


if __name__ == "__main__":
    sys.exit(main())
