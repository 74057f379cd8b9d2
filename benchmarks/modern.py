"""The attention of 2025-2026 models on CPU: Gated DeltaNet, MLA decoding, DeepSeek sparse (DSA).

Three experiments (2 threads, float32 and bfloat16), each against the route a CPU user has today:

    delta   attnkit.gated_delta_rule (chunked, chunk 64) against transformers'
            torch_chunk_gated_delta_rule (its fallback when fla is absent), forward and
            forward+backward, b = 1, h = 4 query/key heads, h_v = 8 value heads, d_k = d_v = 128,
            q/k L2-normalised in the rule. Target: >= 3x faster at n = 4,096 forward+backward,
            with at most its peak memory.
    decode  one MultiHeadLatentAttention layer (e = 2048, h = 16, d_c = 512, d_q = 1536,
            d_n = d_v = 128, d_r = 64: DeepSeek-V3's per-head sizes, fewer heads) decoding one
            token over a cache of n tokens: the absorbed form against the expanded one
            (which rebuilds every head's keys and values from the latents each step). Target:
            absorbed per-token time <= 0.5x expanded at n = 4,096; cache bytes per token as the
            paper states ((d_c + d_r) x 2 bytes in bfloat16).
    dsa     one DeepSeekSparseAttention layer (the same MLA, an indexer of 16 heads x 64, top-k
            512) over n tokens against the same MLA layer attending densely and causally on
            torch's kernel (backend="torch": scaled_dot_product_attention(is_causal=True) on
            the expanded per-head keys and values), forward and forward+backward. Target at
            n = 8,192: faster, with at most 1/8 of its peak memory, forward and
            forward+backward, float32 and bfloat16; the verdicts are printed under the table.
            On CPU torch's kernel takes its math path here (its flash kernel wants one width
            for q, k and v; MLA's values are 128 wide, its keys 192), which builds the
            (b, h, n, n) scores: the dense baseline is what a CPU user of torch gets today.
            Both routes are whole layers (the same projections), so the ratios compare the
            layers, not only their attention kernels.

Method as benchmarks/attention.py: timings of one (experiment, n, dtype) in one fresh
subprocess that interleaves the routes round by round (medians); peak extra memory of each
(route, mode) in its own subprocess (``VmHWM`` after resetting it, minus the RSS before).

    python benchmarks/modern.py                   # every table (hours on 2 cores)
    python benchmarks/modern.py --quick           # tiny sizes, float32, 1 round: a smoke run
    python benchmarks/modern.py --experiments delta --n 4096 --write
    python benchmarks/modern.py --experiments dsa --n 8192    # the DSA target and its verdicts
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _report, when run from anywhere
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's attnkit
import _report
from _report import positive_int, thread_count, time_limit

EXPERIMENTS = {
    "delta": (["attnkit chunked", "transformers chunked"], [1024, 2048, 4096, 8192]),
    "decode": (["absorbed", "expanded"], [1024, 2048, 4096, 8192]),
    "dsa": (["dsa sparse", "dense torch"], [1024, 2048, 4096, 8192]),
}
DTYPES = ["float32", "bfloat16"]
DELTA = dict(h=4, h_v=8, d=128)
MLA = dict(embed_dim=2048, num_heads=16, kv_rank=512, q_rank=1536, nope_dim=128, rope_dim=64,
           v_dim=128)  # fmt: skip
INDEXER = dict(num_heads=16, head_dim=64, top_k=512)


# Worker side: runs inside a fresh subprocess.


def delta_call(route: str, n: int, dtype, *, grad: bool = True, sizes: dict = DELTA):
    """``(fn, leaves)``: one gated delta rule over ``n`` positions by ``route``."""
    import torch

    g = torch.Generator().manual_seed(n)
    h, h_v, d = sizes["h"], sizes["h_v"], sizes["d"]
    q, k = (torch.randn(1, h, n, d, generator=g).to(dtype) for _ in "qk")
    v = torch.randn(1, h_v, n, d, generator=g).to(dtype)
    gate = (-torch.rand(1, h_v, n, generator=g) * 0.5).to(dtype)  # decays in (e^-0.5, 1]
    beta = torch.rand(1, h_v, n, generator=g).to(dtype)
    leaves = [t.requires_grad_(grad) for t in (q, k, v, gate, beta)]
    if route == "attnkit chunked":
        from attnkit import gated_delta_rule

        def fn():
            return gated_delta_rule(q, k, v, gate, beta, use_qk_l2norm=True)[0]
    else:
        from transformers.models.qwen3_next.modeling_qwen3_next import (
            torch_chunk_gated_delta_rule,
        )

        def fn():  # transformers' layout: (b, n, heads, d)
            args = (t.transpose(1, 2) for t in (q, k, v, gate, beta))
            return torch_chunk_gated_delta_rule(*args, use_qk_l2norm_in_kernel=True)[0]

    return fn, leaves


def mla_layer(dtype, sizes: dict = MLA):
    import torch

    from attnkit import MultiHeadLatentAttention

    torch.manual_seed(0)
    return MultiHeadLatentAttention(**sizes).to(dtype)


def decode_call(route: str, n: int, dtype, *, sizes: dict = MLA):
    """``(fn, [])``: one new token attending a ``LatentCache`` of ``n`` tokens by ``route``."""
    import torch

    from attnkit.mla import LatentCache

    layer = mla_layer(dtype, sizes)
    cache = LatentCache(max_len=n + 1)  # allocated once, as a server would
    with torch.no_grad():
        layer(torch.randn(1, n, sizes["embed_dim"]).to(dtype), cache=cache)
        x = torch.randn(1, 1, sizes["embed_dim"]).to(dtype)

    def fn():
        cache.length = n  # the same n cached tokens every call
        return layer(x, cache=cache, absorb=route == "absorbed")[0]

    return fn, []


def dsa_call(route: str, n: int, dtype, *, grad: bool = True, sizes=MLA, indexer=INDEXER):
    """``(fn, leaves)``: one causal layer over ``n`` tokens: DSA, or its MLA dense on torch."""
    import torch

    from attnkit import DeepSeekSparseAttention, LightningIndexer

    mla = mla_layer(dtype, sizes)
    index = LightningIndexer(
        sizes["embed_dim"], sizes["q_rank"], indexer["num_heads"], indexer["head_dim"],
        rope_dim=sizes["rope_dim"], top_k=indexer["top_k"],
    ).to(dtype)  # fmt: skip
    layer = DeepSeekSparseAttention(mla, index)
    x = torch.randn(1, n, sizes["embed_dim"], generator=torch.Generator().manual_seed(n))
    x = x.to(dtype).requires_grad_(grad)
    if route == "dsa sparse":
        return (lambda: layer(x)[0]), [x]
    mla.backend = "torch"
    return (lambda: mla(x)[0]), [x]


def make_call(experiment: str, route: str, n: int, dtype, grad: bool):
    if experiment == "delta":
        return delta_call(route, n, dtype, grad=grad)
    if experiment == "decode":
        return decode_call(route, n, dtype)
    return dsa_call(route, n, dtype, grad=grad)


def worker(job: dict) -> dict:
    import torch

    torch.set_num_threads(job["threads"])
    dtype = getattr(torch, job["dtype"])
    modes = job["modes"] if job["experiment"] != "decode" else ["fwd"]
    if job["kind"] == "memory":
        small, _ = make_call(job["experiment"], job["route"], 64, dtype, job["mode"] != "fwd")
        _report.grad_step(small, job["mode"], [])  # page in the code first
        fn, leaves = make_call(job["experiment"], job["route"], job["n"], dtype, True)
        before = _report.status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        _report.grad_step(fn, job["mode"], leaves)
        return {"extra_mb": (_report.status_kib("VmHWM") - before) / 1024}
    calls = {r: make_call(job["experiment"], r, job["n"], dtype, True) for r in job["routes"]}
    times: dict[str, list[float]] = {f"{r}|{m}": [] for r in calls for m in modes}
    for rnd in range(1 + job["repeats"]):  # round 0 warms up
        for route, (fn, leaves) in calls.items():
            for mode in modes:
                start = time.perf_counter()
                _report.grad_step(fn, mode, leaves)
                if rnd:
                    times[f"{route}|{mode}"].append(time.perf_counter() - start)
    return {key: statistics.median(ts) for key, ts in times.items() if ts}


# Driver side.


def cache_bytes() -> str:
    """The MLA cache per token and layer in bfloat16 against full K/V of the same heads."""
    import torch

    with torch.device("meta"):
        layer = mla_layer(torch.bfloat16)
    latent = layer.cache_bytes_per_token(torch.bfloat16)
    h, d_k, d_v = layer.num_heads, layer.qk_dim, layer.v_dim
    full = h * (d_k + d_v) * 2
    return (
        f"MLA cache: {latent} bytes per token and layer in bfloat16 ((d_c + d_r) x 2 = "
        f"({layer.kv_rank} + {layer.rope_dim}) x 2), against {full} for full K/V of "
        f"{h} heads ({full / latent:.1f}x); with DeepSeek-V3's 128 heads, "
        f"{128 * (d_k + d_v) * 2} ({128 * (d_k + d_v) * 2 / latent:.1f}x)."
    )


def table(rows: list[dict], modes: list[str]) -> str:
    out = [
        "| experiment | n | dtype | route | " + " | ".join(f"{m} s" for m in modes)
        + " | " + " | ".join(f"{m} MB" for m in modes) + " | time ratio | memory ratio |",
        "|---|---|---|---|" + "---|" * (2 * len(modes) + 2),
    ]  # fmt: skip
    for r in rows:
        exp, n, dtype = r["key"]
        routes = EXPERIMENTS[exp][0]
        base = next((d for d in rows if d["key"] == r["key"] and d["route"] == routes[1]), None)
        cells = [f"{r['times'][m]:.4f}" if m in r["times"] else "" for m in modes]
        cells += [f"{r['mem'][m]:.0f}" if m in r["mem"] else "" for m in modes]
        speed = ratio = ""
        last = "fwdbwd" if "fwdbwd" in r["times"] else "fwd"
        if r["route"] == routes[0] and base is not None and last in base["times"]:
            speed = f"{r['times'][last] / base['times'][last]:.2f} ({last})"
            if r["mem"].get(last) is not None and base["mem"].get(last):
                ratio = f"{r['mem'][last] / base['mem'][last]:.3f}"
        out.append(f"| {exp} | {n} | {dtype} | {r['route']} | " + " | ".join(cells)
                   + f" | {speed} | {ratio} |")  # fmt: skip
    return "\n".join(out)


DSA_TARGET = dict(n=8192, time=1.0, memory=1 / 8)  # faster, at most 1/8 of the peak memory


def verdicts(rows: list[dict]) -> list[str]:
    """One line per (dtype, mode) of DSA at the target's n: its time and peak extra memory over
    dense causal attention's, against the target (faster; at most 1/8 of the memory)."""
    lines = []
    sparse, dense = EXPERIMENTS["dsa"][0]
    for r in rows:
        exp, n, dtype = r["key"]
        if exp != "dsa" or n != DSA_TARGET["n"] or r["route"] != sparse:
            continue
        base = next((d for d in rows if d["key"] == r["key"] and d["route"] == dense), None)
        if base is None:
            continue
        for mode in r["times"]:
            time_ratio = r["times"][mode] / base["times"][mode]
            text = (
                f"DSA target, n = {n:,}, top-k {INDEXER['top_k']}, {dtype}, {mode}: time "
                f"{r['times'][mode]:.2f} s against {base['times'][mode]:.2f} s = "
                f"{time_ratio:.3f}x ({'met' if time_ratio < DSA_TARGET['time'] else 'MISSED'}: "
                "faster)"
            )
            mem, base_mem = r["mem"].get(mode), base["mem"].get(mode)
            if mem is not None and base_mem:
                ratio = mem / base_mem
                met = "met" if ratio <= DSA_TARGET["memory"] else "MISSED"
                text += (
                    f"; peak extra memory {mem:.0f} MB against {base_mem:.0f} MB = {ratio:.3f}x "
                    f"({met}: at most 1/8 = 0.125)"
                )
            else:
                text += "; memory not measured"
            lines.append(text)
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="n = 128, 256, float32, 1 round")
    parser.add_argument("--experiments", nargs="*", default=list(EXPERIMENTS),
                        choices=list(EXPERIMENTS))  # fmt: skip
    parser.add_argument(
        "--n", type=positive_int, nargs="*", help="lengths (default per experiment)"
    )
    parser.add_argument("--dtypes", nargs="*", default=DTYPES, choices=DTYPES)
    parser.add_argument("--modes", nargs="*", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--threads", type=thread_count, default=2)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory runs")
    parser.add_argument("--timeout", type=time_limit, default=3600)
    parser.add_argument("--write", action="store_true", help="write docs/benchmarks.md")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    if args.quick:
        args.n, args.dtypes, args.repeats = [128, 256], ["float32"], 1
    rows: list[dict] = []
    for exp in args.experiments:
        routes, default_n = EXPERIMENTS[exp]
        modes = ["fwd"] if exp == "decode" else args.modes
        for n in args.n or default_n:
            for dtype in args.dtypes:
                job = {
                    "kind": "time", "experiment": exp, "n": n, "dtype": dtype, "modes": modes,
                    "routes": routes, "repeats": args.repeats, "threads": args.threads,
                }  # fmt: skip
                times = _report.run_worker(__file__, job, args.timeout)
                for route in routes:
                    row = {"key": (exp, n, dtype), "route": route, "mem": {},
                           "times": {m: times[f"{route}|{m}"] for m in modes}}  # fmt: skip
                    for mode in [] if args.no_memory else modes:
                        mem = {**job, "kind": "memory", "route": route, "mode": mode}
                        row["mem"][mode] = _report.run_worker(__file__, mem, args.timeout)[
                            "extra_mb"
                        ]
                    rows.append(row)
                    print(row, file=sys.stderr, flush=True)
    md = (
        "## The attention of 2025-2026 models (`benchmarks/modern.py`)\n\n"
        f"`python benchmarks/modern.py {' '.join(argv or sys.argv[1:])}`; "
        f"{_report.environment()}. Time ratio: the first route's time over the second's "
        "(forward+backward where measured; decode: one token's forward); memory ratio likewise, "
        f"peak extra MB. {cache_bytes()}\n\n" + table(rows, args.modes)
    )
    lines = verdicts(rows)
    if lines:
        md += "\n\n" + "\n".join(f"- {line}" for line in lines)
    print(md)
    if args.write:
        print(f"wrote {_report.write_section('modern', md)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
