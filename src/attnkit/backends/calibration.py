"""Measuring this machine for ``backend="auto"``: a short calibration, cached beside the kernel.

For one dtype and the current thread count, ``calibrate`` times a few small calls per backend,
forward and forward+backward, interleaved round by round (the fastest of two rounds after a
warm-up: other work on the machine only adds time): a decoding step (the per-call cost), one
head of 1,024 (the per-tile cost), plain calls at three sizes and one wider head (the matmul
rate), and calls with a bias tensor, a relative bias function, a window or a document mask
(the per-pair extra). For each backend and pass it scales the reference table's row
(``rates.reference``) by two factors, fixed costs and throughput, each a median over the calls
it dominates, with the counts the cost model gives those calls (``cost.terms``);
the seconds per element-op of a mask or bias function come from two functions evaluated on a
grid. The table is written to ``rates.calibration_path`` and used by every later process with
the same profile (torch, attnkit, thread count, CPU class, fused build).

    python -m attnkit.backends.calibration float32 2     # what the background process runs
    attnkit kernels calibrate                            # the same, in the foreground
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

from attnkit.backends import cost, rates
from attnkit.backends.fused import jit
from attnkit.functional import make_call, scaled_dot_product_attention
from attnkit.masks import materialize, relative, window_fn

__all__ = ["CONFIGS", "calibrate", "fit"]

# (backend, (b, h, i, j, d), kind): small calls off auto's benchmark grid, chosen so that each
# backend's four constants are separated (decode: call; one head: tile; plain sizes and d = 128:
# GFLOP/s; functions and tensors: per pair).
CONFIGS = [
    ("torch", (1, 8, 1, 256, 64), "plain"),
    ("torch", (2, 8, 384, 384, 64), "plain"),
    ("torch", (1, 8, 1024, 1024, 64), "plain"),
    ("torch", (1, 4, 768, 768, 128), "plain"),
    ("torch", (1, 4, 2048, 2048, 64), "plain"),
    ("torch", (1, 8, 2048, 2048, 64), "plain"),
    ("torch", (1, 4, 768, 768, 64), "bias tensor"),
    ("torch", (1, 8, 384, 384, 64), "document"),
    ("tiled", (1, 8, 1, 256, 64), "plain"),
    ("tiled", (1, 1, 1024, 1024, 64), "plain"),
    ("tiled", (2, 8, 384, 384, 64), "plain"),
    ("tiled", (1, 8, 1024, 1024, 64), "plain"),
    ("tiled", (1, 4, 2048, 2048, 64), "plain"),
    ("tiled", (1, 4, 768, 768, 64), "relative"),
    ("tiled", (1, 8, 384, 384, 64), "document"),
    ("fused", (1, 8, 1, 256, 64), "plain"),
    ("fused", (1, 1, 1024, 1024, 64), "plain"),
    ("fused", (2, 8, 384, 384, 64), "plain"),
    ("fused", (1, 8, 1024, 1024, 64), "plain"),
    ("fused", (1, 4, 768, 768, 128), "plain"),
    ("fused", (1, 4, 2048, 2048, 64), "plain"),
    ("fused", (1, 8, 768, 768, 64), "relative"),
    ("fused", (1, 4, 1024, 1024, 64), "window"),
    ("fused", (1, 8, 2048, 2048, 64), "wide window"),
    ("fused", (2, 8, 384, 384, 64), "document"),
    ("sparse", (1, 1, 256, 256, 64), "window"),
    ("sparse", (1, 1, 1024, 1024, 64), "window"),
    ("sparse", (2, 8, 384, 384, 64), "window"),
    ("sparse", (1, 4, 1024, 1024, 64), "window"),
    ("sparse", (1, 8, 2048, 2048, 64), "wide window"),
    ("math", (1, 8, 1, 256, 64), "plain"),
    ("math", (2, 8, 384, 384, 64), "plain"),
    ("math", (1, 4, 768, 768, 64), "plain"),
    ("math", (1, 2, 768, 768, 128), "plain"),
]
EVAL_SHAPE = (1, 8, 768, 768)
DECODE_STEPS = 20  # a decoding step takes microseconds: timed this many in a row
WINDOW = 128


def _alibi(h: int):
    slopes = torch.tensor([2.0 ** (-8.0 * (x + 1) / h) for x in range(h)])

    def alibi(b, h, i, j):  # ALiBi (Press et al. 2022): -slope_h * |i - j|
        return -slopes[h] * (i - j).abs()

    return relative(alibi)


def _document(n: int):
    ids = torch.arange(n) * 4 // max(1, n)  # four documents of equal length

    def document(b, h, i, j):
        return ids[i] == ids[j]

    return document


def _kwargs(kind: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> dict:
    _, h, i, j, _ = shape
    if kind == "plain":
        return {}
    if kind == "bias tensor":
        return {"bias": torch.randn(1, h, i, j, generator=gen).to(dtype)}
    if kind == "relative":
        return {"bias": _alibi(h)}
    if kind == "window":
        return {"mask": window_fn(WINDOW - 1, 0)}
    if kind == "wide window":
        return {"mask": window_fn(2 * WINDOW - 1, 0)}
    if kind == "document":
        return {"mask": _document(j), "is_causal": True}
    raise ValueError(f"unknown kind {kind!r}")


def _step(fn, mode: str, inputs) -> None:
    if mode == "fwd":
        with torch.no_grad():
            fn()
        return
    out = fn()
    out.float().sum().backward()
    for t in inputs:
        t.grad = None


def _measure(row: str, backends: list[str], repeats: int) -> tuple[list[dict], float]:
    """Time every config of ``backends`` in both passes; return rows and the eval rate."""
    dtype = getattr(torch, row)
    gen = torch.Generator().manual_seed(0)
    runs, found = [], []
    for backend, shape, kind in CONFIGS:
        if backend not in backends:
            continue
        b, h, i, j, d = shape
        q = torch.randn(b, h, i, d, generator=gen).to(dtype).requires_grad_()
        k = torch.randn(b, h, j, d, generator=gen).to(dtype).requires_grad_()
        v = torch.randn(b, h, j, d, generator=gen).to(dtype).requires_grad_()
        kw = _kwargs(kind, shape, dtype, gen)
        steps = DECODE_STEPS if i == 1 else 1

        def fn(q=q, k=k, v=v, kw=kw, backend=backend, steps=steps):
            for _ in range(steps - 1):
                scaled_dot_product_attention(q, k, v, backend=backend, **kw)
            return scaled_dot_product_attention(q, k, v, backend=backend, **kw)

        for mode in rates.PASSES:
            with torch.set_grad_enabled(mode == "fwdbwd"):
                terms = cost.terms(backend, make_call(q, k, v, **kw))
            found.append({"backend": backend, "mode": mode, "terms": terms, "d": d, "steps": steps})
            runs.append((fn, mode, (q, k, v)))
    evals = []
    for fn in (_alibi(EVAL_SHAPE[1]), _document(EVAL_SHAPE[-1])):
        ops = cost._probe(fn, EVAL_SHAPE, torch.device("cpu")).at(EVAL_SHAPE).ops
        evals.append((lambda fn=fn: materialize(fn, EVAL_SHAPE), ops))
    times: list[list[float]] = [[] for _ in runs]
    eval_times: list[list[float]] = [[] for _ in evals]
    for r in range(repeats + 1):  # the first round warms up
        for x, (fn, mode, inputs) in enumerate(runs):
            start = time.perf_counter()
            _step(fn, mode, inputs)
            if r:
                times[x].append(time.perf_counter() - start)
        for x, (fn, _) in enumerate(evals):
            start = time.perf_counter()
            fn()
            if r:
                eval_times[x].append(time.perf_counter() - start)
    # The fastest round: other work on the machine only ever adds time.
    for entry, ts in zip(found, times, strict=True):
        entry["seconds"] = min(ts) / entry["steps"]
    eval_s = statistics.median(
        min(ts) / ops for ts, (_, ops) in zip(eval_times, evals, strict=True)
    )
    return found, eval_s


def _nnls(a: list[list[float]], y: list[float]) -> list[float]:
    """Non-negative least squares for a few unknowns: the best of the least-squares solutions
    over every subset of free unknowns whose solution is non-negative."""
    a_t = torch.tensor(a, dtype=torch.float64)
    y_t = torch.tensor(y, dtype=torch.float64).unsqueeze(1)
    n = a_t.shape[1]
    best, best_err = [0.0] * n, float((y_t**2).sum())
    for size in range(1, n + 1):
        for cols in itertools.combinations(range(n), size):
            sub = a_t[:, list(cols)]
            x = torch.linalg.lstsq(sub, y_t).solution.flatten()
            if bool((x < 0).any()):
                continue
            err = float(((sub @ x.unsqueeze(1) - y_t) ** 2).sum())
            if err < best_err:
                best_err = err
                best = [0.0] * n
                for c, value in zip(cols, x.tolist(), strict=True):
                    best[c] = value
    return best


def fit(
    found: list[dict], eval_s: float, reference: dict[tuple[str, str], rates.Rates]
) -> dict[tuple[str, str], rates.Rates]:
    """Each backend's and pass's ``Rates``: the reference table's row scaled to this machine
    by three factors: one for the fixed costs (per call, per tile: Python and dispatch), one
    for the throughput (FLOPs and elementwise work: the cores, the vector units, the thread
    count), and one for the per-pair work of masks, biases and a window's cut tiles, which
    need not keep the reference's proportion to the matmuls on another CPU class (on Intel
    Xeon a window's cut tiles cost the fused kernel about a fifth of what the reference,
    measured on AMD EPYC, says). The first two are medians over the calls the reference says
    they dominate (more than half of their predicted time), so one call slowed by other work
    on the machine cannot move them; the third a median over the calls with much per-pair work
    (``_factors``). The reference (measured at length on a quiet machine) keeps the balance
    within each part. A backend the reference lacks is fitted on all four constants by
    non-negative least squares."""
    table = {}
    for backend, mode in sorted({(f["backend"], f["mode"]) for f in found}):
        rows = [f for f in found if f["backend"] == backend and f["mode"] == mode]
        ref = reference.get((backend, mode))
        parts = []  # (fixed, matmuls, per pair, measured) per call, in seconds
        a, y = [], []
        for f in rows:
            t = f["terms"]
            measured = max(f["seconds"] - eval_s * t.ops, 1e-9)
            flops = t.pairs * 2 * 2 * f["d"] / 1e9  # 2 (d + dv) flops per pair, d = dv
            a.append([1.0 / measured, t.tiles / measured, flops / measured, t.extra / measured])
            y.append(1.0)
            if ref is not None:
                fixed = ref.call + ref.tile * t.tiles
                parts.append((fixed, flops / ref.gflops, ref.pair * t.extra, measured))
        if ref is None:
            call, tile, per_gflop, pair = _nnls(a, y)
            gflops = 1.0 / per_gflop if per_gflop else 1e6
            table[(backend, mode)] = rates.Rates(call, tile, gflops, pair)
            continue
        fixed_f, matmul_f, pair_f = _factors(parts)
        table[(backend, mode)] = rates.Rates(
            ref.call * fixed_f, ref.tile * fixed_f, ref.gflops / matmul_f, ref.pair * pair_f
        )
    return table


def _factors(parts: list[tuple[float, float, float, float]]) -> tuple[float, float, float]:
    """The fixed-cost, throughput and per-pair factors of ``fit`` from (fixed, matmuls, per pair,
    measured) seconds per call. The first two alternate, each net of the other's share: the
    fixed costs over the calls they dominate, the throughput over the rest (matmuls and
    per-pair work together, as the reference balances them). Then the per-pair factor is
    what the calls whose per-pair part is at least a quarter of their matmuls' took beyond
    the other two parts (a negative remainder counts as 0: the pairs were free); with no
    such call it is the throughput's."""
    fixed_f, throughput_f = 0.0, 0.0
    for _ in range(4):  # each factor net of the other's share, alternately
        fixed = [(m - throughput_f * (mm + pp)) / fx for fx, mm, pp, m in parts if fx > mm + pp]
        fixed_f = _median([x for x in fixed if x > 0]) or fixed_f
        rest = [
            (m - fixed_f * fx) / (mm + pp)
            for fx, mm, pp, m in parts
            if mm + pp >= fx and mm + pp > 0
        ]
        throughput_f = _median([x for x in rest if x > 0]) or throughput_f
    fixed_f = fixed_f or throughput_f or 1.0
    throughput_f = throughput_f or fixed_f
    per_pair = [
        max(0.0, (m - fixed_f * fx - throughput_f * mm) / pp)
        for fx, mm, pp, m in parts
        if pp >= mm / 4 and mm + pp > fx and pp > 0
    ]
    return fixed_f, throughput_f, _median(per_pair) if per_pair else throughput_f


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


