"""``attnkit generate PROMPT``: continue a text (or answer a chat message) with a Llama model.

The text streams to stdout as it is generated. The model is the bundled SmolLM2-135M-Instruct
unless ``--model`` names a ``.gguf`` file or a Hugging Face Llama directory; a GGUF file's weights
stay in their quantised blocks unless ``--weights float32`` de-quantises them. ``--chat`` wraps
the prompt in the model's chat template as one user message. ``--show-attention out.html``
also writes the attention explorer in its generation view: one row per generated token, its
attention over the prompt and the earlier tokens (the KV cache), for every layer and head.
Arguments are checked before the model loads; a bad prompt, number or file is one line on
stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from attnkit.commands.train import PATH, SEED, THREADS


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text with a small Llama model (bundled SmolLM2-135M-Instruct)",
        description="Continue a text, or answer it as a chat message with --chat, streaming the "
        "tokens as they come (greedy unless --temperature is above 0). With --show-attention "
        "OUT.html it also writes the attention explorer: one row per generated token, its "
        "attention over the prompt and the tokens before it, for every layer and head.",
    )
    p.add_argument("prompt", help='the text to continue, e.g. "Once upon a time"')
    p.add_argument("--max-new-tokens", type=int, default=128, help="at most this many tokens")
    p.add_argument("--chat", action="store_true", help="answer the prompt as a chat message")
    p.add_argument("--system", default=None, help="a system message for --chat")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k likeliest tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold")
    p.add_argument("--seed", type=SEED, default=None, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=None, help="stop at this text (repeatable)")
    p.add_argument("--model", type=PATH, default=None, help="a .gguf file or a Llama directory")
    p.add_argument(
        "--weights",
        choices=("gguf", "float32"),
        default=None,
        help="gguf keeps a GGUF file's quantised blocks (its default, about 5x less memory); "
        "float32 de-quantises every weight (a Llama directory's only choice)",
    )
    p.add_argument("--threads", type=THREADS, default=None, help="torch threads")
    p.add_argument(
        "--show-attention",
        type=Path,
        default=None,
        metavar="OUT.html",
        help="write each generated token's attention over the prompt and cache (explorer page)",
    )
    p.set_defaults(func=run)


def load_model(path: Path | None, weights: str | None = None) -> Any:
    """The model to generate with (tests replace this seam)."""
    from attnkit.models.llama import load_pretrained

    return load_pretrained(path, weights=weights)


def run(args: argparse.Namespace) -> int:
    from attnkit.models.llama_generate import Sampling

    if not args.prompt.strip():
        raise ValueError("the prompt is empty: give some text to continue")
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    from attnkit._io import is_utf8

    if not is_utf8(args.prompt) or not is_utf8(args.system or ""):
        raise ValueError("the prompt (or --system) is not valid UTF-8 text")
    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat")
    if any(not s for s in args.stop or ()):
        raise ValueError("--stop needs a non-empty text")
    Sampling(args.temperature, args.top_k, args.top_p)  # checks the sampling arguments
    if args.show_attention is not None and args.max_new_tokens == 0:
        raise ValueError("--show-attention needs --max-new-tokens of at least 1")
    if args.model is not None and not args.model.exists():
        raise FileNotFoundError(f"model {str(args.model)!r} does not exist")
    if args.show_attention is not None:
        from attnkit._io import check_writable

        if args.show_attention.suffix.lower() not in (".html", ".htm"):
            raise ValueError(f"--show-attention writes an .html page, got {args.show_attention}")
        check_writable(args.show_attention)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    if args.weights == "gguf" and args.model is not None and args.model.is_dir():
        raise ValueError(
            f"--weights gguf keeps a GGUF file's blocks; {str(args.model)!r} is a directory of "
            "float tensors (leave --weights out, or pass --weights float32)"
        )
    model = load_model(args.model, args.weights)
    prompt = args.prompt
    if args.chat:
        messages = [{"role": "user", "content": args.prompt}]
        if args.system is not None:
            messages.insert(0, {"role": "system", "content": args.system})
        prompt = model.chat_prompt(messages)
    generated: list[int] = []
    pieces = model.stream(
        prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        on_token=generated.append,
    )
    if not args.chat:
        sys.stdout.write(args.prompt)
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.show_attention is not None:
        path = write_generation_view(
            model, model.encode(prompt), generated, args.show_attention, prompt_text=args.prompt
        )
        print(f"wrote {path}", file=sys.stderr)
    return 0


def write_generation_view(
    model: Any, prompt: list[int], new: list[int], path: Path, *, prompt_text: str | None = None
) -> Path:
    """The explorer with one query row per generated token and a key per position.

    The page shows the prompt (``prompt_text``: what the user typed, default the decoded
    ``prompt``) and the generated text under their own labels. The map is not square (its rows
    are the generating positions, its columns every position), but it is the decoder's causal
    self-attention, and the page says so.
    """
    from attnkit.viz.explorer import AttentionExplorer

    if not new:
        raise ValueError("nothing was generated, so there is no attention to show")
    ids = prompt + new
    # Row t is computed by the step that produced token t + 1, so the rows that produced the
    # generated tokens are the last prompt position and every generated one but the last.
    rows = model.attention(ids)[:, :, len(prompt) - 1 : len(ids) - 1]  # (l, h, new, n)
    names = [model.tokenizer.decode([t], skip_special=False) for t in ids]
    return AttentionExplorer(
        rows.numpy(),
        [f"→ {name}" for name in names[len(prompt) :]],
        names,
        title="Generation: each new token's attention over the prompt and the cache",
        text={
            "Prompt": model.decode(prompt) if prompt_text is None else prompt_text,
            "Generated": model.decode(new),
        },
        rollout=False,
        kind="causal self-attention: each generated token over the prompt and the tokens before it",
    ).save(path)
