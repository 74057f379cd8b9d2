"""What rounding the activations would cost: SmolLM2-135M-Instruct's logits and greedy tokens when
the inputs of its matrix products are rounded to bfloat16, or to int8 per 32 values (the way
llama.cpp's CPU dot products quantise them: Q8_0, a float16 scale per block of 32), against
attnkit's quantised path, which multiplies float32 activations by the exact de-quantised weights.

The reference is the same model in float64 (every GGUF tensor de-quantised, then ``.double()``).
The rounded variants are that float64 model with each product's input rounded first (a hook on
every ``nn.Linear`` and on the final norm, whose output the tied output projection reads), so
their difference from the reference is the rounding of the activations alone. attnkit's row
runs the real quantised model (float32, the fused kernels, built first). It reports:

1. logits: max |logit - reference| over prompts of 1..1,000 tokens (a story, repeated), and the
   share of positions whose most likely token differs from the reference's;
2. greedy: of twenty prompts (generate.py's), how many give the reference's 64 new tokens.

    PYTHONPATH=src python benchmarks/activations.py            # the table, docs/benchmarks.md
    PYTHONPATH=src python benchmarks/activations.py --quick    # 2 prompts, print only
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _report, when run from anywhere
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's attnkit
from _report import environment, thread_count, write_section
from generate import PLAIN_MORE, PROMPTS, STORY

LENGTHS = (1, 7, 64, 257, 1000)
NEW_TOKENS = 64
BLOCK = 32  # values per int8 block, as GGUF's Q8_0 and llama.cpp's Q8_1
ATTNKIT = "attnkit (float32 activations)"  # the row of the real quantised model


def int8_blocks(x: Tensor) -> Tensor:
    """``x (..., k)`` rounded as llama.cpp's ``quantize_row_q8_0`` (and gguf's ``quantize``)
    store it, in float32: per block of 32, ``d = max|x| / 127``, ``q = roundf(x / d)`` (halves
    away from zero, through ``1 / d``) and ``d`` kept in float16; returns ``q d`` in ``x``'s
    dtype (k a multiple of 32)."""
    blocks = x.reshape(-1, BLOCK).float()  # (blocks, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127  # (blocks, 1)
    v = blocks * torch.where(d == 0, 0.0, 1 / d)
    q = v.sign() * (v.abs() + 0.5).floor()  # in -127..127
    return (q * d.half().float()).reshape(x.shape).to(x.dtype)


def bfloat16(x: Tensor) -> Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


ROUNDINGS: dict[str, Callable[[Tensor], Tensor]] = {
    "bfloat16 activations": bfloat16,
    "int8 activations, per 32 (llama.cpp's Q8_0)": int8_blocks,
}


@contextlib.contextmanager
def rounded(model: nn.Module, round_fn: Callable[[Tensor], Tensor]) -> Iterator[None]:
    """Within it, every product's input is rounded: each ``nn.Linear``'s, and the final norm's
    output (the tied output projection reads it)."""
    handles = [
        m.register_forward_pre_hook(lambda _, args: (round_fn(args[0]), *args[1:]))
        for m in model.modules()
        if isinstance(m, nn.Linear)
    ]
    handles.append(model.norm.register_forward_hook(lambda _, __, out: round_fn(out)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def logits_rows(quant, exact, lengths) -> list[dict[str, object]]:
    """Per variant: the largest |logit - reference| and how many positions' argmax moved, over
    prompts of ``lengths`` tokens."""
    ids = exact.encode(STORY * 60)
    reference = []
    with torch.inference_mode():
        for n in lengths:
            reference.append(exact.model(torch.tensor([ids[:n]])).logits[0])  # (n, V)

    def measure(name: str, logits_of: Callable[[Tensor], Tensor]) -> dict[str, object]:
        worst, moved, total = 0.0, 0, 0
        with torch.inference_mode():
            for n, ref in zip(lengths, reference, strict=True):
                got = logits_of(torch.tensor([ids[:n]])).double()
                worst = max(worst, (got - ref).abs().max().item())
                moved += int((got.argmax(-1) != ref.argmax(-1)).sum())
                total += n
        return {"variant": name, "max_error": worst, "argmax_moved": moved, "positions": total}

    rows = [measure(ATTNKIT, lambda x: quant.model(x).logits[0])]
    for name, fn in ROUNDINGS.items():
        with rounded(exact.model, fn):
            rows.append(measure(name, lambda x: exact.model(x).logits[0]))
    return rows


def greedy_counts(quant, exact, prompts) -> dict[str, int]:
    """Per variant: how many prompts give the reference's greedy tokens."""
    chat = lambda text: exact.chat_prompt([{"role": "user", "content": text}])  # noqa: E731
    ids = [exact.encode(chat(text) if kind == "chat" else text) for kind, text in prompts]
    reference = [exact.generate_ids(p, NEW_TOKENS)[0] for p in ids]

    def equal(llm) -> int:
        pairs = zip(ids, reference, strict=True)
        return sum(llm.generate_ids(p, NEW_TOKENS)[0] == r for p, r in pairs)

    same = {ATTNKIT: equal(quant)}
    for name, fn in ROUNDINGS.items():
        with rounded(exact.model, fn):
            same[name] = equal(exact)
    return same


