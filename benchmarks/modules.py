"""Attention modules: attnkit's MultiHeadAttention against torch's, and KV-cache decoding.

Run: PYTHONPATH=src python benchmarks/modules.py [--quick]

Three tables, each a ratio against a baseline timed in the same run, candidates interleaved,
medians of the repeats:

1. forward (and forward+backward) of ``attnkit.MultiHeadAttention`` against
   ``nn.MultiheadAttention`` with the same weights (batch-first, float32, no weights returned);
2. greedy generation with a KV cache against recomputing the whole prefix every token;
3. KV-cache memory with grouped-query heads against full multi-head attention (arithmetic).

Writes the ``modules`` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import environment, write_section

from attnkit import MultiHeadAttention, TransformerConfig, TransformerDecoder


def interleaved(candidates: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds per candidate; one run of each per round, so drift hits all alike."""
    for fn in candidates.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def mha_row(n: int, repeats: int) -> str:
    e, h, b = 256, 8, 2
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(e, h, batch_first=True)
    ours = MultiHeadAttention.from_torch(ref)
    x = torch.randn(b, n, e, requires_grad=True)

    def fwd_torch() -> None:
        with torch.no_grad():
            ref(x, x, x, need_weights=False)

    def fwd_ours() -> None:
        with torch.no_grad():
            ours(x)

    def bwd_torch() -> None:
        ref(x, x, x, need_weights=False)[0].sum().backward()

    def bwd_ours() -> None:
        ours(x)[0].sum().backward()

    t = interleaved(
        {"ft": fwd_torch, "fo": fwd_ours, "bt": bwd_torch, "bo": bwd_ours}, repeats=repeats
    )
    return (
        f"| {n} | {t['ft'] * 1e3:.1f} | {t['fo'] / t['ft']:.2f} | {t['bt'] * 1e3:.1f} | "
        f"{t['bo'] / t['bt']:.2f} |"
    )


def mha_table(quick: bool) -> str:
    rows = [
        "| n | torch fwd ms | attnkit fwd ratio | torch fwd+bwd ms | attnkit fwd+bwd ratio |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n in (128, 512) if quick else (128, 512, 1024):
        rows.append(mha_row(n, repeats=3 if quick else 7))
        print(rows[-1], flush=True)
    return "\n".join(rows)


def decode_table(quick: bool) -> str:
    cfg = TransformerConfig(embed_dim=128, num_heads=8, num_layers=2, vocab_size=1000,
                            positional="rope", num_kv_heads=2)  # fmt: skip
    torch.manual_seed(0)
    dec = TransformerDecoder(cfg).eval()
    prompt = torch.randint(0, 1000, (1, 16))
    rows = ["| new tokens | recompute s | with KV cache s | speed-up |", "|---:|---:|---:|---:|"]
    for new in (16, 64) if quick else (32, 128):

        @torch.no_grad()
        def recompute(new: int = new) -> torch.Tensor:
            ids = prompt
            for _ in range(new):
                logits, _ = dec(ids)
                ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
            return ids

        def cached(new: int = new) -> torch.Tensor:
            return dec.generate(prompt, new)

        assert torch.equal(recompute(), cached())  # the same tokens either way
        t = interleaved({"r": recompute, "c": cached}, repeats=3)
        rows.append(f"| {new} | {t['r']:.3f} | {t['c']:.3f} | {t['r'] / t['c']:.1f}x |")
        print(rows[-1], flush=True)
    return "\n".join(rows)


def cache_memory_table() -> str:
    e, h, n, b, layers = 1024, 16, 4096, 1, 24
    d = e // h
    rows = ["| K/V heads | cache MiB (b=1, n=4096, 24 layers, e=1024, float16) | vs MHA |",
            "|---:|---:|---:|"]  # fmt: skip
    full = None
    for h_kv in (16, 4, 1):
        mib = 2 * layers * b * h_kv * n * d * 2 / 2**20  # keys and values, 2 bytes each
        full = full or mib
        rows.append(f"| {h_kv} | {mib:.0f} | {mib / full:.3f} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    torch.set_num_threads(2)
    parts = [
        "## Attention modules",
        "",
        f"`PYTHONPATH=src python benchmarks/modules.py{' --quick' if args.quick else ''}`; "
        f"{environment()}; 1-minute load average {os.getloadavg()[0]:.1f} at the start (a "
        "shared machine: absolute times are inflated, read the ratios). Ratios are attnkit "
        "time / baseline time in the same run (candidates interleaved, medians); below 1 is "
        "faster.",
        "",
        "`MultiHeadAttention` against `nn.MultiheadAttention` (same weights, b=2, e=256, h=8, "
        "float32, self-attention, no weights returned):",
        "",
        mha_table(args.quick),
        "",
        "Greedy generation, decoder e=128, 2 layers, 8 query heads / 2 K/V heads, RoPE, "
        "16-token prompt: KV cache against recomputing the prefix each token (same tokens):",
        "",
        decode_table(args.quick),
        "",
        "KV-cache size with grouped-query heads (arithmetic: K and V x layers x b x h_kv x n x d x "
        "2 bytes; attnkit stores exactly (b, h_kv, n, d) per layer, never per query head):",
        "",
        cache_memory_table(),
    ]
    text = "\n".join(parts)
    print(text)
    if not args.no_write:
        print(f"wrote {write_section('modules', text)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
