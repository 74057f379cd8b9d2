"""FlexAttention on CPU: attnkit.flex vs the dense route a CPU user has today.

For n = 2,048..16,384 (b=1, h=8, d=64, 2 threads), float32 and bfloat16, forward+backward (and
forward), three attention-gym scenarios:

    document          causal attention within packed documents (mask from captured ids)
    window + ALiBi    causal sliding window of 256 keys, ALiBi as a score_mod
    learned table     causal, a learned relative-position table (h, n) as a score_mod that
                      requires grad (its gradient is part of the backward)

and the routes:

    flex              attnkit.flex.flex_attention with a block mask from create_block_mask
                      (built once, outside the timed call: its build time is reported apart)
    dense             the mask and bias materialised from the same functions inside the timed
                      call, then torch's F.scaled_dot_product_attention (a bias that requires
                      grad sends torch to its math path)
    torch compiled    torch.compile(torch's flex_attention), forward only (--compiled; first
                      compile time reported apart)

Method as benchmarks/attention.py: timings of one (n, dtype) in one fresh subprocess that
interleaves the routes round by round (medians); peak extra memory of each (scenario, route, n,
dtype, mode) in its own subprocess (``VmHWM`` after resetting it, minus the RSS before the call).
Dense routes whose n x n tensors would exceed ``--max-dense-gb`` are skipped and say so.

    python benchmarks/flex.py                 # the full table (hours on 2 cores)
    python benchmarks/flex.py --quick         # n = 512, 1024, float32, 1 round: a smoke run
    python benchmarks/flex.py --n 4096 8192 --routes flex --compiled --modes fwd --no-memory
                                              # forward only against torch's compiled flex
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _report, when run from anywhere
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's attnkit
import _report
from _report import positive_float, positive_int, thread_count, time_limit

from attnkit._progress import progress  # a bar when stderr is a terminal

HEADS, DIM, WINDOW, BLOCK = 8, 64, 256, 128
SCENARIOS = ["document", "window + ALiBi", "learned table"]
ROUTES = ["flex", "dense"]
DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}


# Worker side: runs inside a fresh subprocess.


def scenario(name: str, n: int, dtype=None, device: str = "cpu", grad: bool = True) -> tuple:
    """``(mask_mod, score_mod or None, leaves)`` for ``name`` at length ``n``: functions written
    for torch's flex API; ``leaves`` are captured tensors that require grad (``dtype``, float32
    by default; none with ``grad=False``, for inference)."""
    import torch

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    if name == "document":
        g = torch.Generator().manual_seed(n)
        cuts = torch.randint(1, n, (7,), generator=g).sort().values.tolist()
        lengths = [hi - lo for lo, hi in zip([0, *cuts], [*cuts, n], strict=True)]
        docs = torch.repeat_interleave(torch.arange(8), torch.tensor(lengths)).to(device)

        def document(b, h, q_idx, kv_idx):
            return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)

        return document, None, ()
    if name == "window + ALiBi":
        slopes = torch.tensor([2.0 ** (-8 * (k + 1) / HEADS) for k in range(HEADS)])

        def window(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)

        def alibi(score, b, h, q_idx, kv_idx):  # Press et al. 2022, arXiv:2108.12409
            return score + slopes[h] * (kv_idx - q_idx)

        return window, alibi, ()
    if name == "learned table":
        table = 0.1 * torch.randn(HEADS, n, generator=torch.Generator().manual_seed(1))
        table = table.to(device, dtype or torch.float32).requires_grad_(grad)

        def learned(score, b, h, q_idx, kv_idx):
            return score + table[h, q_idx - kv_idx]  # causal: q_idx - kv_idx >= 0 where kept

        return causal, learned, (table,) if grad else ()
    raise ValueError(f"unknown scenario {name!r}")


def make_call(route: str, name: str, q, k, v):
    """A zero-argument callable computing the attention of ``route`` for scenario ``name``, and
    the leaves whose gradients the backward computes; block-mask build seconds apart."""
    import torch
    import torch.nn.functional as F

    from attnkit.flex import create_block_mask, flex_attention

    n = q.shape[2]
    mask_mod, score_mod, leaves = scenario(name, n, torch.promote_types(q.dtype, torch.float32))
    if route == "flex":
        start = time.perf_counter()
        block_mask = create_block_mask(mask_mod, None, None, n, n, BLOCK_SIZE=BLOCK)
        build = time.perf_counter() - start
        return (lambda: flex_attention(q, k, v, score_mod, block_mask)), leaves, build
    if route == "dense":

        def dense():
            b = torch.zeros(1, 1, 1, 1, dtype=torch.long)
            h = torch.arange(HEADS).view(1, -1, 1, 1)
            i = torch.arange(n).view(1, 1, -1, 1)
            j = torch.arange(n).view(1, 1, 1, -1)
            keep = mask_mod(b, h, i, j)  # (1, 1, n, n)
            if score_mod is None:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
            zero = torch.zeros((), dtype=torch.float32)
            bias = score_mod(zero, b, h, i, j).masked_fill(~keep, -math.inf).to(q.dtype)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # (1, h, n, n) bias

        return dense, leaves, 0.0
    if route == "torch compiled":  # inference only: torch's CPU flex refuses inputs needing grad
        import torch.nn.attention.flex_attention as tf

        dtype = torch.promote_types(q.dtype, torch.float32)
        mask_mod, score_mod, _ = scenario(name, n, dtype, grad=False)
        q, k, v = (t.detach() for t in (q, k, v))
        block_mask = tf.create_block_mask(mask_mod, None, None, n, n, "cpu", BLOCK_SIZE=BLOCK)
        compiled = torch.compile(tf.flex_attention)
        start = time.perf_counter()
        try:
            with torch.no_grad():
                compiled(q, k, v, score_mod, block_mask)
        except Exception as exc:  # reported in the table, one line
            first = (str(exc).strip().splitlines() or [""])[0][:160]
            return None, (), f"{type(exc).__name__}: {first}"
        build = time.perf_counter() - start
        return (lambda: compiled(q, k, v, score_mod, block_mask)), (), build
    raise ValueError(f"unknown route {route!r}")


def worker(job: dict) -> dict:
    import torch

    torch.set_num_threads(job["threads"])
    torch.manual_seed(0)
    dtype = getattr(torch, job["dtype"])
    qkv = [torch.randn(1, HEADS, job["n"], DIM, dtype=dtype, requires_grad=True) for _ in "qkv"]
    if job["kind"] == "memory":
        tiny = [torch.randn(1, HEADS, 256, DIM, dtype=dtype, requires_grad=True) for _ in "qkv"]
        fn, leaves, _ = make_call(job["route"], job["scenario"], *tiny)
        _report.grad_step(fn, job["mode"], [*tiny, *leaves])  # page in the code first
        fn, leaves, _ = make_call(job["route"], job["scenario"], *qkv)
        before = _report.status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        _report.grad_step(fn, job["mode"], [*qkv, *leaves])
        return {"extra_mb": (_report.status_kib("VmHWM") - before) / 1024}
    calls = {r: make_call(r, job["scenario"], *qkv) for r in job["routes"]}
    failed = {r: err for r, (fn, _, err) in calls.items() if fn is None}
    calls = {r: c for r, c in calls.items() if r not in failed}
    times: dict[str, list[float]] = {f"{r}|{m}": [] for r in calls for m in job["modes"]}
    for rnd in range(1 + job["repeats"]):  # round 0 warms up
        for route, (fn, leaves, _) in calls.items():
            for mode in job["modes"]:
                if mode == "fwdbwd" and route == "torch compiled":
                    continue  # torch's CPU flex has no backward
                start = time.perf_counter()
                _report.grad_step(fn, mode, [*qkv, *leaves])
                if rnd:
                    times[f"{route}|{mode}"].append(time.perf_counter() - start)
    result = {key: statistics.median(ts) for key, ts in times.items() if ts}
    result.update({f"{r}|build": build for r, (_, _, build) in calls.items()})
    result.update({f"{r}|error": err for r, err in failed.items()})
    return result


# Driver side.


def run_worker(job: dict, timeout: float) -> dict:
    return _report.run_worker(__file__, job, timeout)


def dense_gb(n: int, dtype: str) -> float:
    """Peak bytes of the dense route's n x n tensors, estimated: bool mask, a float32 bias per
    head, its cast, scores and softmax of the math path (forward+backward)."""
    per = 4.0 + (2.0 if dtype == "bfloat16" else 4.0) * 3
    return HEADS * n * n * per / 1e9


def table(rows: list[dict], modes: list[str]) -> str:
    out = [
        "| scenario | n | dtype | route | " + " | ".join(f"{m} s" for m in modes)
        + " | " + " | ".join(f"{m} MB" for m in modes) + " | speed-up (fwdbwd) | memory ratio |",
        "|---|---|---|---|" + "---|" * (2 * len(modes) + 2),
    ]  # fmt: skip
    for r in rows:
        dense = next(
            (d for d in rows if d["route"] == "dense" and d["key"] == r["key"] and d["times"]),
            None,
        )
        cells = [f"{r['times'].get(m, float('nan')):.3f}" for m in modes]
        cells += [f"{r['mem'].get(m, float('nan')):.0f}" for m in modes]
        speed = ratio = ""
        if r["route"] == "flex" and dense is not None and "fwdbwd" in modes:
            speed = f"{dense['times']['fwdbwd'] / r['times']['fwdbwd']:.1f}x"
            if dense["mem"].get("fwdbwd") and r["mem"].get("fwdbwd") is not None:
                ratio = f"{r['mem']['fwdbwd'] / dense['mem']['fwdbwd']:.3f}"
        if r.get("skipped"):
            cells = [f"not run (needs {r['needs_gb']:.0f} GiB)"] + [""] * (2 * len(modes) - 1)
        scen, n, dtype = r["key"]
        out.append(f"| {scen} | {n} | {dtype} | {r['route']} | " + " | ".join(cells)
                   + f" | {speed} | {ratio} |")  # fmt: skip
    return "\n".join(out)


def compiled_table(rows: list[dict]) -> str:
    """Forward only, no grad: attnkit's flex against ``torch.compile(flex_attention)``, with the
    first compile apart (a failed compile is one line in its row)."""
    out = [
        "| scenario | n | dtype | torch first compile s | attnkit flex fwd s "
        "| torch compiled fwd s | compiled / attnkit time |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["route"] != "torch compiled":
            continue
        ours = next(d for d in rows if d["route"] == "flex" and d["key"] == r["key"])
        flex_s = ours["times"].get("fwd", float("nan"))
        scen, n, dtype = r["key"]
        if r.get("error"):
            cells = ["failed", f"{flex_s:.3f}", r["error"].replace("|", "/"), ""]
        else:
            theirs = r["times"]["fwd"]
            cells = [f"{r['build_s']:.1f}", f"{flex_s:.3f}", f"{theirs:.3f}",
                     f"{theirs / flex_s:.2f}"]  # fmt: skip
        out.append(f"| {scen} | {n} | {dtype} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="n = 512, 1024, float32, 1 round")
    parser.add_argument("--n", type=positive_int, nargs="*", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--scenarios", nargs="*", default=SCENARIOS, choices=SCENARIOS)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--threads", type=thread_count, default=2)
    parser.add_argument("--compiled", action="store_true", help="add torch's compiled forward")
    parser.add_argument("--routes", nargs="*", default=ROUTES, choices=ROUTES,
                        help="attnkit's and the dense route (default both)")  # fmt: skip
    parser.add_argument("--modes", nargs="*", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    parser.add_argument("--no-memory", action="store_true", help="skip the memory runs")
    parser.add_argument("--max-dense-gb", type=positive_float, default=6.0)
    parser.add_argument("--timeout", type=time_limit, default=3600)
    parser.add_argument("--write", action="store_true", help="write docs/benchmarks.md")
    args = parser.parse_args(argv)
    if not (args.n or args.quick or args.worker):
        parser.error("argument --n: expected at least one length")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    if args.quick:
        args.n, args.dtypes, args.repeats = [512, 1024], ["float32"], 1
    modes = args.modes
    routes = args.routes + (["torch compiled"] if args.compiled else [])
    rows: list[dict] = []
    for scen in progress(args.scenarios, desc="scenarios", unit="scenario"):
        for n in args.n:
            for dtype in args.dtypes:
                key = (scen, n, dtype)
                live = [
                    r for r in routes if r != "dense" or dense_gb(n, dtype) <= args.max_dense_gb
                ]
                job = {
                    "kind": "time", "scenario": scen, "n": n, "dtype": dtype, "modes": modes,
                    "routes": live, "repeats": args.repeats, "threads": args.threads,
                }  # fmt: skip
                times = run_worker(job, args.timeout)
                for route in routes:
                    row = {"key": key, "route": route, "skipped": route not in live,
                           "times": {}, "mem": {},
                           "needs_gb": dense_gb(n, dtype) * 1e9 / 2**30}  # fmt: skip
                    row["error"] = times.get(f"{route}|error")
                    if route in live and not row["error"]:
                        row["times"] = {m: times[f"{route}|{m}"] for m in modes
                                        if f"{route}|{m}" in times}  # fmt: skip
                        row["build_s"] = times[f"{route}|build"]
                        measured = not args.no_memory and route != "torch compiled"
                        for mode in row["times"] if measured else []:
                            mem = {**job, "kind": "memory", "route": route, "mode": mode}
                            row["mem"][mode] = run_worker(mem, args.timeout)["extra_mb"]
                    rows.append(row)
                    print(row, file=sys.stderr, flush=True)
    from _report import environment, write_section

    builds = ", ".join(
        f"{r['route']} {r['key'][0]} n={r['key'][1]} {r['key'][2]}: {r['build_s']:.2f} s"
        for r in rows
        if r.get("build_s")
    )
    md = (
        "## FlexAttention on CPU (`benchmarks/flex.py`)\n\n"
        f"`python benchmarks/flex.py {' '.join(argv or sys.argv[1:])}`; {environment()}; "
        f"b = 1, h = {HEADS}, d = {DIM}, block {BLOCK}. Build times apart (attnkit's "
        f"create_block_mask; torch's first compile): {builds}.\n\n"
        + table([r for r in rows if r["route"] != "torch compiled"], modes)
    )
    if args.compiled:
        md += "\n\n" + compiled_table(rows)
    print(md)
    if args.write:
        print(f"wrote {write_section('flex', md)}", file=sys.stderr)
        for dtype in args.dtypes:
            print(f"wrote {chart(rows, dtype)}", file=sys.stderr)
    return 0


def chart(rows: list[dict], dtype: str, out_dir=None):
    """Draw ``flex-DTYPE.png`` from the rows ``main`` measured: forward+backward time and peak
    extra memory of each scenario's flex and dense routes against n."""
    from _report import CHARTS as folder
    from _report import write_chart

    points = [
        {
            "series": f"{r['key'][0]}, {r['route']}",
            "n": r["key"][1],
            "fwdbwd_s": r["times"].get("fwdbwd"),
            "fwdbwd_mb": r["mem"].get("fwdbwd"),
        }
        for r in rows
        if r["key"][2] == dtype and not r.get("skipped")
    ]
    return write_chart(
        f"flex-{dtype}",
        points,
        panels=[
            ("fwdbwd_s", "time, forward + backward", "seconds"),
            ("fwdbwd_mb", "peak extra memory, forward + backward", "MB"),
        ],
        title=f"attnkit.flex, b = 1, h = {HEADS}, d = {DIM}, {dtype}; dashed: the dense route",
        baselines=[p["series"] for p in points if not p["series"].endswith(", flex")],
        group=lambda series: series.rsplit(", ", 1)[0],  # a scenario's routes share a colour
        out_dir=out_dir or folder,
    )


if __name__ == "__main__":
    sys.exit(main())
