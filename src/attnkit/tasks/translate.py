"""The translation worked example: dates in many human formats, to ISO, with cross-attention.

``train_translate(TranslateRun(seed=...), out=...)`` generates its data from the seed (no
download): dates from 1970-01-01 to 2069-12-31, each written in one of ``FORMATS`` ("Tue 25 Nov
2026", "25/11/26", "November 25th, 2026", ...), to be translated character by character into
``2026-11-25``. The dates themselves are split first (a seeded shuffle of every day in the
range), so the 1,000 test dates and the validation dates never occur in training, in any format.
Two-digit years are 19yy for 70-99 and 20yy for 00-69, the range's own rule.

The model is attnkit's encoder-decoder (Vaswani et al. 2017, section 3): a ``TransformerEncoder``
reads the characters, a ``TransformerDecoder`` with cross-attention writes the ISO date after a
start token, trained with teacher forcing (every output character at once, against the right
one). Testing decodes greedily with the KV cache (``TransformerDecoder.generate``: the source's
keys and values are projected once, then one character per step) and counts exact matches.

It writes into ``out``: the checkpoint, ``metrics.json`` (``exact_match`` on the test dates,
beside ``baseline``: the share a decoder that always writes the most common training date gets,
which says the task cannot be won by a guess), ``examples.json``, and the classic picture of
cross-attention: ``alignment.png`` (last layer, mean over heads: output characters against input
characters, Bahdanau et al. 2015, figure 3) and ``alignment_heads.png`` (every head).
"""

from __future__ import annotations

import datetime as dt
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnkit.stacks import TransformerConfig, TransformerDecoder, TransformerEncoder
from attnkit.tasks.runs import load_trained, run_facts, seeded, start_task
from attnkit.train.loop import TrainConfig, evaluate
from attnkit.viz.heatmap import plot_attention, plot_heads, save_figure

__all__ = [
    "FORMATS",
    "TRANSLATE_TRAIN",
    "DateTranslator",
    "TranslateConfig",
    "TranslateRun",
    "cross_attention",
    "date_datasets",
    "evaluate_translate",
    "generate_dates",
    "render_date",
    "train_translate",
    "translate",
]

FIRST, LAST = dt.date(1970, 1, 1), dt.date(2069, 12, 31)
PAD, BOS, EOS = 0, 1, 2
# Every character a format can write, after the three specials; the vocabulary is fixed (not
# learned from data), so a checkpoint needs no vocabulary file.
CHARS = " ,-./0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
VOCAB = ("<pad>", "<s>", "</s>", *CHARS)
SRC_LEN = 32  # the longest format ("Wednesday, September 30th, 2026") has 31 characters
TGT_LEN = 11  # "2026-11-25" and </s>
N_TEST, N_VAL = 1000, 500
# One pass over fresh examples beats several over fewer: 4 epochs of 20,000 left 5-13 % of the
# test dates wrong (years with swapped digits), one epoch of 120,000, as many steps as 7.5 of
# them, left 0.1 %. Twice the first recipe's rate (2e-3), decayed to 0 on a cosine, is what
# lets 938 steps of a 32-wide model do what 1,250 of a 64-wide one did (docs/learn/08).
N_TRAIN = 120_000
TRANSLATE_TRAIN = TrainConfig(
    epochs=1, batch_size=128, lr=4e-3, weight_decay=0.01, warmup_frac=0.05, patience=0
)


def _ordinal(day: int) -> str:
    suffix = "th" if 10 <= day % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    return f"{day}{suffix}"