def report(rows, same, n_prompts: int, lengths) -> str:
    attnkit, *others = rows
    worst = max(others, key=lambda r: r["max_error"])
    rounded_rows = "; ".join(
        f"{r['variant'].split(',')[0]}: {r['max_error']:.2g}, {same[r['variant']]} of {n_prompts}"
        for r in others
    )
    lines = [
        "## Rounding the activations (`benchmarks/activations.py`)",
        "",
        f"**attnkit's float32 activations keep SmolLM2's logits within {attnkit['max_error']:.1e}"
        f" of float64, and its greedy answers equal on {same[attnkit['variant']]} of "
        f"{n_prompts} prompts**; rounded activations move the logits and the answers "
        f"({rounded_rows}).",
        "",
        "<!-- more -->",
        "",
        "SmolLM2-135M-Instruct against the same model in float64 (every GGUF tensor "
        "de-quantised). attnkit's row is its quantised model with the fused kernels, which "
        "multiply float32 activations by the exact de-quantised weights; the other rows "
        "round the input of every matrix product first (in the float64 model, so that the "
        "rounding is the only difference). Logits over prompts of "
        f"{', '.join(map(str, lengths))} tokens; greedy: {NEW_TOKENS} new tokens on "
        f"{n_prompts} prompts.",
        "",
        "| activations | max abs logit error | positions whose argmax moved | greedy tokens "
        "equal to the reference |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        moved = f"{r['argmax_moved']} of {r['positions']}"
        lines.append(
            f"| {r['variant']} | {r['max_error']:.1e} | {moved} | "
            f"{same[r['variant']]} of {n_prompts} |"
        )
    lines += [
        "",
        f"- attnkit's logits stay within {attnkit['max_error']:.1e} of float64; rounded "
        f"activations move them by up to {worst['max_error']:.2g} (the quantised path's "
        "bound against float32 is 1e-3). That is why attnkit's decoding keeps float32 "
        "activations, alone and in a batch, where bfloat16 or int8 products would multiply "
        "more per instruction.",
        "",
        f"{environment()}. `python benchmarks/activations.py`.",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 prompts, short; print only")
    parser.add_argument("--threads", type=thread_count, default=2)
    parser.add_argument("--no-write", action="store_true", help="print only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from attnkit.backends import fused
    from attnkit.models.llama import bundled_model_path, load_pretrained

    fused.build()  # an explicit build: attnkit's row multiplies with the fused kernels

    path = bundled_model_path()
    quant = load_pretrained(path)
    exact = load_pretrained(path, weights="float32")
    exact.model.double()
    lengths = (1, 7) if args.quick else LENGTHS
    prompts = [(k, t) for k, t in PROMPTS] + [("plain", t) for t in PLAIN_MORE]
    prompts = prompts[:2] if args.quick else prompts
    rows = logits_rows(quant, exact, lengths)
    same = greedy_counts(quant, exact, prompts)
    markdown = report(rows, same, len(prompts), lengths)
    print(markdown)
    if not (args.quick or args.no_write):
        print("wrote", write_section("activations", markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
