"""``attnkit show TEXT``: look at the bundled MiniLM's attention for a text, or at any Hugging
Face model's with ``--model DIR`` (a directory with ``config.json``, weights and tokenizer).

Writes the interactive explorer (``--out x.html``, the default ``attention.html``) or a picture
(``--out x.png``, ``x.svg`` or ``x.pdf``: the formats ``save_figure`` writes): one head with
``--layer L --head H``, every head of a layer with ``--layer L`` alone, all layers by all heads
without either. Prints the path and the strongest links between words of one map. Layers and
heads count from 0.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

PAGES = (".html", ".htm")
SPECIAL_TOKENS = frozenset({"[CLS]", "[SEP]", "[PAD]", "<s>", "</s>", "<pad>"})
BAR = "█"
BUNDLED = "BERT attention (all-MiniLM-L6-v2)"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "show", help="look at a model's attention for a text: HTML explorer or heat-map picture"
    )
    parser.add_argument("text", help='the text, e.g. "The cat sat on the mat."')
    parser.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="a Hugging Face model directory (needs attnkit[hf]); default: the bundled MiniLM",
    )
    parser.add_argument("--layer", type=int, default=None, help="layer, from 0")
    parser.add_argument("--head", type=int, default=None, help="head, from 0")
    parser.add_argument(
        "--out",
        default="attention.html",
        help="output file: .html (interactive explorer, the default attention.html), or a "
        "picture: .png, .svg, .pdf",
    )
    parser.add_argument("--top", type=int, default=8, help="how many strongest links to print")
    parser.set_defaults(func=run)


def load_model() -> Any:
    """attnkit's BERT with the bundled all-MiniLM-L6-v2 weights (tests replace this seam)."""
    from attnkit.models.bert_pretrained import load_pretrained

    return load_pretrained()


def encode(text: str) -> tuple[Any, list[str]]:
    """``(attention (l, h, i, i), tokens)`` of the bundled model for one text."""
    result = load_model().encode([text], need_weights=True)
    tokens = list(result.tokens[0])
    n = len(tokens)  # real tokens; a batch of one has no padding, but slice to be sure
    return result.attentions[:, 0, :, :n, :n], tokens  # (l, b, h, i, j) -> (l, h, i, j)