def _formats() -> tuple[Any, ...]:
    """Each format: ``date -> text``. English names; numeric formats are day-month-year (or
    year first), never month-day, so every text names one date."""
    full = lambda d: d.strftime("%B")  # noqa: E731  (English under the C locale)
    abbr = lambda d: d.strftime("%b")  # noqa: E731
    return (
        lambda d: f"{d.strftime('%a')} {d.day} {abbr(d)} {d.year}",  # Tue 25 Nov 2026
        lambda d: f"{d.day:02d}/{d.month:02d}/{d.year % 100:02d}",  # 25/11/26
        lambda d: f"{full(d)} {_ordinal(d.day)}, {d.year}",  # November 25th, 2026
        lambda d: f"{d.day} {full(d)} {d.year}",  # 25 November 2026
        lambda d: f"{d.strftime('%A')}, {full(d)} {d.day}, {d.year}",  # Tuesday, November 25, 2026
        lambda d: f"{d.day}.{d.month}.{d.year}",  # 25.11.2026
        lambda d: f"{abbr(d).lower()} {d.day} {d.year}",  # nov 25 2026
        lambda d: f"{d.day:02d}-{abbr(d)}-{d.year}",  # 25-Nov-2026
        lambda d: f"{d.year}/{d.month:02d}/{d.day:02d}",  # 2026/11/25
        lambda d: f"the {_ordinal(d.day)} of {full(d)} {d.year}",  # the 25th of November 2026
        lambda d: f"{d.strftime('%A')} {d.day} {full(d)} {d.year}".upper(),  # TUESDAY 25 NOV..
        lambda d: f"{d.day}/{d.month}/{d.year}",  # 25/11/2026
    )


FORMATS = _formats()


def render_date(date: dt.date, fmt: int) -> str:
    """``date`` written in format number ``fmt`` (an index into ``FORMATS``)."""
    return FORMATS[fmt](date)


@dataclass(frozen=True)
class DateData:
    """Texts and their ISO dates for train, validation and test (test: one text per date)."""

    train: list[tuple[str, str]]
    val: list[tuple[str, str]]
    test: list[tuple[str, str]]


def generate_dates(seed: int, n_train: int = N_TRAIN) -> DateData:
    """The seeded data: every day in the range shuffled, the first ``N_TEST`` days for testing,
    the next ``N_VAL`` for validation, ``n_train`` examples drawn (in random formats) from the
    rest. Same seed -> same data."""
    rng = random.Random(seed)
    days = [FIRST + dt.timedelta(days=k) for k in range((LAST - FIRST).days + 1)]
    rng.shuffle(days)
    test_days, val_days, train_days = (
        days[:N_TEST],
        days[N_TEST : N_TEST + N_VAL],
        days[N_TEST + N_VAL :],
    )

    def pairs(chosen: list[dt.date]) -> list[tuple[str, str]]:
        return [(render_date(d, rng.randrange(len(FORMATS))), d.isoformat()) for d in chosen]

    return DateData(
        train=pairs([rng.choice(train_days) for _ in range(n_train)]),
        val=pairs(val_days),
        test=pairs(test_days),
    )


def encode(texts: list[str], length: int, *, bos: bool = False, eos: bool = False) -> Tensor:
    """Character ids ``(n, length)``, padded with ``PAD``; ``bos``/``eos`` add the specials."""
    index = {c: k for k, c in enumerate(VOCAB)}
    out = torch.full((len(texts), length), PAD, dtype=torch.long)
    for row, text in enumerate(texts):
        unknown = sorted(set(text) - set(CHARS))
        if unknown:
            raise ValueError(f"{text!r}: characters {unknown} are not in the vocabulary")
        ids = [BOS] * bos + [index[c] for c in text] + [EOS] * eos
        if len(ids) > length:
            raise ValueError(f"{text!r} needs {len(ids)} positions, more than {length}")
        out[row, : len(ids)] = torch.tensor(ids)
    return out


def decode(ids: Tensor) -> list[str]:
    """Ids ``(n, t)`` -> texts, stopping at the first ``EOS``; ``BOS`` and ``PAD`` are dropped."""
    texts = []
    for row in ids.tolist():
        chars = []
        for k in row:
            if k == EOS:
                break
            if k > EOS:
                chars.append(VOCAB[k])
        texts.append("".join(chars))
    return texts


