"""attnkit's BERT vs Hugging Face's ``BertModel`` (SDPA attention) on all-MiniLM-L6-v2, CPU.

Workload: 256 English sentences of about 30 tokens, batch 32, 2 threads, float32,
inference. Two comparisons, each pair measured in the same run with the candidates interleaved
(batch by batch, the order flipping every time) and reported as medians of the totals over all
batches, and their ratio:

1. model forward: the same padded token batches (given order, padded to each batch's longest)
   through attnkit's ``BertModel`` (fast path: no attention weights) and through
   ``transformers.BertModel(attn_implementation="sdpa")``;
2. end to end, texts in -> normalised sentence embeddings out, one call per 32 texts:
   ``PretrainedBert.encode`` and ``SentenceTransformer.encode`` (tokenize, run, pool, normalise).

Run: ``PYTHONPATH=src python benchmarks/bert.py`` (``--repeats N``, ``--no-write`` to only print).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import environment, positive_int, write_section

from attnkit._progress import progress  # a bar when stderr is a terminal

_TEXT = (
    "the a model attention reads every word of a sentence and weighs how much each other word "
    "matters for its meaning so that context flows between positions in one step while "
    "researchers measure speed memory and accuracy on long documents short questions news "
    "reviews about films food travel science history music sport weather markets cities "
    "people often say this film was surprisingly good but too long quiet bright dark small"
)
WORDS = _TEXT.split(" ")


def make_sentences(n: int = 256, seed: int = 0) -> list[str]:
    """``n`` sentences of 22 to 32 words (about 30 WordPiece tokens with [CLS]/[SEP])."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(22, 32))]
        out.append(" ".join(words).capitalize() + ".")
    return out


def interleaved(
    candidates: dict[str, Callable[[int], object]], steps: int, repeats: int
) -> dict[str, float]:
    """Median over repeats of each candidate's total time for ``steps`` steps.

    Candidates alternate at every step (A B, then B A, ...), so both see the same machine load
    even when other jobs come and go; each is warmed up on every step first.
    """
    names = list(candidates)
    for step in range(steps):
        for name in names:
            candidates[name](step)
    totals: dict[str, list[float]] = {name: [] for name in names}
    for r in progress(range(repeats), desc="rounds", unit="round"):
        spent = dict.fromkeys(names, 0.0)
        for step in range(steps):
            for name in names if (r + step) % 2 == 0 else names[::-1]:
                start = time.perf_counter()
                candidates[name](step)
                spent[name] += time.perf_counter() - start
        for name in names:
            totals[name].append(spent[name])
    return {name: statistics.median(ts) for name, ts in totals.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument("--batch-size", type=positive_int, default=32)
    parser.add_argument("--no-write", action="store_true", help="print only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(2)

    import transformers
    from sentence_transformers import SentenceTransformer

    from attnkit.models.bert_pretrained import bundled_model_path, load_pretrained

    path = bundled_model_path()
    ours = load_pretrained()
    hf = transformers.BertModel.from_pretrained(str(path), attn_implementation="sdpa").eval()
    st = SentenceTransformer(str(path), device="cpu")
    sentences = make_sentences()
    bs = args.batch_size

    batches = []
    for start in range(0, len(sentences), bs):
        tok = ours.tokenizer(sentences[start : start + bs])
        real = torch.arange(tok.input_ids.shape[1]) < tok.lengths[:, None]  # (b, n)
        batches.append((tok.input_ids, real, tok.token_type_ids))
    lengths = torch.cat([real.sum(1) for _, real, _ in batches]).float()
    padded = sum(ids.numel() for ids, _, _ in batches)

    # Same outputs first (real tokens), so the race is between equal computations.
    with torch.inference_mode():
        ids, real, types = batches[0]
        a = ours.model(ids, attention_mask=real, token_type_ids=types).hidden_states
        b = hf(input_ids=ids, attention_mask=real.long(), token_type_ids=types).last_hidden_state
        forward_err = (a - b).abs()[real].max().item()
        e_ours = ours.encode(sentences, batch_size=bs).embeddings
        e_st = st.encode(sentences, batch_size=bs, convert_to_tensor=True)
        cos_min = torch.nn.functional.cosine_similarity(e_ours, e_st, dim=-1).min().item()

    def attnkit_forward(step: int) -> None:
        ids, real, types = batches[step]
        with torch.inference_mode():
            ours.model(ids, attention_mask=real, token_type_ids=types)

    def hf_forward(step: int) -> None:
        ids, real, types = batches[step]
        with torch.inference_mode():
            hf(input_ids=ids, attention_mask=real.long(), token_type_ids=types)

    chunks = [sentences[start : start + bs] for start in range(0, len(sentences), bs)]

    def attnkit_encode(step: int) -> None:
        ours.encode(chunks[step], batch_size=bs)

    def st_encode(step: int) -> None:
        st.encode(chunks[step], batch_size=bs, convert_to_tensor=True)

    forward = interleaved(
        {"attnkit": attnkit_forward, "hf": hf_forward}, len(batches), args.repeats
    )
    end_to_end = interleaved(
        {"attnkit": attnkit_encode, "st": st_encode}, len(chunks), args.repeats
    )

    n = len(sentences)
    rows = [
        (
            "model forward, same padded batches",
            "HF `BertModel` (sdpa)",
            forward["attnkit"],
            forward["hf"],
        ),
        (
            "texts -> embeddings, 32 per call",
            "`SentenceTransformer.encode`",
            end_to_end["attnkit"],
            end_to_end["st"],
        ),
    ]
    lines = [
        f"all-MiniLM-L6-v2, {n} sentences ({lengths.mean():.1f} tokens on average, "
        f"{int(lengths.min())}-{int(lengths.max())}; {padded} positions after padding in the "
        "given order), "
        f"batch {bs}, float32, inference; medians of {args.repeats} repeats of the "
        "whole set; the two candidates alternate batch by batch. "
        f"{environment()}.",
        "",
        "| what | baseline | attnkit (s) | baseline (s) | attnkit / baseline "
        "| sentences/s attnkit |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for what, base, t_ours, t_base in rows:
        lines.append(
            f"| {what} | {base} | {t_ours:.3f} | {t_base:.3f} | {t_ours / t_base:.2f} | "
            f"{n / t_ours:.0f} |"
        )
    lines += [
        "",
        f"Agreement in this run: forward max |attnkit - HF| on real tokens {forward_err:.1e}; "
        f"embeddings min cosine vs sentence-transformers {cos_min:.7f}.",
        "A ratio below 1 means attnkit is faster. "
        f"Command: `PYTHONPATH=src python benchmarks/bert.py --repeats {args.repeats}`.",
    ]
    md = "## BERT (all-MiniLM-L6-v2) on CPU\n\n" + "\n".join(lines)
    print(md)
    if not args.no_write:
        print(f"\nwrote {write_section('bert', md)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