def load_hf_model(path: str) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a Hugging Face model directory (tests replace this seam)."""
    from attnkit.integrations.transformers_maps import load

    try:  # a command prints what it did, not progress bars
        from transformers.utils import logging
    except ImportError:
        pass  # load says which extra to install
    else:
        logging.disable_progress_bar()
    try:
        return load(path)
    except ImportError:
        raise  # the CLI names the extra to install
    except Exception as exc:  # a damaged or unusual directory: its files say why, in one line
        reason = " ".join(str(exc).split())[:300]
        raise ValueError(
            f"--model {path!r} could not be loaded: {type(exc).__name__}: {reason}"
        ) from exc


def encode_hf(text: str, path: str) -> tuple[Any, list[str], frozenset[str]]:
    """``(attention (l, h, i, i), tokens, special tokens)`` of the model in ``path``."""
    from attnkit.integrations.transformers_maps import attention_maps

    model, tokenizer = load_hf_model(path)
    (maps,) = attention_maps(model, tokenizer, [text])
    return maps.attention, maps.tokens, maps.special


def strongest_links(
    attention: Any,
    tokens: list[str],
    *,
    layer: int | None = None,
    head: int | None = None,
    top: int = 8,
    special: frozenset[str] = SPECIAL_TOKENS,
) -> str:
    """A few lines of text: the ``top`` strongest query -> key links of one map.

    The map is ``attention[layer, head]`` (defaults: the last layer, the mean of its heads).
    ``special`` tokens ([CLS], [SEP], ...) and a token's link to itself are left out: they carry
    most of BERT's attention and hide the links between words.
    """
    import torch

    att = torch.as_tensor(attention).detach().double()  # (l, h, i, j)
    n_layers = att.shape[0]
    layer = n_layers - 1 if layer is None else layer
    if head is None:
        weights, which = att[layer].mean(dim=0), f"mean of {att.shape[1]} heads"  # (i, j)
    else:
        weights, which = att[layer, head], f"head {head}"
    keep = torch.tensor([t not in special for t in tokens])
    allowed = keep[:, None] & keep[None, :] & ~torch.eye(len(tokens), dtype=torch.bool)
    header = (
        f"Strongest links, layer {layer}, {which} "
        "(query -> key: weight; special tokens and self-links left out):"
    )
    candidates = torch.nonzero(allowed)
    if candidates.numel() == 0:
        return header + "\n  (none: the text has fewer than two word pieces)"
    values = weights[allowed]
    order = torch.argsort(values, descending=True)[:top]
    width_q = max(len(tokens[q]) for q, _ in candidates.tolist())
    width_k = max(len(tokens[k]) for _, k in candidates.tolist())
    digits = len(str(len(tokens) - 1))
    lines = [header]
    for idx in order.tolist():
        q, k = candidates[idx].tolist()
        w = float(values[idx])
        # positions tell repeated words apart ("the" at 1 and at 5)
        lines.append(
            f"  {q:>{digits}} {tokens[q]:<{width_q}} -> {k:>{digits}} {tokens[k]:<{width_k}}"
            f"  {w:.3f}  " + BAR * max(1, round(w * 20))
        )
    return "\n".join(lines)


def write_output(
    attention: Any,
    tokens: list[str],
    text: str,
    out: Path,
    *,
    layer: int | None,
    head: int | None,
    model: str = BUNDLED,
) -> Path:
    """The explorer (.html) or a heat map (.png/.svg/.pdf) of ``attention`` (l, h, i, i) at
    ``out``."""
    from attnkit.viz.explorer import AttentionExplorer
    from attnkit.viz.heatmap import plot_attention, plot_heads, plot_overview, save_figure

    if out.suffix.lower() in PAGES:
        explorer = AttentionExplorer(
            attention,
            tokens,
            title=f"attnkit show: {model}",
            text=text,
            layer=layer,  # None: the last layer, and the mean of its heads, as the printed
            head=head,  # strongest links (the page opens on what the summary describes)
        )
        return explorer.save(out)
    if len(text) > 60:  # a picture's title stays on one line
        text = text[:59] + "…"
    if layer is not None and head is not None:
        fig = plot_attention(
            attention[layer, head], tokens, title=f"Layer {layer}, head {head}: {text}"
        )
    elif layer is not None:
        fig = plot_heads(attention, tokens, layer=layer, title=f"Layer {layer}, all heads: {text}")
    else:
        fig = plot_overview(attention, tokens, title=f"All layers and heads: {text}")
    return save_figure(fig, out)


def run(args: argparse.Namespace) -> int:
    from attnkit._io import check_writable, is_utf8
    from attnkit.viz.heatmap import SAVE_FORMATS

    pictures = tuple(SAVE_FORMATS)  # what save_figure writes
    text = args.text
    if not text.strip():
        raise ValueError('TEXT is empty; give a sentence, e.g. attnkit show "The cat sat."')
    if not is_utf8(text):
        raise ValueError("TEXT is not valid UTF-8 text")
    out = check_writable(args.out)  # fail before loading the model
    if out.suffix.lower() not in pictures + PAGES:
        raise ValueError(
            f"--out {args.out!r}: unknown kind of file; use .html (explorer) or a picture: "
            + ", ".join(pictures)
        )
    if out.suffix.lower() in pictures and args.head is not None and args.layer is None:
        raise ValueError("--head needs --layer for a picture (which layer's head?)")
    if args.top < 0:
        raise ValueError(f"--top must be 0 or more, got {args.top}")

    if args.model is None:
        attention, tokens = encode(text)
        special, model = SPECIAL_TOKENS, BUNDLED
    else:
        attention, tokens, special = encode_hf(text, args.model)
        model = f"attention of {Path(args.model).resolve().name}"
    n_layers, n_heads = attention.shape[:2]
    for value, size, name in ((args.layer, n_layers, "--layer"), (args.head, n_heads, "--head")):
        if value is not None and not 0 <= value < size:
            raise ValueError(
                f"{name} {value} is out of range: the model has {size} "
                f"{name[2:]}s, numbered 0 to {size - 1}"
            )
    path = write_output(attention, tokens, text, out, layer=args.layer, head=args.head, model=model)
    print(f"wrote {path}")
    if args.top:
        links = strongest_links(
            attention, tokens, layer=args.layer, head=args.head, top=args.top, special=special
        )
        print(links)
    return 0