def date_datasets(data: DateData) -> list[dict[str, Tensor]]:
    """``fit``'s datasets: source ids, decoder input (``<s>`` + ISO) and labels (ISO + ``</s>``)."""
    sets = []
    for pairs in (data.train, data.val, data.test):
        src = encode([s for s, _ in pairs], SRC_LEN)
        tgt = encode([t for _, t in pairs], TGT_LEN + 1, bos=True, eos=True)  # (n, 12)
        sets.append({"src": src, "tgt_in": tgt[:, :-1], "labels": tgt[:, 1:]})
    return sets


@dataclass(frozen=True)
class TranslateConfig:
    # 32 wide (64,000 weights, against 242,688 at 64): fewer operations per step, and wide enough
    # to write 99.9 % of the test dates exactly.
    embed_dim: int = 32
    num_heads: int = 4
    num_layers: int = 2
    dropout: float = 0.0


@dataclass(frozen=True)
class TranslateRun:
    """One run: the seed (data, weights, order), the model, the recipe, training examples."""

    seed: int = 0
    model: TranslateConfig = field(default_factory=TranslateConfig)
    train: TrainConfig = TRANSLATE_TRAIN
    n_train: int = N_TRAIN


class DateTranslator(nn.Module):
    """``(src (b, j), tgt_in (b, i))`` -> logits ``(b, V, i)`` (classes on dim 1, the layout
    ``F.cross_entropy`` and ``attnkit.train.fit`` take for sequences)."""

    def __init__(self, config: TranslateConfig) -> None:
        super().__init__()
        self.config = config
        common = dict(
            embed_dim=config.embed_dim,
            num_heads=config.num_heads,
            num_layers=config.num_layers,
            vocab_size=len(VOCAB),
            dropout=config.dropout,
            norm_first=True,
        )
        self.encoder = TransformerEncoder(TransformerConfig(**common))
        self.decoder = TransformerDecoder(TransformerConfig(**common, cross_attention=True))

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """``(memory (b, j, e), memory_mask (b, 1, 1, j))``: padding is never attended to."""
        mask = (src != PAD)[:, None, None, :]  # (b, 1, 1, j), True = may attend
        memory, _ = self.encoder(src, mask)
        return memory, mask

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        memory, mask = self.encode(src)
        logits, _ = self.decoder(tgt_in, memory, memory_mask=mask)  # (b, i, V)
        return logits.transpose(1, 2)  # (b, V, i)


@torch.no_grad()
def translate(model: DateTranslator, texts: list[str], batch_size: int = 500) -> list[str]:
    """Greedy decoding with the KV cache: each text's ISO date as the model writes it."""
    model.eval()
    out = []
    for start in range(0, len(texts), batch_size):
        src = encode(texts[start : start + batch_size], SRC_LEN)
        memory, mask = model.encode(src)
        bos = torch.full((len(src), 1), BOS, dtype=torch.long)
        ids = model.decoder.generate(bos, TGT_LEN, memory, memory_mask=mask, eos_id=EOS)
        out += decode(ids[:, 1:])
    return out


