"""Ring attention on 2 and 4 CPU processes against single-process tiled attention.

For each sequence length ``n`` the same causal attention (forward + backward) runs

* on one process with the tiled backend (the baseline), and
* as ring attention over ``W`` processes (gloo on loopback, zigzag layout), each holding n / W
  positions,

interleaved round by round, and reports the median wall time and the peak memory of each rank.
Peak memory is the rise of the resident set during one forward + backward (the inputs are
created inside the measured region, since holding only a shard of them is the point):
``"5"`` is written to ``/proc/self/clear_refs`` (which resets the high-water mark ``VmHWM`` to
the current RSS), then ``VmHWM`` is read from ``/proc/self/status`` after the run, minus the RSS
before it. ``MALLOC_MMAP_THRESHOLD_`` is fixed so that freed tensors leave the resident set.

One pool of ``max(worlds)`` processes serves every configuration (sub-groups for the smaller
rings), so no configuration pays for process start-up. Threads per process: ``cores // W``
(at least 1), so every configuration uses the same cores.

    python benchmarks/ring.py                               # n = 16384..65536, W = 2, 4
    python benchmarks/ring.py --n 2048 4096 --repeats 2 --no-write   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import natural_int, positive_int, status_kib, thread_count

from attnkit._progress import progress  # a bar when stderr is a terminal


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _measured(run) -> tuple[float, float]:
    """(seconds, peak RSS rise in MiB) of ``run()``."""
    import gc

    gc.collect()
    before = status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    return seconds, (status_kib("VmHWM") - before) / 1024


def _inputs(n: int, args: argparse.Namespace, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (args.batch, args.heads, n, args.dim)
    return [torch.randn(shape, generator=gen).requires_grad_(True) for _ in range(3)]


def _single(n: int, args: argparse.Namespace) -> None:
    from attnkit import scaled_dot_product_attention

    q, k, v = _inputs(n, args, seed=0)
    out = scaled_dot_product_attention(q, k, v, is_causal=True, backend=args.baseline)
    out.backward(torch.ones_like(out))


def _ring(n: int, world: int, rank: int, group: dist.ProcessGroup, args) -> None:
    from attnkit.distributed import ring_attention, shard_lengths

    # Each rank creates only its own shard: holding n / W positions is what is measured.
    q, k, v = _inputs(shard_lengths(n, world, args.layout)[rank], args, seed=rank)
    out = ring_attention(q, k, v, is_causal=True, layout=args.layout, group=group)
    out.backward(torch.ones_like(out))


def _worker(rank: int, world_max: int, port: int, args: argparse.Namespace, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_max, timeout=timedelta(hours=1))
    groups = {w: dist.new_group(list(range(w))) for w in args.worlds}  # every rank calls each
    configs = [1, *args.worlds]
    rows: list[dict] = []
    for n in progress(args.n, desc="sizes", unit="n"):
        samples: dict[int, list[tuple[float, float]]] = {w: [] for w in configs}
        warmup = args.warmup if n == args.n[0] else 0  # once per process: first-call costs
        for repeat in range(warmup + args.repeats):
            for w in configs:  # interleaved: one run of each configuration per round
                torch.set_num_threads(max(1, args.cores // w))
                dist.barrier()
                if rank < w:
                    if w == 1:
                        result = _measured(lambda n=n: _single(n, args))
                    else:
                        result = _measured(lambda n=n, w=w: _ring(n, w, rank, groups[w], args))
                    if repeat >= warmup:
                        samples[w].append(result)
                dist.barrier()
        everyone: list = [None] * world_max
        dist.all_gather_object(everyone, samples)
        for w in configs:
            per_rank = [everyone[r][w] for r in range(w)]
            rows.append(
                {
                    "n": n,
                    "world": w,
                    # a ring step is synchronous: the slowest rank's time is the call's time
                    "seconds": statistics.median(
                        max(s[i][0] for s in per_rank) for i in range(args.repeats)
                    ),
                    "peak_mib": [max(m for _, m in s) for s in per_rank],
                }
            )
    if rank == 0:
        Path(path).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _markdown(rows: list[dict], args: argparse.Namespace, command: str) -> str:
    from _report import environment

    lines = [
        "## Ring attention across processes (CPU, gloo)",
        "",
        f"Command: `{command}`",
        "",
        f"Causal attention, forward + backward, b={args.batch} h={args.heads} d={args.dim} "
        f"float32, {args.layout} layout for the ring. Baseline: one process, "
        f'`backend="{args.baseline}"`. Threads per process: {args.cores} // W. Median of '
        f"{args.repeats} interleaved rounds. Peak memory: rise of the resident set (VmHWM after "
        "clearing it via /proc/self/clear_refs) during one call, inputs included; for the ring, "
        "the largest over ranks. Environment: " + environment() + f"; load average at the "
        f"start {args.load:.1f} on {os.cpu_count()} cores.",
        "",
        "| n | processes | time (s) | time / 1 process | peak memory per rank (MiB) "
        "| memory / 1 process |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        base = next(r for r in rows if r["n"] == row["n"] and r["world"] == 1)
        peak, base_peak = max(row["peak_mib"]), max(base["peak_mib"])
        lines.append(
            f"| {row['n']} | {row['world']} | {row['seconds']:.2f} | "
            f"{row['seconds'] / base['seconds']:.2f} | {peak:.0f} | {peak / base_peak:.2f} |"
        )
    largest = [r for r in rows if r["n"] == max(args.n)]
    peaks = ", ".join(
        f"{r['world']} process{'es' if r['world'] > 1 else ''}: {max(r['peak_mib']):.0f} MiB"
        for r in largest
    )
    base = max(largest[0]["peak_mib"])
    overhead = ", ".join(
        f"{max(r['peak_mib']) * r['world'] / base:.1f} at W = {r['world']}" for r in largest[1:]
    )
    lines += [
        "",
        f"Peak memory per rank at n = {max(args.n)}: {peaks}. Each ring rank holds n / W "
        "positions of the inputs, outputs and gradients, plus the key/value block in transit "
        "(double-buffered so that messages overlap computation) and one gradient accumulator, "
        "so its memory is O(n / W); W x (memory per rank) / (memory of one process) = "
        f"{overhead}. Time: every configuration shares the same cores, so the ring does the "
        "same arithmetic plus messages; time ratios here compare one process with several "
        "threads against several single-threaded processes, not the speed-up that W machines "
        "would bring.",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=positive_int, nargs="+", default=[16384, 32768, 65536])
    parser.add_argument("--worlds", type=thread_count, nargs="+", default=[2, 4])
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--heads", type=positive_int, default=2)
    parser.add_argument("--dim", type=positive_int, default=64)
    parser.add_argument("--layout", choices=["contiguous", "zigzag"], default="zigzag")
    parser.add_argument("--baseline", default="tiled", help="single-process backend")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--warmup", type=natural_int, default=1)
    parser.add_argument(
        "--cores", type=thread_count, default=2, help="cores shared by the processes"
    )
    parser.add_argument("--no-write", action="store_true", help="print, do not write the doc")
    args = parser.parse_args(argv)
    if min(args.worlds) < 2:
        parser.error(
            f"argument --worlds: {min(args.worlds)} is too few: the ring needs at least 2 "
            "processes (1 is the baseline)"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.worlds = sorted(set(args.worlds))
    args.load = os.getloadavg()[0]

    # A fixed mmap threshold makes glibc return every large tensor to the OS when it is freed
    # (by default the threshold grows and freed tensors stay resident), so one process can
    # measure several configurations in turn. The spawned workers read it at start-up.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "rows.json")
        world_max = max(args.worlds)
        mp.start_processes(
            _worker,
            args=(world_max, free_port(), args, path),
            nprocs=world_max,
            start_method="spawn",
        )
        rows = json.loads(Path(path).read_text())
    command = "python benchmarks/ring.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = _markdown(rows, args, command.strip())
    print(md)
    if not args.no_write:
        from _report import write_section

        print("wrote", write_section("ring", md))


if __name__ == "__main__":
    main()
