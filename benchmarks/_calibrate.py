"""The cost model's constants (``attnkit.backends.cost.RATES`` and ``EVAL``), measured here.

For each dtype one fresh process times, interleaved round by round (medians), a few calls per
backend chosen to separate the four constants of ``Rates``: a decoding step (the per-call
cost), a few tiles of one head (the per-tile cost), plain calls at two sizes and two widths
(the matmul rate), calls with a dense bias tensor (torch) or a relative bias function (tiled:
the per-pair extra) and short calls with functions (n = 640, b = 4). Sizes are off the
benchmark grid of ``auto.py`` on purpose. ``EVAL`` is the time to materialise three functions
(ALiBi, T5-style buckets, document ids) divided by the element-ops the cost model counts for
them. The constants are then fitted by non-negative least squares on relative errors and
printed as Python, to be pasted into ``src/attnkit/backends/cost.py``.
"""

from __future__ import annotations

import statistics
import time

# (label, backend, (b, h, i, j, d), call kind): kinds are auto.call_kwargs' plus "bias tensor".
CONFIGS = [
    ("decode", "torch", (1, 8, 1, 200, 64), "plain"),
    ("plain 768", "torch", (2, 8, 768, 768, 64), "plain"),
    ("plain 3072", "torch", (1, 8, 3072, 3072, 64), "plain"),
    ("plain 1536 d128", "torch", (1, 8, 1536, 1536, 128), "plain"),
    ("bias tensor 1536", "torch", (1, 8, 1536, 1536, 64), "bias tensor"),
    ("bias tensor 768", "torch", (2, 8, 768, 768, 64), "bias tensor"),
    ("alibi fn 640", "torch", (4, 8, 640, 640, 64), "alibi"),
    ("document fn 640", "torch", (4, 8, 640, 640, 64), "document"),
    ("decode", "tiled", (1, 8, 1, 200, 64), "plain"),
    ("one head 1024", "tiled", (1, 1, 1024, 1024, 64), "plain"),
    ("plain 768", "tiled", (2, 8, 768, 768, 64), "plain"),
    ("plain 3072", "tiled", (1, 8, 3072, 3072, 64), "plain"),
    ("relative fn 1536", "tiled", (1, 8, 1536, 1536, 64), "relative"),
    ("relative fn one head", "tiled", (1, 1, 1536, 1536, 64), "relative"),
    ("plain 640", "tiled", (4, 8, 640, 640, 64), "plain"),
    ("relative fn 640", "tiled", (4, 8, 640, 640, 64), "relative"),
    ("document fn 640", "tiled", (4, 8, 640, 640, 64), "document"),
    ("decode", "fused", (1, 8, 1, 200, 64), "plain"),
    ("one head 1024", "fused", (1, 1, 1024, 1024, 64), "plain"),
    ("plain 768", "fused", (2, 8, 768, 768, 64), "plain"),
    ("plain 3072", "fused", (1, 8, 3072, 3072, 64), "plain"),
    ("plain 1536 d128", "fused", (1, 8, 1536, 1536, 128), "plain"),
    ("relative fn 1536", "fused", (1, 8, 1536, 1536, 64), "relative"),
    ("plain 640", "fused", (4, 8, 640, 640, 64), "plain"),
    ("relative fn 640", "fused", (4, 8, 640, 640, 64), "relative"),
    ("document fn 640", "fused", (4, 8, 640, 640, 64), "document"),
    ("window 3072", "fused", (1, 8, 3072, 3072, 64), "window"),
    ("window one head 2048", "sparse", (1, 1, 2048, 2048, 64), "window"),
    ("window 1536", "sparse", (2, 8, 1536, 1536, 64), "window"),
    ("window 3072", "sparse", (1, 8, 3072, 3072, 64), "window"),
    ("window 640", "sparse", (4, 8, 640, 640, 64), "window"),
    ("window one head 320", "sparse", (1, 1, 320, 320, 64), "window"),
    ("decode", "math", (1, 8, 1, 200, 64), "plain"),
    ("plain 768", "math", (2, 8, 768, 768, 64), "plain"),
    ("plain 1536", "math", (1, 8, 1536, 1536, 64), "plain"),
    ("plain 1536 d128", "math", (1, 8, 1536, 1536, 128), "plain"),
]
EVAL_KINDS = ["alibi", "relative", "document"]
EVAL_SHAPE = (1, 8, 1536, 1536)