@torch.no_grad()
def cross_attention(model: DateTranslator, text: str, iso: str) -> Tensor:
    """Every decoder layer's cross-attention while it writes ``iso`` after reading ``text``:
    ``(layers, h, i, j)``, output positions (``<s>`` and the ISO characters) against the
    characters of ``text``. A forward hook asks each cross-attention for its weights."""
    model.eval()
    src = encode([text], SRC_LEN)[:, : len(text)]  # no padding: the picture shows the text only
    tgt_in = encode([iso], TGT_LEN + 1, bos=True)[:, : len(iso) + 1]
    maps: list[Tensor] = []
    asking: list[bool] = []  # the hook's own call must not call the hook again

    def grab(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if asking:
            return
        asking.append(True)
        try:
            _, w = module(*args, **{**kwargs, "cache": None, "need_weights": True})
        finally:
            asking.pop()
        maps.append(w[0])  # (h, i, j)

    hooks = [
        block.cross_attn.register_forward_hook(grab, with_kwargs=True)
        for block in model.decoder.blocks
        if block.cross_attn is not None
    ]
    try:
        model(src, tgt_in)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(maps)  # (layers, h, i, j)


def plot_alignment(model: DateTranslator, text: str, iso: str, out: Path) -> bool:
    """``alignment.png`` (mean over the last layer's heads) and ``alignment_heads.png``."""
    maps = cross_attention(model, text, iso)[-1]  # (h, i, j)
    rows, cols = ["<s>", *iso], list(text)
    try:
        fig = plot_attention(
            maps.mean(0),
            rows,
            cols,
            title=f"Cross-attention, last layer, mean of heads: {text!r} -> {iso}",
            annotate=False,
        )
    except ImportError:
        return False
    save_figure(fig, out / "alignment.png", dpi=90)
    fig = plot_heads(maps, rows, cols, title=f"Cross-attention per head (last layer): {text!r}")
    save_figure(fig, out / "alignment_heads.png", dpi=90)
    return True


def most_common_baseline(data: DateData) -> float:
    """Exact match of always answering the most common training date."""
    guess, _ = Counter(iso for _, iso in data.train).most_common(1)[0]
    return round(sum(iso == guess for _, iso in data.test) / len(data.test), 4)


def build_translator(config: TranslateConfig, seed: int) -> DateTranslator:
    return seeded(DateTranslator, config, seed)


def train_translate(
    run: TranslateRun | None = None,
    *,
    out: str | Path | None = None,
    resume: bool = False,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Train the date translator on the seeded data, test it by greedy decoding; the metrics."""
    run = run or TranslateRun()
    seed, model_config = run.seed, run.model
    extra = {"n_train": run.n_train}
    task = start_task("translate", run, out=out, resume=resume, progress=progress, extra=extra)
    data = generate_dates(seed, run.n_train)
    train, val, _ = date_datasets(data)
    model = build_translator(model_config, seed)
    result = task.fit(model, train, val)
    metrics = _metrics(model, data, train, val)
    wrong = [
        {"text": text, "expected": iso, "written": written}
        for (text, iso), written in zip(data.test, metrics.pop("written"), strict=True)
        if written != iso
    ]
    metrics.update(
        task="translate",
        variant="scratch",
        seed=seed,
        **run_facts(model, result),
        n_train=len(data.train),
        n_test=len(data.test),
        formats=len(FORMATS),
        decoding="greedy, KV cache",
        baseline={
            "model": "the most common training date",
            "exact_match": most_common_baseline(data),
        },
        wrong=wrong[:20],
    )
    if task.writes:
        assert task.out is not None
        examples = [data.test[k] for k in range(len(FORMATS))]
        task.save("examples.json", [{"text": t, "iso": i} for t, i in examples])
        text, iso = next((t, i) for t, i in data.test if t[0].isalpha() and "," in t)
        metrics["alignment_png"] = plot_alignment(model, text, iso, task.out)
        task.save("metrics.json", metrics)
    return metrics


def _metrics(model: DateTranslator, data: DateData, train: dict, val: dict) -> dict[str, Any]:
    written = translate(model, [text for text, _ in data.test])
    exact = sum(w == iso for w, (_, iso) in zip(written, data.test, strict=True)) / len(data.test)
    return {
        "exact_match": round(exact, 4),
        "val_token_accuracy": round(evaluate(model, val)[1], 4),
        "train_token_accuracy": round(
            evaluate(model, {k: v[:2000] for k, v in train.items()})[1], 4
        ),
        "written": written,
    }


def evaluate_translate(directory: Path, config: dict[str, Any]) -> dict[str, Any]:
    """Exact match of the checkpoint in ``directory`` on the test dates its seed generates."""
    keys = {"seed": int, "n_train": int}
    model = load_trained(directory, config, TranslateConfig, DateTranslator, keys=keys)
    data = generate_dates(config["seed"], config["n_train"])
    train, val, _ = date_datasets(data)
    metrics = _metrics(model, data, train, val)
    metrics.pop("written")
    return {**metrics, "params": sum(p.numel() for p in model.parameters())}