def calibrate(row: str = "float32", repeats: int = 2) -> rates.Table:
    """Measure this machine for ``row`` ("float32" or "bfloat16") with the current thread
    count, write the table where auto reads it, and return it."""
    if row not in ("float32", "bfloat16"):
        raise ValueError(f"row must be 'float32' or 'bfloat16', got {row!r}")
    start = time.perf_counter()
    backends = ["torch", "tiled", "sparse", "math"]
    built = jit.is_built()
    if built:
        backends.append("fused")
    # One calibration at a time on a machine (two would time each other), and none started
    # in the background by the calls this one makes.
    background = os.environ.get("ATTNKIT_BACKGROUND")
    os.environ["ATTNKIT_BACKGROUND"] = "0"
    try:
        with jit.file_lock(jit.cache_dir() / "calibration.lock", 900.0), torch.random.fork_rng():
            found, eval_s = _measure(row, backends, repeats)
    finally:
        if background is None:
            os.environ.pop("ATTNKIT_BACKGROUND", None)
        else:
            os.environ["ATTNKIT_BACKGROUND"] = background
    seconds = time.perf_counter() - start
    meta = {
        **rates.profile(row),
        "fused": jit.build_key() if built else None,
        "cpu": _cpu_name(),
        "when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "seconds": round(seconds, 1),
    }
    reference = rates.reference()[row].rows
    table = rates.Table(fit(found, eval_s, reference), eval_s, "", meta)
    rates.write_table(table, rates.calibration_path(row))
    return table


def _main(argv: list[str]) -> int:
    """The background process: build the fused kernel where it can be and is not, then
    calibrate one profile; exits at once when another process is doing it."""
    row, threads = argv[0], int(argv[1])
    os.environ["ATTNKIT_BACKGROUND"] = "0"  # this process never starts another
    with jit.file_lock(jit.cache_dir() / "background.lock", 0.0) as held:
        if not held:
            return 0  # another background process is at it
        if jit.prerequisites() is None and not jit.is_built():
            try:
                jit.build()
            except jit.NotBuilt as error:
                print(f"attnkit: {error}", file=sys.stderr)
        torch.set_num_threads(threads)
        if rates._read(row, threads) is None:  # not measured by another process meanwhile
            table = calibrate(row)
            print(f"attnkit: measured {row} with {threads} threads in {table.meta['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