def measure(job: dict) -> dict:
    """Worker: time every config in both passes for one dtype; return times and terms."""
    import _report
    import torch
    from auto import call_kwargs

    import attnkit  # noqa: F401  (registers the backends and their costs)
    from attnkit import masks, scaled_dot_product_attention
    from attnkit.backends import cost
    from attnkit.functional import make_call

    torch.set_num_threads(job["threads"])
    dtype = getattr(torch, job["dtype"])
    gen = torch.Generator().manual_seed(0)
    runs, out = {}, {"configs": [], "eval": []}
    for label, backend, (b, h, i, j, d), kind in CONFIGS:
        if job["backends"] and backend not in job["backends"]:
            continue
        q = torch.randn(b, h, i, d, generator=gen).to(dtype).requires_grad_()
        k = torch.randn(b, h, j, d, generator=gen).to(dtype).requires_grad_()
        v = torch.randn(b, h, j, d, generator=gen).to(dtype).requires_grad_()
        if kind == "bias tensor":
            kw = {"bias": torch.randn(1, h, i, j, generator=gen).to(dtype)}
        else:
            kw = call_kwargs(kind, max(i, j))

        def fn(q=q, k=k, v=v, kw=kw, backend=backend):
            return scaled_dot_product_attention(q, k, v, backend=backend, **kw)

        name = f"{backend}: {label}"
        if i == 1:  # a decoding step takes microseconds: time 50 in a row

            def fn(inner=fn):
                for _ in range(49):
                    inner()
                return inner()

        runs[name] = (fn, (q, k, v))
        for mode in ("fwd", "fwdbwd"):
            with torch.set_grad_enabled(mode == "fwdbwd"):
                t = cost.terms(backend, make_call(q, k, v, **kw))
            out["configs"].append(
                {"name": name, "backend": backend, "mode": mode, "terms": t.__dict__, "d": d}
            )
    for kind in EVAL_KINDS:
        fn = (
            call_kwargs(kind, EVAL_SHAPE[-1]).get("bias")
            or call_kwargs(kind, EVAL_SHAPE[-1])["mask"]
        )
        runs[f"eval: {kind}"] = (lambda fn=fn: masks.materialize(fn, EVAL_SHAPE), ())
        ops = cost._probe(fn, EVAL_SHAPE, torch.device("cpu")).at(EVAL_SHAPE).ops
        out["eval"].append({"name": f"eval: {kind}", "ops": ops})
    times: dict[str, list[float]] = {}
    for r in range(job["warmup"] + job["repeats"]):
        for name, (fn, inputs) in runs.items():
            for mode in ("fwd",) if name.startswith("eval") else ("fwd", "fwdbwd"):
                start = time.perf_counter()
                _report.grad_step(fn, mode, inputs)
                if r >= job["warmup"]:
                    times.setdefault(f"{name}|{mode}", []).append(time.perf_counter() - start)
    out["times"] = {key: statistics.median(ts) for key, ts in times.items()}
    return out


def fit(result: dict, dtype: str) -> tuple[dict, float]:
    """Non-negative least squares on relative errors, per backend and pass."""
    import numpy as np
    from scipy.optimize import nnls

    for key in result["times"]:
        if key.split("|")[0].endswith("decode"):
            result["times"][key] /= 50  # timed 50 in a row
    evals = [result["times"][f"{e['name']}|fwd"] / e["ops"] for e in result["eval"]]
    eval_s = statistics.median(evals)
    rates = {}
    for backend in ("torch", "tiled", "fused", "sparse", "math"):
        for mode in ("fwd", "fwdbwd"):
            rows = [c for c in result["configs"] if c["backend"] == backend and c["mode"] == mode]
            if not rows:
                continue
            a, y = [], []
            for c in rows:
                t = c["terms"]
                measured = result["times"][f"{c['name']}|{mode}"]
                flops = t["pairs"] * 2 * 2 * c["d"] / 1e9  # 2 (d + dv) flops per pair, d = dv
                a.append(np.array([1.0, t["tiles"], flops, t["extra"]]) / measured)
                y.append((measured - eval_s * t["ops"]) / measured)
            x, _ = nnls(np.array(a), np.array(y))
            for c, row, target in zip(rows, a, y, strict=True):
                fitted = float(np.dot(row, x))  # both relative to the measured time
                print(f"# fit {dtype} {c['name']} {mode}: {fitted / target:.2f}x measured")
            call, tile, per_gflop, pair = x.tolist()
            rates[(backend, dtype, mode)] = (
                call,
                tile,
                1.0 / per_gflop if per_gflop else 1e6,
                pair,
            )
    return rates, eval_s


def calibrate(args, run_worker) -> int:
    """Driver: one worker per dtype, fit, print the table as Python."""
    table, evals, lines = {}, [], []
    for dtype in args.dtypes:
        job = {
            "kind": "calibrate",
            "dtype": dtype,
            "threads": args.threads,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "backends": args.backends,
        }
        result = run_worker(job, args.timeout)
        rates, eval_s = fit(result, dtype)
        table.update(rates)
        evals.append(eval_s)
        for key, t in sorted(result["times"].items()):
            lines.append(f"# {dtype} {key}: {t * 1e3:.2f} ms")
    print("\n".join(lines))
    print("RATES: dict[tuple[str, str, str], Rates] = {")
    for (backend, dtype, mode), (call, tile, gflops, pair) in table.items():
        print(
            f'    ("{backend}", "{dtype}", "{mode}"): '
            f"Rates({call:.3g}, {tile:.3g}, {gflops:.4g}, {pair:.3g}),"
        )
    print("}")
    print(f"EVAL = {statistics.median(evals):.3g}")
    return 0
