"""Each attention variant trains: the copy task of the Annotated Transformer, one short run each.

    python benchmarks/variants_training.py              # about a minute per variant, 1 thread
    python benchmarks/variants_training.py --steps 50   # a quick look (writes nothing)

The task (Rush et al., "The Annotated Transformer", section "A First Example"): sequences of
random symbols 1..10 after a start symbol 1; an encoder reads the sequence and a decoder with
cross-attention writes it back. Every run has the same model (pre-norm, RoPE, 2 + 2 layers,
width 32, 4 heads), data, seed and optimiser; only ``AttentionVariants`` (applied to the encoder
and decoder self-attention) or the encoder's registers change. After training, each model
copies 500 fresh sequences greedily; "exact" counts sequences copied without an error.

Writes ``benchmarks/results/variants_training.json`` (curves, accuracies, one trained encoder
map per variant, drawn by ``docs/make_figures.py`` as ``variants_training.png``) and the
section "variants-training" of ``docs/concepts/variants.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import environment, positive_int, write_section

from attnkit import TransformerConfig, TransformerDecoder, TransformerEncoder
from attnkit._io import atomic_write_text
from attnkit.variants import AttentionVariants

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "variants_training.json"
PAGE = ROOT / "docs" / "concepts" / "variants.md"
VOCAB, LENGTH, BATCH = 11, 10, 64
STEPS = 800  # the recorded runs' steps: another --steps writes nothing
BASE = TransformerConfig(
    embed_dim=32, num_heads=4, num_layers=2, vocab_size=VOCAB, ffn_dim=64, positional="rope"
)
RUNS: dict[str, tuple[AttentionVariants | None, int]] = {  # variants, encoder registers
    "baseline": (None, 0),
    "softcap=5": (AttentionVariants(softcap=5.0), 0),
    "sinks": (AttentionVariants(sinks=True), 0),
    "qk_norm=rms": (AttentionVariants(qk_norm="rms"), 0),
    "gate=element": (AttentionVariants(gate="element"), 0),
    "differential": (AttentionVariants(differential=True), 0),
    "value_residual=learned": (AttentionVariants(value_residual="learned"), 0),
    "registers=4": (None, 4),
}


def batch(n: int, generator: torch.Generator) -> torch.Tensor:
    """``(n, LENGTH)`` sequences: the start symbol 1, then random symbols 1..10."""
    data = torch.randint(1, VOCAB, (n, LENGTH), generator=generator)
    data[:, 0] = 1
    return data


def train(name: str, steps: int, seed: int = 0) -> dict:
    variants, registers = RUNS[name]
    torch.manual_seed(seed)
    enc_config = dataclasses.replace(BASE, variants=variants, registers=registers)
    dec_config = dataclasses.replace(BASE, variants=variants, cross_attention=True)
    encoder, decoder = TransformerEncoder(enc_config), TransformerDecoder(dec_config)
    params = [*encoder.parameters(), *decoder.parameters()]
    optimiser = torch.optim.Adam(params, lr=3e-3, betas=(0.9, 0.98))
    data = torch.Generator().manual_seed(1000 + seed)  # the same batches for every variant
    losses = []
    start = time.perf_counter()
    for _ in range(steps):
        seqs = batch(BATCH, data)
        memory, _ = encoder(seqs)
        logits, _ = decoder(seqs[:, :-1], memory)  # predict symbol t + 1 from symbols <= t
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), seqs[:, 1:].reshape(-1))
        optimiser.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimiser.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    encoder.eval()
    decoder.eval()
    with torch.no_grad():
        test = batch(500, torch.Generator().manual_seed(999))
        memory, _ = encoder(test)
        copied = decoder.generate(test[:, :1], LENGTH - 1, memory)
        symbols = (copied[:, 1:] == test[:, 1:]).float().mean().item()
        exact = (copied == test).all(dim=1).float().mean().item()
        _, maps = encoder(test[:1], need_weights=True)
    assert maps is not None
    return {
        "name": name,
        "losses": [round(x, 5) for x in losses],
        "seconds": seconds,
        "symbol_accuracy": symbols,
        "exact": exact,
        "map": maps[-1][0].mean(0).round(decimals=4).tolist(),  # last layer, mean of heads
        "registers": registers,
        "parameters": sum(p.numel() for p in params),
    }


def table(runs: list[dict], steps: int) -> str:
    def mean_loss(r: dict, lo: int, hi: int) -> float:
        window = r["losses"][lo:hi]
        return sum(window) / len(window)

    quarter = steps // 4
    lines = [
        f"Copy task, {steps} steps of {BATCH} sequences, Adam 3e-3, seed 0, one run per "
        f"variant; {environment()}. Made by `python benchmarks/variants_training.py`.",
        "",
        f"| variant | parameters | mean loss, steps 1-{quarter} | last {quarter} steps | "
        "symbols copied | sequences exact |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        lines.append(
            f"| `{r['name']}` | {r['parameters']:,} | {mean_loss(r, 0, quarter):.3f} | "
            f"{mean_loss(r, steps - quarter, steps):.4f} | {r['symbol_accuracy']:.1%} | "
            f"{r['exact']:.1%} |"
        )
    lines += [
        "",
        f"Chance is ln {VOCAB - 1} = 2.303 nats per symbol. One seed each, so the rows show "
        "that every variant trains, not which one is better (their spread has not been "
        "measured against seed-to-seed noise). The results file keeps each run's wall seconds; "
        "on a shared machine they measure its load, not the variants. The curves:",
        "",
        "![Training loss of each variant on the copy task, and a trained encoder map with "
        "registers](../figures/variants_training.png)",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=STEPS)
    parser.add_argument("--only", nargs="*", choices=sorted(RUNS), help="a subset (writes nothing)")
    parser.add_argument(
        "--table-only", action="store_true", help="rewrite the table from the results file"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # tiny matrices: one thread wastes no time synchronising
    if args.table_only:
        results = json.loads(RESULTS.read_text(encoding="utf-8"))
        write_section("variants-training", table(results["runs"], results["steps"]), doc=PAGE)
        return 0
    names = args.only or list(RUNS)
    runs = []
    for name in names:
        runs.append(train(name, args.steps))
        r = runs[-1]
        print(
            f"{name:24s} loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.4f}  "
            f"symbols {r['symbol_accuracy']:.1%}  exact {r['exact']:.1%}  {r['seconds']:.0f} s",
            flush=True,
        )
    if args.only or args.steps != STEPS:
        return 0
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(RESULTS, json.dumps({"steps": args.steps, "runs": runs}) + "\n")
    write_section("variants-training", table(runs, args.steps), doc=PAGE)
    print(f"wrote {RESULTS.relative_to(ROOT)} and the table in {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
