"""The fused module's quantised matrix product (``qmatmul``) against ``F.linear`` with the
float32 weight, on SmolLM2-135M's shapes.

For each (m, n, k) and thread count, two candidates compute ``x (m, k) @ W^T`` (W (n, k)):

- ``linear``: ``torch.nn.functional.linear`` with W de-quantised to float32 (today's decoding,
  reading 4 bytes per weight);
- ``qmatmul``: the fused kernel reading W's GGUF blocks (Q4_1: 0.625 bytes per weight, Q8_0:
  1.06), matrix-vector for m = 1, tiles of W and a float32 matmul for prefill.

Shapes: decoding (m = 1) for the attention projections (576 x 576, 192 x 576 for grouped keys
and values), the feed-forward (1,536 x 576 and 576 x 1,536) and the tied output matrix
(49,152 x 576), in Q4_1 and Q8_0; prefill (m = 256 and 1,024) in Q4_1. The two candidates are
interleaved call by call, so a change in the machine's load hits both; each cell is the median
over the repeats. ``--cold`` cycles each candidate through copies of W worth 256 MiB of float32
weights, so every call reads its matrix from memory, as a decoding step does (the model's
weights are far larger than the caches); without it the small matrices stay in cache between
calls.

``--memory`` asks what bounds the decoding products instead: ``qmatmul`` alone, with 1 and 8
rows of x (one sequence's step, and eight sequences'), each weight either warm (the same matrix
every call, in cache) or cold (copies of it worth 256 MiB of GGUF blocks, taken in turn, so
every call reads the matrix from memory), interleaved call by call. A product bound by reading
its weight runs much slower cold; one bound by the work of de-quantising and multiplying runs
about as fast either way.

Run: ``python benchmarks/quant_matmul.py`` (``--threads 1 2``; ``--repeats N``; ``--quick``:
decoding shapes only; ``--cold``; ``--memory``).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _report, when run from anywhere
from _report import natural_int, thread_count

DECODE = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
PREFILL = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]


def weights(kind, n: int, k: int) -> torch.Tensor:
    """A random (n, k) weight quantised by gguf: uint8 (n, row_bytes)."""
    from gguf.quants import quantize

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)).numpy()
    return torch.from_numpy(quantize(w, kind))


def copies(nbytes: int) -> int:
    """How many copies of a weight of ``nbytes`` make 256 MiB (at least 2): taken in turn, every
    call reads its copy from memory."""
    return max(2, -(-(256 << 20) // nbytes))


def cycling(fn, operands: list[tuple]):
    """A call of ``fn`` on each operand tuple in turn."""
    turn = itertools.cycle(operands)
    return lambda: fn(*next(turn))


def timed(calls: dict, repeats: int) -> dict[str, float]:
    """Median milliseconds of each call, interleaved repeat by repeat (after one warm-up)."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


# SmolLM2-135M's feed-forward shapes in its kinds (the 49,152-row output matrix, 28 MB of Q8_0,
# stays in no cache: it takes Q8_0 in the gate's shape here).
MEMORY = [("Q4_1", 1536, 576), ("Q4_1", 576, 1536), ("Q8_0", 1536, 576)]


def memory(kernel, threads: list[int], repeats: int) -> None:
    """``--memory``: qmatmul with W warm and cold, 1 and 8 rows of x (module docstring)."""
    from gguf import GGMLQuantizationType as Kind

    print(
        "| threads | kind | m | n | k | warm ms | cold ms | cold / warm | warm GMAC/s "
        "| cold GMAC/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for t in threads:
        torch.set_num_threads(t)
        for name, n, k in MEMORY:
            kind = Kind[name]
            w = weights(kind, n, k)
            ws = [w.clone() for _ in range(copies(w.numel()))]
            for m in (1, 8):
                x, out = torch.randn(m, k), torch.empty(m, n)
                ms = timed({
                    "warm": cycling(kernel.qmatmul, [(x, w, int(kind), out)]),
                    "cold": cycling(kernel.qmatmul, [(x, c, int(kind), out) for c in ws]),
                }, repeats or max(50, min(2000, int(4e9 / (m * n * k)))))  # fmt: skip
                rate = {key: m * n * k / (1e6 * value) for key, value in ms.items()}
                print(
                    f"| {t} | {name} | {m} | {n:,} | {k:,} | {ms['warm']:.4f} | "
                    f"{ms['cold']:.4f} | {ms['cold'] / ms['warm']:.2f} | {rate['warm']:.1f} | "
                    f"{rate['cold']:.1f} |",
                    flush=True,
                )
            del ws


def against_linear(kernel, args: argparse.Namespace) -> None:
    """The default table: qmatmul against F.linear with the float32 weight (module docstring)."""
    from gguf import GGMLQuantizationType as Kind

    cases = [(kind, 1, n, k) for kind in (Kind.Q4_1, Kind.Q8_0) for n, k in DECODE]
    if not args.quick:
        cases += [(Kind.Q4_1, m, n, k) for m in (256, 1024) for n, k in PREFILL]
    print("| threads | kind | m | n | k | linear ms | qmatmul ms | linear / qmatmul |")
    print("|---|---|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for kind, m, n, k in cases:
            w = weights(kind, n, k)
            ws = [w.clone() for _ in range(copies(4 * n * k) if args.cold else 1)]
            w32s = [kernel.dequantize(c, int(kind), k) for c in ws]
            x, out = torch.randn(m, k), torch.empty(m, n)
            repeats = args.repeats or max(5, min(500, int(2e9 / (m * n * k))))
            ms = timed({
                "linear": cycling(F.linear, [(x, c) for c in w32s]),
                "qmatmul": cycling(kernel.qmatmul, [(x, c, int(kind), out) for c in ws]),
            }, repeats)  # fmt: skip
            del ws, w32s
            print(
                f"| {threads} | {kind.name} | {m} | {n:,} | {k:,} | {ms['linear']:.4f} | "
                f"{ms['qmatmul']:.4f} | {ms['linear'] / ms['qmatmul']:.2f} |",
                flush=True,
            )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=thread_count, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=natural_int, default=0, help="0: by size")
    parser.add_argument("--quick", action="store_true", help="decoding shapes only")
    parser.add_argument("--cold", action="store_true", help="W read from memory every call")
    parser.add_argument("--memory", action="store_true", help="qmatmul alone, W warm and cold")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from attnkit.backends.fused import jit

    kernel = jit.build()
    print(f"torch {torch.__version__}, CPU class {jit.capability()}")
    before = torch.get_num_threads()
    try:
        if args.memory:
            memory(kernel, args.threads, args.repeats)
        else:
            against_linear(kernel, args)
    finally:
        torch.set_num_threads(before)


if __name__ == "__main__":
    main()
